/*
 * conv.c: the image ops, over (N, H, W, C) tensors. A convolution is a matrix product over the
 * im2col of its input (each output pixel's window as one row), so it runs on the BLAS backend's
 * tensor cores and takes the product's epilogues (the bias); its gradients are the product's
 * and col2im's. Pooling records one window op; batch and layer normalization are made of
 * reductions and elementwise ops, which the planner fuses. Nothing runs here.
 */
#include <inttypes.h>
#include <math.h>
#include <string.h>

#include "internal.h"

/* The slot of window op n's geometry, its int attribute `win` (found by name). */
static int win_slot(kiln__op op) {
  kiln__attr_kind kind;
  int slot;
  KILN_ASSERT(kiln__ops[op].renderer == KILN__RENDER_WINDOW);
  KILN_ASSERT(kiln__attr_find(op, "win", 3, &kind, &slot) && kind == KILN__ATTR_I &&
              kiln__ops[op].attrs[kiln__attr_index(op, "win")].count == KILN__WIN_LEN);
  return slot;
}

kiln__win kiln__win_of(const kiln__node *n) {
  kiln__win w;
  memcpy(&w, &n->i[win_slot(n->op)], sizeof w);
  return w;
}

kiln_tensor *kiln__window(kiln__op op, const char *fn, kiln_tensor *x, kiln_tensor *x2,
                          const int64_t *out_shape, const kiln__win *w) {
  kiln_ctx *ctx = x ? x->ctx : NULL;
  if (!ctx || !kiln__ok(ctx)) return NULL;
  KILN_ASSERT(kiln__is_contiguous(x) && (!x2 || kiln__is_contiguous(x2)));
  kiln_tensor *out = kiln__tensor_intermediate(ctx, fn, x->dtype, 4, out_shape);
  if (!out) return NULL;
  kiln_tensor *in[2] = {x, x2};
  kiln__node *n = kiln__record(ctx, op, x2 ? 2 : 1, in, out);
  if (!n) return NULL;
  memcpy(&n->i[win_slot(op)], w, sizeof *w);
  return out;
}

/* ---------------------------------------------------------------- checks */

static kiln_ctx *begin(const char *fn, int n, kiln_tensor *const *in) {
  kiln_ctx *ctx = kiln__ctx_of(n, in);
  if (!ctx || !kiln__ok(ctx)) return NULL;
  for (int i = 0; i < n; i++)
    if (in[i] && !kiln__check(ctx, in[i], fn)) return NULL;
  return ctx;
}

static bool is_f32(kiln_ctx *ctx, const char *fn, const char *what, const kiln_tensor *t) {
  if (t->dtype == KILN_DTYPE_F32) return true;
  return !kiln__error(ctx, KILN_ERR_DTYPE, "%s: %s is %s; this op takes f32", fn, what,
                      kiln_dtype_name(t->dtype));
}

static bool is_float(kiln_ctx *ctx, const char *fn, const char *what, const kiln_tensor *t) {
  if (kiln__is_float(t->dtype)) return true;
  return !kiln__error(ctx, KILN_ERR_DTYPE, "%s: %s is %s; this op takes f32 or bf16", fn, what,
                      kiln_dtype_name(t->dtype));
}

/* An image (N, H, W, C), f32 or bf16. */
static bool image(kiln_ctx *ctx, const char *fn, const kiln_tensor *x) {
  char sh[96];
  if (x->ndim != 4)
    return !kiln__error(ctx, KILN_ERR_SHAPE, "%s: the input is %s; images are (N, H, W, C)", fn,
                        kiln__shape_of(x, sh, sizeof sh));
  return is_float(ctx, fn, "the input", x);
}

/* The output size of a window along one axis (floor mode); false with an error when the window
 * does not fit. */
static bool out_size(kiln_ctx *ctx, const char *fn, const char *axis, int64_t in, int64_t k,
                     int64_t s, int64_t p, int64_t d, int64_t *out) {
  if (k <= 0 || s <= 0 || p < 0 || d <= 0 || k > INT32_MAX || s > INT32_MAX || p > INT32_MAX ||
      d > INT32_MAX)
    return !kiln__error(ctx, KILN_ERR_INVALID,
                        "%s: %s: kernel %" PRId64 ", stride %" PRId64 ", padding %" PRId64
                        ", dilation %" PRId64 " (kernel, stride and dilation must be > 0, "
                        "padding >= 0)",
                        fn, axis, k, s, p, d);
  int64_t span = d * (k - 1) + 1, room = in + 2 * p;
  if (room < span)
    return !kiln__error(ctx, KILN_ERR_SHAPE,
                        "%s: %s: a window of %" PRId64 " (kernel %" PRId64 ", dilation %" PRId64
                        ") does not fit %" PRId64 " pixels padded by %" PRId64 " on each side",
                        fn, axis, span, k, d, in, p);
  *out = (room - span) / s + 1;
  return true;
}

static int64_t or_default(int v, int64_t dflt) { return v == 0 ? dflt : v; }

/* The columns' count for a convolution of K = kh kw C values a window, in dtype. cuBLAS's bf16
 * products with K not a multiple of 8 run at half speed or less (ResNet-18's stem, K = 147, on
 * the H100: 532 us forward and 566 weight gradient, against 283 and 272 with K = 152;
 * bench/stem_gemm.py), so with KILN_CONV_KPAD=1 such a product, one group and K of at least 64,
 * takes zero columns up to a multiple of 8 (of 24 over 3 channels, whose im2col takes a tap a
 * thread: lanes of 3), and its filters zeros to match. */
static int64_t padded_columns(const kiln_ctx *ctx, kiln_dtype dtype, int64_t G, int64_t C,
                              int64_t K) {
  if (!ctx->conv_kpad || dtype != KILN_DTYPE_BF16 || G != 1 || K < 64 || K % 8 == 0) return K;
  int64_t step = C == 3 ? 24 : 8;
  return (K + step - 1) / step * step;
}

/* ---------------------------------------------------------------- convolution */

/* A strided convolution over few channels, such as ResNet's 7x7 stem over 3 channels at stride
 * 2, as a stride-1 convolution over the image's s x s blocks (KILN_CONV_S2D=0: not). With r zero
 * taps before the window (r = -k mod s, so that k + r is a multiple of s), tap i = s a + b - r
 * of the window at output o reads pixel s (o + a) + b - (p + r): row b of block o + a of the
 * image padded by p + r. So the blocks X = im2col(x) over s x s windows at stride s, padded by
 * p + r (each block's s s C values in im2col's order, then zero columns up to a multiple of 8),
 * are an image whose channels the implicit GEMMs take, and the convolution is X's over windows
 * of a = (k + r) / s blocks at stride 1, no padding, with the filters' own blocks W'(a, b) =
 * W(s a + b - r): their im2col over s x s windows at stride s, padded by r, which has exactly
 * a blocks a side. X has OH + a - 1 blocks down (and OW + a - 1 across): the image padded by
 * p + r before and by what those blocks reach after (im2col's output sets its grid; every tap
 * past the image reads zero). ResNet-18's stem then keeps a 54 MB image for its weight gradient
 * instead of 514.5 MiB of columns, and its products run on wgmma with K = 4 x 4 x 16 (256)
 * instead of on cuBLAS with K = 147. */

/* The weight's columns in im2col's order: (Cout, kh, kw, Cin / groups) as (Cout, Kg), gathered by
 * the cast to ac where there is one (one kernel: the permuted view cast, then a view of it). */
static kiln_tensor *weight_columns(kiln_tensor *weight, kiln_dtype ac, int64_t Kg) {
  kiln_tensor *wp = kiln_permute(weight, KILN_AXES(0, 2, 3, 1));
  if (ac != KILN_DTYPE_F32) wp = kiln_cast(wp, ac);
  return kiln_reshape(wp, KILN_SHAPE(weight->shape[0], Kg));
}

/* A convolution's blocks: the product's window over them (a x a, stride 1), the geometry of the
 * image's im2col that writes them and their shape (blocks down, across, and their channels), and
 * the geometry of the filters' im2col. */
typedef struct {
  kiln__win product, image, filters;
  int64_t rows, cols, channels;
} blocks;

/* Whether kiln_conv2d takes its convolution as blocks: the switch, a Hopper device, bf16 (the
 * compute dtype dt), one group, C channels not in 16-byte chunks and s s C at most 256, stride
 * s of 2 to 8 on both axes, no dilation, a window of at most 64 a side and at least two blocks,
 * and Cout channels the implicit kernels take. Not where the direct kernel takes it (a product
 * nothing takes a gradient through: grad false). Fills *b. */
static bool blocks_fit(const kiln_ctx *ctx, kiln_dtype dt, int64_t G, int64_t C, int64_t Cout,
                       const kiln__win *w, int64_t OH, int64_t OW, bool grad, blocks *b) {
  int64_t s = w->sh, k[2] = {w->kh, w->kw}, r[2], a[2];
  if (!ctx->conv_s2d || ctx->arch != 90 || dt != KILN_DTYPE_BF16 || G != 1 || C % 8 == 0 || s < 2 ||
      s > 8 || w->sw != s || C > 256 / (s * s) || w->dh != 1 || w->dw != 1 || Cout % 8 != 0 ||
      Cout > kiln__implicit_conv_max_co(ctx) ||
      (ctx->conv_direct && !grad && kiln__conv_direct_shape(k[0] * k[1] * C, C, Cout)))
    return false;
  for (int d = 0; d < 2; d++) {
    r[d] = (s - k[d] % s) % s;
    a[d] = (k[d] + r[d]) / s;
    if (k[d] > 64 || a[d] < 2) return false;
  }
  b->product = (kiln__win){.kh = a[0], .kw = a[1], .sh = 1, .sw = 1, .dh = 1, .dw = 1};
  b->image = (kiln__win){
      .kh = s, .kw = s, .sh = s, .sw = s, .ph = w->ph + r[0], .pw = w->pw + r[1], .dh = 1, .dw = 1};
  b->filters = b->image;
  b->filters.ph = r[0], b->filters.pw = r[1];
  b->rows = OH + a[0] - 1, b->cols = OW + a[1] - 1, b->channels = (s * s * C + 7) / 8 * 8;
  return true;
}

/* The blocks of blocks_fit: the image *xc (N, H, W, C) becomes X (N, rows, cols, channels), the
 * filters *wk (Cout, kh kw C) W' (Cout, a a channels), dense. False with the context's error. */
static bool to_blocks(const char *fn, const kiln__win *w, const blocks *b, kiln_tensor **xc,
                      kiln_tensor **wk) {
  int64_t Cout = (*wk)->shape[0], C = (*xc)->shape[3];
  int64_t xshape[4] = {(*xc)->shape[0], b->rows, b->cols, b->channels};
  int64_t fshape[4] = {Cout, b->product.kh, b->product.kw, b->channels};
  kiln_tensor *X = kiln__window(KILN__OP_IM2COL, fn, *xc, NULL, xshape, &b->image);
  kiln_tensor *f = X ? kiln_reshape(*wk, KILN_SHAPE(Cout, w->kh, w->kw, C)) : NULL;
  if (f) f = kiln__window(KILN__OP_IM2COL, fn, f, NULL, fshape, &b->filters);
  if (!f) return false;
  KILN__I(kiln__producer(X), IM2COL, groups) = 1;
  KILN__I(kiln__producer(f), IM2COL, groups) = 1;
  f = kiln_reshape(f, KILN_SHAPE(Cout, fshape[1] * fshape[2] * fshape[3]));
  if (!f) return false;
  *xc = X;
  *wk = f;
  return true;
}

kiln_tensor *kiln_conv2d(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias,
                         const kiln_conv2d_options *o) {
  const char *fn = __func__;
  kiln_tensor *in[3] = {x, weight, bias};
  if (!x || !weight) {
    kiln_ctx *c = kiln__ctx_of(3, in);
    if (c && kiln__ok(c))
      kiln__error(c, KILN_ERR_INVALID, "%s: %s is NULL", fn, !x ? "the input" : "the weight");
    return NULL;
  }
  kiln_ctx *ctx = begin(fn, 3, in);
  if (!ctx || !image(ctx, fn, x) || !is_float(ctx, fn, "the weight", weight) ||
      (bias && !is_float(ctx, fn, "the bias", bias)))
    return NULL;
  kiln_conv2d_options opt = o ? *o : (kiln_conv2d_options){0};
  char s1[96], s2[96];
  /* in an autocast region the input and the weight are cast (the casts fuse into their
   * producers); outside one they must agree */
  kiln_dtype ac = kiln__autocast_dtype(ctx);
  if (ac == KILN_DTYPE_F32 && weight->dtype != x->dtype)
    return kiln__error(ctx, KILN_ERR_DTYPE,
                       "%s: the input is %s and the weight %s (one dtype, or an autocast region)",
                       fn, kiln_dtype_name(x->dtype), kiln_dtype_name(weight->dtype)),
           NULL;
  int64_t N = x->shape[0], H = x->shape[1], W = x->shape[2], C = x->shape[3];
  int64_t G = or_default(opt.groups, 1);
  if (weight->ndim != 4)
    return kiln__error(ctx, KILN_ERR_SHAPE,
                       "%s: the weight is %s; it must be (Cout, Cin / groups, kh, kw)", fn,
                       kiln__shape_of(weight, s1, sizeof s1)),
           NULL;
  int64_t Cout = weight->shape[0], Cg = weight->shape[1];
  if (G <= 0 || C % G != 0 || Cout % G != 0 || Cg != C / G)
    return kiln__error(ctx, KILN_ERR_SHAPE,
                       "%s: input %s, weight %s, groups %" PRId64
                       ": Cin and Cout must be multiples of groups and the weight's second dim "
                       "Cin / groups",
                       fn, kiln__shape_of(x, s1, sizeof s1), kiln__shape_of(weight, s2, sizeof s2),
                       G),
           NULL;
  if (bias && (bias->ndim != 1 || bias->shape[0] != Cout))
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: the bias is %s; the weight %s needs (%" PRId64 ")",
                       fn, kiln__shape_of(bias, s1, sizeof s1),
                       kiln__shape_of(weight, s2, sizeof s2), Cout),
           NULL;
  kiln__win w = {.kh = weight->shape[2],
                 .kw = weight->shape[3],
                 .sh = or_default(opt.stride_h, 1),
                 .sw = or_default(opt.stride_w, 1),
                 .ph = opt.pad_h,
                 .pw = opt.pad_w,
                 .dh = or_default(opt.dilation_h, 1),
                 .dw = or_default(opt.dilation_w, 1)};
  int64_t OH, OW;
  if (!out_size(ctx, fn, "height", H, w.kh, w.sh, w.ph, w.dh, &OH) ||
      !out_size(ctx, fn, "width", W, w.kw, w.sw, w.pw, w.dw, &OW))
    return NULL;
  int64_t K = w.kh * w.kw * C, Kg = K / G, M = N * OH * OW; /* rows and columns of the product */
  kiln_dtype dt = ac == KILN_DTYPE_F32 ? x->dtype : ac;
  blocks b = {.product = w, .rows = H, .cols = W, .channels = C};
  bool blk =
      blocks_fit(ctx, dt, G, C, Cout, &w, OH, OW, x->requires_grad || weight->requires_grad, &b);
  bool pointwise = w.kh == 1 && w.kw == 1 && w.sh == 1 && w.sw == 1 && w.ph == 0 && w.pw == 0;
  int64_t Kp = blk         ? b.product.kh * b.product.kw * b.channels
               : pointwise ? K
                           : padded_columns(ctx, dt, G, C, K);
  int64_t cshape[4] = {N, OH, OW, Kp}, yshape[4] = {N, OH, OW, Cout},
          xshape[4] = {N, b.rows, b.cols, b.channels};
  if (!kiln__valid_shape(ctx, fn, 4, cshape) || !kiln__valid_shape(ctx, fn, 4, yshape) ||
      !kiln__valid_shape(ctx, fn, 4, xshape))
    return NULL;
  /* checked here, before anything is recorded, rather than by the product's own checks */
  if (M > INT32_MAX || Kg > INT32_MAX || Kp > INT32_MAX || Cout > INT32_MAX)
    return kiln__error(ctx, KILN_ERR_SHAPE,
                       "%s: input %s, weight %s: the product of %" PRId64
                       " output pixels by %" PRId64 " window values by %" PRId64
                       " output channels is beyond the matrix product's int range (2^31 - 1 each)",
                       fn, kiln__shape_of(x, s1, sizeof s1), kiln__shape_of(weight, s2, sizeof s2),
                       M, Kp > K ? Kp : Kg, Cout),
           NULL;
  kiln_tensor *xc = kiln_contiguous(ac == KILN_DTYPE_F32 ? x : kiln_cast(x, ac));
  if (!xc) return NULL;
  kiln_tensor *wk = NULL; /* blocks: the filters first, as to_blocks takes them */
  if (blk && !((wk = weight_columns(weight, ac, Kg)) && to_blocks(fn, &w, &b, &xc, &wk)))
    return NULL;
  kiln_tensor *cols = xc;
  if (!pointwise) {
    cols = kiln__window(KILN__OP_IM2COL, fn, xc, NULL, cshape, &b.product);
    if (!cols) return NULL;
    KILN__I(kiln__producer(cols), IM2COL, groups) = G;
  }
  cols = kiln_reshape(cols, KILN_SHAPE(M, Kp));
  if (!blk) wk = weight_columns(weight, ac, Kg);
  if (Kp > K && !blk && wk) { /* the padded columns' zero filters (the concat's gradient is
                                   wk's, sliced) */
    kiln_tensor *zero = kiln_cast(kiln_full(ctx, KILN_SHAPE(Cout, Kp - K), 0.f), wk->dtype);
    wk = kiln_concat(2, (kiln_tensor *const[]){wk, zero}, 1);
  }
  kiln_tensor *y;
  if (G == 1) {
    y = kiln_matmul(cols, kiln_transpose(wk, 0, 1)); /* (M, Cout) */
  } else {
    kiln_tensor *cg = kiln_permute(kiln_reshape(cols, KILN_SHAPE(M, G, Kg)), KILN_AXES(1, 0, 2));
    kiln_tensor *wg = kiln_transpose(kiln_reshape(wk, KILN_SHAPE(G, Cout / G, Kg)), 1, 2);
    y = kiln_matmul(cg, wg); /* (G, M, Cout / G) */
    y = kiln_reshape(kiln_permute(y, KILN_AXES(1, 0, 2)), KILN_SHAPE(M, Cout));
  }
  /* the bias: an f32 one added to the product's rows, where the BLAS library's epilogue may take
   * it (fusion/plan.c's forward_epilogue); a bf16 one, which no epilogue takes, to the image, so
   * that it joins the elementwise run after it (an activation) in one kernel */
  bool rows = y && y->dtype == KILN_DTYPE_F32;
  if (bias && rows) y = kiln_add(y, kiln_cast(bias, y->dtype));
  y = kiln_reshape(y, KILN_SHAPE(N, OH, OW, Cout));
  if (bias && !rows && y) y = kiln_add(y, kiln_cast(bias, y->dtype));
  return y;
}

/* ---------------------------------------------------------------- pooling */

/* Whether x stays in memory until the backward pass whatever its readers do: a persistent tensor,
 * or the output of a node (through views) whose own gradient reads it (a ReLU's, unless that
 * gradient recomputes the ReLU's input: kiln__recomputes_input). */
static bool kept_anyway(const kiln_tensor *x) {
  const kiln__node *p = kiln__producer(x);
  while (p && kiln__ops[p->op].kind == KILN__KIND_VIEW)
    p = kiln__producer(p->in[0]);
  return !p || kiln__keeps_output(p);
}

static kiln_tensor *pool(kiln__op op, const char *fn, kiln_tensor *x,
                         const kiln_pool2d_options *o) {
  kiln_ctx *ctx = begin(fn, 1, &x);
  if (!ctx || !image(ctx, fn, x)) return NULL;
  if (!o)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL options (the kernel size is required)", fn),
           NULL;
  bool max = op == KILN__OP_MAX_POOL;
  if (o->kernel_h <= 0 || o->kernel_w <= 0)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: kernel %dx%d; both sizes must be > 0", fn,
                       o->kernel_h, o->kernel_w),
           NULL;
  if (!max && (o->dilation_h > 1 || o->dilation_w > 1))
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: dilation %dx%d; average pooling has none", fn,
                       o->dilation_h, o->dilation_w),
           NULL;
  kiln__win w = {.kh = o->kernel_h,
                 .kw = o->kernel_w,
                 .sh = or_default(o->stride_h, o->kernel_h),
                 .sw = or_default(o->stride_w, o->kernel_w),
                 .ph = o->pad_h,
                 .pw = o->pad_w,
                 .dh = or_default(o->dilation_h, 1),
                 .dw = or_default(o->dilation_w, 1)};
  if (2 * w.ph > w.kh || 2 * w.pw > w.kw || w.ph < 0 || w.pw < 0)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: padding %" PRId64 "x%" PRId64
                       " must be >= 0 and at most half the kernel %" PRId64 "x%" PRId64,
                       fn, w.ph, w.pw, w.kh, w.kw),
           NULL;
  int64_t shape[4] = {x->shape[0], 0, 0, x->shape[3]};
  if (!out_size(ctx, fn, "height", x->shape[1], w.kh, w.sh, w.ph, w.dh, &shape[1]) ||
      !out_size(ctx, fn, "width", x->shape[2], w.kw, w.sw, w.pw, w.dw, &shape[2]))
    return NULL;
  kiln_tensor *xc = kiln_contiguous(x);
  kiln_tensor *y = xc ? kiln__window(op, fn, xc, NULL, shape, &w) : NULL;
  if (y && !max) KILN__I(kiln__producer(y), AVG_POOL, exclude_pad) = o->exclude_pad != 0;
  /* with fusion on, the gradient reads each value's window position (a byte, 255 for none),
   * written behind y's values, so x need not live until the backward pass; the unfused
   * reference searches x's windows again */
  if (y && max && y->requires_grad && ctx->fusion && w.kh * w.kw < 255 && !kept_anyway(xc)) {
    KILN__I(kiln__producer(y), MAX_POOL, index) = 1;
    y->st->tail = (size_t)kiln_tensor_numel(y);
    y->st->bytes += y->st->tail;
  }
  return y;
}

kiln_tensor *kiln_max_pool2d(kiln_tensor *x, const kiln_pool2d_options *o) {
  return pool(KILN__OP_MAX_POOL, __func__, x, o);
}
kiln_tensor *kiln_avg_pool2d(kiln_tensor *x, const kiln_pool2d_options *o) {
  return pool(KILN__OP_AVG_POOL, __func__, x, o);
}

static kiln_tensor *global_pool(const char *fn, kiln_tensor *x, bool max) {
  kiln_ctx *ctx = begin(fn, 1, &x);
  if (!ctx || !image(ctx, fn, x)) return NULL;
  return max ? kiln_max(x, KILN_AXES(1, 2), 0) : kiln_mean(x, KILN_AXES(1, 2), 0);
}
kiln_tensor *kiln_global_avg_pool2d(kiln_tensor *x) { return global_pool(__func__, x, false); }
kiln_tensor *kiln_global_max_pool2d(kiln_tensor *x) { return global_pool(__func__, x, true); }

kiln_tensor *kiln_flatten(kiln_tensor *x) {
  const char *fn = __func__;
  kiln_ctx *ctx = begin(fn, 1, &x);
  if (!ctx) return NULL;
  if (x->ndim < 1) {
    char sh[96];
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: %s has no batch axis", fn,
                       kiln__shape_of(x, sh, sizeof sh)),
           NULL;
  }
  kiln_tensor *t = x->ndim == 4 ? kiln_permute(x, KILN_AXES(0, 3, 1, 2)) : x; /* PyTorch's order */
  int64_t rest = 1;
  for (int d = 1; d < x->ndim; d++)
    if (__builtin_mul_overflow(rest, x->shape[d], &rest) || rest > KILN__MAX_NUMEL)
      return kiln__error(ctx, KILN_ERR_SHAPE, "%s: %s flattens to more than 2^58 features", fn,
                         kiln__shape_of(x, (char[96]){0}, 96)),
             NULL;
  return kiln_reshape(t, KILN_SHAPE(x->shape[0], rest));
}

/* ---------------------------------------------------------------- augmentation */

kiln_tensor *kiln_augment(kiln_tensor *x, const kiln_augment_options *o) {
  const char *fn = __func__;
  static const kiln_augment_options none = {0};
  if (!o) o = &none;
  kiln_ctx *ctx = begin(fn, 1, &x);
  if (!ctx || (o->idx && !kiln__check(ctx, o->idx, fn)) || !image(ctx, fn, x)) return NULL;
  char sh[96], si[96];
  if (x->requires_grad)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: the images %s require a gradient; augmentation carries none (its "
                       "input is data): pass kiln_detach(x)",
                       fn, kiln__shape_of(x, sh, sizeof sh)),
           NULL;
  int64_t N = x->shape[0], H = x->shape[1], W = x->shape[2], C = x->shape[3];
  if (H < 1 || W < 1 || C < 1)
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: images %s have no pixels or no channels", fn,
                       kiln__shape_of(x, sh, sizeof sh)),
           NULL;
  if (o->pad < 0 || o->pad >= H || o->pad >= W)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: pad %d must be >= 0 and smaller than the images' height %" PRId64
                       " and width %" PRId64,
                       fn, o->pad, H, W),
           NULL;
  if ((o->shift_h || o->shift_w) &&
      (o->pad != 0 || o->shift_h <= -H || o->shift_h >= H || o->shift_w <= -W || o->shift_w >= W))
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: shift (%d, %d) with pad %d: a fixed shift needs pad 0 and each "
                       "below the images' size (%" PRId64 ", %" PRId64 ") in magnitude",
                       fn, o->shift_h, o->shift_w, o->pad, H, W),
           NULL;
  if (o->border != KILN_AUGMENT_BORDER_ZERO && o->border != KILN_AUGMENT_BORDER_REFLECT)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: unknown border %d (KILN_AUGMENT_BORDER_ZERO or _REFLECT)", fn,
                       (int)o->border),
           NULL;
  bool alternate = o->flip == KILN_AUGMENT_FLIP_ALTERNATE;
  if (o->flip != KILN_AUGMENT_FLIP_NONE && o->flip != KILN_AUGMENT_FLIP_RANDOM &&
      o->flip != KILN_AUGMENT_FLIP_ALL && !alternate)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: unknown flip mode %d (KILN_AUGMENT_FLIP_NONE, _RANDOM, _ALL or "
                       "_ALTERNATE)",
                       fn, (int)o->flip),
           NULL;
  if (alternate != (o->idx != NULL))
    return kiln__error(ctx, KILN_ERR_INVALID,
                       alternate ? "%s: KILN_AUGMENT_FLIP_ALTERNATE needs the images' data-set "
                                   "indices (options idx, e.g. kiln_loader_indices)"
                                 : "%s: options idx is given, but only "
                                   "KILN_AUGMENT_FLIP_ALTERNATE reads it",
                       fn),
           NULL;
  kiln_tensor *in[2] = {x, o->idx};
  if (alternate && (o->idx->dtype != KILN_DTYPE_I32 || o->idx->ndim != 1 || o->idx->shape[0] != N))
    return kiln__error(ctx, o->idx->dtype != KILN_DTYPE_I32 ? KILN_ERR_DTYPE : KILN_ERR_SHAPE,
                       "%s: idx is %s %s; it must be (%" PRId64 ") i32, an index per image of %s",
                       fn, kiln__shape_of(o->idx, si, sizeof si), kiln_dtype_name(o->idx->dtype), N,
                       kiln__shape_of(x, sh, sizeof sh)),
           NULL;
  in[0] = kiln_contiguous(x);
  if (alternate) in[1] = kiln_contiguous(o->idx);
  if (!in[0] || (alternate && !in[1])) return NULL;
  kiln_tensor *out = kiln__tensor_intermediate(ctx, fn, x->dtype, 4, x->shape);
  kiln__node *n = out ? kiln__record(ctx, KILN__OP_AUGMENT, alternate ? 2 : 1, in, out) : NULL;
  if (!n) return NULL;
  KILN__I(n, AUGMENT, pad) = o->pad;
  KILN__I(n, AUGMENT, flip) = o->flip;
  KILN__I(n, AUGMENT, border) = o->border;
  KILN__I(n, AUGMENT, shift_h) = o->shift_h;
  KILN__I(n, AUGMENT, shift_w) = o->shift_w;
  /* step values, as dropout's: a replayed step draws new numbers, and the epoch's parity
   * changes without a new capture */
  KILN__U(n, AUGMENT, seed) = ctx->seed;
  KILN__U(n, AUGMENT, offset) = ctx->philox_offset++;
  KILN__U(n, AUGMENT, epoch) = (uint64_t)o->epoch;
  return out;
}

kiln_tensor *kiln__resize_crop(kiln_tensor *raw, kiln_tensor *table, int64_t height, int64_t width,
                               const float mean[3], const float std[3], kiln_dtype dt,
                               const char *fn) {
  kiln_tensor *in[2] = {raw, table};
  kiln_ctx *ctx = begin(fn, 2, in);
  if (!ctx) return NULL;
  /* internal: the image loader builds both inputs */
  KILN_ASSERT(raw->dtype == KILN_DTYPE_I32 && raw->ndim == 1 && table->dtype == KILN_DTYPE_I32 &&
              table->ndim == 2 && table->shape[1] == KILN__RESIZE_COLS && height > 0 && width > 0 &&
              (dt == KILN_DTYPE_F32 || dt == KILN_DTYPE_BF16));
  in[0] = kiln_contiguous(raw);
  in[1] = kiln_contiguous(table);
  if (!in[0] || !in[1]) return NULL;
  int64_t shape[4] = {table->shape[0], height, width, 3};
  kiln_tensor *out = kiln__tensor_intermediate(ctx, fn, dt, 4, shape);
  kiln__node *n = out ? kiln__record(ctx, KILN__OP_RESIZE_CROP, 2, in, out) : NULL;
  if (!n) return NULL;
  /* (v / 255 - mean) / std = v mul + add, per channel */
  KILN__F(n, RESIZE_CROP, mul0) = 1.f / (255.f * std[0]);
  KILN__F(n, RESIZE_CROP, mul1) = 1.f / (255.f * std[1]);
  KILN__F(n, RESIZE_CROP, mul2) = 1.f / (255.f * std[2]);
  KILN__F(n, RESIZE_CROP, add0) = -mean[0] / std[0];
  KILN__F(n, RESIZE_CROP, add1) = -mean[1] / std[1];
  KILN__F(n, RESIZE_CROP, add2) = -mean[2] / std[2];
  return out;
}

/* ---------------------------------------------------------------- normalization */

/* A per-channel vector (C) that must match x's last axis. */
static bool channel_vector(kiln_ctx *ctx, const char *fn, const char *what, const kiln_tensor *v,
                           int64_t C) {
  if (!v) return true;
  char sh[96];
  if (v->ndim != 1 || v->shape[0] != C)
    return !kiln__error(ctx, KILN_ERR_SHAPE, "%s: %s is %s; the input has %" PRId64 " channels", fn,
                        what, kiln__shape_of(v, sh, sizeof sh), C);
  return is_f32(ctx, fn, what, v);
}

static kiln_tensor *affine(kiln_tensor *y, kiln_tensor *weight, kiln_tensor *bias) {
  if (weight) y = kiln_mul(y, weight);
  if (bias) y = kiln_add(y, bias);
  return y;
}

/* running = (1 - m) running + m scale batch for the running mean (scale 1) and variance (scale
 * n / (n - 1), the unbiased estimate; batch computed without gradients), recorded in place: both
 * new values first, over the batch values' shape (1, C), where they fuse with the statistics'
 * kernel, then the two assignments, which run as one multi-tensor update. */
static bool running_update(const char *fn, kiln_tensor *const running[2],
                           kiln_tensor *const batch[2], float m, const float scale[2]) {
  kiln_ctx *ctx = running[0]->ctx;
  kiln_no_grad_begin(ctx);
  kiln_tensor *v[2];
  for (int k = 0; k < 2; k++) {
    kiln_tensor *r = batch[k] ? kiln_reshape(running[k], kiln_tensor_shape(batch[k])) : NULL;
    v[k] = kiln_add(kiln_mul_scalar(r, 1.f - m), kiln_mul_scalar(batch[k], m * scale[k]));
    v[k] = kiln_reshape(v[k], kiln_tensor_shape(running[k]));
  }
  bool ok = v[0] && v[1];
  for (int k = 0; k < 2 && ok; k++)
    ok = kiln__update(KILN__OP_ASSIGN, fn, 2, (kiln_tensor *[]){running[k], v[k]}) != NULL;
  kiln_no_grad_end(ctx);
  return ok;
}

bool kiln__moments(const char *fn, int mode, kiln_tensor *const *in, kiln_tensor *s[2]) {
  kiln_ctx *ctx = in[0] ? in[0]->ctx : NULL;
  s[0] = s[1] = NULL;
  if (!ctx || !kiln__ok(ctx)) return false;
  int nin = mode ? 4 : 2;
  kiln_tensor *c[4];
  for (int q = 0; q < nin; q++)
    if (!(c[q] = kiln_contiguous(in[q]))) return false;
  int64_t R = c[0]->shape[0], C = c[0]->shape[1], rows = KILN__MOMENTS_ROWS;
  while ((R + rows - 1) / rows > KILN__MAX_GRID_Y) /* the blocks of rows are a grid's y */
    rows *= 2;
  int64_t P = R > 0 ? (R + rows - 1) / rows : 1;
  int64_t shape[3] = {P, 2, C};
  kiln_tensor *parts = kiln__tensor_intermediate(ctx, fn, KILN_DTYPE_F32, 3, shape);
  kiln__node *n = parts ? kiln__record(ctx, KILN__OP_MOMENTS, nin, c, parts) : NULL;
  if (!n) return false;
  KILN__I(n, MOMENTS, mode) = mode;
  KILN__I(n, MOMENTS, rows) = rows;
  if (ctx->bn_rows && P > 1 && P <= KILN__MOMENTS_ROW_PARTS) {
    /* each channel's P partial sums a row of a (2, C, P) view: two reductions over the last
     * axis, which start a row program that the per-channel values after them join */
    kiln_tensor *t = kiln_permute(parts, KILN_AXES(1, 2, 0));
    for (int j = 0; j < 2; j++) {
      kiln_tensor *half = kiln_slice(t, 0, j, j + 1, 1); /* (1, C, P) */
      s[j] = half ? kiln__reduce(KILN__OP_SUM, fn, half, 1u << 2, 0, 1.f) : NULL;
    }
  } else {
    kiln_tensor *all = kiln__reduce(KILN__OP_SUM, fn, parts, 1u, 0, 1.f); /* (2, C) */
    for (int j = 0; j < 2 && all; j++)
      s[j] = kiln_slice(all, 0, j, j + 1, 1);
  }
  if (s[0] && s[1]) return true;
  s[0] = s[1] = NULL; /* the context holds the error */
  return false;
}

/* y = (x - mean) invstd weight + bias, over the last axis (the bn_apply op); NULL weight and bias
 * are 1 and 0. */
static kiln_tensor *bn_apply(const char *fn, kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias,
                             kiln_tensor *mean, kiln_tensor *invstd, bool batch) {
  kiln_ctx *ctx = x->ctx;
  kiln_tensor *in[5] = {x, weight ? weight : kiln_full(ctx, KILN_SHAPE(1), 1.f), mean, invstd,
                        bias ? bias : kiln_full(ctx, KILN_SHAPE(1), 0.f)};
  kiln_tensor *y = kiln__ew(KILN__OP_BN_APPLY, fn, 5, in);
  if (y) KILN__I(kiln__producer(y), BN_APPLY, batch) = batch;
  return y;
}

int64_t kiln__implicit_conv_max_co(const kiln_ctx *ctx) {
  return ctx->implicit_conv_max_co > 0 ? ctx->implicit_conv_max_co : KILN__IMPLICIT_CONV_MAX_CO;
}

/* The im2col node whose columns mm's first operand is, as kiln_conv2d records them (the (N, OH,
 * OW, K) columns reshaped to (M, K)), or NULL. */
static const kiln__node *columns_node(const kiln__node *mm) {
  if (mm->op != KILN__OP_MATMUL || mm->in[0]->ndim != 2) return NULL;
  const kiln__node *v = kiln__producer(mm->in[0]);
  if (v && v->op == KILN__OP_RESHAPE) v = kiln__producer(v->in[0]);
  return v && v->op == KILN__OP_IM2COL ? v : NULL;
}

bool kiln__columns_padded(const kiln__node *w) {
  if (w->op != KILN__OP_IM2COL && w->op != KILN__OP_COL2IM) return false;
  bool im2col = w->op == KILN__OP_IM2COL;
  const kiln_tensor *cols = im2col ? w->out : w->in[0], *img = im2col ? w->in[0] : w->out;
  kiln__win win = kiln__win_of(w);
  return cols->shape[3] != win.kh * win.kw * img->shape[3];
}

bool kiln__implicit_conv_image(const kiln_ctx *ctx, const kiln__node *c) {
  const kiln_tensor *x = c->in[0];
  return ctx->arch == 90 && KILN__I(c, IM2COL, groups) == 1 && x->dtype == KILN_DTYPE_BF16 &&
         x->ndim == 4 && x->shape[3] % 8 == 0 && !kiln__columns_padded(c);
}

bool kiln__conv_direct_shape(int64_t k, int64_t ci, int64_t co) {
  return k >= 1 && k <= KILN__CONV_DIRECT_MAX_K && co >= 8 && co <= KILN__CONV_DIRECT_MAX_CO &&
         co % 8 == 0 && ci % 8 != 0;
}

bool kiln__conv_direct_image(const kiln_ctx *ctx, const kiln__node *c) {
  const kiln_tensor *x = c->in[0];
  return ctx->conv_direct && KILN__I(c, IM2COL, groups) == 1 && x->dtype == KILN_DTYPE_BF16 &&
         x->ndim == 4 && !kiln__columns_padded(c);
}

bool kiln__conv_tma_window(const kiln__win *w, int64_t ci) {
  int64_t lo[2] = {-w->ph, -w->pw},
          hi[2] = {w->ph - w->dh * (w->kh - 1), w->pw - w->dw * (w->kw - 1)};
  for (int i = 0; i < 2; i++)
    if (lo[i] < -128 || lo[i] > 127 || hi[i] < -128 || hi[i] > 127) return false;
  /* a 4-D im2col copy's tap offsets are 8 bits (PTX ISA, im2col mode) */
  return ci % 64 == 0 && w->sh >= 1 && w->sh <= 8 && w->sw >= 1 && w->sw <= 8 &&
         w->dh * (w->kh - 1) <= 255 && w->dw * (w->kw - 1) <= 255;
}

bool kiln__conv_few_shape(const kiln__win *w, int64_t ci, int64_t co) {
  return w->sh == 1 && w->sw == 1 && w->dh == 1 && w->dw == 1 && co == 64 && ci > 0 &&
         ci % 8 == 0 && ci < 64 && w->kh * w->kw * ci <= KILN__CONV_FEW_MAX_K && w->ph >= 0 &&
         w->pw >= 0;
}

bool kiln__few_wgrad_shape(const kiln__win *w, int64_t ci, int64_t co) {
  return kiln__conv_few_shape(w, ci, co) && w->kh * w->kw * ci <= KILN__CONV_FEW_WGRAD_MAX_K;
}

kiln__win kiln__dgrad_window(const kiln__win *w) {
  return (kiln__win){.kh = w->kh,
                     .kw = w->kw,
                     .sh = 1,
                     .sw = 1,
                     .ph = w->dh * (w->kh - 1) - w->ph,
                     .pw = w->dw * (w->kw - 1) - w->pw,
                     .dh = w->dh,
                     .dw = w->dw};
}

bool kiln__conv_tma_dgrad(const kiln__win *w, int64_t co, int64_t ci) {
  kiln__win f = kiln__dgrad_window(w);
  return w->sh == 1 && w->sw == 1 && f.ph >= 0 && f.pw >= 0 && ci % 64 == 0 &&
         kiln__conv_tma_window(&f, co);
}

bool kiln__implicit_conv_channels(const kiln_ctx *ctx, const kiln__node *c, int64_t co) {
  if (co % 8 != 0) return false;
  kiln__win w = kiln__win_of(c);
  if (ctx->conv_tma && ctx->implicit_conv_max_co <= 0 &&
      kiln__conv_tma_window(&w, c->in[0]->shape[3]))
    return true;
  return co <= kiln__implicit_conv_max_co(ctx);
}

bool kiln__recomputes_columns(const kiln__node *mm) {
  const kiln_ctx *ctx = mm->out ? mm->out->ctx : NULL;
  const kiln__node *c = ctx && ctx->conv_recompute ? columns_node(mm) : NULL;
  return c && mm->out->ndim == 2 &&
         !(kiln__implicit_conv_image(ctx, c) &&
           kiln__implicit_conv_channels(ctx, c, mm->out->shape[1]));
}

/* The persistent tensor (no view) whose windows im2col node b gathers, itself or through its cast
 * (*cast: that node, else NULL): an image's blocks (to_blocks), read by another im2col. Else NULL.
 */
static kiln_tensor *blocks_source(const kiln__node *b, const kiln__node **cast) {
  *cast = NULL;
  if (!b || b->op != KILN__OP_IM2COL) return NULL;
  kiln_tensor *x = b->in[0];
  const kiln__node *p = kiln__producer(x);
  if (p && p->op == KILN__OP_CAST) *cast = p, x = p->in[0];
  return x->persistent && !kiln__producer(x) ? x : NULL;
}

bool kiln__gathers_again(const kiln__node *c) {
  const kiln_ctx *ctx = c->out->ctx;
  if (c->op != KILN__OP_IM2COL) return false;
  const kiln__node *a = kiln__producer(c->in[0]), *cast;
  if (a && a->op == KILN__OP_RELU) return ctx->conv_recompute_input && kiln__recomputes_input(a);
  return ctx->conv_recompute_blocks && blocks_source(a, &cast) != NULL;
}

/* Whether persistent x is as node `reader` of the open step read it: not freed, no copy from the
 * host since (kiln_tensor_copy_from_host runs what was recorded, then writes) and no recorded
 * update that stores into it. Else false with the context's error, which says what to do. */
static bool unchanged_since(kiln_ctx *ctx, const kiln_tensor *x, int32_t reader) {
  bool freed = x->magic != KILN__TENSOR_MAGIC || !x->st;
  bool same = !freed && !(x->st->host_step == ctx->gen && x->st->host_at > reader);
  for (int32_t i = reader + 1; i < ctx->trace.n && same; i++)
    same = !kiln__node_stores_into(&ctx->trace.nodes[i], x->st);
  if (!same)
    kiln__error(ctx, KILN_ERR_STATE,
                "kiln_backward: the persistent tensor that node #%d read was %s after it; the "
                "weight gradient of the convolution over its blocks gathers them from it again: "
                "%s it after kiln_backward, or set KILN_CONV_RECOMPUTE_BLOCKS=0 to keep them",
                reader, freed ? "freed" : "written", freed ? "free" : "write");
  return same;
}

/* The image of im2col node c recorded again for the weight gradient where kiln__gathers_again (a
 * ReLU over its batch norm's application recorded again; an image's blocks gathered again from
 * their unchanged source, through its cast); *again false and NULL where it is not; NULL with the
 * context's error where it is but cannot be. */
static kiln_tensor *image_again(const kiln__node *c, bool *again) {
  *again = kiln__gathers_again(c);
  if (!*again) return NULL;
  /* copies: recording moves the trace when it grows */
  const kiln__node a = *kiln__producer(c->in[0]), *cp;
  kiln_ctx *ctx = c->out->ctx;
  if (a.op == KILN__OP_RELU) {
    kiln_tensor *in = kiln__activation_input(&a);
    return in ? kiln__record_again_with(&a, &in) : NULL;
  }
  kiln_tensor *src = blocks_source(&a, &cp);
  kiln__node cast = cp ? *cp : a;
  if (!unchanged_since(ctx, src, cp ? cast.out->node : a.out->node)) return NULL;
  kiln_tensor *xc = cp ? kiln__record_again(&cast) : src;
  return xc ? kiln__record_again_with(&a, &xc) : NULL;
}

kiln_tensor *kiln__columns_for_gradient(const kiln__node *mm) {
  const kiln__node *c = columns_node(mm);
  kiln_tensor *cols = NULL;
  bool again = false;
  if (kiln__recomputes_columns(mm)) {
    cols = kiln__record_again(c);
  } else if (c) {
    const kiln__node cn = *c; /* a copy: image_again records */
    kiln_tensor *x = image_again(&cn, &again);
    if (!again) return mm->in[0];
    cols = x ? kiln__record_again_with(&cn, &x) : NULL;
  } else {
    return mm->in[0];
  }
  return cols ? kiln_reshape(cols, kiln_tensor_shape(mm->in[0])) : NULL;
}

bool kiln__recomputes_input(const kiln__node *n) {
  if (n->op != KILN__OP_GELU_ERF && n->op != KILN__OP_GELU_TANH && n->op != KILN__OP_SILU &&
      n->op != KILN__OP_LEAKY_RELU && n->op != KILN__OP_RELU)
    return false;
  const kiln__node *p = kiln__producer(n->in[0]);
  return p && p->op == KILN__OP_BN_APPLY && KILN__I(p, BN_APPLY, batch) && p->in[4]->persistent;
}

bool kiln__keeps_output(const kiln__node *n) {
  return n->out && n->out->requires_grad && (kiln__ops[n->op].saves & 8) &&
         !kiln__recomputes_input(n);
}

kiln_tensor *kiln__activation_input(const kiln__node *n) {
  return kiln__recomputes_input(n) ? kiln__record_again(kiln__producer(n->in[0])) : n->in[0];
}

kiln_tensor *kiln_batch_norm(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias,
                             kiln_tensor *running_mean, kiln_tensor *running_var, int training,
                             float momentum, float eps) {
  const char *fn = __func__;
  kiln_tensor *in[5] = {x, weight, bias, running_mean, running_var};
  if (!x) {
    kiln_ctx *c = kiln__ctx_of(5, in);
    if (c && kiln__ok(c)) kiln__error(c, KILN_ERR_INVALID, "%s: the input is NULL", fn);
    return NULL;
  }
  kiln_ctx *ctx = begin(fn, 5, in);
  if (!ctx || !is_float(ctx, fn, "the input", x)) return NULL;
  char sh[96];
  if (x->ndim != 2 && x->ndim != 4)
    return kiln__error(ctx, KILN_ERR_SHAPE,
                       "%s: the input is %s; it must be (N, H, W, C) or (N, C)", fn,
                       kiln__shape_of(x, sh, sizeof sh)),
           NULL;
  int64_t C = x->shape[x->ndim - 1], n = kiln_tensor_numel(x) / (C ? C : 1);
  if (!channel_vector(ctx, fn, "the weight", weight, C) ||
      !channel_vector(ctx, fn, "the bias", bias, C) ||
      !channel_vector(ctx, fn, "running_mean", running_mean, C) ||
      !channel_vector(ctx, fn, "running_var", running_var, C))
    return NULL;
  if (!running_mean != !running_var)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: running_mean and running_var are given together or not at all", fn),
           NULL;
  /* kiln.h's rule, as the layer's: 0 is PyTorch's default, KILN_ZERO an exact 0 */
  momentum = kiln__opt_or(momentum, 0.1f);
  eps = kiln__opt_or(eps, 1e-5f);
  if (!(eps >= 0.f) || !(momentum >= 0.f && momentum <= 1.f))
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: eps %g must be >= 0, momentum %g in [0, 1]", fn,
                       eps, momentum),
           NULL;
  if (!kiln__training_flag(ctx, fn, &training)) return NULL;
  bool batch_stats = training || !running_mean;
  if (batch_stats && n < 2 && training)
    return kiln__error(ctx, KILN_ERR_SHAPE,
                       "%s: training needs more than one value per channel; the input is %s", fn,
                       kiln__shape_of(x, sh, sizeof sh)),
           NULL;
  if (batch_stats && n < 1)
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: no values to take statistics of in %s", fn,
                       kiln__shape_of(x, sh, sizeof sh)),
           NULL;
  if (running_mean && training &&
      (!running_mean->persistent || !running_var->persistent ||
       !kiln__is_contiguous(running_mean) || !kiln__is_contiguous(running_var)))
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: running statistics are updated in place: they must be persistent "
                       "contiguous tensors",
                       fn),
           NULL;
  if (!batch_stats) {
    kiln_no_grad_begin(ctx);
    kiln_tensor *invstd = kiln_rsqrt(kiln_add_scalar(running_var, eps));
    kiln_no_grad_end(ctx);
    return invstd ? bn_apply(fn, x, weight, bias, running_mean, invstd, false) : NULL;
  }
  /* the batch's statistics in one pass over x: sums of x - k and of its square, k x's first row
   * (near the mean, so that the variance does not cancel), or (KILN_CONV_FPROP_MOMENTS, on) the
   * running mean where there is one, which a convolution's kernel has before it computes x and
   * so can sum x as it stores it (fusion/plan_conv.c's kiln__fprop_moments); bn_apply's rule
   * differentiates through them */
  kiln_no_grad_begin(ctx);
  kiln_tensor *xr = kiln_reshape(x, KILN_SHAPE(n, C));
  kiln_tensor *k = running_mean && ctx->fprop_moments ? kiln_reshape(running_mean, KILN_SHAPE(1, C))
                                                      : kiln_slice(xr, 0, 0, 1, 1); /* (1, C) */
  kiln_tensor *mi[2] = {xr, k}, *s[2];
  kiln__moments(fn, 0, mi, s); /* (1, C) each */
  /* every per-channel value over (1, C), so that they are one kernel with the sums and the
   * running statistics' new values */
  float inv_n = (float)(1.0 / (double)n);
  kiln_tensor *d = kiln_mul_scalar(s[0], inv_n); /* mean - k */
  kiln_tensor *mean = kiln_add(k, d);
  kiln_tensor *var = kiln_sub(kiln_mul_scalar(s[1], inv_n), kiln_mul(d, d));
  var = kiln_clamp(var, 0.f, INFINITY); /* biased */
  kiln_tensor *invstd = kiln_rsqrt(kiln_add_scalar(var, eps));
  kiln_no_grad_end(ctx);
  if (!invstd) return NULL;
  if (running_mean && training && momentum > 0.f && /* an exact 0 leaves them as they are */
      !running_update(fn, (kiln_tensor *[]){running_mean, running_var},
                      (kiln_tensor *[]){mean, var}, momentum,
                      (float[]){1.f, (float)((double)n / (double)(n - 1))}))
    return NULL;
  return bn_apply(fn, x, weight, bias, kiln_reshape(mean, KILN_SHAPE(C)),
                  kiln_reshape(invstd, KILN_SHAPE(C)), true);
}

kiln_tensor *kiln_layer_norm(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias, float eps) {
  const char *fn = __func__;
  kiln_tensor *in[3] = {x, weight, bias};
  if (!x) {
    kiln_ctx *c = kiln__ctx_of(3, in);
    if (c && kiln__ok(c)) kiln__error(c, KILN_ERR_INVALID, "%s: the input is NULL", fn);
    return NULL;
  }
  kiln_ctx *ctx = begin(fn, 3, in);
  if (!ctx || !is_float(ctx, fn, "the input", x)) return NULL;
  char sh[96];
  if (x->ndim < 1 || x->shape[x->ndim - 1] == 0)
    return kiln__error(ctx, KILN_ERR_SHAPE, "%s: the input %s has no last axis to normalise", fn,
                       kiln__shape_of(x, sh, sizeof sh)),
           NULL;
  int64_t C = x->shape[x->ndim - 1];
  if (!channel_vector(ctx, fn, "the weight", weight, C) ||
      !channel_vector(ctx, fn, "the bias", bias, C))
    return NULL;
  eps = kiln__opt_or(eps, 1e-5f); /* 0: PyTorch's default; KILN_ZERO: 0 */
  if (!(eps >= 0.f))
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: eps %g must be >= 0", fn, eps), NULL;
  x = kiln_cast(x, KILN_DTYPE_F32); /* computed in f32, as under torch.autocast */
  kiln_tensor *mean = kiln_mean(x, KILN_AXES(-1), 1);
  kiln_tensor *xc = kiln_sub(x, mean);
  kiln_tensor *var = kiln_mean(kiln_mul(xc, xc), KILN_AXES(-1), 1);
  return affine(kiln_mul(xc, kiln_rsqrt(kiln_add_scalar(var, eps))), weight, bias);
}
