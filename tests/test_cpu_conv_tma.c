/*
 * test_cpu_conv_tma.c: the TMA-fed convolution products (KILN_CONV_TMA=1,
 * fusion/device/conv_tma.cuh) without a GPU: which windows and channel counts the kernels take,
 * which products of a step the planner gives them, and that every such kernel renders with its
 * maps bound after its operands and compiles (NVRTC, sm_90a). The maps themselves are
 * test_cpu_tmap.c's.
 */
#include <string.h>

#include "fusion/fusion.h"
#include "inspect.h"

/* ---------------------------------------------------------------- what the kernels take */

Test(conv_tma, windows_and_channels_the_kernels_take) {
  kiln__win same = {.kh = 3, .kw = 3, .sh = 1, .sw = 1, .ph = 1, .pw = 1, .dh = 1, .dw = 1};
  cr_assert(kiln__conv_tma_window(&same, 64));
  cr_assert(kiln__conv_tma_window(&same, 512));
  cr_assert_not(kiln__conv_tma_window(&same, 24), "a stage is 64 channels of one tap");
  cr_assert_not(kiln__conv_tma_window(&same, 96));
  kiln__win s2 = same;
  s2.sh = s2.sw = 2;
  cr_assert(kiln__conv_tma_window(&s2, 64));
  s2.sh = s2.sw = 9;
  cr_assert_not(kiln__conv_tma_window(&s2, 64), "traversal strides are 1 to 8");
  kiln__win wide = same;
  wide.ph = 129;
  cr_assert_not(kiln__conv_tma_window(&wide, 64), "box corners within [-128, 127]");
  wide.ph = 128; /* corners -128 and 126 */
  cr_assert(kiln__conv_tma_window(&wide, 64));
  wide.ph = 1;
  wide.kh = 200; /* upper corner 1 - 199 */
  cr_assert_not(kiln__conv_tma_window(&wide, 64));
  /* tap offsets d (k - 1) are 8 bits in a 4-D copy: p 128 and d (k - 1) 256 keep the corners in
   * range (-128 and -128) but not the offset */
  kiln__win far = {.kh = 3, .kw = 3, .sh = 1, .sw = 1, .ph = 128, .pw = 1, .dh = 128, .dw = 1};
  cr_assert_not(kiln__conv_tma_window(&far, 64), "a tap offset of 256");
  far.dh = 127; /* offset 254, corners -128 and -126 */
  cr_assert(kiln__conv_tma_window(&far, 64));

  /* the data gradient: stride 1, its window's padding d (k - 1) - p not negative */
  kiln__win f = kiln__dgrad_window(&same);
  cr_assert_eq(f.ph, 1);
  cr_assert_eq(f.sh, 1);
  cr_assert(kiln__conv_tma_dgrad(&same, 256, 64));
  cr_assert_not(kiln__conv_tma_dgrad(&same, 256, 32), "32 input channels: half a panel");
  cr_assert_not(kiln__conv_tma_dgrad(&same, 48, 64), "48 output channels: not a stage");
  kiln__win valid = same;
  valid.ph = valid.pw = 0;
  cr_assert_eq(kiln__dgrad_window(&valid).ph, 2);
  cr_assert(kiln__conv_tma_dgrad(&valid, 64, 64));
  kiln__win over = same;
  over.ph = over.pw = 3;
  cr_assert_not(kiln__conv_tma_dgrad(&over, 64, 64), "padding past the window");
  cr_assert_not(kiln__conv_tma_dgrad(&s2, 64, 64), "stride 2");
}

/* ---------------------------------------------------------------- plans and kernels */

/* Records, in a new step, the bf16 y = conv2d(relu(x)) of x (n, h, w, cin), a kxk weight with
 * cout filters, padding k / 2, stride s, and the backward pass of sum(y). */
static void record_window(kiln_ctx *ctx, const char *what, int64_t n, int64_t h, int64_t w,
                          int64_t cin, int64_t cout, int64_t kk, int s) {
  kiln_step_begin(ctx);
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(n, h, w, cin));
  kiln_tensor *k = th_param(ctx, KILN_SHAPE(cout, cin, kk, kk));
  int pad = (int)(kk / 2);
  kiln_conv2d_options o = {.pad_h = pad, .pad_w = pad, .stride_h = s, .stride_w = s};
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *y = kiln_conv2d(kiln_relu(x), k, NULL, &o);
  kiln_autocast_end(ctx);
  cr_assert_not_null(y, "%s: %s", what, th_err(ctx));
  cr_assert_eq(kiln_backward(kiln_cast(kiln_sum(y, KILN_ALL_AXES, 0), KILN_DTYPE_F32)), KILN_OK,
               "%s: %s", what, th_err(ctx));
}

/* record_window with a 3x3 weight, padding 1. */
static void record_image(kiln_ctx *ctx, const char *what, int64_t n, int64_t h, int64_t w,
                         int64_t cin, int64_t cout, int s) {
  record_window(ctx, what, n, h, w, cin, cout, 3, s);
}

/* Frees a program built for the open step, then ends the step and frees the context. */
/* record_image of x (4, 9, 7, cin). */
static void record(kiln_ctx *ctx, const char *what, int64_t cin, int64_t cout, int s) {
  record_image(ctx, what, 4, 9, 7, cin, cout, s);
}

/* What the compiled program of the open step gives each convolution product. */
typedef struct {
  int fprop, wgrad, dgrad;             /* implicit groups */
  int tma_fprop, tma_wgrad, tma_dgrad; /* of those, TMA-fed kernels */
} products;

static products program_products(kiln_ctx *ctx, const char *what) {
  kiln__program pg;
  cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s: %s", what,
            th_err(ctx));
  products n = {0};
  for (int k = 0; k < pg.plan.ng; k++) {
    const kiln__group *g = &pg.plan.g[k];
    const kiln__call *c = &pg.call[k];
    bool tma = strstr(c->name, "_tma") != NULL;
    cr_assert_eq(tma, c->ntmap > 0, "%s: %s has %d maps", what, c->name, c->ntmap);
    if (tma) {
      cr_assert_eq(c->ntmap, 2, "%s: %s", what, c->name);
      cr_assert_eq(c->block, 288, "%s: %s: two warpgroups and a producer warp", what, c->name);
      /* the maps' slot follows the operands (and the split-K workspace's two) */
      cr_assert_geq(c->tma_slot, c->arg.nptr, "%s: %s", what, c->name);
      cr_assert_lt(c->tma_slot, KILN__KMAX_PTR, "%s: %s", what, c->name);
      if (c->ws_slot > 0) cr_assert_eq(c->tma_slot, c->ws_slot + 2, "%s: %s", what, c->name);
      cr_assert(c->tmap[0].im2col, "%s: %s: the first map gathers the image", what, c->name);
      cr_assert_not(c->tmap[1].im2col, "%s: %s", what, c->name);
      for (int i = 0; i < 2; i++) {
        cr_assert_lt(c->tmap[i].operand, c->arg.nptr, "%s: %s", what, c->name);
        const kiln_tensor *t = c->arg.ptr[c->tmap[i].operand];
        uint64_t numel = 1;
        for (int d = 0; d < c->tmap[i].rank; d++)
          numel *= c->tmap[i].dims[d];
        cr_assert_eq(numel, (uint64_t)kiln_tensor_numel(t),
                     "%s: %s: map %d covers another tensor's elements", what, c->name, i);
        cr_assert_eq(t->dtype, KILN_DTYPE_BF16);
      }
    }
    n.fprop += g->implicit == KILN__IMPLICIT_FPROP;
    n.wgrad += g->implicit == KILN__IMPLICIT_WGRAD;
    n.dgrad += g->implicit == KILN__IMPLICIT_DGRAD;
    n.tma_fprop += tma && g->implicit == KILN__IMPLICIT_FPROP;
    n.tma_wgrad += tma && g->implicit == KILN__IMPLICIT_WGRAD;
    n.tma_dgrad += tma && g->implicit == KILN__IMPLICIT_DGRAD;
  }
  kiln__program_free(&pg);
  return n;
}

/* With KILN_CONV_TMA=1 a bf16 convolution with input channels in whole stages of 64 runs its
 * forward product and weight gradient on the TMA-fed kernels whatever its output channels (the
 * 64-channel cap is the cp.async kernels'), and its data gradient too at stride 1 with output
 * channels in stages of 64; every kernel renders with its two maps and compiles for sm_90a.
 * Other shapes keep the kernels they had; without the switch nothing is TMA-fed. */
Test(conv_tma, the_planner_gives_the_tma_kernels_what_they_take) {
  struct {
    const char *what;
    int64_t cin, cout;
    int stride;
    bool tma;
    products want;
  } cases[] = {
      {"64->256", 64, 256, 1, true, {1, 1, 1, 1, 1, 1}},
      {"128->64", 128, 64, 1, true, {1, 1, 1, 1, 1, 1}},
      {"64->128 stride 2", 64, 128, 2, true, {1, 1, 0, 1, 1, 0}},
      {"64->40 (40 output channels: the data gradient on conv.cuh)",
       64,
       40,
       1,
       true,
       {1, 1, 1, 1, 1, 0}},
      {"24->64 (24 input channels: conv.cuh's kernels)", 24, 64, 1, true, {1, 1, 1, 0, 0, 0}},
      {"24->256 (24 input channels, 256 output: cuBLAS)", 24, 256, 1, true, {0, 0, 0, 0, 0, 0}},
      {"64->256 without the switch", 64, 256, 1, false, {0, 0, 0, 0, 0, 0}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->conv_tma = cases[i].tma;
    record(ctx, cases[i].what, cases[i].cin, cases[i].cout, cases[i].stride);
    products got = program_products(ctx, cases[i].what), want = cases[i].want;
    cr_assert_eq(got.fprop, want.fprop, "%s: %d implicit forward products", cases[i].what,
                 got.fprop);
    cr_assert_eq(got.wgrad, want.wgrad, "%s: %d implicit weight gradients", cases[i].what,
                 got.wgrad);
    cr_assert_eq(got.dgrad, want.dgrad, "%s: %d implicit data gradients", cases[i].what, got.dgrad);
    cr_assert_eq(got.tma_fprop, want.tma_fprop, "%s: TMA forward", cases[i].what);
    cr_assert_eq(got.tma_wgrad, want.tma_wgrad, "%s: TMA weight gradient", cases[i].what);
    cr_assert_eq(got.tma_dgrad, want.tma_dgrad, "%s: TMA data gradient", cases[i].what);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", cases[i].what, th_err(ctx));
    th_free_scratch();
    th_ctx_free(ctx);
  }
}

/* KILN_CONV_FEW=1: a bf16 convolution at stride 1 from 8 to 56 input channels (in 16-byte chunks)
 * into 64, of at most 288 values a window, runs its forward product on conv_few.cuh's kernel
 * (k_conv_few_: persistent blocks of 256 threads, two an SM, launched over at most two blocks an
 * SM's worth of tiles, each with the filters, two halos and the staged rows in shared memory),
 * which renders and compiles; 4 x 32 tiles, or 8 x 16 where those leave fewer pixels past the
 * output's edges (an output at most 16 wide; ResNet's stem, 112 wide); a pixel's halo stride an
 * odd count of 16-byte chunks (16 channels: three, one of them padding), and a filter's row too
 * (ResNet's stem: 33 of 32). With
 * KILN_CONV_FEW_WGRAD=0 its gradients keep their kernels (the next test takes the weight's). Not
 * without the switch, not at stride 2, not into 32 channels, not over 64 (TMA's), not for 600
 * values a window. */
Test(conv_tma, few_channel_forward_products_run_from_a_halo_tile) {
  struct {
    const char *what;
    int64_t h, w, cin, cout, k;
    int s;
    bool on;
    int want, th, tw;
  } cases[] = {
      {"24->64 3x3 on 9x7 images", 9, 7, 24, 64, 3, 1, true, 1, 8, 16},
      {"24->64 3x3 on 31x31 images (air's first conv)", 31, 31, 24, 64, 3, 1, true, 1, 4, 32},
      {"8->64 5x5", 9, 7, 8, 64, 5, 1, true, 1, 8, 16},
      {"32->64 3x3 on 20x17 images", 20, 17, 32, 64, 3, 1, true, 1, 4, 32},
      {"16->64 4x4 pad 2 on 111x111 images (112x112 out, as ResNet's stem on its blocks)", 111, 111,
       16, 64, 4, 1, true, 1, 8, 16},
      {"48->64 2x2 pad 1 on 9x7 images (six chunks a pixel, padded to seven)", 9, 7, 48, 64, 2, 1,
       true, 1, 8, 16},
      {"56->64 2x2 pad 1 on 9x7 images (seven chunks a pixel)", 9, 7, 56, 64, 2, 1, true, 1, 8, 16},
      {"24->64 without the switch", 9, 7, 24, 64, 3, 1, false, 0, 0, 0},
      {"24->64 stride 2", 9, 7, 24, 64, 3, 2, true, 0, 0, 0},
      {"24->32", 9, 7, 24, 32, 3, 1, true, 0, 0, 0},
      {"64->64 (TMA's)", 9, 7, 64, 64, 3, 1, true, 0, 0, 0},
      {"24->64 5x5 (600 values a window)", 9, 7, 24, 64, 5, 1, true, 0, 0, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    const char *what = cases[i].what;
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->conv_few = cases[i].on;
    ctx->conv_few_wgrad = false;
    record_window(ctx, what, 4, cases[i].h, cases[i].w, cases[i].cin, cases[i].cout, cases[i].k,
                  cases[i].s);
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s: %s", what,
              th_err(ctx));
    int few = 0, fprop = 0;
    for (int k = 0; k < pg.plan.ng; k++) {
      const kiln__call *c = &pg.call[k];
      fprop += pg.plan.g[k].implicit == KILN__IMPLICIT_FPROP;
      if (!strstr(c->name, "k_conv_few_")) continue;
      few++;
      cr_assert_eq(pg.plan.g[k].implicit, KILN__IMPLICIT_FPROP, "%s: %s", what, c->name);
      cr_assert_eq(c->block, 256, "%s", what);
      cr_assert_eq(c->ntmap, 0, "%s", what);
      const int64_t th = cases[i].th, tw = cases[i].tw, k2 = cases[i].k, ch = cases[i].cin / 8;
      const int64_t px = ch % 2 ? ch : ch + 1; /* a pixel's chunks in the halo */
      const int64_t tiles = 4 * ((cases[i].h + th - 1) / th) * ((cases[i].w + tw - 1) / tw);
      cr_assert_eq(c->grid, tiles < 2 * 132 ? tiles : 2 * 132, "%s: grid %u", what, c->grid);
      cr_assert_eq(c->smem,
                   (unsigned)(64 * ((k2 * k2 * ch) | 1) * 16 + 16 +
                              2 * (th + k2 - 1) * (tw + k2 - 1) * px * 16 + 128 * 144),
                   "%s: %u bytes of shared memory", what, c->smem);
      kiln__target t = {.num_sms = 132, .conv_few = true};
      kiln__rendered r;
      memset(&r, 0, sizeof r);
      cr_assert(kiln__render(&t, &pg.spec[k], &r), "%s", what);
      char tiling[64];
      snprintf(tiling, sizeof tiling, "kiln_conv_few<G, %lld, %lld, false>", (long long)th,
               (long long)tw);
      cr_assert(strstr(r.src.s, "__launch_bounds__(256, 2)"), "%s: %s", what, r.src.s);
      cr_assert(strstr(r.src.s, tiling), "%s: %s", what, r.src.s);
      cr_assert_str_eq(r.name, c->name, "%s", what);
      kiln__sb_free(&r.src);
    }
    cr_assert_eq(few, cases[i].want, "%s: %d forward products from a halo", what, few);
    if (cases[i].want) cr_assert_eq(fprop, 1, "%s", what);
    th_finish_program(ctx, &pg, what);
  }
}

/* KILN_CONV_FEW_WGRAD=1: the weight gradient of a convolution whose forward product comes from a
 * halo tile runs on conv_few.cuh's kiln_conv_few_wgrad from the same tiles (k_conv_few_wgrad_,
 * 256 threads, two blocks an SM, the split-K workspace after its operands, no maps), which renders
 * and compiles; not without the switch, not where the forward product does not take the shape
 * (stride 2), not past 256 values a window, and not with KILN_CONV_WGRAD_INTO (that kernel writes
 * the f32 gradient itself). */
Test(conv_tma, few_channel_weight_gradients_from_the_same_tiles_with_the_switch) {
  struct {
    const char *what;
    int64_t h, w, cin, k;
    int s;
    bool on, into;
    int want;
  } cases[] = {
      {"24->64 3x3 on 31x31 images", 31, 31, 24, 3, 1, true, false, 1},
      {"8->64 5x5 on 9x7 images", 9, 7, 8, 5, 1, true, false, 1},
      {"24->64 without the switch", 31, 31, 24, 3, 1, false, false, 0},
      {"24->64 stride 2", 31, 31, 24, 3, 2, true, false, 0},
      {"24->64 written into .grad", 31, 31, 24, 3, 1, true, true, 0},
      {"16->64 4x4 (ResNet's stem on its blocks: 256 values a window)", 23, 23, 16, 4, 1, true,
       false, 1},
      {"48->64 2x2 (six chunks a pixel, padded to seven)", 9, 7, 48, 2, 1, true, false, 1},
      {"32->64 3x3 (288 values a window: a block's dWt past its registers)", 20, 17, 32, 3, 1, true,
       false, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    const char *what = cases[i].what;
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->conv_few_wgrad = cases[i].on;
    ctx->conv_wgrad_into = cases[i].into;
    record_window(ctx, what, 4, cases[i].h, cases[i].w, cases[i].cin, 64, cases[i].k, cases[i].s);
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s: %s", what,
              th_err(ctx));
    int few = 0, wgrad = 0;
    for (int k = 0; k < pg.plan.ng; k++) {
      const kiln__call *c = &pg.call[k];
      wgrad += pg.plan.g[k].implicit == KILN__IMPLICIT_WGRAD;
      if (!strstr(c->name, "k_conv_few_wgrad_")) continue;
      few++;
      cr_assert_eq(pg.plan.g[k].implicit, KILN__IMPLICIT_WGRAD, "%s: %s", what, c->name);
      cr_assert_eq(c->block, 256, "%s", what);
      cr_assert_eq(c->ntmap, 0, "%s", what);
      cr_assert_eq(c->ws_slot, c->arg.nptr, "%s: the workspace after the operands", what);
      cr_assert_leq(c->grid, 2 * 132, "%s", what);
    }
    cr_assert_eq(few, cases[i].want, "%s: %d weight gradients from halo tiles", what, few);
    cr_assert_eq(wgrad, 1, "%s: %d implicit weight gradients", what, wgrad);
    th_finish_program(ctx, &pg, what);
  }
}

/* An explicit KILN_IMPLICIT_CONV_MAX_CO still caps the output channels of the implicit
 * forward products and weight gradients, TMA-fed or not (to measure one against the other). */
Test(conv_tma, an_explicit_channel_cap_still_holds) {
  kiln_ctx *ctx = th_cpu_ctx();
  ctx->conv_tma = true;
  ctx->implicit_conv_max_co = 64;
  record(ctx, "64->256 capped at 64", 64, 256, 1);
  products got = program_products(ctx, "64->256 capped at 64");
  cr_assert_eq(got.fprop, 0);
  cr_assert_eq(got.wgrad, 0);
  cr_assert_eq(got.tma_dgrad, 1, "the data gradient has no cap of its own");
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  th_free_scratch();
  th_ctx_free(ctx);
}

/* A convolution image, as record_image takes it (3x3, padding 1, stride 1). */
typedef struct {
  int64_t n, hw, cin, cout;
} image_case;

/* For each case, the program of record_image's step in a context whose widest tile for products
 * of `kind` is bn (data gradients: 0 as wide as the channels; forward products:
 * KILN_CONV_FPROP_BN's field, 0 for one block an SM); check() sees each group of `kind` in it (one
 * a case). */
static void each_product(const image_case *cases, size_t ncases, kiln__implicit kind, int bn,
                         void (*check)(const char *what, const kiln_ctx *ctx,
                                       const kiln__call *c)) {
  for (size_t i = 0; i < ncases; i++) {
    char what[96];
    snprintf(what, sizeof what, "%lldx%lldx%lld->%lld, batch %lld", (long long)cases[i].hw,
             (long long)cases[i].hw, (long long)cases[i].cin, (long long)cases[i].cout,
             (long long)cases[i].n);
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->conv_tma = true;
    if (kind == KILN__IMPLICIT_DGRAD) ctx->conv_dgrad_bn = bn;
    if (kind == KILN__IMPLICIT_FPROP) ctx->conv_fprop_bn = bn;
    record_image(ctx, what, cases[i].n, cases[i].hw, cases[i].hw, cases[i].cin, cases[i].cout, 1);
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s: %s", what,
              th_err(ctx));
    int found = 0;
    for (int g = 0; g < pg.plan.ng; g++)
      if (pg.plan.g[g].implicit == kind) {
        found++;
        check(what, ctx, &pg.call[g]);
      }
    cr_assert_eq(found, 1, "%s: %d products of the kind", what, found);
    th_finish_program(ctx, &pg, what);
  }
}

static void check_wave(const char *what, const kiln_ctx *ctx, const kiln__call *c) {
  const int64_t sms = ctx->num_sms, blocks = (int64_t)c->grid * c->grid_y * c->grid_z;
  const int64_t last = blocks % sms == 0 ? sms : blocks % sms;
  cr_assert_gt(c->grid_z, 1, "%s: %s: the pixels split", what, c->name);
  cr_assert_geq(4 * last, 3 * sms, "%s: %s: %lld blocks (%u splits) on %lld SMs", what, c->name,
                (long long)blocks, c->grid_z, (long long)sms);
  cr_assert_leq(blocks, sms, "%s: %s: %lld blocks", what, c->name, (long long)blocks);
}

/* A weight gradient splits its pixels into as many parts as one wave of blocks (one an SM) holds:
 * L2 bounds it, so a second wave costs about what the first does. The old rule (just past one
 * block an SM) gave air's 7x7x256->256 conv 4 splits of 36 tiles, 144 blocks on 132 SMs. Shapes of
 * the air step (batch 1024) and ResNet-18 (batch 128). */
Test(conv_tma, weight_gradient_blocks_fill_their_last_wave) {
  const image_case cases[] = {{1024, 7, 256, 256}, {1024, 15, 64, 256}, {1024, 15, 64, 64},
                              {1024, 3, 256, 256}, {128, 28, 128, 128}, {128, 14, 256, 256}};
  each_product(cases, sizeof cases / sizeof *cases, KILN__IMPLICIT_WGRAD, 0, check_wave);
}

static void check_two_blocks(const char *what, const kiln_ctx *ctx, const kiln__call *c) {
  (void)ctx;
  cr_assert_gt(c->ntmap, 0, "%s: %s: TMA-fed", what, c->name);
  /* an H100's or H200's SM: 228 KB of shared memory, 1 KB of it reserved a block */
  cr_assert_leq(2 * ((int64_t)c->smem + 1024), 228 * 1024, "%s: %s: %u bytes", what, c->name,
                c->smem);
}

/* A TMA-fed data gradient of 64 input channels (a 64-wide tile) takes 4 stages, so that two
 * blocks share an SM and one's epilogue (batch norm applied again, an activation's derivative)
 * runs beside the other's products; with 8 (192 KB), one block an SM idled its tensor cores
 * through its epilogue. The air step's 15x15x64 convs and ResNet-18's first stage. */
Test(conv_tma, narrow_data_gradients_run_two_blocks_an_sm) {
  const image_case cases[] = {{1024, 15, 64, 64}, {1024, 15, 64, 256}, {128, 56, 64, 64}};
  each_product(cases, sizeof cases / sizeof *cases, KILN__IMPLICIT_DGRAD, 0, check_two_blocks);
}

static void check_one_sm(const char *what, const kiln_ctx *ctx, const kiln__call *c) {
  (void)ctx;
  cr_assert_gt(c->ntmap, 0, "%s: %s: TMA-fed", what, c->name);
  cr_assert_gt(c->smem, 128 * 1024, "%s: %s: %u bytes, one block an SM", what, c->name, c->smem);
}

static void check_one_block(const char *what, const kiln_ctx *ctx, const kiln__call *c) {
  check_one_sm(what, ctx, c);
  cr_assert_eq(c->grid_y, 1, "%s: %s: one tile of 256 channels", what, c->name);
}

static void check_halves(const char *what, const kiln_ctx *ctx, const kiln__call *c) {
  check_two_blocks(what, ctx, c);
  cr_assert_eq(c->grid_y, 2, "%s: %s: two tiles of 128 channels", what, c->name);
}

/* The data gradients of 256 channels take tiles of 128 in 3 stages, two blocks an SM (the
 * default), or one 256 wide in 4 (one an SM) with KILN_CONV_DGRAD_BN=256 (the field at 0): air's
 * 7x7x256 and 3x3x256 convs. Each renders and compiles (NVRTC). */
Test(conv_tma, data_gradient_tiles_are_128_wide_unless_the_switch_says_256) {
  const image_case cases[] = {{64, 7, 256, 256}, {64, 3, 256, 256}};
  each_product(cases, 2, KILN__IMPLICIT_DGRAD, 0, check_one_block);
  each_product(cases, 2, KILN__IMPLICIT_DGRAD, 128, check_halves);
}

/* With KILN_CONV_FPROP_BN=0 a TMA-fed forward product takes about 192 KB of stages, one block an
 * SM, in tiles up to 256 wide; with 256 (the default) its tiles of at most 128 take 96 KB, two
 * blocks an SM, and with 128 the 256-channel ones are narrowed to two such tiles. Air's and
 * ResNet-18's shapes; each renders and compiles (NVRTC). */
Test(conv_tma, forward_product_tiles_run_two_blocks_an_sm_with_the_switch) {
  const image_case narrow[] = {{1024, 15, 64, 64}, {128, 56, 64, 64}, {128, 28, 128, 128}};
  const image_case wide[] = {{64, 7, 256, 256}, {64, 15, 64, 256}};
  each_product(narrow, 3, KILN__IMPLICIT_FPROP, 0, check_one_sm);
  each_product(narrow, 3, KILN__IMPLICIT_FPROP, 256, check_two_blocks);
  each_product(wide, 2, KILN__IMPLICIT_FPROP, 256, check_one_block);
  each_product(wide, 2, KILN__IMPLICIT_FPROP, 128, check_halves);
}

/* A tiny convolution that nothing takes a gradient through runs its forward product as one
 * direct kernel with KILN_CONV_DIRECT=1 (conv_direct.cuh: no column matrix), which renders and
 * compiles: the geometries of gpu_ops::tiny_conv2d_forward_products_run_direct (a whitening
 * layer's 2x2 over 3 channels into 24; 3x3 stride 2 padding 1; 2x3 dilation 2 over 5 channels
 * into 64; 1x3 padding (0, 1)). Not without the switch, not when the filters take a gradient
 * (their product needs the columns), not with 20 output channels (not in 16-byte chunks), and not
 * for a 1x1 convolution (no im2col to replace). */
Test(conv_tma, tiny_convolutions_without_gradients_run_direct) {
  struct {
    int64_t cin, cout, kh, kw;
    kiln_conv2d_options o;
    bool on, grad, want;
  } cases[] = {
      {3, 24, 2, 2, {0}, true, false, true},
      {3, 16, 3, 3, {.stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1}, true, false, true},
      {5, 64, 2, 3, {.dilation_h = 2, .dilation_w = 2, .pad_h = 1, .pad_w = 1}, true, false, true},
      {3, 8, 1, 3, {.pad_w = 1}, true, false, true},
      {3, 24, 2, 2, {0}, false, false, false},
      {3, 24, 2, 2, {0}, true, true, false},
      {3, 20, 2, 2, {0}, true, false, false},
      {3, 8, 1, 1, {0}, true, false, false},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char what[96];
    snprintf(what, sizeof what, "%lld->%lld %lldx%lld, switch %d, gradient %d",
             (long long)cases[i].cin, (long long)cases[i].cout, (long long)cases[i].kh,
             (long long)cases[i].kw, cases[i].on, cases[i].grad);
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->conv_direct = cases[i].on;
    kiln_step_begin(ctx);
    kiln_tensor *x = th_f32(ctx, KILN_SHAPE(4, 9, 7, cases[i].cin));
    kiln_shape ks = KILN_SHAPE(cases[i].cout, cases[i].cin, cases[i].kh, cases[i].kw);
    kiln_tensor *k = cases[i].grad ? th_param(ctx, ks) : th_f32(ctx, ks);
    kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *y = kiln_conv2d(x, k, NULL, &cases[i].o);
    kiln_autocast_end(ctx);
    kiln_tensor *s = kiln_cast(kiln_sum(y, KILN_ALL_AXES, 0), KILN_DTYPE_F32);
    cr_assert_not_null(s, "%s: %s", what, th_err(ctx));
    if (cases[i].grad) cr_assert_eq(kiln_backward(s), KILN_OK, "%s: %s", what, th_err(ctx));
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s: %s", what,
              th_err(ctx));
    int direct = 0;
    for (int g = 0; g < pg.plan.ng; g++)
      if (strstr(pg.call[g].name, "k_conv_direct_")) {
        direct++;
        cr_assert_eq(pg.plan.g[g].implicit, KILN__IMPLICIT_FPROP, "%s", what);
        cr_assert_eq(pg.call[g].ntmap, 0, "%s", what);
      }
    cr_assert_eq(direct, cases[i].want ? 1 : 0, "%s: %d direct kernels", what, direct);
    th_finish_program(ctx, &pg, what);
  }
}

/* KILN_CONV_DIRECT_EPI=1: a direct forward product (air's whitening conv) takes the unary
 * elementwise chain that reads its result (GELU, then ReLU) into its kernel, which stores only
 * the chain's last value (renamed k_conv_direct_gelu_relu_, rendered and compiled); the product
 * is never written. Not where the product has another reader, nor without the switch. */
Test(conv_tma, direct_products_apply_the_unary_chain_after_them_with_the_switch) {
  for (int c = 0; c < 3; c++) {
    bool on = c != 0, shared = c == 2;
    char what[64];
    snprintf(what, sizeof what, "switch %d, product read twice %d", on, shared);
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->conv_direct_epi = on;
    kiln_step_begin(ctx);
    kiln_tensor *x = th_f32(ctx, KILN_SHAPE(4, 9, 7, 3)), *k = th_f32(ctx, KILN_SHAPE(24, 3, 2, 2));
    kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *y = kiln_conv2d(x, k, NULL, NULL);
    kiln_tensor *z = kiln_relu(kiln_gelu(y, KILN_GELU_ERF));
    if (shared) z = kiln_add(z, y);
    kiln_autocast_end(ctx);
    cr_assert_not_null(kiln_cast(kiln_sum(z, KILN_ALL_AXES, 0), KILN_DTYPE_F32), "%s: %s", what,
                       th_err(ctx));
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s: %s", what,
              th_err(ctx));
    int direct = 0;
    for (int g = 0; g < pg.plan.ng; g++) {
      const kiln__group *grp = &pg.plan.g[g];
      if (!strstr(pg.call[g].name, "k_conv_direct_")) continue;
      direct++;
      bool chain = on && !shared;
      cr_assert_eq(grp->n, chain ? 4 : 2, "%s: %d members", what, grp->n);
      cr_assert_eq(strstr(pg.call[g].name, "k_conv_direct_gelu_relu_") != NULL, chain, "%s: %s",
                   what, pg.call[g].name);
      cr_assert_eq(pg.plan.store[grp->node - pg.plan.first], !chain,
                   "%s: the product is written only without the chain", what);
    }
    cr_assert_eq(direct, 1, "%s", what);
    th_finish_program(ctx, &pg, what);
  }
}

/* Records, in a new step, a bf16 conv (C -> C, 3x3 pad 1) -> batch norm -> GELU -> conv (C -> C)
 * block over x (8, 9, 7, C); returns its output. */
static kiln_tensor *record_bn_block_of(kiln_ctx *ctx, int64_t C) {
  kiln_step_begin(ctx);
  kiln_tensor *x = th_f32(ctx, KILN_SHAPE(8, 9, 7, C));
  kiln_tensor *k1 = th_param(ctx, KILN_SHAPE(C, C, 3, 3)),
              *k2 = th_param(ctx, KILN_SHAPE(C, C, 3, 3));
  kiln_tensor *gamma = th_param(ctx, KILN_SHAPE(C)), *beta = th_param(ctx, KILN_SHAPE(C));
  kiln_conv2d_options o = {.pad_h = 1, .pad_w = 1};
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *h = kiln_conv2d(x, k1, NULL, &o);
  h = kiln_gelu(kiln_batch_norm(h, gamma, beta, NULL, NULL, 1, 0, 0), KILN_GELU_ERF);
  kiln_tensor *y = kiln_conv2d(h, k2, NULL, &o);
  kiln_autocast_end(ctx);
  return y;
}

static kiln_tensor *record_bn_block(kiln_ctx *ctx) { return record_bn_block_of(ctx, 64); }

/* Batch norm's backward sums (a moments node of mode 1) over what a data gradient's epilogue
 * computes join that kernel (plan_conv.c's kiln__dgrad_moments): in a bf16 conv (64 -> 64) ->
 * batch norm -> GELU -> conv (64 -> 64) block, the second conv's data gradient (its epilogue
 * GELU's derivative at the recomputed batch norm) writes the first batch norm's sums, and no
 * moments kernel of mode 1 is left for it; the group's last member is the moments node, stored
 * (the sum over its blocks reads it), and its kernel renders with the sums' operand before its
 * maps and compiles (NVRTC). Not with KILN_CONV_MOMENTS=0, not with KILN_CONV_STAGED=0 (the
 * sums take the staged epilogue's rows), not with the TMA kernels off. */
Test(conv_tma, data_gradients_sum_the_batch_norm_before_them) {
  struct {
    bool moments, staged, tma, want;
  } cases[] = {{true, true, true, true},
               {false, true, true, false},
               {true, false, true, false},
               {true, true, false, false}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char what[96];
    snprintf(what, sizeof what, "moments %d, staged %d, tma %d", cases[i].moments, cases[i].staged,
             cases[i].tma);
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->conv_moments = cases[i].moments;
    ctx->conv_staged = cases[i].staged;
    ctx->conv_tma = cases[i].tma;
    kiln_tensor *y = record_bn_block(ctx);
    cr_assert_not_null(y, "%s: %s", what, th_err(ctx));
    cr_assert_eq(kiln_backward(kiln_cast(kiln_sum(y, KILN_ALL_AXES, 0), KILN_DTYPE_F32)), KILN_OK,
                 "%s: %s", what, th_err(ctx));
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s: %s", what,
              th_err(ctx));
    int fused = 0, alone = 0;
    for (int g = 0; g < pg.plan.ng; g++) {
      const kiln__group *gr = &pg.plan.g[g];
      const kiln__call *c = &pg.call[g];
      for (int m = 0; m < gr->n; m++) {
        const kiln__node *nd = &ctx->trace.nodes[pg.plan.members[gr->first + m]];
        if (nd->op != KILN__OP_MOMENTS || KILN__I(nd, MOMENTS, mode) != 1) continue;
        if (gr->n == 1) {
          alone++;
          continue;
        }
        fused++;
        cr_assert(gr->moments && gr->implicit == KILN__IMPLICIT_DGRAD, "%s", what);
        cr_assert_eq(m, gr->n - 1, "%s: the sums are the group's last member", what);
        cr_assert(pg.plan.store[pg.plan.members[gr->first + m] - pg.plan.first], "%s", what);
        cr_assert(strstr(c->name, "_tma_moments_"), "%s: %s", what, c->name);
        cr_assert_eq(c->ntmap, 2, "%s: %s", what, c->name);
        cr_assert_geq(c->tma_slot, c->arg.nptr, "%s: %s", what, c->name);
        bool writes_sums = false;
        for (int q = 0; q < c->arg.nptr; q++)
          writes_sums |= c->arg.ptr[q] == nd->out;
        cr_assert(writes_sums, "%s: %s takes the sums' operand", what, c->name);
      }
    }
    cr_assert_eq(fused, cases[i].want ? 1 : 0, "%s: %d data gradients sum", what, fused);
    cr_assert_eq(alone, cases[i].want ? 0 : 1, "%s: %d moments kernels", what, alone);
    th_finish_program(ctx, &pg, what);
  }
}

/* KILN_CONV_AHEAD=1 gives the forward product of a 24->64 conv (four steps of the reduction, on
 * the cp.async kernel) a kernel of its own, which renders and compiles (NVRTC), and leaves its
 * TMA-fed products (64 channels: 64->64) as they are. */
Test(conv_tma, short_reductions_issue_their_copies_at_once_with_the_switch) {
  const int64_t cin[2] = {24, 64};
  for (int i = 0; i < 2; i++) {
    char names[2][96] = {"", ""};
    for (int on = 0; on < 2; on++) {
      kiln_ctx *ctx = th_cpu_ctx();
      ctx->conv_ahead = on;
      ctx->conv_few = false; /* 24->64 on the cp.async kernel, not from a halo tile */
      record(ctx, "ahead", cin[i], 64, 1);
      kiln__program pg;
      cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s", th_err(ctx));
      for (int g = 0; g < pg.plan.ng; g++)
        if (pg.plan.g[g].implicit == KILN__IMPLICIT_FPROP)
          snprintf(names[on], sizeof names[on], "%s", pg.call[g].name);
      kiln__program_free(&pg);
      cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
      th_free_scratch();
      th_ctx_free(ctx);
    }
    cr_assert(names[0][0] && names[1][0], "%lld channels: a forward product", (long long)cin[i]);
    if (cin[i] == 24)
      cr_assert_str_neq(names[0], names[1], "the switch changes the cp.async forward product");
    else
      cr_assert_str_eq(names[0], names[1], "the TMA-fed forward product keeps its kernel");
  }
}

/* KILN_CONV_WGRAD_INTO=1: the implicit weight gradient of a bf16 convolution (3x3 by cp.async
 * over 24 channels, by TMA over 64, stride 1 and 2; ResNet's 1x1 stride-2 shortcut) takes the
 * cast of its result, permuted, to f32 and the assignment of that to the weight's gradient into
 * its group: its kernel (renamed wgrad_into, which renders and compiles) writes the weight's
 * (64, cin, k, k) f32 gradient, and no assignment is left to launch. Without the switch they stay
 * apart, and the cast writes through to .grad (no assignment either). */
Test(conv_tma, weight_gradients_write_the_gradient_with_the_switch) {
  const int64_t cin[3] = {24, 64, 64}, k[3] = {3, 3, 1};
  for (int i = 0; i < 3; i++)
    for (int s = k[i] == 1 ? 2 : 1; s <= 2; s++) /* 1x1 at stride 1: a plain product */
      for (int on = 0; on < 2; on++) {
        char what[96];
        snprintf(what, sizeof what, "%lld->64 %lldx%lld stride %d, switch %d", (long long)cin[i],
                 (long long)k[i], (long long)k[i], s, on);
        kiln_ctx *ctx = th_cpu_ctx();
        ctx->conv_wgrad_into = on;
        record_window(ctx, what, 4, 9, 7, cin[i], 64, k[i], s);
        kiln__program pg;
        cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s: %s", what,
                  th_err(ctx));
        int wgrads = 0, assigns = 0;
        for (int g = 0; g < pg.plan.ng; g++) {
          const kiln__group *grp = &pg.plan.g[g];
          for (int m = 0; m < grp->n; m++)
            assigns +=
                grp->n == 1 && th_node(ctx, pg.plan.members[grp->first + m])->op == KILN__OP_ASSIGN;
          if (grp->implicit != KILN__IMPLICIT_WGRAD) continue;
          wgrads++;
          cr_assert_eq(grp->n, on ? 3 : 1, "%s: %d members", what, grp->n);
          cr_assert_eq(strstr(pg.call[g].name, "k_conv_wgrad_into_") != NULL, on, "%s: %s", what,
                       pg.call[g].name);
          if (!on) {
            cr_assert_null(grp->grad, "%s", what);
            continue;
          }
          const kiln_tensor *G = grp->grad;
          cr_assert(G && G->persistent && G->dtype == KILN_DTYPE_F32 && G->ndim == 4 &&
                        G->shape[0] == 64 && G->shape[1] == cin[i] && G->shape[2] == k[i] &&
                        G->shape[3] == k[i],
                    "%s: the weight's gradient", what);
          cr_assert(!pg.plan.store[grp->node - pg.plan.first] &&
                        !pg.plan.store[pg.plan.members[grp->first + 1] - pg.plan.first],
                    "%s: the bf16 result and its cast are never written", what);
        }
        cr_assert_eq(wgrads, 1, "%s: %d implicit weight gradients", what, wgrads);
        cr_assert_eq(assigns, 0, "%s: %d assignments of their own", what, assigns);
        th_finish_program(ctx, &pg, what);
      }
}

/* KILN_CONV_PREFETCH=1 gives the data gradient of the block above a kernel of its own (its
 * producer thread asks L2 for the epilogue's rows), which renders and compiles (NVRTC); the
 * other kernels stay as they are. */
Test(conv_tma, data_gradients_prefetch_their_epilogue_rows_with_the_switch) {
  char names[2][96];
  int others[2] = {0, 0};
  for (int on = 0; on < 2; on++) {
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->conv_tma = true;
    ctx->conv_prefetch = on;
    kiln_tensor *y = record_bn_block(ctx);
    cr_assert_eq(kiln_backward(kiln_cast(kiln_sum(y, KILN_ALL_AXES, 0), KILN_DTYPE_F32)), KILN_OK,
                 "%s", th_err(ctx));
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s", th_err(ctx));
    int found = 0;
    for (int g = 0; g < pg.plan.ng; g++) {
      if (pg.plan.g[g].moments) {
        found++;
        snprintf(names[on], sizeof names[on], "%s", pg.call[g].name);
      } else {
        others[on]++;
      }
    }
    cr_assert_eq(found, 1, "switch %d", on);
    kiln__program_free(&pg);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    th_free_scratch();
    th_ctx_free(ctx);
  }
  cr_assert_str_neq(names[0], names[1], "the switch changes the data gradient's kernel");
  cr_assert_eq(others[0], others[1]);
}

/* With KILN_CONV_DGRAD_WS=1 the data gradient of a bf16 conv -> batch norm -> GELU -> conv block
 * (its epilogue GELU's derivative at the recomputed batch norm, and batch norm's sums) runs on
 * persistent blocks with two warpgroups of their own for the epilogue (conv_tma.cuh's
 * kiln_conv_dgrad_tma_ws): a kernel named _tma_ws_moments_ of 544 threads (launch bounds saying
 * so), one block a tile up to one an SM, one block an SM of shared memory (the stages and one
 * room for staged tiles, two with KILN_CONV_DGRAD_WS=2, which the source names), its producer
 * thread 512, its source rendered and compiled (NVRTC); not with the switch off (288 threads,
 * producer 256: 4e7f019 launched those with 256, no producer, and they hung), not with the
 * epilogue's loads unhoisted (KILN_CONV_HOIST=0), not with tiles 256 wide (KILN_CONV_DGRAD_BN=256,
 * 256 channels). */
Test(conv_tma, data_gradients_store_on_warps_of_their_own_with_the_switch) {
  struct {
    int64_t c;
    int on, hoist, bn;
    bool want;
  } cases[] = {{64, 1, 2, 128, true},  {64, 2, 2, 128, true},  {64, 0, 2, 128, false},
               {64, 1, 0, 128, false}, {256, 1, 2, 128, true}, {256, 2, 2, 128, true},
               {256, 1, 2, 0, false}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char what[96];
    snprintf(what, sizeof what, "%lld channels, switch %d, hoist %d, widest %d",
             (long long)cases[i].c, cases[i].on, cases[i].hoist, cases[i].bn);
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->conv_tma = true;
    ctx->conv_dgrad_ws = cases[i].on;
    ctx->conv_hoist = cases[i].hoist;
    ctx->conv_dgrad_bn = cases[i].bn;
    int64_t C = cases[i].c;
    kiln_tensor *y = record_bn_block_of(ctx, C);
    cr_assert_eq(kiln_backward(kiln_cast(kiln_sum(y, KILN_ALL_AXES, 0), KILN_DTYPE_F32)), KILN_OK,
                 "%s: %s", what, th_err(ctx));
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s: %s", what,
              th_err(ctx));
    kiln__target t = {.num_sms = 132,
                      .conv_tma = true,
                      .conv_staged = ctx->conv_staged,
                      .conv_dgrad_bn = cases[i].bn,
                      .conv_prefetch = ctx->conv_prefetch,
                      .conv_hoist = cases[i].hoist,
                      .conv_dgrad_ws = cases[i].on};
    int found = 0;
    for (int g = 0; g < pg.plan.ng; g++) {
      const kiln__call *c = &pg.call[g];
      if (c->ntmap > 0) /* every TMA-fed kernel has its producer warp */
        cr_assert_geq(c->block, 288, "%s: %s: %u threads", what, c->name, c->block);
      if (!pg.plan.g[g].moments || pg.plan.g[g].implicit != KILN__IMPLICIT_DGRAD) continue;
      found++;
      bool ws = strstr(c->name, "_tma_ws_moments_") != NULL;
      cr_assert_eq(ws, cases[i].want, "%s: %s", what, c->name);
      kiln__rendered r;
      memset(&r, 0, sizeof r);
      cr_assert(kiln__render(&t, &pg.spec[g], &r), "%s", what);
      const char *bounds = ws ? "__launch_bounds__(544, 1)" : "__launch_bounds__(288, 1)";
      const char *producer = ws ? "if (threadIdx.x == 512)" : "if (threadIdx.x == 256)";
      cr_assert(strstr(r.src.s, bounds) && strstr(r.src.s, producer), "%s: %s", what, r.src.s);
      char rooms[48];
      snprintf(rooms, sizeof rooms, "kiln_conv_dgrad_tma_ws<G, BN, S, %d>", cases[i].on);
      cr_assert_eq(strstr(r.src.s, rooms) != NULL, ws, "%s: %s", what, r.src.s);
      kiln__sb_free(&r.src);
      cr_assert_eq(c->block, ws ? 544u : 288u, "%s: %s: %u threads", what, c->name, c->block);
      if (!ws) continue;
      int64_t tiles = (8 * 9 * 7 + 127) / 128 * (C / (C < 128 ? C : 128)),
              sms = ctx->num_sms > 0 ? ctx->num_sms : 132;
      cr_assert_eq(c->grid, (unsigned)(tiles < sms ? tiles : sms), "%s: %s: %u blocks", what,
                   c->name, c->grid);
      cr_assert_eq(c->grid_y, 1, "%s: %s", what, c->name);
      /* one block an SM: more than half of an SM's 228 KB, at most a block's 227 */
      cr_assert(c->smem > 114 * 1024 && c->smem <= 227 * 1024, "%s: %s: %u bytes", what, c->name,
                c->smem);
    }
    cr_assert_eq(found, 1, "%s: %d data gradients with batch norm's sums", what, found);
    th_finish_program(ctx, &pg, what);
  }
}

/* With KILN_CONV_FPROP_MOMENTS=1 batch norm's statistics (a moments node of mode 0) after a
 * TMA-fed or halo-tile forward product join its group, last (plan_conv.c's kiln__fprop_moments),
 * summed in the kernel's epilogue (named _moments; it renders and compiles, NVRTC), their shift
 * the norm's running mean, whose update the statistics' kernel still writes in place (no
 * assignment of its own); the halo-tile kernel's persistent blocks a partial sum each, at most as
 * many as the partial sums; not without running statistics (the shift is then the image's first
 * row, which the product computes), nor without the switch. */
Test(conv_tma, forward_products_sum_the_batch_norm_after_them_with_the_switch) {
  struct {
    int64_t cin, cout;
    bool on, running, want;
  } cases[] = {{64, 128, true, true, true},
               {24, 64, true, true, true},
               {64, 128, true, false, false},
               {64, 128, false, true, false}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char what[80];
    int64_t ci = cases[i].cin, co = cases[i].cout;
    snprintf(what, sizeof what, "%lld->%lld, switch %d, %s running statistics", (long long)ci,
             (long long)co, cases[i].on, cases[i].running ? "with" : "without");
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->fprop_moments = cases[i].on;
    kiln_step_begin(ctx);
    kiln_tensor *x = th_param(ctx, KILN_SHAPE(4, 9, 7, ci)),
                *k = th_param(ctx, KILN_SHAPE(co, ci, 3, 3));
    kiln_tensor *gamma = th_param(ctx, KILN_SHAPE(co)), *beta = th_param(ctx, KILN_SHAPE(co));
    kiln_tensor *rm = cases[i].running ? th_f32(ctx, KILN_SHAPE(co)) : NULL;
    kiln_tensor *rv = cases[i].running ? th_f32(ctx, KILN_SHAPE(co)) : NULL;
    kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
    kiln_tensor *y = kiln_conv2d(x, k, NULL, &(kiln_conv2d_options){.pad_h = 1, .pad_w = 1});
    y = kiln_relu(kiln_batch_norm(y, gamma, beta, rm, rv, 1, 0.1f, 1e-5f));
    kiln_autocast_end(ctx);
    kiln__program pg;
    th_backward_program(ctx, y, &pg, what);
    int fused = 0, left = 0, assigns = 0;
    for (int g = 0; g < pg.plan.ng; g++) {
      const kiln__group *gr = &pg.plan.g[g];
      const kiln__node *last = &ctx->trace.nodes[pg.plan.members[gr->first + gr->n - 1]];
      bool mode0 = last->op == KILN__OP_MOMENTS && KILN__I(last, MOMENTS, mode) == 0;
      assigns += gr->n == 1 && last->op == KILN__OP_ASSIGN && rm &&
                 (last->in[0]->st == rm->st || last->in[0]->st == rv->st);
      if (!gr->moments || gr->implicit != KILN__IMPLICIT_FPROP) {
        left += mode0;
        continue;
      }
      fused++;
      cr_assert(mode0 && gr->n == 3, "%s: the statistics last", what);
      cr_assert_eq(last->in[1]->st, rm->st, "%s: the running mean is the shift", what);
      cr_assert(pg.plan.store[pg.plan.members[gr->first + 1] - pg.plan.first],
                "%s: the product is written", what);
      bool few = ci == 24;
      cr_assert(strstr(pg.call[g].name, few ? "k_conv_few_moments_" : "k_conv_fprop_moments_") &&
                    pg.call[g].ntmap == (few ? 0 : 2),
                "%s: %s", what, pg.call[g].name);
      if (few) cr_assert_leq(pg.call[g].grid, (unsigned)last->out->shape[0], "%s", what);
    }
    cr_assert_eq(fused, cases[i].want, "%s: %d products sum", what, fused);
    cr_assert_eq(left, !cases[i].want, "%s: %d moments kernels of mode 0", what, left);
    cr_assert_eq(assigns, 0, "%s: the running statistics assigned apart", what);
    th_finish_program(ctx, &pg, what);
  }
}
