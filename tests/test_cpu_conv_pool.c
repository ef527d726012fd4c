/*
 * test_cpu_conv_pool.c: the planner's max pool in a forward product's epilogue (plan_conv.c's
 * kiln__conv_pool: KILN_CONV_FEW_POOL after a halo-tile product, KILN_CONV_TMA_POOL after a
 * TMA-fed one), without a GPU: which pools join the product's group, what the group writes, and
 * the kernel it renders, compiled by NVRTC for sm_90 (kiln__program_build compiles every kernel
 * of the plan). Its values, bitwise against the pool's own kernel, are
 * test_gpu_conv_switches.c's.
 */
#include <string.h>

#include "fusion/fusion.h"
#include "inspect.h"

typedef struct {
  const char *what;
  int64_t h, w, cin, cout;
  int pool_k, pool_s;
  bool grads, second_reader, on, tma;
  int want;           /* pools in a product's group */
  const char *tiling; /* what the kernel's source says of its tiles */
  int64_t ph, pw;     /* the pooled image */
} pool_case;

/* Records, in a new step, y = max_pool2d(conv2d(x, k)) in bf16 (3x3 filters, padding 1) of
 * x (4, h, w, cin), with the backward pass of sum(y) when c->grads (the pool then writes its
 * window positions for its gradient), and with a second reader of the product's result when
 * c->second_reader. */
static void record_pooled(kiln_ctx *ctx, const pool_case *c) {
  kiln_step_begin(ctx);
  kiln_tensor *x = th_param(ctx, KILN_SHAPE(4, c->h, c->w, c->cin));
  kiln_tensor *k = th_param(ctx, KILN_SHAPE(c->cout, c->cin, 3, 3));
  if (!c->grads) {
    kiln_tensor_set_requires_grad(x, 0);
    kiln_tensor_set_requires_grad(k, 0);
  }
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *conv = kiln_conv2d(x, k, NULL, &(kiln_conv2d_options){.pad_h = 1, .pad_w = 1});
  kiln_pool2d_options po = {
      .kernel_h = c->pool_k, .kernel_w = c->pool_k, .stride_h = c->pool_s, .stride_w = c->pool_s};
  kiln_tensor *y = kiln_max_pool2d(conv, &po);
  if (c->second_reader) y = kiln_add(y, kiln_max_pool2d(conv, &po));
  kiln_autocast_end(ctx);
  cr_assert_not_null(y, "%s: %s", c->what, th_err(ctx));
  kiln_tensor *loss = kiln_cast(kiln_sum(y, KILN_ALL_AXES, 0), KILN_DTYPE_F32);
  if (c->grads) cr_assert_eq(kiln_backward(loss), KILN_OK, "%s: %s", c->what, th_err(ctx));
}

/* A 2x2 max pool at stride 2 read from a forward product's result, its only reader, joins the
 * product's group as its last member: the product's result is never written, the pooled image is
 * (and the window positions too, behind its values, where the pool's gradient reads them). After
 * a halo-tile product with KILN_CONV_FEW_POOL=1: k_conv_few_pool_,
 * kiln_conv_few<G, TH, TW, true>. After a TMA-fed one with KILN_CONV_TMA_POOL=1:
 * k_conv_fprop_pool_, tiles of pairs of whole rows copied B pixels a row (kiln__conv_pool_rows: 16
 * for a 15-wide output, 8 for 7), two maps. Not without the switches, not for other windows or
 * strides, not where the product has another reader, not for rows wider than 64 pixels, not where
 * the product is neither kernel's. */
Test(conv_pool, max_pools_join_their_products_group) {
  const pool_case cases[] = {
      {"24->64 on 31x31 images (air's first conv), 2x2 pool", 31, 31, 24, 64, 2, 2, true, false,
       true, false, 1, "kiln_conv_few<G, 4, 32, true>", 15, 15},
      {"24->64 on 9x7 images, 2x2 pool", 9, 7, 24, 64, 2, 2, true, false, true, false, 1,
       "kiln_conv_few<G, 8, 16, true>", 4, 3},
      {"24->64 on 9x7 images, no gradients (no positions)", 9, 7, 24, 64, 2, 2, false, false, true,
       false, 1, "kiln_conv_few<G, 8, 16, true>", 4, 3},
      {"32->64 on 20x17 images", 20, 17, 32, 64, 2, 2, true, false, true, false, 1,
       "kiln_conv_few<G, 4, 32, true>", 10, 8},
      {"24->64 without the switch", 9, 7, 24, 64, 2, 2, true, false, false, false, 0, NULL, 0, 0},
      {"24->64, 3x3 pool at stride 2", 9, 7, 24, 64, 3, 2, true, false, true, false, 0, NULL, 0, 0},
      {"24->64, 2x2 pool at stride 1", 9, 7, 24, 64, 2, 1, true, false, true, false, 0, NULL, 0, 0},
      {"24->64, the product read by two pools", 9, 7, 24, 64, 2, 2, true, true, true, false, 0,
       NULL, 0, 0},
      {"24->32 (neither kernel)", 9, 7, 24, 32, 2, 2, true, false, true, false, 0, NULL, 0, 0},
      {"64->256 on 15x15 images (air's second group), TMA", 15, 15, 64, 256, 2, 2, true, false,
       true, true, 1, "constexpr int B = 16;", 7, 7},
      {"256->256 on 7x7 images (air's third group), TMA", 7, 7, 256, 256, 2, 2, true, false, true,
       true, 1, "constexpr int B = 8;", 3, 3},
      {"64->64 on 15x15 images, no gradients, TMA", 15, 15, 64, 64, 2, 2, false, false, true, true,
       1, "constexpr int B = 16;", 7, 7},
      {"64->128 on 9x40 images, TMA", 9, 40, 64, 128, 2, 2, true, false, true, true, 1,
       "constexpr int B = 64;", 4, 20},
      {"64->256 on 15x15 images without KILN_CONV_TMA_POOL", 15, 15, 64, 256, 2, 2, true, false,
       false, true, 0, NULL, 0, 0},
      {"64->64 on 5x130 images (rows past 64 pixels), TMA", 5, 130, 64, 64, 2, 2, true, false, true,
       true, 0, NULL, 0, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    const pool_case *c = &cases[i];
    kiln_ctx *ctx = th_cpu_ctx();
    ctx->conv_few_pool = c->on && !c->tma;
    ctx->conv_tma_pool = c->on && c->tma;
    record_pooled(ctx, c);
    kiln__program pg;
    cr_assert(kiln__program_build(ctx, ctx->trace.done, ctx->trace.n, &pg), "%s: %s", c->what,
              th_err(ctx));
    const kiln__plan *p = &pg.plan;
    int pooled = 0, pools = 0;
    for (int k = 0; k < p->ng; k++) {
      const kiln__group *g = &p->g[k];
      const kiln__node *last = &ctx->trace.nodes[p->members[g->first + g->n - 1]];
      pools += !g->implicit && ctx->trace.nodes[g->node].op == KILN__OP_MAX_POOL; /* its own */
      if (g->implicit != KILN__IMPLICIT_FPROP || last->op != KILN__OP_MAX_POOL) continue;
      pooled++;
      const kiln__call *call = &pg.call[k];
      const int32_t mm = p->members[g->first + 1];
      cr_assert_eq(g->n, 3, "%s: im2col, the product and the pool", c->what);
      cr_assert_not(p->store[mm - p->first], "%s: the product's result is written", c->what);
      cr_assert(p->store[p->members[g->first + 2] - p->first], "%s: the pool's is not", c->what);
      cr_assert_eq(last->out->shape[1], c->ph, "%s", c->what);
      cr_assert_eq(last->out->shape[2], c->pw, "%s", c->what);
      cr_assert(strstr(call->name, c->tma ? "k_conv_fprop_pool_" : "k_conv_few_pool_"), "%s: %s",
                c->what, call->name);
      cr_assert_eq(call->ntmap, c->tma ? 2 : 0, "%s", c->what);
      kiln__target t = {.num_sms = 132, .conv_few = true, .conv_tma = true};
      kiln__rendered r;
      memset(&r, 0, sizeof r);
      cr_assert(kiln__render(&t, &pg.spec[k], &r), "%s", c->what);
      cr_assert(strstr(r.src.s, c->tiling), "%s: %s", c->what, r.src.s);
      if (c->tma) { /* a block a 128 / (2 B) pairs of rows */
        int B = kiln__conv_pool_rows(c->w), pairs = 128 / B / 2;
        cr_assert_eq(r.grid, (unsigned)((4 * c->ph + pairs - 1) / pairs), "%s: grid %u", c->what,
                     r.grid);
        cr_assert_eq(r.tmap[0].pixels, (uint32_t)B, "%s", c->what);
      }
      /* the positions behind the pooled values, where the gradient reads them */
      char at[96];
      snprintf(at, sizeof at, "+ %lldLL)", (long long)kiln_tensor_numel(last->out));
      cr_assert_eq(strstr(r.src.s, at) != NULL, c->grads, "%s: positions: %s", c->what, r.src.s);
      cr_assert_eq(last->out->st->tail != 0, c->grads, "%s", c->what);
      kiln__sb_free(&r.src);
    }
    cr_assert_eq(pooled, c->want, "%s: %d pools in a product's group", c->what, pooled);
    cr_assert_eq(pools, (c->second_reader ? 2 : 1) - pooled, "%s: %d pools alone", c->what, pools);
    kiln__program_free(&pg);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", c->what, th_err(ctx));
    th_free_scratch();
    th_ctx_free(ctx);
  }
}

/* kiln__conv_pool_rows: the least power of two from 8 to 64 that holds a row's pooled pixels. */
Test(conv_pool, rows_copied_for_the_pool) {
  const int64_t ow[] = {1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 64, 65, 66, 200};
  const int want[] = {0, 8, 8, 8, 8, 16, 16, 16, 32, 32, 64, 64, 0, 0};
  for (size_t i = 0; i < sizeof ow / sizeof *ow; i++)
    cr_assert_eq(kiln__conv_pool_rows(ow[i]), want[i], "%lld wide: %d", (long long)ow[i],
                 kiln__conv_pool_rows(ow[i]));
}
