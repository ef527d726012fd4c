/*
 * test_cpu_nonfinite.c: non-finite steps without a GPU. Anomaly mode (kiln_set_anomaly,
 * KILN_DEBUG=nan): its switch and environment, flushes planned unfused with its check kernel
 * compiled by NVRTC, and what the trace keeps to name a node (the function that recorded it, the
 * forward node whose backward it is). Skipping non-finite optimizer steps
 * (kiln_optim_skip_nonfinite): its calls and errors, what a step records (the flag cleared, one
 * found_inf per gradient, the skipped count, the guarded updates reading the flag and the counts,
 * the counts advanced) for SGD, Adam and Muon, the planner batching found_inf despite the shared
 * flag, and the generated kernels reading one-value inputs once. test_gpu_nonfinite.c runs them.
 */
#include <stdlib.h>
#include <string.h>

#include "fusion/fusion.h"
#include "inspect.h"
#include "optim/optimizer.h"

TestSuite(cpu_anomaly, .fini = th_remove_tmpdirs);
TestSuite(cpu_skip, .fini = th_remove_tmpdirs);

/* ---------------------------------------------------------------- anomaly mode */

Test(cpu_anomaly, the_switch_and_the_environment) {
  kiln_ctx *ctx = th_cpu_ctx();
  cr_assert_eq(kiln_anomaly(ctx), 0, "off by default (KILN_DEBUG=%s)", getenv("KILN_DEBUG"));
  kiln_set_anomaly(ctx, 1);
  cr_assert_eq(kiln_anomaly(ctx), 1);
  kiln_set_anomaly(ctx, 0);
  cr_assert_eq(kiln_anomaly(ctx), 0);
  kiln_set_anomaly(NULL, 1); /* does nothing */
  cr_assert_eq(kiln_anomaly(NULL), 0);
  th_ctx_free(ctx);

  const char *was = getenv("KILN_DEBUG");
  char *saved = was ? strdup(was) : NULL;
  const char *on[] = {"nan", "verify,nan", "nan,plan"}, *off[] = {"verify", "nanx", "na"};
  for (size_t i = 0; i < sizeof on / sizeof *on; i++) {
    cr_assert_eq(setenv("KILN_DEBUG", on[i], 1), 0);
    ctx = th_cpu_ctx();
    cr_assert_eq(kiln_anomaly(ctx), 1, "KILN_DEBUG=%s", on[i]);
    th_ctx_free(ctx);
  }
  for (size_t i = 0; i < sizeof off / sizeof *off; i++) {
    cr_assert_eq(setenv("KILN_DEBUG", off[i], 1), 0);
    ctx = th_cpu_ctx();
    cr_assert_eq(kiln_anomaly(ctx), 0, "KILN_DEBUG=%s", off[i]);
    th_ctx_free(ctx);
  }
  if (saved)
    setenv("KILN_DEBUG", saved, 1);
  else
    unsetenv("KILN_DEBUG");
  free(saved);
}

/* Records a training step of m (forward, backward, SGD) without running it. */
static void record_step(th_net *m, kiln_optim *o) {
  kiln_optim_zero_grad(o);
  th_net_backward(m);
  cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(m->ctx));
}

/* The groups of the pending nodes' plan. */
static int groups_of(kiln_ctx *ctx, bool fuse) {
  kiln__plan p;
  cr_assert(kiln__plan_build(ctx, ctx->trace.done, ctx->trace.n, fuse, &p), "%s", th_err(ctx));
  int ng = p.ng;
  kiln__plan_free(&p);
  return ng;
}

Test(cpu_anomaly, flushes_run_unfused_and_its_check_compiles) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "anomaly-dump");
  cr_assert_eq(setenv("KILN_DUMP_KERNELS", dir, 1), 0);
  kiln_ctx *ctx = th_cpu_ctx();
  unsetenv("KILN_DUMP_KERNELS");
  th_net m;
  th_net_init(&m, ctx, 16, 2, (int64_t[]){12, 8, 4});
  kiln_optim *o = kiln_sgd_new(m.params, &(kiln_sgd_options){.lr = 0.1f, .momentum = 0.9f});
  cr_assert_not_null(o);

  /* a step with anomaly mode on is planned node by node, the check kernel compiled with it */
  kiln_set_anomaly(ctx, 1);
  kiln_step_begin(ctx);
  record_step(&m, o);
  int unfused = groups_of(ctx, false), fused = groups_of(ctx, true);
  cr_assert_lt(fused, unfused, "fusion merges something in this step (%d, %d)", fused, unfused);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  cr_assert_eq(st.last_flush.groups, (uint64_t)unfused, "%llu groups in anomaly mode, want %d",
               (unsigned long long)st.last_flush.groups, unfused);
  char path[512];
  snprintf(path, sizeof path, "%s/k_anomaly_check.cu", dir);
  char *src = th_read_whole(path, NULL);
  cr_assert(strstr(src, "anomaly.cuh"), "the check's source includes its device file: %s", src);
  free(src);
  cr_assert(kiln_fusion(ctx), "anomaly mode leaves the fusion setting alone");

  /* off again: the same step fused */
  kiln_set_anomaly(ctx, 0);
  kiln_step_begin(ctx);
  record_step(&m, o);
  cr_assert_eq(groups_of(ctx, true), fused);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  kiln_stats(ctx, &st);
  cr_assert_eq(st.last_flush.groups, (uint64_t)fused);
  kiln_optim_free(o);
  th_net_free(&m);
  th_ctx_free(ctx);
}

Test(cpu_anomaly, the_trace_names_functions_and_backward_nodes) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_params *ps = kiln_params_new(ctx);
  kiln_tensor *w = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(8));
  kiln_tensor_set_requires_grad(w, 1);
  cr_assert_eq(kiln_params_add(ps, "w", w), KILN_OK);
  kiln_optim *o = kiln_adam_new(ps, NULL);
  kiln_step_begin(ctx);
  kiln_tensor *l = kiln_log(w);
  int32_t log_node = th_tlen(ctx) - 1;
  cr_assert_eq(th_node(ctx, log_node)->op, KILN__OP_LOG);
  cr_assert_str_eq(th_node(ctx, log_node)->fn, "kiln_log");
  cr_assert_eq(th_node(ctx, log_node)->from, -1, "a forward node");
  kiln_tensor *loss = kiln_sum(l, KILN_ALL_AXES, 0);
  int32_t first_bw = th_tlen(ctx);
  cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(ctx));
  /* log's gradient g / x: recorded for node log_node, by the op functions its rule calls */
  int found = 0;
  for (int32_t i = first_bw; i < th_tlen(ctx); i++) {
    kiln__node *n = th_node(ctx, i);
    if (n->op == KILN__OP_DIV) {
      cr_assert_eq(n->from, log_node, "log's gradient says whose it is (%d)", n->from);
      cr_assert_str_eq(n->fn, "kiln_div");
      found++;
    }
    if (n->op == KILN__OP_ASSIGN) { /* the leaf's gradient written */
      cr_assert_str_eq(n->fn, "kiln_backward");
      cr_assert_eq(n->from, -1);
    }
  }
  cr_assert_eq(found, 1, "one division in log's gradient");
  cr_assert_eq(kiln_optim_step(o), KILN_OK);
  cr_assert_str_eq(th_node(ctx, -1)->fn, "kiln_optim_step");
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  kiln_optim_free(o);
  kiln_params_free(ps);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- skipping non-finite steps */

Test(cpu_skip, calls_and_errors) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 4, 1, (int64_t[]){3, 2});
  kiln_optim *o = kiln_sgd_new(m.params, NULL);
  cr_assert_eq(kiln_optim_skip_nonfinite(NULL, 1), KILN_ERR_INVALID);
  cr_assert_eq(kiln_optim_skipped_steps(NULL), -1);
  cr_assert_eq(kiln_optim_skipped_steps(o), 0, "nothing skipped with the option off");

  /* set outside steps only; the failed call changes nothing */
  kiln_step_begin(ctx);
  cr_assert_eq(kiln_optim_skip_nonfinite(o, 1), KILN_ERR_STATE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_optim_skip_nonfinite", "outside a step");
  kiln_ctx_clear_error(ctx);
  th_net_backward(&m);
  int32_t first = th_tlen(ctx);
  cr_assert_eq(kiln_optim_step(o), KILN_OK);
  TH_ASSERT_OPS_FROM(ctx, first, KILN__OP_SGD, KILN__OP_SGD);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK);

  int before = ctx->npersistent;
  cr_assert_eq(kiln_optim_skip_nonfinite(o, 1), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(ctx->npersistent, before + 4, "the flag, the skipped count, 2 parameters' counts");
  cr_assert_eq(kiln_optim_skip_nonfinite(o, 7), KILN_OK, "on again: nothing changes");
  cr_assert_eq(ctx->npersistent, before + 4);
  cr_assert_not_null(o->applied[0]);
  cr_assert_str_eq(kiln_tensor_name(o->applied[0]), "fc1.weight.step");
  /* the count is on the device: without a GPU it cannot be read */
  cr_assert_eq(kiln_optim_skipped_steps(o), -1);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_tensor_to_host", "no GPU");
  kiln_ctx_clear_error(ctx);

  /* a parameter list that changed is refused */
  kiln_tensor *extra = th_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(2));
  cr_assert_eq(kiln_params_add(m.params, "extra", extra), KILN_OK);
  cr_assert_eq(kiln_optim_skip_nonfinite(o, 0), KILN_ERR_STATE);
  TH_ASSERT_ERROR(ctx, KILN_ERR_STATE, "kiln_optim_skip_nonfinite", "parameter list changed");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(ctx->npersistent, before + 5, "the option is still on (and extra is there)");
  kiln_optim_free(o);
  cr_assert_eq(ctx->npersistent, before + 1, "freeing the optimizer frees the option's tensors");

  /* off again: the host's counts (without a GPU, the host's own), plain updates */
  before = ctx->npersistent;
  o = kiln_sgd_new(m.params, NULL);
  cr_assert_eq(kiln_optim_skip_nonfinite(o, 1), KILN_OK);
  cr_assert_eq(kiln_optim_skip_nonfinite(o, 0), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(ctx->npersistent, before);
  kiln_step_begin(ctx);
  th_net_backward(&m);
  first = th_tlen(ctx);
  cr_assert_eq(kiln_optim_step(o), KILN_OK);
  TH_ASSERT_OPS_FROM(ctx, first, KILN__OP_SGD, KILN__OP_SGD);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK);
  kiln_optim_free(o);
  th_net_free(&m);
  th_ctx_free(ctx);
}

/* Asserts that nodes [first, first + n) are guarded updates op reading the optimizer's flag at
 * input fi and parameter k's count at ci (-1: none), in the list's order from parameter k0. */
static void assert_guarded(kiln_ctx *ctx, kiln_optim *o, int32_t first, int n, kiln__op op, int fi,
                           int ci) {
  for (int k = 0; k < n; k++) {
    kiln__node *nd = th_node(ctx, first + k);
    cr_assert_eq(nd->op, op, "node %d: %s", first + k, th_op_name(nd->op));
    cr_assert_eq(nd->nin, kiln__ops[op].nin);
    cr_assert_eq(nd->in[fi], o->found, "node %d reads the flag", first + k);
    if (ci >= 0) cr_assert_eq(nd->in[ci], o->applied[k], "node %d reads its count", first + k);
    cr_assert_eq(KILN__F_NAMED(nd, "lr"), kiln_optim_lr(o));
  }
}

Test(cpu_skip, a_step_records_the_check_the_guarded_updates_and_the_counts) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 4, 2, (int64_t[]){3, 5, 2}); /* 4 parameters */
  kiln_optim *os[3] = {
      kiln_sgd_new(m.params, &(kiln_sgd_options){.lr = 0.1f}),
      kiln_sgd_new(m.params, &(kiln_sgd_options){.lr = 0.2f, .momentum = 0.9f, .dampening = 0.1f}),
      kiln_adamw_new(m.params, &(kiln_adam_options){.lr = 0.3f})};
  const kiln__op ops[3] = {KILN__OP_SGD_GUARDED, KILN__OP_SGD_MOMENTUM_GUARDED,
                           KILN__OP_ADAM_GUARDED};
  const int fi[3] = {2, 3, 4}, ci[3] = {-1, 4, 5};
  kiln_step_begin(ctx);
  th_net_backward(&m);
  for (int k = 0; k < 3; k++) {
    cr_assert_eq(kiln_optim_skip_nonfinite(os[k], 1), KILN_ERR_STATE, "inside the step");
    kiln_ctx_clear_error(ctx);
  }
  cr_assert_eq(kiln_step_end(ctx), KILN_OK);
  for (int k = 0; k < 3; k++)
    cr_assert_eq(kiln_optim_skip_nonfinite(os[k], 1), KILN_OK, "%s", th_err(ctx));

  kiln_step_begin(ctx);
  th_net_backward(&m);
  for (int k = 0; k < 3; k++) {
    kiln_optim *o = os[k];
    int32_t first = th_tlen(ctx);
    cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
    /* the flag cleared (a fill assigned), set by each gradient, counted; the updates; the counts
     * advanced by 1 - found */
    TH_ASSERT_OPS_FROM(ctx, first, KILN__OP_FILL, KILN__OP_ASSIGN, KILN__OP_FOUND_INF,
                       KILN__OP_FOUND_INF, KILN__OP_FOUND_INF, KILN__OP_FOUND_INF, KILN__OP_ACCUM,
                       ops[k], ops[k], ops[k], ops[k], KILN__OP_NEG, KILN__OP_ADD_SCALAR,
                       KILN__OP_ACCUM, KILN__OP_ACCUM, KILN__OP_ACCUM, KILN__OP_ACCUM);
    cr_assert_eq(th_node(ctx, first + 1)->in[0], o->found);
    for (int i = 0; i < 4; i++) {
      kiln__node *f = th_node(ctx, first + 2 + i);
      cr_assert_eq(f->in[0], kiln_tensor_grad(kiln_params_get(m.params, i)));
      cr_assert_eq(f->in[1], o->found);
      cr_assert_eq(th_node(ctx, first + 13 + i)->in[0], o->applied[i]);
      cr_assert_eq(th_node(ctx, first + 13 + i)->in[1], th_node(ctx, first + 12)->out);
    }
    cr_assert_eq(th_node(ctx, first + 6)->in[0], o->skipped);
    cr_assert_eq(th_node(ctx, first + 6)->in[1], o->found);
    cr_assert_eq(th_node(ctx, first + 10)->nin, kiln__ops[ops[k]].nin);
    assert_guarded(ctx, o, first + 7, 4, ops[k], fi[k], ci[k]);
    cr_assert_eq(kiln_optim_steps(o), 1);
  }
  /* Adam's bias corrections are the device's: only its rates are step values */
  kiln__node *adam = th_node(ctx, -7);
  cr_assert_eq(adam->op, KILN__OP_ADAM_GUARDED);
  cr_assert_float_eq(KILN__F_NAMED(adam, "beta2"), 0.999f, 0.f);
  cr_assert_eq(KILN__I_NAMED(adam, "decoupled"), 1);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  for (int k = 0; k < 3; k++)
    kiln_optim_free(os[k]);
  th_net_free(&m);
  th_ctx_free(ctx);
}

Test(cpu_skip, muon_and_parameters_without_gradients) {
  kiln_ctx *ctx = th_cpu_ctx();
  th_net m;
  th_net_init(&m, ctx, 4, 2, (int64_t[]){3, 5, 2});
  kiln_optim *o =
      kiln_muon_new(m.params, &(kiln_muon_options){.ns_steps = 1, .normalize_weight = 1});
  cr_assert_eq(
      kiln_optim_add_group(o, kiln_select_no_decay, NULL, &(kiln_param_group){.exclude = 1}), 2);
  cr_assert_eq(kiln_optim_skip_nonfinite(o, 1), KILN_OK, "%s", th_err(ctx));
  /* 4 parameters, x and y, 2 matrices' momentum buffers, the flag, the skipped count and 4
   * parameters' counts (every parameter that is no buffer: an excluded one may come back) */
  cr_assert_eq(ctx->npersistent, 4 + 2 + 2 + 2 + 4, "%d persistent tensors", ctx->npersistent);
  kiln_step_begin(ctx);
  th_net_backward(&m);
  int32_t first = th_tlen(ctx);
  cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(th_count_ops(ctx, first, th_tlen(ctx), KILN__OP_FOUND_INF), 2, "the matrices");
  cr_assert_eq(th_count_ops(ctx, first, th_tlen(ctx), KILN__OP_MUON_MOMENTUM_GUARDED), 2);
  cr_assert_eq(th_count_ops(ctx, first, th_tlen(ctx), KILN__OP_SCALE_GUARDED), 2);
  cr_assert_eq(th_count_ops(ctx, first, th_tlen(ctx), KILN__OP_MUON_GUARDED), 2);
  cr_assert_eq(th_count_ops(ctx, first, th_tlen(ctx), KILN__OP_MUON_MOMENTUM), 0);
  cr_assert_eq(th_count_ops(ctx, first, th_tlen(ctx), KILN__OP_ACCUM), 1 + 2, "skipped, 2 counts");
  cr_assert_eq(th_node(ctx, first + 1)->op, KILN__OP_ASSIGN, "the flag cleared first");
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));

  /* a parameter without a gradient is neither checked nor updated nor counted */
  kiln_optim *s = kiln_sgd_new(m.params, NULL);
  cr_assert_eq(kiln_optim_skip_nonfinite(s, 1), KILN_OK);
  kiln_step_begin(ctx);
  kiln_params_zero_grad(m.params);
  kiln_tensor *w = kiln_params_get(m.params, 0);
  cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(w, w), KILN_ALL_AXES, 0)), KILN_OK);
  first = th_tlen(ctx);
  cr_assert_eq(kiln_optim_step(s), KILN_OK, "%s", th_err(ctx));
  TH_ASSERT_OPS_FROM(ctx, first, KILN__OP_FILL, KILN__OP_ASSIGN, KILN__OP_FOUND_INF, KILN__OP_ACCUM,
                     KILN__OP_SGD_GUARDED, KILN__OP_NEG, KILN__OP_ADD_SCALAR, KILN__OP_ACCUM);
  cr_assert_eq(th_node(ctx, -1)->in[0], s->applied[0]);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  kiln_optim_free(s);
  kiln_optim_free(o);
  th_net_free(&m);
  th_ctx_free(ctx);
}

/* The group of the pending plan whose main node is op, and how many such groups there are. */
static int groups_led_by(const kiln_ctx *ctx, const kiln__plan *p, kiln__op op, int *members) {
  int count = 0;
  for (int k = 0; k < p->ng; k++) {
    if (ctx->trace.nodes[p->g[k].node].op != op) continue;
    count++;
    *members = p->g[k].n;
  }
  return count;
}

Test(cpu_skip, the_planner_batches_the_check_and_the_kernels_compile) {
  char dir[256];
  th_tmpdir(dir, sizeof dir, "skip-dump");
  cr_assert_eq(setenv("KILN_DUMP_KERNELS", dir, 1), 0);
  kiln_ctx *ctx = th_cpu_ctx();
  unsetenv("KILN_DUMP_KERNELS");
  th_net m;
  th_net_init(&m, ctx, 4, 2, (int64_t[]){3, 5, 2});
  kiln_optim *o = kiln_adam_new(m.params, NULL);
  cr_assert_eq(kiln_optim_skip_nonfinite(o, 1), KILN_OK);
  kiln_step_begin(ctx);
  th_net_backward(&m);
  cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
  /* fused: the four checks share the flag they set, and still run as one launch; so do the
   * four guarded updates (6 pointers each) and the four counts */
  kiln__plan p;
  cr_assert(kiln__plan_build(ctx, ctx->trace.done, ctx->trace.n, true, &p), "%s", th_err(ctx));
  char why[512];
  cr_assert_null(kiln__plan_verify(ctx, &p, why, sizeof why), "%s", why);
  int members = 0;
  cr_assert_eq(groups_led_by(ctx, &p, KILN__OP_FOUND_INF, &members), 1);
  cr_assert_eq(members, 4);
  cr_assert_eq(groups_led_by(ctx, &p, KILN__OP_ADAM_GUARDED, &members), 1);
  cr_assert_eq(members, 4);
  kiln__plan_free(&p);
  cr_assert_eq(kiln__engine_compile(ctx, ctx->trace.done, ctx->trace.n), KILN_OK, "%s",
               th_err(ctx));
  kiln_set_fusion(ctx, 0); /* and one by one */
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));

  /* the flag and the counts are read at element 0, found_inf's flag stored only where it changed */
  char cmd[1024];
  snprintf(
      cmd, sizeof cmd,
      "grep -l 'x1 = ((const float \\*)a.ptr\\[t \\* 2 + 1\\])\\[0\\]' %s/k_found_inf_f32_x4_*.cu "
      "| xargs grep -l 'if (x1 != was1) ((float \\*)a.ptr\\[t \\* 2 + 1\\])\\[0\\] = x1;' "
      ">/dev/null",
      dir);
  cr_assert_eq(system(cmd), 0, "no found_inf kernel storing its flag where it changed in %s", dir);
  snprintf(cmd, sizeof cmd,
           "grep -l 'x5 = ((const float \\*)a.ptr\\[t \\* 6 + 5\\])\\[0\\]' "
           "%s/k_adam_guarded_f32_x1_*.cu | xargs grep -l 'if (x4 == 0.f) kiln_adam_counted' "
           ">/dev/null",
           dir);
  cr_assert_eq(system(cmd), 0, "no lone adam_guarded kernel reading its count once in %s", dir);
  kiln_optim_free(o);
  th_net_free(&m);
  th_ctx_free(ctx);
}

Test(cpu_skip, one_value_inputs_are_checked) {
  kiln_ctx *ctx = th_cpu_ctx();
  kiln_tensor *p = th_f32(ctx, KILN_SHAPE(4, 3)), *g = th_f32(ctx, KILN_SHAPE(4, 3));
  kiln_tensor *flag = th_f32(ctx, KILN_SHAPE(1)), *wide = th_f32(ctx, KILN_SHAPE(2));
  int32_t n0 = th_tlen(ctx);
  cr_assert_null(kiln__update(KILN__OP_SGD_GUARDED, "probe", 3, (kiln_tensor *[]){p, g, wide}));
  TH_ASSERT_ERROR(ctx, KILN_ERR_SHAPE, "probe: input 2 is [2] f32", "it must be one f32 value");
  kiln_ctx_clear_error(ctx);
  cr_assert_null(kiln__update(KILN__OP_FOUND_INF, "probe", 2, (kiln_tensor *[]){g, wide}));
  TH_ASSERT_ERROR(ctx, KILN_ERR_SHAPE, "input 1 is [2] f32", "one f32 value");
  kiln_ctx_clear_error(ctx);
  cr_assert_eq(th_tlen(ctx), n0, "the failed calls recorded nothing");
  kiln__node *n = kiln__update(KILN__OP_SGD_GUARDED, "probe", 3, (kiln_tensor *[]){p, g, flag});
  cr_assert_not_null(n, "%s", th_err(ctx));
  cr_assert_str_eq(n->fn, "probe");
  th_free_scratch();
  th_ctx_free(ctx);
}
