/*
 * test_cpu_conv_few.c: the planner's prologue of a few-channel convolution's weight gradient
 * (plan_merge.c's kiln__phase_few_prologue, KILN_CONV_FEW_PROLOGUE), without a GPU: which
 * elementwise runs join the gradient's group, what the group writes, and the kernel it renders,
 * compiled by NVRTC for sm_90 (kiln__program_build compiles every kernel of the plan). Its values,
 * bitwise against the run's own kernel, are test_gpu_conv_switches.c's.
 */
#include <string.h>

#include "fusion/fusion.h"
#include "inspect.h"

typedef struct {
  const char *what;
  int64_t h, w, cin, cout, k, stride, pad;
  bool image_grad, on;
  int want; /* weight gradients with a prologue */
} few_case;

/* Records, in a new step, loss = sum(relu(batch_norm(conv2d(x, f)))) in bf16 (training, the
 * norm's weight and bias parameters) of x (4, h, w, cin), and its backward pass; x requires a
 * gradient when c->image_grad. */
static void record_block(kiln_ctx *ctx, const few_case *c) {
  kiln_step_begin(ctx);
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(4, c->h, c->w, c->cin));
  kiln_tensor *f = th_param(ctx, KILN_SHAPE(c->cout, c->cin, c->k, c->k));
  kiln_tensor *gamma = th_param(ctx, KILN_SHAPE(c->cout)),
              *beta = th_param(ctx, KILN_SHAPE(c->cout));
  kiln_tensor_set_requires_grad(x, c->image_grad);
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_conv2d_options o = {
      .pad_h = c->pad, .pad_w = c->pad, .stride_h = c->stride, .stride_w = c->stride};
  kiln_tensor *h = kiln_conv2d(x, f, NULL, &o);
  h = kiln_relu(kiln_batch_norm(h, gamma, beta, NULL, NULL, 1, 0.1f, 1e-5f));
  kiln_autocast_end(ctx);
  cr_assert_not_null(h, "%s: %s", c->what, th_err(ctx));
  kiln_tensor *loss = kiln_cast(kiln_sum(h, KILN_ALL_AXES, 0), KILN_DTYPE_F32);
  cr_assert_eq(kiln_backward(loss), KILN_OK, "%s: %s", c->what, th_err(ctx));
}

/* Batch norm's dx, the elementwise run that writes the convolution's dY, joins the weight
 * gradient's group as its first members where conv_few.cuh's kernel computes that gradient and
 * nothing else reads dY: none of the run's values written, the product last, the kernel
 * k_conv_few_wgrad_pro_ computing dY as it loads it (kiln_few_dy_by) from the run's inputs, which
 * the plan keeps until then. Over airbench's first conv (24 channels, 3x3) and ResNet's stem (3
 * channels, 7x7 at stride 2, on the image's blocks: 4x4 over 16); not without the switch, not
 * where the image's gradient reads dY too (its data gradient), not where the product is
 * another kernel's (64 input channels: TMA-fed; 32 outputs). */
Test(conv_few, weight_gradients_compute_their_dy_as_they_load_it) {
  const few_case cases[] = {
      {"24->64 3x3 on 9x7 images", 9, 7, 24, 64, 3, 1, 1, false, true, 1},
      {"3->64 7x7 stride 2 on 20x18 images (ResNet's stem)", 20, 18, 3, 64, 7, 2, 3, false, true,
       1},
      {"24->64 3x3 without the switch", 9, 7, 24, 64, 3, 1, 1, false, false, 0},
      {"24->64 3x3, the image's gradient too", 9, 7, 24, 64, 3, 1, 1, true, true, 0},
      {"64->64 3x3 (TMA-fed)", 9, 7, 64, 64, 3, 1, 1, false, true, 0},
      {"24->32 3x3 (the cp.async kernel)", 9, 7, 24, 32, 3, 1, 1, false, true, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    const few_case *c = &cases[i];
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->few_prologue = c->on;
    record_block(ctx, c);
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s: %s", c->what,
              th_err(ctx));
    const kiln__plan *p = &pg.plan;
    int fused = 0, few = 0;
    for (int k = 0; k < p->ng; k++) {
      const kiln__group *g = &p->g[k];
      if (g->implicit != KILN__IMPLICIT_WGRAD) continue;
      few += strstr(pg.call[k].name, "k_conv_few_wgrad_") != NULL;
      if (!g->prologue) {
        cr_assert_null(strstr(pg.call[k].name, "_pro_"), "%s: %s", c->what, pg.call[k].name);
        continue;
      }
      fused++;
      cr_assert_eq(g->n, g->prologue + 1, "%s: the run, then the product", c->what);
      cr_assert_eq(p->members[g->first + g->prologue], g->node, "%s", c->what);
      const kiln__node *last = &ctx->trace.nodes[p->members[g->first + g->prologue - 1]];
      cr_assert_eq(last->op, KILN__OP_CAST, "%s: dY's cast to bf16 ends the run", c->what);
      cr_assert_eq(kiln_tensor_numel(last->out), kiln_tensor_numel(ctx->trace.nodes[g->node].in[0]),
                   "%s", c->what);
      for (int m = 0; m < g->prologue; m++) {
        int32_t j = p->members[g->first + m];
        cr_assert_eq(kiln__ops[ctx->trace.nodes[j].op].kind, KILN__KIND_EW, "%s", c->what);
        cr_assert_not(p->store[j - p->first], "%s: #%d written", c->what, j);
      }
      cr_assert(strstr(pg.call[k].name, "k_conv_few_wgrad_pro_"), "%s: %s", c->what,
                pg.call[k].name);
      kiln__target t = {.num_sms = 132, .conv_few = true, .conv_few_wgrad = true};
      kiln__rendered r;
      memset(&r, 0, sizeof r);
      cr_assert(kiln__render(&t, &pg.spec[k], &r), "%s", c->what);
      cr_assert(strstr(r.src.s, "kiln_few_dy_by<decltype(kiln_dy)>{kiln_dy}"), "%s: %s", c->what,
                r.src.s);
      kiln__sb_free(&r.src);
    }
    cr_assert_eq(fused, c->want, "%s: %d weight gradients with a prologue", c->what, fused);
    cr_assert_eq(few > 0, c->cout == 64 && c->cin < 64, "%s: %d from halo tiles", c->what, few);
    kiln__program_free(&pg);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", c->what, th_err(ctx));
    th_free_scratch();
    th_ctx_free(ctx);
  }
}
