/*
 * test_gpu_graph.c: step graphs. Replayed steps against steps run without graphs (the same
 * contexts' other mode): bitwise the same losses and parameters over 200 steps; dropout masks
 * that change every step and match; a learning-rate schedule and Adam's step count that change
 * without a new capture; new signatures (a partial batch, an evaluation step) captured once each;
 * the arena smaller than the intermediates, and shared by the graphs whose plans fit in it; reading
 * inside an open step an error; kernels launched as programmatic dependents (KILN_PDL=1) bitwise
 * those launched without. Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <string.h>

#include "helpers.h"

/* A small classifier: 48 -> 64 ReLU -> dropout -> 10, its optimizer, fixed data. */
typedef struct net {
  kiln_ctx *ctx;
  kiln_params *p;
  kiln_linear l1, l2;
  kiln_optim *opt;
  kiln_tensor *x, *y;
  float drop;
} net;

static void net_init(net *n, kiln_ctx *ctx, bool graphs, bool adam, float drop) {
  memset(n, 0, sizeof *n);
  n->ctx = ctx;
  kiln_set_graphs(ctx, graphs);
  kiln_manual_seed(ctx, 11);
  n->p = kiln_params_new(ctx);
  cr_assert_eq(
      kiln_linear_init(&n->l1, n->p, &(kiln_linear_options){.name = "l1", .in = 48, .out = 64}),
      KILN_OK);
  cr_assert_eq(
      kiln_linear_init(&n->l2, n->p, &(kiln_linear_options){.name = "l2", .in = 64, .out = 10}),
      KILN_OK);
  if (adam) {
    kiln_adam_options o = kiln_adamw_defaults();
    o.lr = 3e-3f;
    n->opt = kiln_adamw_new(n->p, &o);
  } else {
    kiln_sgd_options o = kiln_sgd_defaults(0.1f);
    o.momentum = 0.9f;
    o.nesterov = 1;
    o.weight_decay = 1e-4f;
    n->opt = kiln_sgd_new(n->p, &o);
  }
  cr_assert_not_null(n->opt, "%s", kiln_ctx_error(ctx));
  n->x = th_rand(ctx, KILN_SHAPE(96, 48), 21, -1.f, 1.f, NULL);
  int32_t lab[96];
  for (int i = 0; i < 96; i++)
    lab[i] = (i * 7 + 3) % 10;
  n->y = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(96), lab);
  n->drop = drop;
}

static kiln_tensor *net_logits(net *n, kiln_tensor *x, bool train) {
  kiln_tensor *h = kiln_relu(kiln_linear_forward(&n->l1, x));
  return kiln_linear_forward(&n->l2, kiln_dropout(h, n->drop, train));
}

/* One training step on rows [0, rows) of the data; returns the loss (read after the step). */
static float net_step(net *n, int64_t rows) {
  kiln_step_begin(n->ctx);
  kiln_tensor *x = rows == 96 ? n->x : kiln_slice(n->x, 0, 0, rows, 1);
  kiln_tensor *y = rows == 96 ? n->y : kiln_slice(n->y, 0, 0, rows, 1);
  kiln_tensor *loss = kiln_cross_entropy(net_logits(n, x, true), y, KILN_REDUCTION_MEAN, 0.f);
  kiln_optim_zero_grad(n->opt);
  kiln_backward(loss);
  kiln_optim_step(n->opt);
  cr_assert_eq(kiln_step_end(n->ctx), KILN_OK, "%s", kiln_ctx_error(n->ctx));
  return kiln_tensor_item(loss);
}

/* An evaluation step: no gradients, dropout off; returns the mean loss. */
static float net_eval(net *n) {
  kiln_no_grad_begin(n->ctx);
  kiln_step_begin(n->ctx);
  kiln_tensor *l = kiln_cross_entropy(net_logits(n, n->x, false), n->y, KILN_REDUCTION_MEAN, 0.f);
  cr_assert_eq(kiln_step_end(n->ctx), KILN_OK, "%s", kiln_ctx_error(n->ctx));
  kiln_no_grad_end(n->ctx);
  return kiln_tensor_item(l);
}

static void net_free(net *n) {
  kiln_optim_free(n->opt);
  kiln_params_free(n->p);
  kiln_tensor_free(n->x);
  kiln_tensor_free(n->y);
}

/* Every parameter of a and b bitwise equal. */
static void same_params(net *a, net *b) {
  for (int i = 0; i < kiln_params_count(a->p); i++) {
    kiln_tensor *ta = kiln_params_get(a->p, i), *tb = kiln_params_get(b->p, i);
    float *va = th_read(ta), *vb = th_read(tb);
    int64_t n = kiln_tensor_numel(ta);
    for (int64_t k = 0; k < n; k++)
      cr_assert(memcmp(&va[k], &vb[k], 4) == 0, "%s[%lld]: graph %.9g, no graph %.9g",
                kiln_params_name(a->p, i), (long long)k, va[k], vb[k]);
    free(va);
    free(vb);
  }
}

static kiln_exec_stats stats_of(kiln_ctx *ctx) {
  kiln_exec_stats s;
  kiln_stats(ctx, &s);
  return s;
}

Test(gpu_graph, replay_is_bitwise_the_same_over_200_steps) {
  TH_GPU_CTX(cg);
  TH_GPU_CTX(ce);
  net g, e;
  net_init(&g, cg, true, false, 0.25f);
  net_init(&e, ce, false, false, 0.25f);
  kiln_mem_stats m2, m200;
  for (int s = 0; s < 200; s++) {
    float lg = net_step(&g, 96), le = net_step(&e, 96);
    cr_assert(memcmp(&lg, &le, 4) == 0, "step %d: loss %.9g with graphs, %.9g without", s, lg, le);
    if (s == 1) kiln_memory_stats(cg, &m2);
  }
  kiln_memory_stats(cg, &m200);
  cr_assert_eq(m200.in_use, m2.in_use, "replays reuse the arena: no memory grows");
  cr_assert_eq(m200.device_mallocs, m2.device_mallocs);
  same_params(&g, &e);
  kiln_exec_stats sg = stats_of(cg), se = stats_of(ce);
  cr_log_info("200 steps: %llu captures, %llu replays; arena %llu bytes for %llu of intermediates",
              (unsigned long long)sg.graph_captures, (unsigned long long)sg.graph_replays,
              (unsigned long long)sg.arena_bytes, (unsigned long long)sg.arena_sum_bytes);
  cr_assert_eq(sg.graph_captures, 1, "one signature, one capture");
  cr_assert_eq(sg.graph_replays, 199);
  cr_assert_eq(se.graph_captures + se.graph_replays, 0);
  cr_assert_eq(sg.kernels_launched, se.kernels_launched, "the graph holds the same launches");
  /* the static memory plan shares memory between values whose lifetimes do not overlap */
  cr_assert_gt(sg.arena_bytes, 0);
  cr_assert_lt(sg.arena_bytes, sg.arena_sum_bytes);
  cr_assert_leq(sg.arena_live_bytes, sg.arena_bytes, "no arena holds less than is live at once");
  cr_assert_gt(sg.arena_live_bytes, 0);
  net_free(&g);
  net_free(&e);
  th_ctx_free(cg);
  th_ctx_free(ce);
}

/* The dropout output of step s (the step's only value, read after it). */
static float *dropout_mask(kiln_ctx *ctx, kiln_tensor *x) {
  kiln_step_begin(ctx);
  kiln_tensor *d = kiln_dropout(x, 0.5f, 1);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  return th_read(d);
}

Test(gpu_graph, dropout_masks_change_every_step_and_match) {
  TH_GPU_CTX(cg);
  TH_GPU_CTX(ce);
  kiln_set_graphs(ce, 0);
  kiln_manual_seed(cg, 5);
  kiln_manual_seed(ce, 5);
  kiln_tensor *xg = th_rand(cg, KILN_SHAPE(4096), 3, 1.f, 2.f, NULL);
  kiln_tensor *xe = th_rand(ce, KILN_SHAPE(4096), 3, 1.f, 2.f, NULL);
  float *prev = NULL;
  for (int s = 0; s < 6; s++) {
    float *mg = dropout_mask(cg, xg), *me = dropout_mask(ce, xe);
    cr_assert(memcmp(mg, me, 4096 * 4) == 0, "step %d: the graph's mask is the no-graph one", s);
    if (prev) {
      int same = 0;
      for (int i = 0; i < 4096; i++)
        same += (mg[i] == 0.f) == (prev[i] == 0.f);
      cr_assert_lt(same, 4096 * 3 / 4, "step %d: the mask changed (%d of 4096 agree)", s, same);
    }
    free(prev);
    prev = mg;
    free(me);
  }
  free(prev);
  cr_assert_eq(stats_of(cg).graph_captures, 1);
  cr_assert_eq(stats_of(cg).graph_replays, 5);
  kiln_tensor_free(xg);
  kiln_tensor_free(xe);
  th_ctx_free(cg);
  th_ctx_free(ce);
}

Test(gpu_graph, schedules_and_adam_steps_are_step_values) {
  for (int adam = 0; adam < 2; adam++) {
    TH_GPU_CTX(cg);
    TH_GPU_CTX(ce);
    net g, e;
    net_init(&g, cg, true, adam, 0.f);
    net_init(&e, ce, false, adam, 0.f);
    kiln_schedule s = {.kind = adam ? KILN_SCHEDULE_ONE_CYCLE : KILN_SCHEDULE_COSINE,
                       .base_lr = adam ? 3e-3f : 0.1f,
                       .total_steps = 30};
    kiln_optim_set_schedule(g.opt, &s);
    kiln_optim_set_schedule(e.opt, &s);
    float lrs[30];
    for (int t = 0; t < 30; t++) {
      float lg = net_step(&g, 96), le = net_step(&e, 96);
      lrs[t] = kiln_optim_lr(g.opt);
      cr_assert(memcmp(&lg, &le, 4) == 0, "%s step %d: loss %.9g with graphs, %.9g without",
                adam ? "AdamW" : "SGD", t, lg, le);
      cr_assert_float_eq(lrs[t], kiln_schedule_lr(&s, t), 0.f);
    }
    cr_assert_neq(lrs[0], lrs[10]);
    cr_assert_neq(lrs[10], lrs[29]);
    same_params(&g, &e);
    cr_assert_eq(stats_of(cg).graph_captures, 1, "the rate changes without a new capture");
    cr_assert_eq(stats_of(cg).graph_replays, 29);
    net_free(&g);
    net_free(&e);
    th_ctx_free(cg);
    th_ctx_free(ce);
  }
}

Test(gpu_graph, new_signatures_are_planned_and_captured_once) {
  TH_GPU_CTX(cg);
  TH_GPU_CTX(ce);
  net g, e;
  net_init(&g, cg, true, false, 0.1f);
  net_init(&e, ce, false, false, 0.1f);
  /* full batches, a partial one, an evaluation step: three signatures */
  for (int round = 0; round < 4; round++) {
    for (int s = 0; s < 3; s++) {
      float lg = net_step(&g, 96), le = net_step(&e, 96);
      cr_assert(memcmp(&lg, &le, 4) == 0, "round %d full batch %d", round, s);
    }
    float pg = net_step(&g, 40), pe = net_step(&e, 40);
    cr_assert(memcmp(&pg, &pe, 4) == 0, "round %d partial batch: %.9g vs %.9g", round, pg, pe);
    float vg = net_eval(&g), ve = net_eval(&e);
    cr_assert(memcmp(&vg, &ve, 4) == 0, "round %d evaluation: %.9g vs %.9g", round, vg, ve);
  }
  same_params(&g, &e);
  kiln_exec_stats s = stats_of(cg);
  cr_assert_eq(s.graph_captures, 3, "%llu captures", (unsigned long long)s.graph_captures);
  cr_assert_eq(s.graph_replays, 4 * 5 - 3);
  cr_assert_eq(s.graph_evictions, 0);
  net_free(&g);
  net_free(&e);
  th_ctx_free(cg);
  th_ctx_free(ce);
}

/* Step graphs share arenas: a partial batch's and an evaluation step's plans, smaller than the
 * training step's, go in its arena; a larger plan gets one of its own; the arenas go with the
 * graphs. The values are checked against eager runs above (new_signatures_...). */
Test(gpu_graph, smaller_steps_share_the_training_steps_arena) {
  TH_GPU_CTX(ctx);
  net g;
  net_init(&g, ctx, true, false, 0.1f);
  net_step(&g, 96);
  kiln_exec_stats s = stats_of(ctx);
  uint64_t train = s.arena_bytes;
  cr_assert_gt(train, 0);
  cr_assert_eq(s.graphs_arena_bytes, train);
  net_step(&g, 40);
  s = stats_of(ctx);
  cr_assert_leq(s.arena_bytes, train, "the partial batch's plan is the smaller");
  cr_assert_eq(s.graphs_arena_bytes, train, "the partial batch's graph has an arena of its own");
  net_eval(&g);
  s = stats_of(ctx);
  cr_assert_leq(s.arena_bytes, train);
  cr_assert_eq(s.graphs_arena_bytes, train, "the evaluation's graph has an arena of its own");
  cr_assert_eq(s.graph_captures, 3);
  /* a step larger than the training step's: an arena of its own */
  kiln_tensor *big = th_rand(ctx, KILN_SHAPE(1024, 1024), 5, -1.f, 1.f, NULL);
  kiln_step_begin(ctx);
  kiln_tensor *m = kiln_exp(kiln_mul(big, big)); /* 4 MiB, the step's output */
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  float *mv = th_read(m);
  cr_assert(mv[0] >= 1.f && mv[0] <= expf(1.f), "%g", mv[0]);
  free(mv);
  s = stats_of(ctx);
  cr_assert_gt(s.arena_bytes, train);
  cr_assert_eq(s.graphs_arena_bytes, train + s.arena_bytes);
  /* every step again: replays, no new capture, the arenas as they were */
  net_step(&g, 96);
  net_step(&g, 40);
  net_eval(&g);
  s = stats_of(ctx);
  cr_assert_eq(s.graph_captures, 4);
  cr_assert_eq(s.graph_replays, 3);
  /* graphs off: the graphs and their arenas go at the next step */
  kiln_set_graphs(ctx, 0);
  kiln_step_begin(ctx);
  cr_assert_eq(stats_of(ctx).graphs_arena_bytes, 0);
  kiln_step_end(ctx);
  kiln_tensor_free(big);
  net_free(&g);
  th_ctx_free(ctx);
}

Test(gpu_graph, host_reads_inside_a_step) {
  TH_GPU_CTX(ctx);
  kiln_tensor *a = th_rand(ctx, KILN_SHAPE(256), 8, -1.f, 1.f, NULL);
  /* inside an open step: a clear error, and the step runs nothing */
  kiln_step_begin(ctx);
  kiln_tensor *e = kiln_exp(a);
  float v[256];
  cr_assert_eq(kiln_tensor_to_host(e, v, sizeof v), KILN_ERR_STATE);
  cr_assert(strstr(kiln_ctx_error(ctx), "inside an open step") != NULL, "%s", kiln_ctx_error(ctx));
  cr_assert_neq(kiln_step_end(ctx), KILN_OK);
  kiln_ctx_clear_error(ctx);
  /* after kiln_step_end: the step's outputs read fine; a value the step consumed and whose
   * memory a later value took says so */
  float *av = th_read(a);
  for (int round = 0; round < 2; round++) {
    kiln_step_begin(ctx);
    kiln_tensor *big = kiln_exp(kiln_add_scalar(kiln_mul_scalar(a, 2.f), 1.f));
    kiln_tensor *s = kiln_sum(big, KILN_ALL_AXES, 0);
    kiln_tensor *t = kiln_mul_scalar(kiln_add(kiln_tanh(kiln_mul(s, s)), kiln_tanh(s)), 0.5f);
    kiln_tensor *out = kiln_add(kiln_mul(a, t), a);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
    float *ov = th_read(out);
    double sum = 0;
    for (int i = 0; i < 256; i++)
      sum += exp(2.0 * av[i] + 1.0);
    double tt = 0.5 * (tanh(sum * sum) + tanh(sum));
    for (int i = 0; i < 256; i++)
      cr_assert(fabs(ov[i] - (av[i] * tt + av[i])) <= 1e-5 * (1 + fabs(ov[i])), "round %d [%d]",
                round, i);
    free(ov);
  }
  free(av);
  cr_assert_eq(stats_of(ctx).graph_replays, 1);
  /* a product consumed inside the step, whose memory the plan gave to a later product */
  kiln_tensor *w = th_rand(ctx, KILN_SHAPE(64, 64), 9, -1.f, 1.f, NULL);
  kiln_step_begin(ctx);
  kiln_tensor *m1 = kiln_matmul(w, w);
  kiln_tensor *r = kiln_sum(m1, KILN_ALL_AXES, 1);
  kiln_tensor *m2 = kiln_matmul(kiln_mul(w, r), w);
  kiln_tensor *total = kiln_sum(m2, KILN_ALL_AXES, 0);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
  (void)kiln_tensor_item(total);
  th_assert_ok(ctx);
  float mv[64 * 64];
  cr_assert_eq(kiln_tensor_to_host(m1, mv, sizeof mv), KILN_ERR_STATE);
  cr_assert(strstr(kiln_ctx_error(ctx), "memory plan") != NULL, "%s", kiln_ctx_error(ctx));
  kiln_ctx_clear_error(ctx);
  kiln_tensor_free(w);
  kiln_tensor_free(a);
  th_ctx_free(ctx);
}

/* Loader batches (with a partial last one), training and evaluation, in the three modes. */
Test(gpu_graph, loader_epochs_in_three_modes) {
  float loss[3][2][8];
  uint64_t captures[3];
  for (int mode = 0; mode < 3; mode++) {
    TH_GPU_CTX(ctx);
    kiln_set_fusion(ctx, mode > 0);
    kiln_set_graphs(ctx, mode == 2);
    kiln_mnist m = {.n = 300, .rows = 6, .cols = 8};
    m.images = malloc(300 * 48);
    m.labels = malloc(300);
    for (int i = 0; i < 300 * 48; i++)
      m.images[i] = (uint8_t)((i * 37 + i / 48 * 11) % 256);
    for (int i = 0; i < 300; i++)
      m.labels[i] = (uint8_t)((i * 3) % 10);
    kiln_dataset *ds = kiln_dataset_from_mnist(ctx, &m, 0.5f, 0.3f);
    free(m.images);
    free(m.labels);
    kiln_loader *l = kiln_loader_new(
        ds, &(kiln_loader_options){
                .batch = 64, .shuffle = 1, .seed = 7}); /* 4 batches of 64, one of 44 */
    cr_assert_not_null(l, "%s", kiln_ctx_error(ctx));
    net n;
    net_init(&n, ctx, mode == 2, false, 0.f);
    for (int epoch = 0; epoch < 2; epoch++) {
      kiln_loader_start(l, epoch);
      int b = 0;
      for (;;) {
        kiln_step_begin(ctx);
        kiln_tensor *x, *y;
        if (!kiln_loader_next(l, &x, &y)) break;
        kiln_tensor *lo = kiln_cross_entropy(net_logits(&n, kiln_flatten(x), true), y,
                                             KILN_REDUCTION_MEAN, 0.f); /* (B, 6, 8, 1) rows */
        kiln_optim_zero_grad(n.opt);
        kiln_backward(lo);
        kiln_optim_step(n.opt);
        cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
        loss[mode][epoch][b++] = kiln_tensor_item(lo);
      }
      cr_assert_eq(b, 5);
      loss[mode][epoch][5] = net_eval(&n);
    }
    captures[mode] = stats_of(ctx).graph_captures;
    net_free(&n);
    kiln_loader_free(l);
    kiln_dataset_free(ds);
    th_ctx_free(ctx);
  }
  cr_assert_eq(captures[2], 3, "full batch, partial batch, evaluation: %llu",
               (unsigned long long)captures[2]);
  for (int e = 0; e < 2; e++)
    for (int b = 0; b < 6; b++) {
      cr_assert(memcmp(&loss[2][e][b], &loss[1][e][b], 4) == 0,
                "epoch %d batch %d: graph %.9g, fused %.9g", e, b, loss[2][e][b], loss[1][e][b]);
      cr_assert(fabsf(loss[1][e][b] - loss[0][e][b]) <= 1e-4f * (1 + fabsf(loss[0][e][b])),
                "epoch %d batch %d: fused %.9g, unfused %.9g", e, b, loss[1][e][b], loss[0][e][b]);
    }
}

/* A loop that makes a new signature every step: the cache keeps 16 graphs and evicts the least
 * recently used (with a warning on stderr), and the results stay right. */
Test(gpu_graph, the_graph_cache_is_bounded) {
  TH_GPU_CTX(ctx);
  kiln_tensor *a = th_rand(ctx, KILN_SHAPE(40), 12, -1.f, 1.f, NULL);
  float *av = th_read(a);
  for (int round = 0; round < 2; round++)
    for (int64_t n = 1; n <= 20; n++) {
      kiln_step_begin(ctx);
      kiln_tensor *s = kiln_sum(kiln_exp(kiln_slice(a, 0, 0, n, 1)), KILN_ALL_AXES, 0);
      cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", kiln_ctx_error(ctx));
      double want = 0;
      for (int64_t i = 0; i < n; i++)
        want += exp(av[i]);
      cr_assert_float_eq(kiln_tensor_item(s), want, 1e-5 * want, "round %d, %lld elements", round,
                         (long long)n);
    }
  kiln_exec_stats s = stats_of(ctx);
  /* cycling through 20 signatures with 16 kept, least recently used out: every step misses */
  cr_assert_eq(s.graph_captures + s.graph_replays, 40);
  cr_assert_gt(s.graph_evictions, 0);
  cr_assert_eq(s.graph_captures - s.graph_evictions, 16, "the cache holds 16 graphs");
  /* graphs off: the cached graphs and their arenas go at the next step */
  kiln_mem_stats m0, m1;
  kiln_memory_stats(ctx, &m0);
  kiln_set_graphs(ctx, 0);
  kiln_step_begin(ctx);
  kiln_memory_stats(ctx, &m1);
  cr_assert_lt(m1.in_use, m0.in_use, "turning graphs off frees their memory");
  free(av);
  kiln_tensor_free(a);
  th_ctx_free(ctx);
}

/* kiln_assign: an exponential moving average of a parameter, its decay changing every step, in a
 * replayed step graph (one capture) against the same arithmetic on the host; a bf16 source is
 * widened; bad arguments record nothing. */
Test(gpu_graph, an_average_by_kiln_assign_replays_with_its_decay_as_a_step_value) {
  TH_GPU_CTX(ctx);
  enum { N = 1000, STEPS = 8 };
  float *hp;
  kiln_tensor *p = th_rand(ctx, KILN_SHAPE(N), 91, -1.f, 1.f, &hp);
  kiln_tensor *ema = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(N));
  kiln_tensor *half = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(N));
  cr_assert_not_null(ema);
  float want[N] = {0};
  for (int t = 0; t < STEPS; t++) {
    float keep = 1.f - 0.1f * (float)(t + 1); /* 1 - decay */
    kiln_step_begin(ctx);
    kiln_tensor *v = kiln_add(ema, kiln_mul_scalar(kiln_sub(p, ema), keep));
    cr_assert_eq(kiln_assign(ema, v), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_assign(half, kiln_cast(kiln_mul_scalar(p, 0.5f), KILN_DTYPE_BF16)), KILN_OK,
                 "%s", th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    for (int i = 0; i < N; i++)
      want[i] = want[i] + (hp[i] - want[i]) * keep;
  }
  kiln_exec_stats st = stats_of(ctx);
  cr_assert_eq(st.graph_captures, 1, "%llu captures: the decay is a step value",
               (unsigned long long)st.graph_captures);
  float *got = th_read(ema), *h = th_read(half);
  for (int i = 0; i < N; i++) {
    cr_assert_float_eq(got[i], want[i], 1e-6f, "element %d: %g, not %g", i, (double)got[i],
                       (double)want[i]);
    cr_assert_eq(h[i], kiln_bf16_to_f32(kiln_bf16_from_f32(0.5f * hp[i])), "element %d", i);
  }
  kiln_tensor *small = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(N - 1));
  cr_assert_eq(kiln_assign(small, p), KILN_ERR_SHAPE);
  cr_assert(strstr(kiln_ctx_error(ctx), "kiln_assign") && strstr(kiln_ctx_error(ctx), "[999]"),
            "%s", th_err(ctx));
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(kiln_assign(kiln_mul_scalar(p, 2.f), p), KILN_ERR_INVALID, "an intermediate dst");
  cr_assert(strstr(kiln_ctx_error(ctx), "persistent"), "%s", th_err(ctx));
  kiln_ctx_clear_error(ctx);
  free(got), free(h), free(hp);
  kiln_tensor_free(p), kiln_tensor_free(ema), kiln_tensor_free(half), kiln_tensor_free(small);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- a bf16 conv net */

/* air's first group at a small size: conv 24->64 3x3 pad 1, batch norm, GELU, max pool 2, conv
 * 64->64 3x3 pad 1, batch norm, GELU, global max pool, linear 64->10, in a bf16 autocast region,
 * on 64 images of 16x16x24. On an sm_90 device both convolutions' forward products and weight
 * gradients run as implicit GEMMs, the first conv's weight gradient split over 8 blocks a tile
 * and summed inside the kernel: the order of that sum is fixed, so that replays and eager steps
 * agree bit for bit. */
typedef struct convnet {
  kiln_params *p;
  kiln_conv2d_layer c1, c2;
  kiln_batch_norm_layer b1, b2;
  kiln_linear fc;
  kiln_optim *opt;
  kiln_tensor *x, *y;
} convnet;

static void convnet_init(convnet *m, kiln_ctx *ctx, bool graphs) {
  kiln_set_graphs(ctx, graphs);
  kiln_manual_seed(ctx, 17);
  m->p = kiln_params_new(ctx);
  cr_assert_eq(kiln_conv2d_layer_init(
                   &m->c1, m->p,
                   &(kiln_conv2d_layer_options){
                       .name = "c1", .in = 24, .out = 64, .kernel = 3, .padding = 1, .no_bias = 1}),
               KILN_OK);
  cr_assert_eq(
      kiln_batch_norm_layer_init(&m->b1, m->p,
                                 &(kiln_batch_norm_layer_options){
                                     .name = "b1", .features = 64, .momentum = 0.1f, .eps = 1e-5f}),
      KILN_OK);
  cr_assert_eq(kiln_conv2d_layer_init(
                   &m->c2, m->p,
                   &(kiln_conv2d_layer_options){
                       .name = "c2", .in = 64, .out = 64, .kernel = 3, .padding = 1, .no_bias = 1}),
               KILN_OK);
  cr_assert_eq(
      kiln_batch_norm_layer_init(&m->b2, m->p,
                                 &(kiln_batch_norm_layer_options){
                                     .name = "b2", .features = 64, .momentum = 0.1f, .eps = 1e-5f}),
      KILN_OK);
  cr_assert_eq(
      kiln_linear_init(&m->fc, m->p, &(kiln_linear_options){.name = "fc", .in = 64, .out = 10}),
      KILN_OK);
  kiln_sgd_options o = kiln_sgd_defaults(0.05f);
  o.momentum = 0.9f;
  o.nesterov = 1;
  m->opt = kiln_sgd_new(m->p, &o);
  cr_assert_not_null(m->opt, "%s", kiln_ctx_error(ctx));
  m->x = th_rand(ctx, KILN_SHAPE(64, 16, 16, 24), 31, -1.f, 1.f, NULL);
  int32_t lab[64];
  for (int i = 0; i < 64; i++)
    lab[i] = (i * 3 + 1) % 10;
  m->y = kiln_tensor_from_host(ctx, KILN_DTYPE_I32, KILN_SHAPE(64), lab);
}

static float convnet_step(convnet *m, kiln_ctx *ctx) {
  kiln_step_begin(ctx);
  kiln_autocast_begin(ctx, KILN_DTYPE_BF16);
  kiln_tensor *h =
      kiln_gelu(kiln_batch_norm_layer_forward(&m->b1, kiln_conv2d_layer_forward(&m->c1, m->x)),
                KILN_GELU_TANH);
  h = kiln_max_pool2d(h, &(kiln_pool2d_options){.kernel_h = 2, .kernel_w = 2});
  h = kiln_gelu(kiln_batch_norm_layer_forward(&m->b2, kiln_conv2d_layer_forward(&m->c2, h)),
                KILN_GELU_TANH);
  kiln_tensor *logits = kiln_linear_forward(&m->fc, kiln_global_max_pool2d(h));
  kiln_autocast_end(ctx);
  kiln_tensor *loss = kiln_cross_entropy(logits, m->y, KILN_REDUCTION_MEAN, 0.f);
  kiln_optim_zero_grad(m->opt);
  cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_step(m->opt), KILN_OK, "%s", th_err(ctx));
  kiln_tensor *keep = kiln_detach(loss);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  return kiln_tensor_item(keep);
}

Test(gpu_graph, a_bf16_conv_net_replays_bitwise_over_50_steps) {
  TH_GPU_CTX(cg);
  TH_GPU_CTX(ce);
  convnet g, e;
  convnet_init(&g, cg, true);
  convnet_init(&e, ce, false);
  float first = 0, last = 0;
  for (int s = 0; s < 50; s++) {
    float lg = convnet_step(&g, cg), le = convnet_step(&e, ce);
    cr_assert(memcmp(&lg, &le, 4) == 0, "step %d: loss %a with graphs, %a without", s, (double)lg,
              (double)le);
    if (s == 0) first = lg;
    last = lg;
  }
  int64_t ng, ne;
  float *pg = th_params_values(g.p, &ng), *pe = th_params_values(e.p, &ne);
  cr_assert_eq(ng, ne);
  cr_assert_eq(memcmp(pg, pe, (size_t)ng * sizeof *pg), 0, "graph and no-graph parameters differ");
  cr_assert_lt(last, 0.5f * first, "the net did not learn its 64 labels: %g to %g", (double)first,
               (double)last);
  kiln_exec_stats sg = stats_of(cg);
  cr_assert_eq(sg.graph_captures, 1);
  free(pg), free(pe);
  for (convnet *m = &g; m; m = m == &g ? &e : NULL) {
    kiln_optim_free(m->opt);
    kiln_params_free(m->p);
    kiln_tensor_free(m->x);
    kiln_tensor_free(m->y);
  }
  th_ctx_free(cg);
  th_ctx_free(ce);
}

/* A context made with KILN_PDL set to `on` (kiln's kernels launched as programmatic dependents,
 * each waiting first for the kernel before it), fusion as given. */
static kiln_ctx *pdl_ctx(const char *on, bool fuse) {
  setenv("KILN_PDL", on, 1); /* read when the context is made */
  kiln_ctx *ctx = kiln_ctx_new(NULL);
  unsetenv("KILN_PDL");
  cr_assert(ctx && kiln_ctx_has_gpu(ctx));
  kiln_set_tf32(ctx, 0);
  kiln_set_fusion(ctx, fuse);
  return ctx;
}

/* KILN_PDL=1 changes no value: the bf16 conv net's 30 steps, fused and replayed from a step graph
 * (the dependents' edges inside it), and unfused and eager (a kernel a node, each reading what the
 * one before it wrote), bitwise the losses and parameters of the same contexts without it. */
Test(gpu_graph, kernels_launched_as_dependents_change_nothing) {
  TH_GPU_CTX(probe); /* skips without a GPU */
  th_ctx_free(probe);
  for (int fuse = 1; fuse >= 0; fuse--) {
    kiln_ctx *c[2] = {pdl_ctx("0", fuse), pdl_ctx("1", fuse)};
    convnet m[2];
    for (int k = 0; k < 2; k++)
      convnet_init(&m[k], c[k], fuse);
    for (int s = 0; s < 30; s++) {
      float l0 = convnet_step(&m[0], c[0]), l1 = convnet_step(&m[1], c[1]);
      cr_assert(memcmp(&l0, &l1, 4) == 0, "fusion %d, step %d: loss %a, %a as dependents", fuse, s,
                (double)l0, (double)l1);
    }
    int64_t n0, n1;
    float *p0 = th_params_values(m[0].p, &n0), *p1 = th_params_values(m[1].p, &n1);
    cr_assert_eq(n0, n1);
    cr_assert_eq(memcmp(p0, p1, (size_t)n0 * sizeof *p0), 0,
                 "fusion %d: the parameters differ as dependents", fuse);
    free(p0), free(p1);
    for (int k = 0; k < 2; k++) {
      kiln_optim_free(m[k].opt);
      kiln_params_free(m[k].p);
      kiln_tensor_free(m[k].x);
      kiln_tensor_free(m[k].y);
      th_ctx_free(c[k]);
    }
  }
}
