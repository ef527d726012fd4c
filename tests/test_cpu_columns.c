/*
 * test_cpu_columns.c: the columns im2col writes for the products on cuBLAS, on a no-GPU context:
 * how many channels a thread takes, and the zero columns that pad a product's K to a multiple of
 * 8 (the default; KILN_CONV_KPAD=0: none); each kernel planned, rendered and compiled (NVRTC). Its
 * tests are the images suite's, as test_cpu_images.c's.
 */
#include <string.h>

#include "fusion/fusion.h"
#include "inspect.h"

/* With KILN_IM2COL_LANES=1 an im2col over 2 or 3 channels (ResNet's stem: RGB images) takes all
 * of a tap's channels a thread (lanes of 2 or 3, its kernel named _v2 or _v3), so that each
 * thread decodes its tap once for them; 1 channel, and any count without the switch, keep a lane
 * a thread. Every such kernel renders and compiles (NVRTC). */
Test(images, im2col_of_few_channels_takes_a_tap_a_thread) {
  struct {
    int64_t cin;
    bool on;
    const char *suffix; /* of the im2col kernel's stem, before its hash */
  } cases[] = {{3, true, "_f32_v3_"},
               {2, true, "_f32_v2_"},
               {3, false, "_f32_"},
               {1, true, "_f32_"},
               {4, true, "_f32_v4_"}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->im2col_lanes = cases[i].on;
    kiln_step_begin(ctx);
    kiln_tensor *x = th_f32(ctx, KILN_SHAPE(2, 9, 7, cases[i].cin));
    kiln_tensor *k = th_f32(ctx, KILN_SHAPE(8, cases[i].cin, 3, 3));
    kiln_conv2d_options o = {.pad_h = 1, .pad_w = 1};
    kiln_tensor *s = kiln_sum(kiln_conv2d(x, k, NULL, &o), KILN_ALL_AXES, 0);
    cr_assert_not_null(s, "%lld channels: %s", (long long)cases[i].cin, th_err(ctx));
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s", th_err(ctx));
    int found = 0;
    for (int g = 0; g < pg.plan.ng; g++) {
      const char *name = pg.call[g].name;
      if (strncmp(name, "k_im2col_3x3_s1", 15) != 0) continue;
      found++;
      cr_assert(strncmp(name + 15, cases[i].suffix, strlen(cases[i].suffix)) == 0,
                "%lld channels, switch %d: %s", (long long)cases[i].cin, cases[i].on, name);
    }
    cr_assert_eq(found, 1, "%lld channels: %d im2col kernels", (long long)cases[i].cin, found);
    kiln__program_free(&pg);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    th_free_scratch();
    th_ctx_free(ctx);
  }
}

/* By default (KILN_CONV_KPAD=0 turns it off) a bf16 convolution whose window holds K >= 64 values,
 * K not a multiple of 8, gets zero columns up to a multiple of 8 (24 over 3 channels, whose im2col
 * takes a tap a thread) and its product K of that width; its filters a zero block to match, and its
 * weight gradient the filters' own shape. ResNet's stem (7x7 over 3 channels, 147 values: 168
 * columns), 5x5 over 4 channels (100: 104, four lanes a thread); not a window of 27 values, not
 * f32, not without the switch, not K already a multiple of 8 (3x3 over 8 channels). Each renders
 * and compiles (NVRTC). */
Test(images, wide_windows_pad_their_columns_to_multiples_of_8) {
  struct {
    int64_t cin, k;
    kiln_dtype dtype;
    bool on;
    int64_t columns;
    const char *lanes; /* the im2col kernel's, in its name (NULL: an implicit product, none) */
  } cases[] = {
      {3, 7, KILN_DTYPE_BF16, true, 168, "_v3_"},  {4, 5, KILN_DTYPE_BF16, true, 104, "_v4_"},
      {3, 7, KILN_DTYPE_BF16, false, 147, "_v3_"}, {3, 7, KILN_DTYPE_F32, true, 147, "_v3_"},
      {3, 3, KILN_DTYPE_BF16, true, 27, "_v3_"},   {8, 3, KILN_DTYPE_BF16, true, 72, NULL}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char what[96];
    snprintf(what, sizeof what, "%lldx%lld over %lld channels, %s, switch %d",
             (long long)cases[i].k, (long long)cases[i].k, (long long)cases[i].cin,
             kiln_dtype_name(cases[i].dtype), cases[i].on);
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->conv_kpad = cases[i].on;
    ctx->conv_direct = false; /* the 27 values' product stays on im2col too */
    ctx->conv_s2d = false;    /* the stem's product on the columns, not on blocks */
    kiln_step_begin(ctx);
    /* x takes a gradient too: col2im sums rows of the padded width */
    kiln_tensor *x = th_param(ctx, KILN_SHAPE(2, 17, 15, cases[i].cin));
    kiln_tensor *k = th_param(ctx, KILN_SHAPE(16, cases[i].cin, cases[i].k, cases[i].k));
    kiln_conv2d_options o = {.stride_h = 2, .stride_w = 2, .pad_h = 3, .pad_w = 3};
    if (cases[i].dtype == KILN_DTYPE_BF16) kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *y = kiln_conv2d(x, k, NULL, &o);
    if (cases[i].dtype == KILN_DTYPE_BF16) kiln_autocast_end(ctx);
    cr_assert_not_null(y, "%s: %s", what, th_err(ctx));
    cr_assert_eq(kiln_backward(kiln_sum(kiln_cast(y, KILN_DTYPE_F32), KILN_ALL_AXES, 0)), KILN_OK,
                 "%s: %s", what, th_err(ctx));
    th_assert_shape(kiln_tensor_grad(k), kiln_tensor_shape(k));
    kiln_shape ys = kiln_tensor_shape(y);
    int64_t m = ys.d[0] * ys.d[1] * ys.d[2];
    int im2col = 0, col2im = 0, products = 0;
    for (int32_t j = 0; j < ctx->trace.n; j++) {
      const kiln__node *n = &ctx->trace.nodes[j];
      if (n->op == KILN__OP_IM2COL || n->op == KILN__OP_COL2IM) {
        const kiln_tensor *cols = n->op == KILN__OP_IM2COL ? n->out : n->in[0];
        im2col += n->op == KILN__OP_IM2COL;
        col2im += n->op == KILN__OP_COL2IM;
        cr_assert_eq(cols->shape[3], cases[i].columns, "%s: %s over %lld columns", what,
                     kiln__ops[n->op].name, (long long)cols->shape[3]);
      }
      if (n->op != KILN__OP_MATMUL || n->in[0]->ndim != 2 || n->in[1]->ndim != 2) continue;
      /* the columns (M, K), M rows of output pixels: the forward product's first
       * operand, the weight gradient's second (dY^T cols) */
      const kiln_tensor *cols = n->in[0]->shape[0] == m   ? n->in[0]
                                : n->in[1]->shape[0] == m ? n->in[1]
                                                          : NULL;
      if (cols && cols->shape[1] != 16) {
        products++;
        cr_assert_eq(cols->shape[1], cases[i].columns, "%s: a product over %lld columns", what,
                     (long long)cols->shape[1]);
      }
    }
    if (cases[i].lanes)
      cr_assert_eq(products, 2, "%s: %d products over the columns", what, products);
    cr_assert_eq(im2col, 1, "%s: %d im2col nodes", what, im2col);
    cr_assert_eq(col2im, 1, "%s: %d col2im nodes", what, col2im);
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s", th_err(ctx));
    int found = 0;
    for (int g = 0; g < pg.plan.ng; g++)
      if (strncmp(pg.call[g].name, "k_im2col", 8) == 0) {
        found++;
        cr_assert_not_null(strstr(pg.call[g].name, cases[i].lanes), "%s: %s", what,
                           pg.call[g].name);
      }
    cr_assert_eq(found, cases[i].lanes ? 1 : 0, "%s: %d im2col kernels", what, found);
    kiln__program_free(&pg);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", what, th_err(ctx));
    th_free_scratch();
    th_ctx_free(ctx);
  }
}

/* With KILN_CONV_S2D=1 a bf16 convolution at stride s over channels not in 16-byte chunks is a
 * stride-1 convolution over the image's s x s blocks (core/conv.c's to_blocks): the image's
 * im2col over s x s windows at stride s (each block's s s C values and zero columns up to a
 * multiple of 8) and the filters' likewise, then a product the implicit GEMMs run, forward and
 * weight gradient, over a x a blocks. ResNet's stem (7x7, stride 2, padding 3, 3 channels into
 * 64: 4x4 blocks of 16 values, K = 256), 3x3 at stride 2 (2x2 blocks), 8x8 at stride 4 over 3
 * channels (2x2 blocks of 48 values), 7x5 with paddings (3, 2); not without the switch, not in
 * f32, not over 8 channels (the implicit GEMMs take those as they are), not with 96 output
 * channels (more than they take), not at stride 1, not with dilation. Each renders and compiles
 * (NVRTC). */
Test(images, strided_convolutions_over_few_channels_run_on_blocks) {
  struct {
    int64_t cin, cout, kh, kw;
    kiln_conv2d_options o;
    kiln_dtype dtype;
    bool on;
    int64_t channels, ah, aw; /* the blocks' channels and window; 0: none */
  } cases[] = {
      {3, 64, 7, 7, {2, 2, 3, 3, 0, 0, 0}, KILN_DTYPE_BF16, true, 16, 4, 4},
      {3, 32, 3, 3, {2, 2, 1, 1, 0, 0, 0}, KILN_DTYPE_BF16, true, 16, 2, 2},
      {3, 32, 8, 8, {4, 4, 2, 2, 0, 0, 0}, KILN_DTYPE_BF16, true, 48, 2, 2},
      {3, 16, 7, 5, {2, 2, 3, 2, 0, 0, 0}, KILN_DTYPE_BF16, true, 16, 4, 3},
      {3, 64, 7, 7, {2, 2, 3, 3, 0, 0, 0}, KILN_DTYPE_BF16, false, 0, 0, 0},
      {3, 64, 7, 7, {2, 2, 3, 3, 0, 0, 0}, KILN_DTYPE_F32, true, 0, 0, 0},
      {8, 64, 7, 7, {2, 2, 3, 3, 0, 0, 0}, KILN_DTYPE_BF16, true, 0, 0, 0},
      {3, 96, 7, 7, {2, 2, 3, 3, 0, 0, 0}, KILN_DTYPE_BF16, true, 0, 0, 0},
      {3, 64, 7, 7, {1, 1, 3, 3, 0, 0, 0}, KILN_DTYPE_BF16, true, 0, 0, 0},
      {3, 64, 7, 7, {2, 2, 3, 3, 2, 2, 0}, KILN_DTYPE_BF16, true, 0, 0, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    const kiln_conv2d_options *o = &cases[i].o;
    char what[128];
    snprintf(what, sizeof what, "%lld->%lld %lldx%lld stride %d dilation %d, %s, switch %d",
             (long long)cases[i].cin, (long long)cases[i].cout, (long long)cases[i].kh,
             (long long)cases[i].kw, o->stride_h, o->dilation_h, kiln_dtype_name(cases[i].dtype),
             cases[i].on);
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->conv_s2d = cases[i].on;
    ctx->conv_recompute_blocks = false; /* the blocks gathered again: the test below */
    kiln_step_begin(ctx);
    kiln_tensor *x = th_f32(ctx, KILN_SHAPE(2, 21, 18, cases[i].cin));
    kiln_tensor *k =
        th_param(ctx, KILN_SHAPE(cases[i].cout, cases[i].cin, cases[i].kh, cases[i].kw));
    bool bf16 = cases[i].dtype == KILN_DTYPE_BF16;
    if (bf16) kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *y = kiln_conv2d(x, k, NULL, o);
    if (bf16) kiln_autocast_end(ctx);
    cr_assert_not_null(y, "%s: %s", what, th_err(ctx));
    cr_assert_eq(kiln_backward(kiln_sum(kiln_cast(y, KILN_DTYPE_F32), KILN_ALL_AXES, 0)), KILN_OK,
                 "%s: %s", what, th_err(ctx));
    th_assert_shape(kiln_tensor_grad(k), kiln_tensor_shape(k));
    int im2col = 0; /* blocks: the image's, the filters' and the product's */
    for (int32_t j = 0; j < ctx->trace.n; j++)
      im2col += ctx->trace.nodes[j].op == KILN__OP_IM2COL;
    cr_assert_eq(im2col, cases[i].channels ? 3 : 1, "%s: %d im2col nodes", what, im2col);
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s", th_err(ctx));
    int fprop = 0, wgrad = 0;
    for (int g = 0; g < pg.plan.ng && cases[i].channels; g++) {
      const kiln__group *gr = &pg.plan.g[g];
      if (gr->implicit != KILN__IMPLICIT_FPROP && gr->implicit != KILN__IMPLICIT_WGRAD) continue;
      const kiln__node *c = &ctx->trace.nodes[gr->window];
      kiln__win w = kiln__win_of(c);
      fprop += gr->implicit == KILN__IMPLICIT_FPROP;
      wgrad += gr->implicit == KILN__IMPLICIT_WGRAD;
      cr_assert_eq(c->in[0]->shape[3], cases[i].channels, "%s: %s over %lld channels", what,
                   pg.call[g].name, (long long)c->in[0]->shape[3]);
      cr_assert(w.kh == cases[i].ah && w.kw == cases[i].aw && w.sh == 1 && w.sw == 1 && w.ph == 0 &&
                    w.pw == 0,
                "%s: %s over %lldx%lld windows at stride %lld", what, pg.call[g].name,
                (long long)w.kh, (long long)w.kw, (long long)w.sh);
    }
    int want = cases[i].channels ? 1 : 0;
    cr_assert(fprop == want && wgrad == want,
              "%s: %d implicit forward products, %d weight "
              "gradients",
              what, fprop, wgrad);
    kiln__program_free(&pg);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", what, th_err(ctx));
    th_free_scratch();
    th_ctx_free(ctx);
  }
}

/* A bf16 convolution's bias (autocast casts it to bf16, which no BLAS epilogue takes) is added to
 * the image rather than to the product's rows, so that the activation after it shares its
 * iteration space and runs in the same kernel: the whitening layer of the CIFAR-10 example while
 * its bias trains (a direct product, then one kernel for the bias and GELU), and a 3x3 over 16
 * channels (an implicit product). In f32 the bias stays on the rows, where the BLAS library's
 * epilogue takes it with the ReLU. */
Test(images, a_bf16_convolution_s_bias_joins_its_activation) {
  struct {
    int64_t cin, cout, k;
    bool bf16;
  } cases[] = {{3, 24, 2, true}, {16, 32, 3, true}, {16, 32, 3, false}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char what[64];
    snprintf(what, sizeof what, "%lld->%lld %lldx%lld, %s", (long long)cases[i].cin,
             (long long)cases[i].cout, (long long)cases[i].k, (long long)cases[i].k,
             cases[i].bf16 ? "bf16" : "f32");
    kiln_ctx *ctx = th_cpu_ctx();
    kiln_step_begin(ctx);
    kiln_tensor *x = th_f32(ctx, KILN_SHAPE(4, 9, 7, cases[i].cin));
    kiln_tensor *k = th_f32(ctx, KILN_SHAPE(cases[i].cout, cases[i].cin, cases[i].k, cases[i].k));
    kiln_tensor *b = th_param(ctx, KILN_SHAPE(cases[i].cout));
    if (cases[i].bf16) kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *y = kiln_conv2d(x, k, b, NULL);
    y = cases[i].bf16 ? kiln_gelu(y, KILN_GELU_ERF) : kiln_relu(y);
    if (cases[i].bf16) kiln_autocast_end(ctx);
    kiln_tensor *s = kiln_cast(kiln_sum(y, KILN_ALL_AXES, 0), KILN_DTYPE_F32);
    cr_assert_eq(kiln_backward(s), KILN_OK, "%s: %s", what, th_err(ctx));
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s", th_err(ctx));
    int together = 0, epilogue = 0;
    for (int g = 0; g < pg.plan.ng; g++) {
      const kiln__group *gr = &pg.plan.g[g];
      bool add = false, act = false;
      for (int m = 0; m < gr->n; m++) {
        kiln__op op = th_node(ctx, pg.plan.members[gr->first + m])->op;
        add |= op == KILN__OP_ADD;
        act |= op == KILN__OP_GELU_ERF || op == KILN__OP_RELU;
      }
      together += add && act;
      epilogue += gr->bias != NULL;
    }
    if (cases[i].bf16)
      cr_assert_eq(together, 1, "%s: %d kernels with the bias and the activation", what, together);
    else
      cr_assert_eq(epilogue, 1, "%s: %d products with a bias epilogue", what, epilogue);
    kiln__program_free(&pg);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", what, th_err(ctx));
    th_free_scratch();
    th_ctx_free(ctx);
  }
}

/* Compiles what the open step recorded (NVRTC, every kernel), ends it, and returns its step
 * graph's planned arena; `which` names the case in a failure. */
static uint64_t compiled_arena(kiln_ctx *ctx, int which) {
  cr_assert_eq(kiln__engine_compile(ctx, ctx->trace.done, ctx->trace.n), KILN_OK, "case %d: %s",
               which, th_err(ctx));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "case %d: %s", which, th_err(ctx));
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  return st.arena_bytes;
}

/* A convolution's input that is the ReLU of a batch norm in training (ResNet's blocks) is recorded
 * again in the backward pass for the convolution's weight gradient, from the norm's input, weight
 * and statistics that the norm's gradient keeps anyway, so that the ReLU's output dies at the
 * forward product (one reader, not two) and the step's arena shrinks by at least one of them
 * (KILN_CONV_RECOMPUTE_INPUT; off: kept). Both ways every product runs implicit (forward and
 * weight gradient), the recomputed columns included; each kernel renders and compiles (NVRTC). */
Test(images, a_weight_gradient_s_image_recomputed_from_its_batch_norm) {
  enum { L = 3 };                                   /* conv, norm, ReLU; then a last conv */
  const uint64_t relu_bytes = 4 * 10 * 10 * 64 * 2; /* one ReLU's output, bf16 */
  uint64_t arena[2];
  for (int on = 0; on < 2; on++) {
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->conv_recompute_input = on;
    kiln_conv2d_options same = {.pad_h = 1, .pad_w = 1};
    kiln_step_begin(ctx);
    kiln_tensor *h = th_f32(ctx, KILN_SHAPE(4, 10, 10, 64)), *relu[L];
    kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    for (int l = 0; l < L; l++) {
      h = kiln_conv2d(h, th_param(ctx, KILN_SHAPE(64, 64, 3, 3)), NULL, &same);
      h = kiln_batch_norm(h, th_param(ctx, KILN_SHAPE(64)), th_param(ctx, KILN_SHAPE(64)), NULL,
                          NULL, 1, 0.1f, 1e-5f);
      h = relu[l] = kiln_relu(h);
    }
    kiln_tensor *y = kiln_conv2d(h, th_param(ctx, KILN_SHAPE(64, 64, 3, 3)), NULL, &same);
    kiln_autocast_end(ctx);
    cr_assert_not_null(y, "switch %d: %s", on, th_err(ctx));
    int32_t back = ctx->trace.n;
    cr_assert_eq(kiln_backward(kiln_sum(kiln_cast(y, KILN_DTYPE_F32), KILN_ALL_AXES, 0)), KILN_OK,
                 "switch %d: %s", on, th_err(ctx));
    int again =
        0; /* im2col nodes of the backward pass: over a ReLU of a norm, both recorded there */
    for (int32_t i = back; i < ctx->trace.n; i++) {
      const kiln__node *n = &ctx->trace.nodes[i];
      if (n->op != KILN__OP_IM2COL) continue;
      const kiln__node *r = kiln__producer(n->in[0]);
      cr_assert(r && r->op == KILN__OP_RELU && r->out->node >= back, "switch %d: im2col over %s",
                on, r ? th_op_name(r->op) : "a leaf");
      const kiln__node *a = kiln__producer(r->in[0]);
      cr_assert(a && a->op == KILN__OP_BN_APPLY && a->out->node >= back);
      again++;
    }
    cr_assert_eq(again, on ? L : 0, "switch %d: %d im2col nodes in the backward pass", on, again);
    for (int l = 0; l < L; l++) { /* the backward nodes that read ReLU l's forward columns */
      const kiln_tensor *cols[2] = {NULL, NULL}; /* im2col's, and their (M, K) reshape */
      int readers = 0;
      for (int32_t i = 0; i < ctx->trace.n; i++) {
        const kiln__node *n = &ctx->trace.nodes[i];
        if (n->op == KILN__OP_IM2COL && n->in[0] == relu[l]) cols[0] = n->out;
        if (n->op == KILN__OP_RESHAPE && cols[0] && n->in[0] == cols[0]) cols[1] = n->out;
        for (int q = 0; q < n->nin && i >= back; q++)
          readers += cols[0] && (n->in[q] == cols[0] || n->in[q] == cols[1]);
      }
      cr_assert_eq(readers, on ? 0 : 1, "switch %d: %d backward nodes read ReLU %d's columns", on,
                   readers, l);
    }
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s", th_err(ctx));
    int fprop = 0, wgrad = 0, gathered = 0;
    for (int g = 0; g < pg.plan.ng; g++) {
      const kiln__group *gr = &pg.plan.g[g];
      fprop += gr->implicit == KILN__IMPLICIT_FPROP;
      wgrad += gr->implicit == KILN__IMPLICIT_WGRAD;
      gathered += gr->n > 0 && th_node(ctx, pg.plan.members[gr->first])->op == KILN__OP_IM2COL &&
                  gr->implicit != KILN__IMPLICIT_FPROP;
    }
    cr_assert(fprop == L + 1 && wgrad == L + 1 && gathered == 0,
              "switch %d: %d implicit forward products, %d weight gradients, %d im2col kernels", on,
              fprop, wgrad, gathered);
    kiln__program_free(&pg);
    arena[on] = compiled_arena(ctx, on);
    th_free_scratch();
    th_ctx_free(ctx);
  }
  cr_log_info("arena %llu bytes recomputing, %llu keeping", (unsigned long long)arena[1],
              (unsigned long long)arena[0]);
  cr_assert_leq(arena[1] + relu_bytes, arena[0], "arena %llu bytes recomputing, %llu keeping",
                (unsigned long long)arena[1], (unsigned long long)arena[0]);
}

/* The blocks of a persistent image that a strided convolution over few channels runs on (ResNet's
 * stem) are gathered again for its weight gradient, through the image's cast, instead of kept
 * (KILN_CONV_RECOMPUTE_BLOCKS; off: kept): two im2col nodes and the cast recorded by the backward
 * pass, the products implicit, and a smaller arena (a ReLU and a 3x3 convolution after the stem,
 * whose backward pass runs while the blocks would be kept). The image copied from the host before
 * the forward pass (a training loop's next batch), or read by an assignment after it, is fine;
 * copied from the host or freed after it, before kiln_backward, the blocks cannot be gathered
 * again and kiln_backward says so (KILN_ERR_STATE), naming the switch. */
Test(images, a_strided_stem_s_blocks_gathered_again_from_its_image) {
  const size_t bytes = 4 * 32 * 32 * 3 * sizeof(float);
  float *data = calloc(1, bytes);
  cr_assert_not_null(data);
  uint64_t arena[2];
  /* off, on, on with the image copied, freed, or read by an assignment before kiln_backward */
  for (int mode = 0; mode < 5; mode++) {
    int on = mode > 0;
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->conv_recompute_blocks = on;
    kiln_tensor *x = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(4, 32, 32, 3));
    kiln_tensor *snap = th_f32(ctx, KILN_SHAPE(4, 32, 32, 3));
    kiln_tensor *k = th_param(ctx, KILN_SHAPE(64, 3, 7, 7)),
                *k2 = th_param(ctx, KILN_SHAPE(64, 64, 3, 3));
    kiln_step_begin(ctx);
    cr_assert_eq(kiln_tensor_copy_from_host(x, data, bytes), KILN_OK, "%s", th_err(ctx));
    kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_conv2d_options o = {.stride_h = 2, .stride_w = 2, .pad_h = 3, .pad_w = 3};
    kiln_tensor *y = kiln_conv2d(kiln_relu(kiln_conv2d(x, k, NULL, &o)), k2, NULL,
                                 &(kiln_conv2d_options){.pad_h = 1, .pad_w = 1});
    kiln_autocast_end(ctx);
    cr_assert_not_null(y, "mode %d: %s", mode, th_err(ctx));
    kiln_tensor *loss = kiln_sum(kiln_cast(y, KILN_DTYPE_F32), KILN_ALL_AXES, 0);
    if (mode == 2 || mode == 3) {
      if (mode == 2)
        cr_assert_eq(kiln_tensor_copy_from_host(x, data, bytes), KILN_OK, "%s", th_err(ctx));
      else
        kiln_tensor_free(x);
      cr_assert_eq(kiln_backward(loss), KILN_ERR_STATE, "mode %d: no error", mode);
      const char *e = kiln_ctx_error(ctx);
      cr_assert(e && strstr(e, "kiln_backward") && strstr(e, mode == 2 ? "written" : "freed") &&
                    strstr(e, "KILN_CONV_RECOMPUTE_BLOCKS=0"),
                "mode %d: the error: %s", mode, e ? e : "none");
      if (mode == 2) kiln_tensor_free(x);
      th_free_scratch();
      th_ctx_free(ctx);
      continue;
    }
    if (mode == 4) cr_assert_eq(kiln_assign(snap, x), KILN_OK, "%s", th_err(ctx));
    int32_t back = ctx->trace.n;
    cr_assert_eq(kiln_backward(loss), KILN_OK, "mode %d: %s", mode, th_err(ctx));
    int im2col = 0, cast = 0;
    for (int32_t i = back; i < ctx->trace.n; i++) {
      const kiln__node *n = &ctx->trace.nodes[i];
      im2col += n->op == KILN__OP_IM2COL;
      cast += n->op == KILN__OP_CAST && n->in[0] == x;
    }
    cr_assert(im2col == 2 * on && cast == on,
              "mode %d: %d im2col nodes and %d casts of x in the backward pass", mode, im2col,
              cast);
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s", th_err(ctx));
    int fprop = 0, wgrad = 0;
    for (int g = 0; g < pg.plan.ng; g++) {
      fprop += pg.plan.g[g].implicit == KILN__IMPLICIT_FPROP;
      wgrad += pg.plan.g[g].implicit == KILN__IMPLICIT_WGRAD;
    }
    cr_assert(fprop == 2 && wgrad == 2,
              "mode %d: %d implicit forward products, %d weight gradients", mode, fprop, wgrad);
    kiln__program_free(&pg);
    uint64_t planned = compiled_arena(ctx, mode);
    if (mode < 2) arena[on] = planned;
    kiln_tensor_free(x);
    th_free_scratch();
    th_ctx_free(ctx);
  }
  free(data);
  /* the blocks: 4 x 19 x 19 (16 x 16 outputs and 3 more blocks a side) x 16 bf16 */
  const uint64_t blocks = 4 * 19 * 19 * 16 * 2;
  cr_assert_leq(arena[1] + blocks / 2, arena[0], "arena %llu bytes gathering again, %llu keeping",
                (unsigned long long)arena[1], (unsigned long long)arena[0]);
}

/* The recomputations of a weight gradient's image (a ReLU over its batch norm, the stem's blocks)
 * record several nodes in a row while reading others of the trace: with 0 to 63 nodes recorded
 * before the network, the trace grows in the middle of them for some count, and every backward
 * pass still records and plans (under AddressSanitizer, CI's second run, a read of the trace's old
 * memory would be caught). */
Test(images, recomputed_images_survive_the_trace_growing) {
  for (int pad = 0; pad < 64; pad++) {
    kiln_ctx *ctx = th_cpu_ctx();
    kiln_tensor *x = th_f32(ctx, KILN_SHAPE(2, 16, 16, 3));
    kiln_tensor *k1 = th_param(ctx, KILN_SHAPE(64, 3, 7, 7)),
                *k2 = th_param(ctx, KILN_SHAPE(64, 64, 3, 3)),
                *k3 = th_param(ctx, KILN_SHAPE(64, 64, 3, 3));
    kiln_tensor *w = th_param(ctx, KILN_SHAPE(64)), *b = th_param(ctx, KILN_SHAPE(64));
    kiln_step_begin(ctx);
    for (int i = 0; i < pad; i++)
      cr_assert_not_null(kiln_full(ctx, KILN_SHAPE(1), 0.f));
    kiln_conv2d_options same = {.pad_h = 1, .pad_w = 1},
                        stem = {.stride_h = 2, .stride_w = 2, .pad_h = 3, .pad_w = 3};
    kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *h = kiln_conv2d(kiln_conv2d(x, k1, NULL, &stem), k2, NULL, &same);
    h = kiln_relu(kiln_batch_norm(h, w, b, NULL, NULL, 1, 0.1f, 1e-5f));
    kiln_tensor *y = kiln_conv2d(h, k3, NULL, &same);
    kiln_autocast_end(ctx);
    cr_assert_eq(kiln_backward(kiln_sum(kiln_cast(y, KILN_DTYPE_F32), KILN_ALL_AXES, 0)), KILN_OK,
                 "%d nodes before: %s", pad, th_err(ctx));
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s", th_err(ctx));
    kiln__program_free(&pg);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%d nodes before: %s", pad, th_err(ctx));
    th_free_scratch();
    th_ctx_free(ctx);
  }
}

/* KILN_IM2COL_ROWS (on by default): an im2col of one group over fewer than 8 channels whose rows
 * hold 8 to 32 values (a multiple of 8) takes a row a thread (its kernel named _row): the blocks of
 * ResNet's stem, the image's and the filters'. Not without the switch, and not the stem's columns
 * without blocks (KILN_CONV_S2D=0: 168 values a row). Each kernel renders and compiles (NVRTC). */
Test(images, blocks_gathered_a_row_a_thread) {
  for (int c = 0; c < 3; c++) { /* rows on blocks, off on blocks, on on columns */
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->im2col_rows = c != 1;
    ctx->conv_s2d = c != 2;
    kiln_step_begin(ctx);
    kiln_tensor *x = th_f32(ctx, KILN_SHAPE(2, 21, 18, 3));
    kiln_tensor *k = th_param(ctx, KILN_SHAPE(64, 3, 7, 7));
    kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *y = kiln_conv2d(
        x, k, NULL, &(kiln_conv2d_options){.stride_h = 2, .stride_w = 2, .pad_h = 3, .pad_w = 3});
    kiln_autocast_end(ctx);
    cr_assert_eq(kiln_backward(kiln_sum(kiln_cast(y, KILN_DTYPE_F32), KILN_ALL_AXES, 0)), KILN_OK,
                 "case %d: %s", c, th_err(ctx));
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s", th_err(ctx));
    int rows = 0, im2col = 0;
    for (int g = 0; g < pg.plan.ng; g++) {
      if (!strstr(pg.call[g].name, "k_im2col")) continue;
      im2col++;
      rows += strstr(pg.call[g].name, "_row_") != NULL;
    }
    cr_assert(im2col >= (c == 2 ? 1 : 2) && rows == (c == 0 ? im2col : 0),
              "case %d: %d of %d im2col kernels a row a thread", c, rows, im2col);
    kiln__program_free(&pg);
    compiled_arena(ctx, c);
    th_free_scratch();
    th_ctx_free(ctx);
  }
}

/* KILN_POOL_GRAD_BLOCKS (on by default): max pooling's gradient over overlapping windows at stride
 * 2 (ResNet's 3x3 stem pool, padding 1), on an image whose sides are multiples of the stride, takes
 * a block of 2 x 2 pixels a thread (its kernel named _blocks), with the positions the forward pass
 * wrote (fusion on) or searching the windows again (off). Not without the switch, not for windows
 * that tile the image (their own kernel), at stride 1, or on an odd side. Each kernel renders and
 * compiles (NVRTC). */
Test(images, max_pool_gradient_a_block_of_pixels_a_thread) {
  struct {
    int on, fuse, h, k, s, blocks;
  } cases[] = {{1, 1, 12, 3, 2, 1}, {1, 0, 12, 3, 2, 1}, {0, 1, 12, 3, 2, 0},
               {1, 1, 11, 3, 2, 0}, {1, 1, 12, 2, 2, 0}, {1, 1, 12, 3, 1, 0}};
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->pool_grad_blocks = cases[c].on;
    kiln_set_fusion(ctx, cases[c].fuse);
    kiln_step_begin(ctx);
    kiln_tensor *x = th_param(ctx, KILN_SHAPE(2, cases[c].h, 10, 8));
    const int pad = cases[c].k == 3;
    kiln_tensor *y = kiln_max_pool2d(kiln_cast(kiln_mul(x, x), KILN_DTYPE_BF16),
                                     &(kiln_pool2d_options){.kernel_h = cases[c].k,
                                                            .kernel_w = cases[c].k,
                                                            .stride_h = cases[c].s,
                                                            .stride_w = cases[c].s,
                                                            .pad_h = pad,
                                                            .pad_w = pad});
    cr_assert_eq(kiln_backward(kiln_sum(kiln_cast(y, KILN_DTYPE_F32), KILN_ALL_AXES, 0)), KILN_OK,
                 "case %zu: %s", c, th_err(ctx));
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s", th_err(ctx));
    int grads = 0, blocks = 0;
    for (int g = 0; g < pg.plan.ng; g++) {
      if (!strstr(pg.call[g].name, "k_max_pool_grad")) continue;
      grads++;
      blocks += strstr(pg.call[g].name, "_blocks") != NULL;
    }
    cr_assert(grads == 1 && blocks == cases[c].blocks,
              "case %zu: %d of %d max pooling gradients a block a thread", c, blocks, grads);
    kiln__program_free(&pg);
    compiled_arena(ctx, (int)c);
    th_free_scratch();
    th_ctx_free(ctx);
  }
}
