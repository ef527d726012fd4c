/*
 * test_cpu_conv_phases.c: a strided convolution's data gradient one phase of dX at a time on the
 * TMA-fed kernel (conv_tma.cuh's kiln_conv_dgrad_tma_phase; KILN_CONV_TMA_PHASES=1), without a
 * GPU: the phases' taps and dY's box corners against their definition, which convolutions the
 * planner gives the kernel, its launch and maps, the batch norm sums in its epilogue, and its
 * kernels rendered and compiled by NVRTC for sm_90a (kiln__program_build compiles every kernel
 * of the plan). The values, against float64, are test_gpu_ops_conv.c's.
 */
#include <string.h>

#include "fusion/fusion.h"
#include "inspect.h"

/* Along one direction (window k, stride s, padding p), the taps of phase r by their definition:
 * dX pixel s a + r = s oh - p + kh takes tap kh from dY's pixel oh = a + d, d = (r + p - kh) / s,
 * wherever s divides r + p - kh. kiln__phase_taps counts them and kiln__phase_corner gives the
 * least d of every phase (never above 0) and the greatest, for k 1 to 7, s 1 to 4, p 0 to k - 1. */
Test(conv_phases, taps_and_corners_match_their_definition) {
  for (int64_t k = 1; k <= 7; k++)
    for (int64_t s = 1; s <= 4; s++)
      for (int64_t p = 0; p < k; p++) {
        int64_t least = 0, most = 0, far = -99;
        for (int64_t r = 0; r < s; r++) {
          int taps = 0;
          for (int64_t kh = 0; kh < k; kh++) {
            if ((r + p - kh) % s != 0) continue;
            taps++;
            int64_t d = (r + p - kh) / s;
            least = d < least ? d : least;
            most = d > most ? d : most;
          }
          cr_assert_eq(kiln__phase_taps(k, s, p, r), taps, "k %lld, s %lld, p %lld, phase %lld",
                       (long long)k, (long long)s, (long long)p, (long long)r);
        }
        cr_assert_eq(kiln__phase_corner(k, s, p, &far), least, "k %lld, s %lld, p %lld",
                     (long long)k, (long long)s, (long long)p);
        cr_assert_eq(far, most, "k %lld, s %lld, p %lld", (long long)k, (long long)s, (long long)p);
      }
  int64_t far;
  cr_assert_eq(kiln__phase_corner(3, 2, 1, &far), 0, "ResNet's 3x3 downsampling");
  cr_assert_eq(far, 1);
  cr_assert_eq(kiln__phase_taps(3, 2, 1, 0), 1);
  cr_assert_eq(kiln__phase_taps(3, 2, 1, 1), 2);
  cr_assert_eq(kiln__phase_corner(5, 2, 2, &far), -1, "a 5x5 window's taps reach back");
  cr_assert_eq(kiln__phase_taps(1, 2, 0, 1), 0, "a 1x1 window's odd pixels take no tap");
}

typedef struct {
  const char *what;
  int64_t n, h, w, cin, cout, k, sh, sw, pad, dil;
  bool phased; /* the planner gives the data gradient the phase kernel */
} phase_case;

/* Records, in a new step, the bf16 y = conv2d(relu(x)) of case c and the backward pass of
 * sum(y). */
static void record_case(kiln_ctx *ctx, const phase_case *c) {
  kiln_step_begin(ctx);
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(c->n, c->h, c->w, c->cin));
  kiln_tensor *f = th_param(ctx, KILN_SHAPE(c->cout, c->cin, c->k, c->k));
  kiln_conv2d_options o = {.pad_h = (int)c->pad,
                           .pad_w = (int)c->pad,
                           .stride_h = (int)c->sh,
                           .stride_w = (int)c->sw,
                           .dilation_h = (int)c->dil,
                           .dilation_w = (int)c->dil};
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *y = kiln_conv2d(kiln_relu(x), f, NULL, &o);
  kiln_autocast_end(ctx);
  cr_assert_not_null(y, "%s: %s", c->what, th_err(ctx));
  cr_assert_eq(kiln_backward(kiln_cast(kiln_sum(y, KILN_ALL_AXES, 0), KILN_DTYPE_F32)), KILN_OK,
               "%s: %s", c->what, th_err(ctx));
}

/* With KILN_CONV_TMA_PHASES=1 the data gradient of a strided bf16 convolution whose image is its
 * output times the strides, with channels in stages of 64, is one implicit group on the TMA-fed
 * kernel (k_matmul_col2im_..._tma): a grid of every phase's tiles of 128 of its pixels, dY's
 * im2col map with both box corners at the least dY offset of any tap (so that its walk is dY's
 * own pixels) and the filters' map, compiled for sm_90a. Not where the image is not a multiple
 * of the output (14x13 at stride 2), with dilation, with 32 input channels, or without the
 * switch: then cuBLAS's columns and col2im as before, or with 64 output channels igemm.cuh's
 * mma.sync kernel. */
Test(conv_phases, strided_data_gradients_run_a_phase_at_a_time_with_the_switch) {
  const phase_case cases[] = {
      {"64->128 3x3 stride 2 pad 1", 4, 14, 14, 64, 128, 3, 2, 2, 1, 1, true},
      {"64->128 1x1 stride 2 on 14x12 images", 3, 14, 12, 64, 128, 1, 2, 2, 0, 1, true},
      {"64->64 5x5 stride 2 pad 2", 2, 10, 12, 64, 64, 5, 2, 2, 2, 1, true},
      {"64->64 3x3 stride 2 down, 1 across", 3, 8, 9, 64, 64, 3, 2, 1, 1, 1, true},
      {"64->256 4x4 stride 2 pad 1", 2, 8, 10, 64, 256, 4, 2, 2, 1, 1, true},
      {"64->64 3x3 stride 3", 2, 9, 6, 64, 64, 3, 3, 3, 0, 1, true},
      {"64->128 1x1 stride 2 on 14x13 images", 4, 14, 13, 64, 128, 1, 2, 2, 0, 1, false},
      {"64->64 3x3 stride 2 dilation 2 pad 2", 2, 12, 12, 64, 64, 3, 2, 2, 2, 2, false},
      {"32->128 3x3 stride 2 pad 1", 4, 14, 14, 32, 128, 3, 2, 2, 1, 1, false},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    for (int on = 0; on < 2; on++) {
      const phase_case *c = &cases[i];
      kiln_ctx *ctx = th_cpu_ctx();
      ctx->conv_phases = on;
      record_case(ctx, c);
      kiln__program pg;
      cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s: %s", c->what,
                th_err(ctx));
      int phased = 0;
      for (int g = 0; g < pg.plan.ng; g++) {
        const kiln__call *call = &pg.call[g];
        /* else the mma.sync kernel's (64 output channels), or none */
        if (pg.plan.g[g].implicit != KILN__IMPLICIT_DGRAD || !strstr(call->name, "_tma")) continue;
        cr_assert(strstr(call->name, "k_matmul_col2im"), "%s: %s", c->what, call->name);
        phased++;
        int64_t oh = c->h / c->sh, ow = c->w / c->sw, phases = c->sh * c->sw;
        int64_t rows = c->n * oh * ow, bn = c->cin <= 64 ? 64 : 128;
        cr_assert_eq(call->grid, (unsigned)(phases * ((rows + 127) / 128)), "%s: %u blocks",
                     c->what, call->grid);
        cr_assert_eq(call->grid_y, (unsigned)((c->cin + bn - 1) / bn), "%s", c->what);
        cr_assert_eq(call->ntmap, 2, "%s", c->what);
        const kiln__tmap_desc *a = &call->tmap[0];
        cr_assert(a->im2col && !call->tmap[1].im2col, "%s", c->what);
        cr_assert(a->dims[0] == (uint64_t)c->cout && a->dims[1] == (uint64_t)ow &&
                      a->dims[2] == (uint64_t)oh && a->dims[3] == (uint64_t)c->n,
                  "%s: the map walks dY", c->what);
        int64_t far, lw = kiln__phase_corner(c->k, c->sw, c->pad, &far),
                     lh = kiln__phase_corner(c->k, c->sh, c->pad, &far);
        cr_assert(a->lower[0] == lw && a->upper[0] == lw && a->lower[1] == lh &&
                      a->upper[1] == lh && a->elem_strides[1] == 1 && a->elem_strides[2] == 1,
                  "%s: corners (%d, %d) and (%d, %d)", c->what, a->lower[0], a->lower[1],
                  a->upper[0], a->upper[1]);
      }
      cr_assert_eq(phased, on && c->phased ? 1 : 0, "%s, switch %d: %d phased data gradients",
                   c->what, on, phased);
      kiln__program_free(&pg);
      cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", c->what, th_err(ctx));
      th_free_scratch();
      th_ctx_free(ctx);
    }
}

/* Records, in a new step, a bf16 conv (64 -> 64, 3x3 pad 1) -> batch norm -> GELU -> conv
 * (64 -> 64, 3x3 at stride 2, pad 1) block over x (n, 10, 8, 64) and the backward pass of sum(y).
 */
static void record_bn_block(kiln_ctx *ctx, int64_t n) {
  kiln_step_begin(ctx);
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(n, 10, 8, 64));
  kiln_tensor *k1 = th_param(ctx, KILN_SHAPE(64, 64, 3, 3)),
              *k2 = th_param(ctx, KILN_SHAPE(64, 64, 3, 3));
  kiln_tensor *gamma = th_param(ctx, KILN_SHAPE(64)), *beta = th_param(ctx, KILN_SHAPE(64));
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *h = kiln_conv2d(x, k1, NULL, &(kiln_conv2d_options){.pad_h = 1, .pad_w = 1});
  h = kiln_gelu(kiln_batch_norm(h, gamma, beta, NULL, NULL, 1, 0, 0), KILN_GELU_ERF);
  kiln_tensor *y = kiln_conv2d(
      h, k2, NULL, &(kiln_conv2d_options){.pad_h = 1, .pad_w = 1, .stride_h = 2, .stride_w = 2});
  kiln_autocast_end(ctx);
  cr_assert_not_null(y, "%s", th_err(ctx));
  cr_assert_eq(kiln_backward(kiln_cast(kiln_sum(y, KILN_ALL_AXES, 0), KILN_DTYPE_F32)), KILN_OK,
               "%s", th_err(ctx));
}

/* Batch norm's backward sums over what the phased data gradient's epilogue computes (GELU's
 * derivative at the recomputed batch norm) join its kernel (plan_conv.c's kiln__dgrad_moments),
 * its blocks' partial sums one a block of 128 pixels, where every phase's pixels fill whole tiles:
 * 32 images of 10x8 (640 pixels a phase), not 16 (320: a phase's last tile would be short, and the
 * blocks would outnumber the sums' 128-row partials); the kernel renders and compiles. */
Test(conv_phases, phased_data_gradients_sum_the_batch_norm_before_them) {
  const int64_t batch[2] = {32, 16};
  for (int i = 0; i < 2; i++) {
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->conv_phases = true;
    record_bn_block(ctx, batch[i]);
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s", th_err(ctx));
    int strided = 0, sums = 0;
    for (int g = 0; g < pg.plan.ng; g++) {
      const kiln__group *gr = &pg.plan.g[g];
      if (gr->implicit != KILN__IMPLICIT_DGRAD || !strstr(pg.call[g].name, "_3x3_s2_")) continue;
      strided++;
      sums += gr->moments;
      cr_assert_eq(gr->moments, strstr(pg.call[g].name, "_tma_moments_") != NULL, "%s",
                   pg.call[g].name);
    }
    cr_assert_eq(strided, 1, "batch %lld: the strided conv's data gradient is phased",
                 (long long)batch[i]);
    cr_assert_eq(sums, i == 0, "batch %lld: %d data gradients sum", (long long)batch[i], sums);
    kiln__program_free(&pg);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    th_free_scratch();
    th_ctx_free(ctx);
  }
}
