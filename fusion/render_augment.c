/*
 * render_augment.c: image augmentation (kiln_augment): a translation and a left-right flip per
 * image, drawn on the device.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "render.h"

/* ---------------------------------------------------------------- image augmentation */

/* kiln_augment: x (N, H, W, C) to y of its shape, one thread per V neighbouring channels of an
 * output pixel (V = 4 with 16-byte loads and stores when the channels allow it, else the whole
 * pixel up to 4 channels, else 1). Each thread of image n draws the image's Philox block
 * (seed, offset, n) itself: the same numbers for all of them, so no thread waits for another.
 * The sizes but the batch, the padding and the modes are constants; the seed, the offset and the
 * epoch are step values. Operand 0 is x, then the data-set indices (alternating flip), then y. */
bool kiln__render_augment(const kiln__target *tg, const kiln__node *n, kiln__rendered *r) {
  const kiln_tensor *x = n->in[0], *y = n->out;
  KILN_ASSERT(kiln__is_contiguous(x) && kiln__is_float(x->dtype) && x->ndim == 4 &&
              y->dtype == x->dtype);
  const char *T = kiln__ctype(x->dtype);
  kiln__kargs *a = &r->arg.args;
  kiln__operands o = {0};
  for (int q = 0; q < n->nin; q++)
    kiln__operand(&o, n->in[q], false, NULL);
  int out = kiln__operand(&o, y, true, NULL);
  int8_t aslot[KILN__MAX_ATTRS];
  int nf = 0, ni = 0, nu = 0;
  kiln__wire_attrs(&r->arg, n, aslot, &nf, &ni, &nu);
  int seed = aslot[kiln__attr_index(n->op, "seed")],
      offset = aslot[kiln__attr_index(n->op, "offset")],
      epoch = aslot[kiln__attr_index(n->op, "epoch")];
  int64_t H = x->shape[1], W = x->shape[2], C = x->shape[3], total = kiln_tensor_numel(y);
  int64_t pad = KILN__I(n, AUGMENT, pad), flip = KILN__I(n, AUGMENT, flip);
  int64_t shift_h = KILN__I(n, AUGMENT, shift_h), shift_w = KILN__I(n, AUGMENT, shift_w);
  bool moves = pad > 0 || shift_h != 0 || shift_w != 0; /* a translation, random or fixed */
  bool reflect = KILN__I(n, AUGMENT, border) == KILN_AUGMENT_BORDER_REFLECT;
  bool alternate = flip == KILN_AUGMENT_FLIP_ALTERNATE, rnd = flip == KILN_AUGMENT_FLIP_RANDOM;
  KILN_ASSERT(n->nin == (alternate ? 2 : 1) && C >= 1);
  bool vec = C % 4 == 0 && x->offset % 4 == 0 && y->offset % 4 == 0;
  int V = vec ? 4 : (C <= 4 ? (int)C : 1);
  bool wide = kiln__wide_index(total);
  a->n = total / V;

  kiln__sb b = {0};
  kiln__sb_printf(&b,
                  "  typedef %s ix; // %s indexing\n"
                  "  const ix H = %lld, W = %lld, C = %lld;\n"
                  "  const int V = %d; // channels a thread moves\n"
                  "  const %s *x = (const %s *)a.ptr[0];\n",
                  wide ? "long long" : "int", wide ? "64-bit" : "32-bit", (long long)H,
                  (long long)W, (long long)C, V, T, T);
  if (alternate) kiln__sb_printf(&b, "  const int *idx = (const int *)a.ptr[1];\n");
  kiln__sb_printf(&b, "  %s *y = (%s *)a.ptr[%d];\n", T, T, out);
  if (pad > 0 || rnd)
    kiln__sb_printf(&b, "  const unsigned long long seed = a.uv[%d], offset = a.uv[%d];\n", seed,
                    offset);
  else if (alternate)
    kiln__sb_printf(&b, "  const unsigned long long seed = a.uv[%d];\n", seed);
  if (pad > 0) kiln__sb_printf(&b, "  const int PAD = %lld;\n", (long long)pad);
  kiln__sb_printf(&b, "  for (ix e = (ix)blockIdx.x * blockDim.x + threadIdx.x; e < (ix)a.n;\n"
                      "       e += (ix)gridDim.x * blockDim.x) {\n"
                      "    ix m = e;\n"
                      "    const ix c = (m %% (C / V)) * V; m /= C / V;\n"
                      "    const ix w = m %% W; m /= W;\n"
                      "    const ix h = m %% H, n = m / H;\n");
  if (pad > 0 || rnd)
    kiln__sb_printf(&b, "    // image n's draws, the same in each of its threads\n"
                        "    unsigned int r[4];\n"
                        "    kiln_philox4(seed, offset, (unsigned long long)n, r);\n");
  if (pad > 0)
    kiln__sb_printf(&b, "    const int dy = (int)kiln_philox_below(r[0], 2 * PAD + 1) - PAD;\n"
                        "    const int dx = (int)kiln_philox_below(r[1], 2 * PAD + 1) - PAD;\n");
  else if (moves)
    kiln__sb_printf(&b, "    const int dy = %lld, dx = %lld; // a fixed translation\n",
                    (long long)shift_h, (long long)shift_w);
  if (rnd)
    kiln__sb_printf(&b, "    const bool flip = (r[2] >> 31) != 0u; // half the images\n");
  else if (flip == KILN_AUGMENT_FLIP_ALL)
    kiln__sb_printf(&b, "    const bool flip = true; // every image\n");
  else if (alternate)
    kiln__sb_printf(&b,
                    "    // a fixed bit of the image's data-set index, complemented on odd epochs\n"
                    "    const unsigned int bit =\n"
                    "        kiln_philox(seed, KILN_PHILOX_FLIP_OFFSET, (unsigned int)idx[n]) "
                    ">> 31;\n"
                    "    const bool flip = (bit ^ (unsigned int)(a.uv[%d] & 1ull)) != 0u;\n",
                    epoch);
  bool zero_fill = moves && !reflect;
  if (moves) {
    kiln__sb_printf(&b,
                    "    // the source: pixel (h + dy, w + dx) of the image, flipped or not, "
                    "%s outside it\n"
                    "    ix sh = h + dy, sw = w + dx;\n",
                    reflect ? "reflected" : "0");
    if (reflect)
      kiln__sb_printf(&b, "    sh = sh < 0 ? -sh : (sh >= H ? 2 * (H - 1) - sh : sh);\n"
                          "    sw = sw < 0 ? -sw : (sw >= W ? 2 * (W - 1) - sw : sw);\n");
    else
      kiln__sb_printf(&b, "    const bool inside = sh >= 0 && sh < H && sw >= 0 && sw < W;\n");
  } else {
    kiln__sb_printf(&b, "    const ix sh = h;\n    %six sw = w;\n",
                    flip != KILN_AUGMENT_FLIP_NONE ? "" : "const ");
  }
  if (flip != KILN_AUGMENT_FLIP_NONE) kiln__sb_printf(&b, "    if (flip) sw = W - 1 - sw;\n");
  kiln__sb_printf(&b, "    const ix src = ((n * H + sh) * W + sw) * C + c;\n");
  char zero[32];
  snprintf(zero, sizeof zero, " : (%s)0.f", T);
  if (vec)
    kiln__sb_printf(&b,
                    "    float v[4] = {0.f, 0.f, 0.f, 0.f};\n"
                    "    %skiln_load4(&x[src], v);\n"
                    "    kiln_store4(&y[e * 4], v);\n",
                    zero_fill ? "if (inside) " : "");
  else
    kiln__sb_printf(&b,
                    "#pragma unroll\n"
                    "    for (int l = 0; l < V; l++) y[e * V + l] = %sx[src + l]%s;\n",
                    zero_fill ? "inside ? " : "", zero_fill ? zero : "");
  kiln__sb_printf(&b, "  }\n");
  static const char *const flips[] = {"", "_flip", "_flip_all", "_flip_alt"};
  KILN_ASSERT(flip >= 0 && flip < 4);
  char stem[128];
  char shift[64] = "";
  if (pad == 0 && moves)
    snprintf(shift, sizeof shift, "_shift%s%lld_%s%lld", shift_h < 0 ? "m" : "",
             (long long)llabs(shift_h), shift_w < 0 ? "m" : "", (long long)llabs(shift_w));
  snprintf(stem, sizeof stem, "k_augment_p%lld%s%s%s_%s%s", (long long)pad, shift,
           moves ? (reflect ? "_reflect" : "_zero") : "", flips[flip], kiln_dtype_name(x->dtype),
           vec ? "_v4" : "");
  bool ok = kiln__finish(&b, stem, &o, r);
  kiln__sb_free(&b);
  r->block = KILN__BLOCK;
  r->grid = kiln__grid_for(tg, a->n);
  kiln__tally_bytes(&o, r);
  return ok;
}
