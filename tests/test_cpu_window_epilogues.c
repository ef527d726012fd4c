/*
 * test_cpu_window_epilogues.c: the window ops' kernels with what the planner puts around them
 * (render_window.c, fusion/device/window.cuh), without a GPU: batch norm's statistics in a max
 * pool's kernel (KILN_POOL_MOMENTS) and its backward sums in a window gradient's
 * (KILN_WINDOW_MOMENTS), a window gradient's epilogue operands fetched ahead (KILN_WINDOW_AHEAD),
 * and the elementwise runs that become a pool gradient's or a max pool's prologue
 * (KILN_POOL_PROLOGUE, KILN_POOL_FWD_PROLOGUE): which groups the plan makes and the kernels they
 * render, compiled by NVRTC (kiln__program_build compiles every kernel of the plan). Their values,
 * bitwise against the switches off, are test_gpu_conv_switches.c's and test_gpu_ops_pool.c's.
 */
#include <string.h>

#include "fusion/fusion.h"
#include "inspect.h"

/* Records, in a new step, a bf16 2x2 max pool of x (8, 10, 11, c) then batch norm in training
 * (and GELU); returns its output. */
static kiln_tensor *record_pool_bn(kiln_ctx *ctx, int64_t c, bool gelu) {
  kiln_step_begin(ctx);
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(8, 10, 11, c));
  kiln_tensor *gamma = th_param(ctx, KILN_SHAPE(c));
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *h = kiln_cast(x, KILN_DTYPE_BF16);
  h = kiln_max_pool2d(h, &(kiln_pool2d_options){.kernel_h = 2, .kernel_w = 2});
  h = kiln_batch_norm(h, gamma, NULL, NULL, NULL, 1, 0, 0);
  if (gelu) h = kiln_gelu(h, KILN_GELU_ERF);
  kiln_autocast_end(ctx);
  return h;
}

/* With KILN_POOL_MOMENTS=1 batch norm's statistics after a max pool join the pool's kernel
 * (plan_conv.c's kiln__pool_moments): a bf16 2x2 pool of 64 or 256 channels then batch norm in
 * training, the
 * pool's group ends with the moments node (stored: the sum over its blocks reads it) and its
 * kernel, named _moments, renders and compiles (NVRTC); not without the switch, not over 48
 * channels (12 lane groups a row do not divide a block of 256 threads). A pool that computes its
 * image as its prologue (KILN_POOL_FWD_PROLOGUE=1: here the cast before it) sums no statistics:
 * that switch off here, whatever the environment says. */
Test(window_epilogues, max_pools_sum_the_batch_norm_after_them) {
  struct {
    int64_t c;
    bool on, want;
  } cases[] = {{64, true, true}, {256, true, true}, {64, false, false}, {48, true, false}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char what[64];
    snprintf(what, sizeof what, "%lld channels, switch %d", (long long)cases[i].c, cases[i].on);
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->pool_moments = cases[i].on;
    ctx->pool_fwd_prologue = false;
    kiln__program pg;
    th_backward_program(ctx, record_pool_bn(ctx, cases[i].c, false), &pg, what);
    int fused = 0;
    for (int g = 0; g < pg.plan.ng; g++) {
      const kiln__group *gr = &pg.plan.g[g];
      if (!gr->moments) continue;
      fused++;
      const kiln__node *m = &ctx->trace.nodes[pg.plan.members[gr->first + gr->n - 1]];
      cr_assert_eq(gr->n, 2, "%s", what);
      cr_assert_eq(ctx->trace.nodes[gr->node].op, KILN__OP_MAX_POOL, "%s", what);
      cr_assert(m->op == KILN__OP_MOMENTS && KILN__I(m, MOMENTS, mode) == 0, "%s", what);
      cr_assert(pg.plan.store[pg.plan.members[gr->first + 1] - pg.plan.first], "%s", what);
      cr_assert(strstr(pg.call[g].name, "_moments_"), "%s: %s", what, pg.call[g].name);
      cr_assert_eq(pg.call[g].grid, (unsigned)m->out->shape[0], "%s: a block a partial sum", what);
    }
    cr_assert_eq(fused, cases[i].want ? 1 : 0, "%s: %d pools sum", what, fused);
    th_finish_program(ctx, &pg, what);
  }
}

/* x (8, 12, 12, c) through batch norm (training) and a ReLU in bf16, then ResNet's stem pool (3x3
 * at stride 2, padding 1) or a 3x3 convolution at stride 2 (c -> 64, its data gradient on columns:
 * a col2im), open for the backward pass. */
static kiln_tensor *record_bn_relu_then(kiln_ctx *ctx, int64_t c, bool pool) {
  kiln_step_begin(ctx);
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(8, 12, 12, c));
  kiln_tensor *gamma = th_param(ctx, KILN_SHAPE(c));
  return th_bn_relu_then_stride2(x, gamma, pool ? NULL : th_param(ctx, KILN_SHAPE(128, c, 3, 3)));
}

/* Batch norm's backward sums (a moments node of mode 1) over what a window op's epilogue computes
 * join that kernel (plan_conv.c's kiln__window_moments): after batch norm and a ReLU, the stem
 * pool's gradient (a block of 2x2 pixels a thread) and a stride-2 convolution's col2im each end
 * their group with the moments node, stored (the sum over its blocks reads it), after an epilogue
 * that computes g (the ReLU's derivative at the recomputed batch norm); their kernels, named
 * _moments, render and compile (NVRTC), a block a slice of channels. Not with the switch off, not
 * over 48 channels (12 lane groups a row do not divide a block of 256 threads). */
Test(window_epilogues, window_gradients_sum_the_batch_norm_before_them) {
  struct {
    int64_t c;
    bool pool, on, want;
  } cases[] = {{64, true, true, true},  {64, true, false, false}, {48, true, true, false},
               {64, false, true, true}, {128, false, true, true}, {64, false, false, false}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char what[80];
    snprintf(what, sizeof what, "%s, %lld channels, switch %d", cases[i].pool ? "pool" : "conv",
             (long long)cases[i].c, cases[i].on);
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->window_moments = cases[i].on;
    kiln__program pg;
    th_backward_program(ctx, record_bn_relu_then(ctx, cases[i].c, cases[i].pool), &pg, what);
    int fused = 0, left = 0;
    for (int g = 0; g < pg.plan.ng; g++) {
      const kiln__group *gr = &pg.plan.g[g];
      const kiln__node *m = &ctx->trace.nodes[pg.plan.members[gr->first + gr->n - 1]];
      if (!gr->moments) {
        left += m->op == KILN__OP_MOMENTS && KILN__I(m, MOMENTS, mode) == 1;
        continue;
      }
      fused++;
      const kiln__node *head = &ctx->trace.nodes[gr->node];
      cr_assert_eq(head->op, cases[i].pool ? KILN__OP_MAX_POOL_GRAD : KILN__OP_COL2IM, "%s", what);
      cr_assert_eq(pg.plan.members[gr->first], gr->node, "%s: the window op first", what);
      cr_assert_geq(gr->n, 3, "%s: an epilogue computes g", what);
      cr_assert_eq(ctx->trace.nodes[pg.plan.members[gr->first + gr->n - 2]].op, KILN__OP_RELU_GRAD,
                   "%s", what);
      cr_assert(m->op == KILN__OP_MOMENTS && KILN__I(m, MOMENTS, mode) == 1, "%s", what);
      cr_assert(pg.plan.store[pg.plan.members[gr->first + gr->n - 1] - pg.plan.first], "%s", what);
      cr_assert(strstr(pg.call[g].name, "_moments_") &&
                    (!cases[i].pool || strstr(pg.call[g].name, "_blocks")),
                "%s: %s", what, pg.call[g].name);
      /* a block a slice of 64 channels of GP partials, about 2,048 blocks (at least a partial) */
      int64_t P = m->out->shape[0], slices = cases[i].c > 64 ? cases[i].c / 64 : 1;
      int64_t gp = P * slices / 2048 > 1 ? P * slices / 2048 : 1;
      cr_assert_eq(pg.call[g].grid, (unsigned)((P + gp - 1) / gp * slices), "%s: %u blocks", what,
                   pg.call[g].grid);
    }
    cr_assert_eq(fused, cases[i].want ? 1 : 0, "%s: %d window kernels sum", what, fused);
    cr_assert_eq(left, cases[i].want ? 0 : 1, "%s: %d moments kernels of mode 1", what, left);
    th_finish_program(ctx, &pg, what);
  }
}

/* With KILN_WINDOW_AHEAD (on by default) the epilogue of a window gradient, the stem pool's a
 * block of 2x2 pixels a thread or a stride-2 convolution's col2im, after batch norm and a ReLU,
 * fetches what it reads for each of the thread's pixels before the op's own loads
 * (render_window.c's emit_ahead: rings XR<k> the epilogue unpacks at pixel kiln_p), batch norm's
 * sums in the kernel or not (KILN_WINDOW_MOMENTS), its launch bounds asking for three blocks an SM
 * (four for a col2im); its kernel renders and compiles (NVRTC). Not with the switch off. */
Test(window_epilogues, window_gradients_fetch_their_epilogue_operands_ahead_with_the_switch) {
  for (int i = 0; i < 8; i++) {
    bool pool = i & 1, moments = i & 2, on = i & 4;
    char what[80];
    snprintf(what, sizeof what, "%s, sums %d, switch %d", pool ? "pool" : "conv", moments, on);
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->window_moments = moments;
    ctx->window_ahead = on;
    kiln__program pg;
    th_backward_program(ctx, record_bn_relu_then(ctx, 64, pool), &pg, what);
    kiln__target t = {.num_sms = 132, .pool_grad_blocks = true, .window_ahead = on};
    int found = 0;
    for (int g = 0; g < pg.plan.ng; g++) {
      const kiln__group *gr = &pg.plan.g[g];
      kiln__op op = ctx->trace.nodes[gr->node].op;
      if (gr->n < 2 || op != (pool ? KILN__OP_MAX_POOL_GRAD : KILN__OP_COL2IM)) continue;
      found++;
      cr_assert_eq(gr->moments, moments, "%s: %s", what, pg.call[g].name);
      kiln__rendered r;
      memset(&r, 0, sizeof r);
      cr_assert(kiln__render(&t, &pg.spec[g], &r), "%s", what);
      cr_assert_str_eq(r.name, pg.call[g].name, "%s", what);
      cr_assert_eq(strstr(r.src.s, "kiln_unpack4(XR") != NULL, on, "%s: %s", what, r.src.s);
      cr_assert_eq(strstr(r.src.s, "kiln_p++;") != NULL, on, "%s: %s", what, r.src.s);
      /* room for the rings' registers: three blocks an SM, four for a col2im */
      const char *bounds = pool ? "__launch_bounds__(256, 3)" : "__launch_bounds__(256, 4)";
      cr_assert_eq(strstr(r.src.s, bounds) != NULL, on, "%s: %s", what, r.src.s);
      kiln__sb_free(&r.src);
    }
    cr_assert_eq(found, 1, "%s: %d window gradients with an epilogue", what, found);
    th_finish_program(ctx, &pg, what);
  }
}

/* The groups of pg whose elementwise run is op's prologue: each one group, the run's nodes first
 * and none of them written, op last, its kernel named with `name` in it (rendered and compiled,
 * NVRTC); their count. */
static int prologue_groups(const kiln_ctx *ctx, const kiln__program *pg, kiln__op op,
                           const char *name) {
  int fused = 0;
  for (int g = 0; g < pg->plan.ng; g++) {
    const kiln__group *gr = &pg->plan.g[g];
    if (!gr->prologue || ctx->trace.nodes[gr->node].op != op) continue;
    fused++;
    cr_assert_eq(gr->n, gr->prologue + 1, "%s last", kiln__ops[op].name);
    cr_assert_eq(pg->plan.members[gr->first + gr->prologue], gr->node);
    for (int m = 0; m < gr->prologue; m++) {
      int32_t j = pg->plan.members[gr->first + m];
      cr_assert_eq(kiln__ops[ctx->trace.nodes[j].op].kind, KILN__KIND_EW);
      cr_assert_not(pg->plan.store[j - pg->plan.first], "#%d is in registers", j);
    }
    cr_assert(strstr(pg->call[g].name, name), "%s", pg->call[g].name);
  }
  return fused;
}

/* With KILN_POOL_PROLOGUE=1 the elementwise run that computes a max pool gradient's dy (batch
 * norm's dx, after a bf16 2x2 pool of 64 channels then batch norm in training) becomes that
 * gradient's prologue (plan_conv.c's kiln__pool_grad_prologue): one group, the run's nodes first
 * and none of them written, the gradient last; its kernel, named _at_pro, renders and compiles
 * (NVRTC). Without the switch, the run is a kernel of its own. */
Test(window_epilogues, pool_gradients_compute_their_dy_as_they_read_it_with_the_switch) {
  for (int on = 0; on < 2; on++) {
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->pool_prologue = on;
    char what[32];
    snprintf(what, sizeof what, "switch %d", on);
    kiln__program pg;
    th_backward_program(ctx, record_pool_bn(ctx, 64, true), &pg, what);
    int fused = prologue_groups(ctx, &pg, KILN__OP_MAX_POOL_GRAD, "_at_pro_");
    cr_assert_eq(fused, on, "%s: %d prologues", what, fused);
    th_finish_program(ctx, &pg, what);
  }
}

/* With KILN_POOL_FWD_PROLOGUE=1 the elementwise run that computes a max pool's image (batch norm's
 * application and the ReLU, bf16, 64 channels, before ResNet's stem pool: 3x3 at stride 2, padding
 * 1) becomes the pool's prologue (plan_conv.c's kiln__pool_fwd_prologue): with the backward pass
 * (the pool writes its positions: a kernel named _at_pro) and without it (x and the norm's weight
 * given no gradient: no positions, _pro); not with the switch off, nor where the ReLU's output is
 * read again (by the sum beside the pool), nor where the ReLU's own rule keeps its output for a
 * backward pass recorded later (no batch norm before it: the forward pass's flush alone; that
 * once tripped the plan's check, "prologue node #0 (relu) is not the input's, or is written"). */
Test(window_epilogues, max_pools_compute_their_image_as_they_read_it_with_the_switch) {
  const struct {
    bool on, train, twice, kept;
  } cases[] = {{false, true, false, false},  {true, true, false, false},
               {false, false, false, false}, {true, false, false, false},
               {true, true, true, false},    {true, false, true, false},
               {true, false, false, true}};
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    bool on = cases[c].on, train = cases[c].train, twice = cases[c].twice, kept = cases[c].kept;
    char what[64];
    snprintf(what, sizeof what, "switch %d, %s%s%s", on, train ? "training" : "forward only",
             twice ? ", ReLU read twice" : "", kept ? ", ReLU's output kept" : "");
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->pool_fwd_prologue = on;
    kiln__program pg;
    kiln_step_begin(ctx);
    kiln_shape xs = KILN_SHAPE(8, 12, 12, 64), cs = KILN_SHAPE(64);
    kiln_tensor *x = train || kept ? th_param(ctx, xs) : th_f32(ctx, xs);
    kiln_tensor *gamma = train ? th_param(ctx, cs) : th_f32(ctx, cs);
    kiln_tensor *beta = train ? th_param(ctx, cs) : th_f32(ctx, cs);
    kiln_autocast_begin(ctx, KILN_DTYPE_BF16); /* the norm's bias a parameter, as in a ResNet */
    kiln_tensor *h = kiln_cast(x, KILN_DTYPE_BF16);
    if (!kept) h = kiln_batch_norm(h, gamma, beta, NULL, NULL, 1, 0.1f, 1e-5f);
    kiln_tensor *y = kiln_max_pool2d(
        kiln_relu(h),
        &(kiln_pool2d_options){
            .kernel_h = 3, .kernel_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1});
    kiln_autocast_end(ctx);
    if (twice) { /* the pool's input, reached through its producer's output */
      const kiln__node *pool = kiln__producer(y);
      y = kiln_add(th_sum_all(y), th_sum_all(pool->in[0]));
    }
    if (train) {
      th_backward_program(ctx, y, &pg, what);
    } else {
      cr_assert_not_null(y, "%s: %s", what, th_err(ctx));
      cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s: %s", what,
                th_err(ctx));
    }
    int fused = prologue_groups(ctx, &pg, KILN__OP_MAX_POOL, train ? "_at_pro_" : "_pro_");
    cr_assert_eq(fused, on && !twice && !kept, "%s: %d prologues", what, fused);
    th_finish_program(ctx, &pg, what);
  }
}
