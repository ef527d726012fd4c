/*
 * render_augment.c: image augmentation (kiln_augment): a translation and a left-right flip per
 * image, drawn on the device (fusion/device/augment.cuh). The sizes but the batch, the padding
 * and the modes are constants of the kernel; the seed, the offset and the epoch are step values.
 * Operand 0 is x, then the data-set indices (alternating flip), then y. The image loader's resize
 * and crop (its batch of decoded images to the network's input) is the family's other kernel.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "render.h"

/* An augmentation node's settings, as the kernel's constants. */
typedef struct augment {
  int64_t H, W, C, pad, flip, shift_h, shift_w;
  bool reflect, moves, vec, wide;
  int V; /* channels a thread moves */
} augment;

/* augment.cuh's struct of constants. */
static void emit_constants(kiln__sb *pre, const augment *g) {
  static const char *const flips[] = {"no flip", "half the images, at random", "every image",
                                      "alternating by data-set index and epoch"};
  kiln__sb_printf(pre,
                  "#include \"augment.cuh\"\n"
                  "struct G { /* the images and the augmentation */\n"
                  "  typedef %s ix; // %s indexing\n"
                  "  static constexpr ix H = %lld, W = %lld, C = %lld;\n"
                  "  static constexpr int V = %d; // channels a thread moves\n"
                  "  static constexpr bool VEC = %s;\n"
                  "  static constexpr int PAD = %lld, SHIFT_H = %lld, SHIFT_W = %lld;\n"
                  "  static constexpr bool REFLECT = %s;\n"
                  "  static constexpr int FLIP = %lld; // %s\n"
                  "};\n",
                  g->wide ? "long long" : "int", g->wide ? "64-bit" : "32-bit", (long long)g->H,
                  (long long)g->W, (long long)g->C, g->V, g->vec ? "true" : "false",
                  (long long)g->pad, (long long)g->shift_h, (long long)g->shift_w,
                  g->reflect ? "true" : "false", (long long)g->flip, flips[g->flip]);
}

/* k_augment_p2_reflect_flip_alt_bf16_v4: the padding or fixed shift, border, flip, dtype. */
static void name_of(const augment *g, kiln_dtype dt, char *stem, size_t n) {
  static const char *const flips[] = {"", "_flip", "_flip_all", "_flip_alt"};
  char shift[64] = "";
  if (g->pad == 0 && g->moves)
    snprintf(shift, sizeof shift, "_shift%s%lld_%s%lld", g->shift_h < 0 ? "m" : "",
             (long long)llabs(g->shift_h), g->shift_w < 0 ? "m" : "", (long long)llabs(g->shift_w));
  snprintf(stem, n, "k_augment_p%lld%s%s%s_%s%s", (long long)g->pad, shift,
           g->moves ? (g->reflect ? "_reflect" : "_zero") : "", flips[g->flip], kiln_dtype_name(dt),
           g->vec ? "_v4" : "");
}

/* The image loader's resize (kiln__resize_crop): one thread per output pixel, its three
 * channels. The output's size and the table's columns are constants; the images' places and
 * sizes are data (the table), the normalisation step values. */
static bool render_resize(const kiln__target *tg, const kiln__node *n, kiln__rendered *r) {
  const kiln_tensor *y = n->out;
  KILN_ASSERT(n->nin == 2 && y->ndim == 4 && y->shape[3] == 3 &&
              n->in[1]->shape[1] == KILN__RESIZE_COLS);
  bool wide = kiln__wide_index(kiln_tensor_numel(y));
  kiln__operands o = {0};
  kiln__operand(&o, n->in[0], false, NULL);
  kiln__operand(&o, n->in[1], false, NULL);
  int out = kiln__operand(&o, y, true, NULL);
  int8_t aslot[KILN__MAX_ATTRS];
  int nf = 0, ni = 0, nu = 0;
  kiln__wire_attrs(&r->arg, n, aslot, &nf, &ni, &nu);
  r->arg.args.n = kiln_tensor_numel(y) / 3;
  const char *T = kiln__ctype(y->dtype);
  kiln__sb pre = {0}, b = {0};
  kiln__sb_printf(&pre,
                  "#include \"augment.cuh\"\n"
                  "struct G { /* the output, and the columns of the table's rows */\n"
                  "  typedef %s ix; // %s indexing\n"
                  "  static constexpr int OH = %lld, OW = %lld, COLS = %d;\n"
                  "  static constexpr int OFF = %d, ROWS = %d, SRC_COLS = %d, RROWS = %d, "
                  "RCOLS = %d;\n"
                  "  static constexpr int OY = %d, OX = %d, R0 = %d, C0 = %d, SW = %d, FLIP = %d;\n"
                  "};\n",
                  wide ? "long long" : "int", wide ? "64-bit" : "32-bit", (long long)y->shape[1],
                  (long long)y->shape[2], KILN__RESIZE_COLS, KILN__RZ_OFFSET, KILN__RZ_ROWS,
                  KILN__RZ_COLS, KILN__RZ_RROWS, KILN__RZ_RCOLS, KILN__RZ_OY, KILN__RZ_OX,
                  KILN__RZ_R0, KILN__RZ_C0, KILN__RZ_SW, KILN__RZ_FLIP);
  kiln__sb_printf(&b,
                  "  typedef G::ix ix;\n"
                  "  for (ix e = (ix)blockIdx.x * blockDim.x + threadIdx.x; e < (ix)a.n;\n"
                  "       e += (ix)gridDim.x * blockDim.x)\n"
                  "    kiln_resize_crop<G>((const unsigned char *)a.ptr[0], (const int *)a.ptr[1], "
                  "(%s *)a.ptr[%d], e,\n"
                  "                        a.fv[%d], a.fv[%d], a.fv[%d], a.fv[%d], a.fv[%d], "
                  "a.fv[%d]);\n",
                  T, out, aslot[kiln__attr_index(n->op, "mul0")],
                  aslot[kiln__attr_index(n->op, "mul1")], aslot[kiln__attr_index(n->op, "mul2")],
                  aslot[kiln__attr_index(n->op, "add0")], aslot[kiln__attr_index(n->op, "add1")],
                  aslot[kiln__attr_index(n->op, "add2")]);
  char stem[96];
  snprintf(stem, sizeof stem, "k_resize_crop_%lldx%lld_%s", (long long)y->shape[1],
           (long long)y->shape[2], kiln_dtype_name(y->dtype));
  return kiln__finish_loop(&b, &pre, stem, &o, tg, r);
}

/* One thread per V neighbouring channels of an output pixel: V = 4 with 16-byte loads and
 * stores when the channels allow it, else the whole pixel up to 4 channels, else 1. */
bool kiln__render_augment(const kiln__target *tg, const kiln__node *n, kiln__rendered *r) {
  if (n->op == KILN__OP_RESIZE_CROP) return render_resize(tg, n, r);
  const kiln_tensor *x = n->in[0], *y = n->out;
  KILN_ASSERT(kiln__is_contiguous(x) && kiln__is_float(x->dtype) && x->ndim == 4 &&
              y->dtype == x->dtype);
  augment g = {.H = x->shape[1],
               .W = x->shape[2],
               .C = x->shape[3],
               .pad = KILN__I(n, AUGMENT, pad),
               .flip = KILN__I(n, AUGMENT, flip),
               .shift_h = KILN__I(n, AUGMENT, shift_h),
               .shift_w = KILN__I(n, AUGMENT, shift_w),
               .reflect = KILN__I(n, AUGMENT, border) == KILN_AUGMENT_BORDER_REFLECT,
               .wide = kiln__wide_index(kiln_tensor_numel(y))};
  g.vec = g.C % 4 == 0 && x->offset % 4 == 0 && y->offset % 4 == 0;
  g.moves = g.pad > 0 || g.shift_h != 0 || g.shift_w != 0; /* a translation, random or fixed */
  g.V = g.vec ? 4 : (g.C <= 4 ? (int)g.C : 1);
  bool alternate = g.flip == KILN_AUGMENT_FLIP_ALTERNATE;
  KILN_ASSERT(n->nin == (alternate ? 2 : 1) && g.C >= 1 && g.flip >= 0 && g.flip < 4);
  kiln__operands o = {0};
  for (int q = 0; q < n->nin; q++)
    kiln__operand(&o, n->in[q], false, NULL);
  int out = kiln__operand(&o, y, true, NULL);
  int8_t aslot[KILN__MAX_ATTRS];
  int nf = 0, ni = 0, nu = 0;
  kiln__wire_attrs(&r->arg, n, aslot, &nf, &ni, &nu);
  r->arg.args.n = kiln_tensor_numel(y) / g.V;
  const char *T = kiln__ctype(x->dtype);
  kiln__sb pre = {0}, b = {0};
  emit_constants(&pre, &g);
  kiln__sb_printf(&b,
                  "  typedef G::ix ix;\n"
                  "  for (ix e = (ix)blockIdx.x * blockDim.x + threadIdx.x; e < (ix)a.n;\n"
                  "       e += (ix)gridDim.x * blockDim.x)\n"
                  "    kiln_augment<G>((const %s *)a.ptr[0], %s, (%s *)a.ptr[%d], e, a.uv[%d], "
                  "a.uv[%d], a.uv[%d]);\n",
                  T, alternate ? "(const int *)a.ptr[1]" : "nullptr", T, out,
                  aslot[kiln__attr_index(n->op, "seed")], aslot[kiln__attr_index(n->op, "offset")],
                  aslot[kiln__attr_index(n->op, "epoch")]);
  char stem[128];
  name_of(&g, x->dtype, stem, sizeof stem);
  return kiln__finish_loop(&b, &pre, stem, &o, tg, r);
}
