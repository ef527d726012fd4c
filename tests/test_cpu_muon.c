/*
 * test_cpu_muon.c: the Muon optimizer as recorded nodes on a no-GPU context: its defaults and
 * zero fields, the step's phases (the momentum buffers' in-place updates, the Newton-Schulz
 * iteration as products and elementwise nodes on the short side's Gram matrix, the weight
 * normalisation, the parameters' in-place updates) and their attributes, groups and schedules
 * reaching those attributes, parameters of fewer than 2 dims refused, bad options refused with
 * nothing made, and a Muon + SGD step over one parameter list planned and compiled.
 */
#include <math.h>
#include <string.h>

#include "inspect.h"

/* The parameter of the list that node n writes (its input 0), or -1. */
static int param_of(kiln_params *p, const kiln__node *n) {
  for (int i = 0; i < kiln_params_count(p); i++)
    if (kiln_params_get(p, i) == n->in[0]) return i;
  return -1;
}

/* The nodes of op from node first on, in order (at most max); returns how many. */
static int nodes_of(kiln_ctx *ctx, int32_t first, kiln__op op, kiln__node **out, int max) {
  int k = 0;
  for (int32_t i = first; i < th_tlen(ctx); i++) {
    kiln__node *n = th_node(ctx, i);
    if (n->op != op) continue;
    if (k < max) out[k] = n;
    k++;
  }
  return k;
}

/* Whether any update node from first on writes (input 0) the tensor t. */
static bool written(kiln_ctx *ctx, int32_t first, const kiln_tensor *t) {
  for (int32_t i = first; i < th_tlen(ctx); i++) {
    kiln__node *n = th_node(ctx, i);
    if (kiln__ops[n->op].kind == KILN__KIND_UPDATE && n->in[0] == t) return true;
  }
  return false;
}

static int select_matrices(const char *name, const kiln_tensor *t, void *user) {
  (void)name;
  (void)user;
  return kiln_tensor_ndim(t) >= 2;
}

/* fc1 (4, 6): rows < cols; fc2 (9, 4): rows > cols. */
static const int64_t dims[] = {6, 4, 9};

Test(muon, defaults_and_zero_fields) {
  kiln_muon_options d = kiln_muon_defaults();
  cr_assert_eq(d.lr, 1e-3f);
  cr_assert_eq(d.momentum, 0.95f);
  cr_assert_eq(d.no_nesterov, 0);
  cr_assert_eq(d.weight_decay, 0.1f);
  cr_assert_eq(d.eps, 1e-7f);
  cr_assert_eq(d.ns_steps, 5);
  cr_assert_eq(d.ns_a, 3.4445f);
  cr_assert_eq(d.ns_b, -4.775f);
  cr_assert_eq(d.ns_c, 2.0315f);
  cr_assert_eq(d.adjust_lr, KILN_MUON_ADJUST_ORIGINAL);
  cr_assert_eq(d.normalize_weight, 0);
  cr_assert_eq(d.ns_dtype, KILN_DTYPE_F32);

  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 8, 2, dims);
  /* NULL options and all-zero options are the defaults */
  kiln_optim *o[2] = {kiln_muon_new(m.params, NULL),
                      kiln_muon_new(m.params, &(kiln_muon_options){0})};
  th_net_backward(&m);
  for (int k = 0; k < 2; k++) {
    cr_assert_not_null(o[k], "%s", th_err(ctx));
    cr_assert_eq(kiln_optim_lr(o[k]), 1e-3f);
    cr_assert_eq(
        kiln_optim_add_group(o[k], kiln_select_no_decay, NULL, &(kiln_param_group){.exclude = 1}),
        2);
    int32_t n0 = th_tlen(ctx);
    cr_assert_eq(kiln_optim_step(o[k]), KILN_OK, "%s", th_err(ctx));
    kiln__node *ns[4];
    cr_assert_eq(nodes_of(ctx, n0, KILN__OP_MUON_MOMENTUM, ns, 4), 2);
    cr_assert_eq(KILN__F(ns[0], MUON_MOMENTUM, momentum), 0.95f);
    cr_assert_eq(nodes_of(ctx, n0, KILN__OP_MUON, ns, 4), 2);
    for (int j = 0; j < 2; j++) {
      cr_assert_eq(KILN__F(ns[j], MUON, lr), 1e-3f);
      cr_assert_eq(KILN__F(ns[j], MUON, weight_decay), 0.1f, "torch's decoupled decay");
    }
    /* five iterations of three products for each of the two matrices */
    cr_assert_eq(th_count_ops(ctx, n0, th_tlen(ctx), KILN__OP_MATMUL), 2 * 5 * 3);
    kiln__node *eps[4];
    cr_assert_eq(nodes_of(ctx, n0, KILN__OP_ADD_SCALAR, eps, 4), 2);
    cr_assert_eq(KILN__F(eps[0], ADD_SCALAR, s), 1e-7f, "u / (||u|| + eps)");
    /* the coefficients: a X, b A and c A A, as scalar products */
    int seen[3] = {0, 0, 0};
    for (int32_t i = n0; i < th_tlen(ctx); i++) {
      kiln__node *n = th_node(ctx, i);
      if (n->op != KILN__OP_MUL_SCALAR) continue;
      float s = KILN__F(n, MUL_SCALAR, s);
      seen[0] += s == 3.4445f;
      seen[1] += s == -4.775f;
      seen[2] += s == 2.0315f;
    }
    for (int j = 0; j < 3; j++)
      cr_assert_eq(seen[j], 2 * 5, "coefficient %d in %d products", j, seen[j]);
  }
  cr_assert_eq(kiln_optim_steps(o[0]), 1);
  kiln_optim_free(o[0]); /* at the end: see bug_tensor_free_fails_a_no_gpu_context */
  kiln_optim_free(o[1]);
  th_net_free(&m);
  th_ctx_free(ctx);
}

Test(muon, a_step_in_phases) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 8, 2, dims);
  kiln_optim *o = kiln_muon_new(
      m.params, &(kiln_muon_options){
                    .lr = 0.02f, .momentum = 0.9f, .weight_decay = KILN_ZERO, .ns_steps = 3});
  cr_assert_not_null(o, "%s", th_err(ctx));
  cr_assert_eq(
      kiln_optim_add_group(o, kiln_select_no_decay, NULL, &(kiln_param_group){.exclude = 1}), 2);
  kiln_tensor *w[2] = {m.l[0].weight, m.l[1].weight};
  th_net_backward(&m);
  int32_t n0 = th_tlen(ctx);
  cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
  int32_t n1 = th_tlen(ctx);

  /* 1: the momentum buffers, first and one after another (one multi-tensor launch) */
  for (int k = 0; k < 2; k++) {
    kiln__node *n = th_node(ctx, n0 + k);
    cr_assert_eq(n->op, KILN__OP_MUON_MOMENTUM, "node %d is %s", k, th_op_name(n->op));
    cr_assert_eq(n->nin, 2);
    char want[64];
    snprintf(want, sizeof want, "%s.momentum_buffer", kiln_tensor_name(w[k]));
    cr_assert_str_eq(kiln_tensor_name(n->in[0]), want);
    cr_assert(kiln_tensor_is_persistent(n->in[0]));
    th_assert_shape(n->in[0], kiln_tensor_shape(w[k]));
    cr_assert_eq(n->in[1], kiln_tensor_grad(w[k]));
    cr_assert_eq(KILN__F(n, MUON_MOMENTUM, momentum), 0.9f);
  }
  /* 3: the parameters' steps, last; the update X a view of the iteration's last sum */
  float scale[2] = {1.f, 1.5f}; /* sqrt(max(1, rows / cols)): 4 < 6, and sqrt(9 / 4) */
  for (int k = 0; k < 2; k++) {
    kiln__node *n = th_node(ctx, n1 - 2 + k);
    cr_assert_eq(n->op, KILN__OP_MUON, "node %d from the end is %s", 2 - k, th_op_name(n->op));
    cr_assert_eq(n->in[0], w[k]);
    th_assert_shape(n->in[1], kiln_tensor_shape(w[k]));
    kiln__node *v = kiln__producer(n->in[1]);
    cr_assert_eq(v->op, KILN__OP_RESHAPE);
    cr_assert_eq(kiln__producer(v->in[0])->op, KILN__OP_ADD, "X = a X + B X");
    cr_assert_eq(KILN__F(n, MUON, lr), 0.02f);
    cr_assert_eq(KILN__F(n, MUON, scale), scale[k]);
    cr_assert_eq(KILN__F(n, MUON, weight_decay), 0.f, "KILN_ZERO: no decay");
  }
  /* 2: in between, products on the short side: A is 4 x 4 for fc1, 4 x 4 (X^T X) for fc2 */
  cr_assert_eq(th_count_ops(ctx, n0, n1, KILN__OP_MATMUL), 2 * 3 * 3);
  for (int32_t i = n0; i < n1; i++) {
    kiln__node *n = th_node(ctx, i);
    if (n->op == KILN__OP_MATMUL && n->in[0] == n->in[1]) /* A A */
      th_assert_shape(n->out, KILN_SHAPE(4, 4));
    cr_assert(n->op != KILN__OP_SCALE, "no weight normalisation unless asked");
    if (kiln__ops[n->op].kind == KILN__KIND_UPDATE)
      cr_assert(i < n0 + 2 || i >= n1 - 2, "update %s in the middle", th_op_name(n->op));
    cr_assert(!n->out || !kiln_tensor_requires_grad(n->out), "%s records a gradient path",
              th_op_name(n->op));
  }
  /* the norms: one sum per matrix */
  cr_assert_eq(th_count_ops(ctx, n0, n1, KILN__OP_SUM), 2);
  /* biases are excluded: nothing writes them */
  cr_assert(!written(ctx, n0, m.l[0].bias) && !written(ctx, n0, m.l[1].bias));
  cr_assert_eq(kiln_optim_steps(o), 1);

  /* the rate changes on the nodes; Nesterov's look-ahead multiplies the buffer by the momentum */
  kiln_optim_set_lr(o, 0.01f);
  n0 = th_tlen(ctx);
  cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
  kiln__node *ns[4];
  cr_assert_eq(nodes_of(ctx, n0, KILN__OP_MUON, ns, 4), 2);
  cr_assert_eq(KILN__F(ns[0], MUON, lr), 0.01f);
  bool lookahead = false;
  for (int32_t i = n0; i < th_tlen(ctx); i++) {
    kiln__node *n = th_node(ctx, i);
    if (n->op == KILN__OP_MUL_SCALAR && KILN__F(n, MUL_SCALAR, s) == 0.9f) lookahead = true;
  }
  cr_assert(lookahead, "u = g + momentum buf");
  th_assert_ok(ctx);
  kiln_optim_free(o);
  th_net_free(&m);
  th_ctx_free(ctx);
}

Test(muon, normalize_weight_nesterov_off_groups_and_schedules) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 8, 2, dims);
  kiln_optim *o = kiln_muon_new(m.params, &(kiln_muon_options){.lr = 0.1f,
                                                               .no_nesterov = 1,
                                                               .weight_decay = 0.01f,
                                                               .ns_steps = 2,
                                                               .adjust_lr = KILN_MUON_ADJUST_NONE,
                                                               .normalize_weight = 1});
  cr_assert_not_null(o, "%s", th_err(ctx));
  cr_assert_eq(
      kiln_optim_add_group(o, kiln_select_no_decay, NULL, &(kiln_param_group){.exclude = 1}), 2);
  cr_assert_eq(kiln_optim_add_group(o, kiln_select_prefix, "fc2.w",
                                    &(kiln_param_group){.lr_scale = 0.5f, .weight_decay = 0.2f}),
               1);
  kiln_schedule oc = {.kind = KILN_SCHEDULE_ONE_CYCLE, .base_lr = 0.1f, .total_steps = 10};
  kiln_optim_set_schedule(o, &oc);
  th_assert_ok(ctx);
  kiln_tensor *w[2] = {m.l[0].weight, m.l[1].weight};
  th_net_backward(&m);
  for (int t = 0; t < 2; t++) {
    int32_t n0 = th_tlen(ctx);
    cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
    int32_t n1 = th_tlen(ctx);
    float lr = kiln_schedule_lr(&oc, t), mom = kiln_schedule_momentum(&oc, t);
    cr_assert(isfinite(mom));
    kiln__node *ns[4];
    cr_assert_eq(nodes_of(ctx, n0, KILN__OP_MUON_MOMENTUM, ns, 4), 2);
    cr_assert_eq(KILN__F(ns[1], MUON_MOMENTUM, momentum), mom, "the cycled momentum");
    /* the weights scaled to norm sqrt(rows), in place, one after another before the steps */
    for (int k = 0; k < 2; k++) {
      kiln__node *n = th_node(ctx, n1 - 4 + k);
      cr_assert_eq(n->op, KILN__OP_SCALE, "node %d from the end is %s", 4 - k, th_op_name(n->op));
      cr_assert_eq(n->in[0], w[k]);
      kiln__node *f = kiln__producer(n->in[1]);
      cr_assert_eq(f->op, KILN__OP_MUL_SCALAR);
      cr_assert_float_eq(KILN__F(f, MUL_SCALAR, s), sqrt((double)dims[k + 1]), 1e-6);
      cr_assert_eq(kiln__producer(f->in[0])->op, KILN__OP_RSQRT);
    }
    for (int k = 0; k < 2; k++) {
      kiln__node *n = th_node(ctx, n1 - 2 + k);
      cr_assert_eq(n->op, KILN__OP_MUON);
      cr_assert_eq(param_of(m.params, n), 2 * k);
      float want = k ? (float)((double)lr * 0.5f) : lr;
      cr_assert_eq(KILN__F(n, MUON, lr), want, "step %d, %s: lr %g, want %g", t,
                   kiln_tensor_name(w[k]), KILN__F(n, MUON, lr), want);
      cr_assert_eq(KILN__F(n, MUON, scale), 1.f, "KILN_MUON_ADJUST_NONE");
      cr_assert_eq(KILN__F(n, MUON, weight_decay), k ? 0.2f : 0.01f);
    }
    /* without Nesterov the buffer itself is orthogonalised: no product by the momentum */
    for (int32_t i = n0; i < n1; i++) {
      kiln__node *n = th_node(ctx, i);
      if (n->op == KILN__OP_MUL_SCALAR) cr_assert_neq(KILN__F(n, MUL_SCALAR, s), mom);
    }
  }
  kiln_optim_free(o);
  th_net_free(&m);
  th_ctx_free(ctx);
}

Test(muon, matrices_only) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 8, 2, dims);
  kiln_conv2d_layer conv;
  cr_assert_eq(
      kiln_conv2d_layer_init(&conv, m.params,
                             &(kiln_conv2d_layer_options){
                                 .name = "conv", .in = 3, .out = 5, .kernel = 3, .no_bias = 1}),
      KILN_OK);
  kiln_optim *o = kiln_muon_new(m.params, &(kiln_muon_options){.lr = 0.02f});
  cr_assert_not_null(o, "%s", th_err(ctx));
  th_net_backward(&m);
  /* a bias not excluded: an error naming it, nothing recorded, no step counted */
  int32_t n0 = th_tlen(ctx);
  cr_assert_eq(kiln_optim_step(o), KILN_ERR_SHAPE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_SHAPE, "kiln_optim_step", "fc1.bias", "has 1", "exclude");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(th_tlen(ctx), n0);
  cr_assert_eq(kiln_optim_steps(o), 0);
  /* excluded, the matrices (the 4-D filter too, as (5, 27)) step */
  cr_assert_eq(
      kiln_optim_add_group(o, kiln_select_no_decay, NULL, &(kiln_param_group){.exclude = 1}), 2);
  cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_steps(o), 1);
  cr_assert_eq(th_count_ops(ctx, n0, th_tlen(ctx), KILN__OP_MUON), 2,
               "the filter has no gradient: left alone");
  /* a group taking a bias back: an error naming it, and nothing changes */
  int before = ctx->npersistent;
  cr_assert_eq(kiln_optim_add_group(o, kiln_select_prefix, "fc2.", &(kiln_param_group){0}), -1);
  TH_ASSERT_ERROR(ctx, KILN_ERR_SHAPE, "kiln_optim_add_group", "fc2.bias");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(ctx->npersistent, before, "no state made for it");
  n0 = th_tlen(ctx);
  cr_assert_eq(kiln_optim_step(o), KILN_OK, "still excluded: %s", th_err(ctx));
  cr_assert(!written(ctx, n0, m.l[1].bias));
  /* a group of matrices only is fine */
  cr_assert_eq(kiln_optim_add_group(o, select_matrices, NULL, &(kiln_param_group){.lr_scale = 2}),
               3);
  kiln_optim_free(o);
  th_net_free(&m);
  th_ctx_free(ctx);
}

Test(muon, bad_options_make_nothing) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 8, 2, dims);
  int before = ctx->npersistent;
  struct {
    kiln_muon_options o;
    kiln_status status;
    const char *want;
  } bad[] = {
      {{.lr = -1.f}, KILN_ERR_INVALID, "lr -1 must be finite and >= 0"},
      {{.lr = INFINITY}, KILN_ERR_INVALID, "lr inf"},
      {{.momentum = 1.f}, KILN_ERR_INVALID, "momentum 1 must be in [0, 1)"},
      {{.momentum = -0.5f}, KILN_ERR_INVALID, "momentum -0.5"},
      {{.momentum = NAN}, KILN_ERR_INVALID, "momentum nan"},
      {{.weight_decay = -0.1f}, KILN_ERR_INVALID, "weight_decay -0.1"},
      {{.eps = -1e-7f}, KILN_ERR_INVALID, "eps -1e-07"},
      {{.ns_steps = -1}, KILN_ERR_INVALID, "ns_steps -1 must be in 1..99"},
      {{.ns_steps = 100}, KILN_ERR_INVALID, "ns_steps 100"},
      {{.ns_b = NAN}, KILN_ERR_INVALID, "ns_b nan must be finite"},
      {{.adjust_lr = (kiln_muon_adjust_lr)7}, KILN_ERR_INVALID, "adjust_lr 7"},
      {{.ns_dtype = KILN_DTYPE_I32}, KILN_ERR_DTYPE, "ns_dtype i32"},
  };
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    cr_assert_null(kiln_muon_new(m.params, &bad[k].o), "case %zu made an optimizer", k);
    TH_ASSERT_ERROR(ctx, bad[k].status, "kiln_muon_new", bad[k].want);
    kiln_ctx_clear_error(ctx);
    cr_assert_eq(ctx->npersistent, before, "case %zu left state tensors", k);
  }
  /* the edges are fine: momentum KILN_ZERO, one iteration, 99 */
  kiln_optim *z =
      kiln_muon_new(m.params, &(kiln_muon_options){.momentum = KILN_ZERO, .ns_steps = 1});
  cr_assert_not_null(z, "%s", th_err(ctx));
  kiln_optim *n = kiln_muon_new(m.params, &(kiln_muon_options){.ns_steps = 99});
  cr_assert_not_null(n, "%s", th_err(ctx));
  kiln_optim_free(z);
  kiln_optim_free(n);
  cr_assert_null(kiln_muon_new(NULL, NULL));
  th_net_free(&m);
  th_ctx_free(ctx);
}

static int select_filters(const char *name, const kiln_tensor *t, void *user) {
  (void)name;
  (void)user;
  return kiln_tensor_ndim(t) == 4;
}
static int select_others(const char *name, const kiln_tensor *t, void *user) {
  return !select_filters(name, t, user);
}

/* A small convolutional net trained by Muon (the filters) and SGD with Nesterov momentum (the
 * rest) over one parameter list: two steps plan and compile every group without a GPU. */
Test(muon, a_muon_and_sgd_step_plans_and_compiles_without_a_gpu) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *p = kiln_params_new(ctx);
  kiln_conv2d_layer c1, c2;
  kiln_linear fc;
  cr_assert_eq(
      kiln_conv2d_layer_init(
          &c1, p,
          &(kiln_conv2d_layer_options){.name = "c1", .in = 3, .out = 8, .kernel = 3, .padding = 1}),
      KILN_OK);
  cr_assert_eq(kiln_conv2d_layer_init(
                   &c2, p,
                   &(kiln_conv2d_layer_options){
                       .name = "c2", .in = 8, .out = 24, .kernel = 3, .padding = 1, .no_bias = 1}),
               KILN_OK); /* tall */
  cr_assert_eq(kiln_linear_init(&fc, p, &(kiln_linear_options){.name = "fc", .in = 24, .out = 10}),
               KILN_OK);
  kiln_tensor *x = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(4, 8, 8, 3));
  kiln_tensor *y = th_new(ctx, KILN_DTYPE_I32, KILN_SHAPE(4));
  kiln_optim *mu = kiln_muon_new(
      p, &(kiln_muon_options){.lr = 0.05f, .momentum = 0.6f, .ns_steps = 3, .normalize_weight = 1});
  kiln_optim *sgd =
      kiln_sgd_new(p, &(kiln_sgd_options){.lr = 0.1f, .momentum = 0.9f, .nesterov = 1});
  cr_assert(mu && sgd, "%s", th_err(ctx));
  cr_assert_eq(kiln_optim_add_group(mu, select_others, NULL, &(kiln_param_group){.exclude = 1}), 3);
  cr_assert_eq(kiln_optim_add_group(sgd, select_filters, NULL, &(kiln_param_group){.exclude = 1}),
               2);
  for (int step = 0; step < 2; step++) {
    kiln_step_begin(ctx);
    kiln_params_zero_grad(p);
    kiln_tensor *h = kiln_relu(kiln_conv2d_layer_forward(&c1, x));
    h = kiln_relu(kiln_conv2d_layer_forward(&c2, h));
    kiln_tensor *logits = kiln_linear_forward(&fc, kiln_global_max_pool2d(h));
    kiln_tensor *loss = kiln_cross_entropy(logits, y, KILN_REDUCTION_MEAN, 0.f);
    cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(ctx));
    int32_t n0 = th_tlen(ctx);
    cr_assert_eq(kiln_optim_step(mu), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_optim_step(sgd), KILN_OK, "%s", th_err(ctx));
    int32_t nodes = th_tlen(ctx);
    /* each parameter is written by one optimizer only */
    for (int i = 0; i < kiln_params_count(p); i++) {
      int writers = 0;
      for (int32_t j = n0; j < nodes; j++) {
        kiln__node *n = th_node(ctx, j);
        writers += (n->op == KILN__OP_MUON || n->op == KILN__OP_SGD_MOMENTUM) &&
                   n->in[0] == kiln_params_get(p, i);
      }
      cr_assert_eq(writers, 1, "%s is stepped %d times", kiln_params_name(p, i), writers);
    }
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "step %d: %s", step, th_err(ctx));
    kiln_exec_stats st;
    kiln_stats(ctx, &st);
    cr_assert_eq(st.last_flush.nodes, (uint64_t)nodes, "the whole step was planned");
    cr_assert_gt(st.last_flush.compiled + st.last_flush.cache_hits, 0);
    cr_assert_eq(st.nodes_executed, 0, "nothing ran");
  }
  cr_assert_eq(kiln_optim_steps(mu), 2);
  cr_assert_eq(kiln_optim_steps(sgd), 2);
  kiln_optim_free(mu);
  kiln_optim_free(sgd);
  kiln_params_free(p);
  kiln_tensor_free(x);
  kiln_tensor_free(y);
  th_ctx_free(ctx);
}
