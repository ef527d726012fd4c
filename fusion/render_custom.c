/*
 * render_custom.c: a custom op's kernel (include/kiln_custom.h): the prelude, custom.cuh, the
 * op's source, and a __global__ wrapper that unpacks the one argument every kiln kernel takes into
 * a kiln_custom_args and calls the op's entry. The source is the same for every call of the op
 * (shapes, parameters and the launch are arguments, kargs.cuh says where), so it is compiled once,
 * when the op is made (the engine's kiln__engine_compile_custom), and found in the kernel cache
 * by every flush after.
 */
#include <inttypes.h>
#include <string.h>

#include "render.h"

_Static_assert(KILN_DTYPE_F32 == 0 && KILN_DTYPE_BF16 == 1 && KILN_DTYPE_I32 == 3,
               "custom.cuh numbers the dtypes as kiln.h does");
_Static_assert(KILN_CUSTOM_MAX_IN + 1 <= KILN__CUSTOM_META &&
                   KILN_CUSTOM_MAX_IN + 1 <= 2 * KILN__KMAX_DIMS &&
                   KILN_CUSTOM_PARAMS <= KILN__KMAX_DIMS && KILN__CUSTOM_PARAM < KILN__KMAX_PTR,
               "a custom op's tensors and parameters fit the kernel's argument");

bool kiln__custom_source(const kiln_custom_op *op, kiln__rendered *r) {
  const char *name = op->o.name;
  kiln__sb body = {0};
  /* the #line makes NVRTC's messages count the op's own lines */
  kiln__sb_printf(&body,
                  "#include \"custom.cuh\"\n"
                  "#line 1 \"%s.cu\"\n"
                  "%s\n"
                  "#line 1 \"kiln_custom_wrapper\"\n",
                  name, op->o.source);
  const char *first = kiln__pdl_line(r);
  uint64_t h = kiln__hash(body.s ? body.s : "", body.n, (uint64_t)op->max_block);
  h = kiln__hash(first, strlen(first), h);
  snprintf(r->name, sizeof r->name, "k_custom_%s_%08" PRIx64, name, h & 0xffffffffu);
  kiln__sb_printf(&r->src,
                  "#include \"prelude.cuh\"\n%s"
                  "extern \"C\" __global__ void __launch_bounds__(%d) %s(const kiln__kargs a) {\n"
                  "%s"
                  "  kiln_custom_args c;\n"
                  "  kiln__custom_unpack(a, c);\n"
                  "  %s(c);\n"
                  "}\n",
                  body.s ? body.s : "", op->max_block, r->name, first, op->o.entry);
  bool ok = !body.oom && !r->src.oom;
  kiln__sb_free(&body);
  return ok;
}

bool kiln__render_custom(const kiln__target *t, const kiln__node *n, kiln__rendered *r) {
  int64_t id = KILN__I(n, CUSTOM, id);
  KILN_ASSERT(id >= 0 && id < t->ncustom);
  const kiln_custom_op *op = t->customs[id];
  if (!kiln__custom_source(op, r)) return false;
  int nin = n->nin;
  kiln__operands o = {.n = nin + 1};
  kiln__kargs *a = &r->arg.args;
  for (int q = 0; q <= nin; q++) {
    const kiln_tensor *x = q < nin ? n->in[q] : n->out;
    o.t[q] = x;
    o.store[q] = q == nin;
    r->arg.ptr[q] = x;
    for (int d = 0; d < KILN__KMAX_DIMS; d++)
      a->st[q][d] = d < x->ndim ? x->shape[d] : 1;
    a->st[KILN__CUSTOM_META + q / KILN__KMAX_DIMS][q % KILN__KMAX_DIMS] =
        x->ndim + 16 * (long long)x->dtype;
  }
  r->arg.nptr = nin + 1;
  for (int k = 0; k < KILN_CUSTOM_PARAMS; k++)
    a->st[KILN__CUSTOM_PARAM][k] = KILN__IA(n, CUSTOM, param, k);
  a->i[0] = nin;
  a->n = kiln_tensor_numel(n->out); /* an empty output launches nothing */
  r->grid = (unsigned)KILN__IA(n, CUSTOM, launch, 0);
  r->grid_y = (unsigned)KILN__IA(n, CUSTOM, launch, 1);
  r->grid_z = (unsigned)KILN__IA(n, CUSTOM, launch, 2);
  r->block = (unsigned)KILN__IA(n, CUSTOM, launch, 3);
  r->smem = (unsigned)KILN__IA(n, CUSTOM, launch, 4);
  if (op->o.zero_output) {
    r->zero_slot = nin;
    r->zero_bytes = (uint64_t)kiln_tensor_numel(n->out) * kiln_dtype_size(n->out->dtype);
  }
  kiln__tally_bytes(&o, r);
  return true;
}
