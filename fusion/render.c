/*
 * render.c: the renderer's entry. kiln__render hands a spec to the file of its kernel family
 * (render.h lists them); none of them compiles, allocates or reads a device address.
 */
#include <string.h>

#include "render.h"

bool kiln__render(const kiln__target *t, const kiln__spec *s, kiln__rendered *r) {
  memset(r, 0, sizeof *r);
  r->pdl = t->pdl;
  switch (s->kind) {
  case KILN__SPEC_EW: return kiln__render_ew(t, &s->prog, r);
  case KILN__SPEC_REDUCE: return kiln__render_reduce(t, &s->prog, s->red, r);
  case KILN__SPEC_ROWS: return kiln__render_rows(t, &s->prog, s->full, r);
  case KILN__SPEC_UPDATES: return kiln__render_updates(t, s->ups, s->nups, r);
  case KILN__SPEC_CASTS: return kiln__render_casts(t, s->ups, s->nups, r);
  case KILN__SPEC_GATHER: return kiln__render_gather(t, s->red, r);
  case KILN__SPEC_WINDOW: return kiln__render_window(t, &s->prog, &s->pro, s->moments, r);
  case KILN__SPEC_CONV: return kiln__render_conv(t, s, r);
  case KILN__SPEC_MOMENTS: return kiln__render_moments(t, s->red, r);
  case KILN__SPEC_AUGMENT: return kiln__render_augment(t, s->red, r);
  case KILN__SPEC_CUSTOM: return kiln__render_custom(t, s->red, r);
  case KILN__SPEC_BLAS: break;
  }
  KILN_ASSERT(!"nothing to render for a BLAS call");
  return false;
}
