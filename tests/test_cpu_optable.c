/*
 * test_cpu_optable.c: the op table (core/ops.def) against itself and against the backward rules:
 * names, kinds, expressions and their placeholders, the in-place stores of update ops, which ops
 * have a backward rule, that each row's saves mask is exactly what its rule reads, each row's
 * kernel family and iteration space, and attributes found by name.
 * No GPU needed.
 */
#include <signal.h>
#include <string.h>

#include "inspect.h"

/* The ops that carry no gradient; every other op must have a backward rule. */
static bool expect_no_grad(kiln__op op) {
  switch (op) {
  case KILN__OP_EQ:
  case KILN__OP_NE:
  case KILN__OP_LT:
  case KILN__OP_LE:
  case KILN__OP_GT:
  case KILN__OP_GE:
  case KILN__OP_RELU_GRAD:
  case KILN__OP_GELU_ERF_GRAD:
  case KILN__OP_GELU_TANH_GRAD:
  case KILN__OP_CLAMP_GRAD:
  case KILN__OP_ABS_GRAD:
  case KILN__OP_SILU_GRAD:
  case KILN__OP_LEAKY_RELU_GRAD:
  case KILN__OP_SOFTPLUS_GRAD:
  case KILN__OP_FILL:
  case KILN__OP_ONEHOT:
  case KILN__OP_ACCUM:
  case KILN__OP_ASSIGN:
  case KILN__OP_SCALE:
  case KILN__OP_SGD:
  case KILN__OP_SGD_MOMENTUM:
  case KILN__OP_ADAM:
  case KILN__OP_MUON_MOMENTUM:
  case KILN__OP_MUON:
  case KILN__OP_FOUND_INF:
  case KILN__OP_SGD_GUARDED:
  case KILN__OP_SGD_MOMENTUM_GUARDED:
  case KILN__OP_ADAM_GUARDED:
  case KILN__OP_MUON_MOMENTUM_GUARDED:
  case KILN__OP_MUON_GUARDED:
  case KILN__OP_SCALE_GUARDED:
  case KILN__OP_ARGMAX:
  case KILN__OP_DETACH:
  case KILN__OP_INDEX_ADD:
  case KILN__OP_RAND:
  case KILN__OP_RANDN:
  case KILN__OP_COL2IM:
  case KILN__OP_MAX_POOL_GRAD:
  case KILN__OP_AVG_POOL_GRAD:
  case KILN__OP_MOMENTS:
  case KILN__OP_AUGMENT:
  case KILN__OP_RESIZE_CROP: return true;
  default: return false;
  }
}

Test(optable, names_are_unique_identifiers) {
  for (int i = 0; i < KILN__OP_COUNT; i++) {
    const char *n = kiln__ops[i].name;
    cr_assert(n && *n, "op %d has no name", i);
    for (const char *p = n; *p; p++)
      cr_assert((*p >= 'a' && *p <= 'z') || *p == '_' || (p > n && *p >= '0' && *p <= '9'),
                "op %d's name '%s' is not a lower-case identifier (it names kernels)", i, n);
    for (int j = 0; j < i; j++)
      cr_assert_str_neq(n, kiln__ops[j].name, "ops %d and %d are both named '%s'", j, i, n);
    cr_assert(kiln__ops[i].nin >= 0 && kiln__ops[i].nin <= KILN__MAX_IN, "op %s: nin %d", n,
              kiln__ops[i].nin);
  }
}

/* Checks an expression's placeholders: $N below nin, $idx, $c (with an int attribute axis) and
 * $<name> naming one of the op's attributes. */
static void check_placeholders(kiln__op op) {
  const kiln__op_info *o = &kiln__ops[op];
  for (const char *p = o->expr; *p; p++) {
    if (*p != '$') continue;
    size_t len = strspn(p + 1, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_");
    kiln__attr_kind kind;
    int slot;
    char c = p[1];
    if (len == 3 && (strncmp(p + 1, "idx", 3) == 0 || strncmp(p + 1, "err", 3) == 0)) {
      continue; /* the linear index, the error record */
    } else if (len == 1 && c == 'c') {
      cr_assert(kiln__attr_find(op, "axis", 4, &kind, &slot) && kind == KILN__ATTR_I,
                "op %s: '%s' reads $c without an int attribute axis", o->name, o->expr);
    } else if (c >= '0' && c <= '9') {
      cr_assert(c - '0' < o->nin, "op %s: '%s' reads $%c but has %d inputs", o->name, o->expr, c,
                o->nin);
    } else {
      cr_assert(len > 0 && kiln__attr_find(op, p + 1, len, &kind, &slot),
                "op %s: '%s' names $%.*s, which is none of its attributes", o->name, o->expr,
                (int)len, p + 1);
    }
  }
}

Test(optable, kinds_expressions_and_stores) {
  int counts[KILN__KIND_LIB + 1] = {0};
  for (int i = 0; i < KILN__OP_COUNT; i++) {
    const kiln__op_info *o = &kiln__ops[i];
    cr_assert_not_null(o->expr, "op %s has a NULL expression", o->name);
    counts[o->kind]++;
    switch (o->kind) {
    case KILN__KIND_EW:
      cr_assert(o->expr[0], "elementwise op %s has no expression", o->name);
      cr_assert_eq(o->stores, 0u, "elementwise op %s stores into inputs", o->name);
      check_placeholders((kiln__op)i);
      break;
    case KILN__KIND_UPDATE:
      cr_assert(o->expr[0], "update op %s has no expression", o->name);
      cr_assert_neq(o->stores, 0u, "update op %s stores nothing", o->name);
      cr_assert_eq(o->stores & ~((1u << o->nin) - 1), 0u,
                   "update op %s stores 0x%x beyond its %d inputs", o->name, o->stores, o->nin);
      /* found_inf iterates over its input 0 (a gradient) and writes its flag, input 1 */
      cr_assert(o->stores & (i == KILN__OP_FOUND_INF ? 2u : 1u),
                "update op %s does not write its input 0", o->name);
      /* one-value inputs (a factor, a flag, a count) are inputs */
      cr_assert_eq(kiln__update_scalars((kiln__op)i) & ~((1u << o->nin) - 1), 0u, "%s", o->name);
      cr_assert(!kiln__has_grad((kiln__op)i), "update op %s has a backward rule", o->name);
      check_placeholders((kiln__op)i);
      break;
    case KILN__KIND_REDUCE:
      cr_assert_eq(o->nin, 1, "reduction %s takes %d inputs", o->name, o->nin);
      cr_assert_eq(o->stores, 0u);
      break;
    case KILN__KIND_MATMUL:
      cr_assert_eq(o->nin, 2, "matmul %s takes %d inputs", o->name, o->nin);
      cr_assert_str_empty(o->expr);
      break;
    case KILN__KIND_VIEW:
      cr_assert_eq(o->nin, 1, "view %s takes %d inputs", o->name, o->nin);
      cr_assert_str_empty(o->expr, "view %s has an expression", o->name);
      cr_assert_eq(o->stores, 0u);
      break;
    case KILN__KIND_LIB:
      cr_assert_str_empty(o->expr, "library op %s has an expression", o->name);
      break;
    }
  }
  /* the reductions' kernels are the renderer's own; each has a scale, a mask and keepdim */
  for (int op = KILN__OP_SUM; op <= KILN__OP_ARGMAX; op++) {
    cr_assert_str_empty(kiln__ops[op].expr);
    kiln__attr_kind kind;
    int slot;
    cr_assert(kiln__attr_find((kiln__op)op, "scale", 5, &kind, &slot) && kind == KILN__ATTR_F);
    cr_assert(kiln__attr_find((kiln__op)op, "mask", 4, &kind, &slot) && kind == KILN__ATTR_I);
  }
  cr_assert_eq(kiln__ops[KILN__OP_CONCAT].nin, KILN__MAX_IN);
  cr_assert_eq(kiln__ops[KILN__OP_SGD_MOMENTUM].stores, 5u); /* p and the momentum buffer */
  cr_assert_eq(kiln__ops[KILN__OP_ADAM].stores, 13u);        /* p, m and v */
  /* the guarded updates write what their plain forms write; their flag (and count) come last */
  const kiln__op plain[] = {KILN__OP_SGD,           KILN__OP_SGD_MOMENTUM, KILN__OP_ADAM,
                            KILN__OP_MUON_MOMENTUM, KILN__OP_MUON,         KILN__OP_SCALE},
                 guarded[] = {KILN__OP_SGD_GUARDED,  KILN__OP_SGD_MOMENTUM_GUARDED,
                              KILN__OP_ADAM_GUARDED, KILN__OP_MUON_MOMENTUM_GUARDED,
                              KILN__OP_MUON_GUARDED, KILN__OP_SCALE_GUARDED};
  for (size_t k = 0; k < sizeof plain / sizeof *plain; k++) {
    const kiln__op_info *p = &kiln__ops[plain[k]], *g = &kiln__ops[guarded[k]];
    cr_assert_eq(g->stores, p->stores, "%s and %s", g->name, p->name);
    int extra = g->nin - p->nin; /* found, and a count for SGD with momentum and Adam */
    cr_assert(extra == 1 || extra == 2, "%s", g->name);
    cr_assert_eq(kiln__update_scalars(guarded[k]) >> p->nin, (1u << extra) - 1, "%s", g->name);
    cr_assert_eq(kiln__update_scalars(guarded[k]) & ((1u << p->nin) - 1),
                 kiln__update_scalars(plain[k]), "%s", g->name);
    cr_assert_eq(strncmp(g->name, p->name, strlen(p->name)), 0, "%s", g->name);
  }
  cr_assert_eq(kiln__ops[KILN__OP_FOUND_INF].stores, 2u); /* its flag */
  cr_assert_eq(kiln__update_scalars(KILN__OP_FOUND_INF), 2u);
  cr_assert_eq(counts[KILN__KIND_MATMUL], 1, "one matmul row");
  /* the rows of each kind that the planner and the executor special-case */
  const kiln__op reduce[] = {KILN__OP_SUM, KILN__OP_MAX, KILN__OP_ARGMAX};
  const kiln__op views[] = {KILN__OP_RESHAPE, KILN__OP_PERMUTE, KILN__OP_SLICE, KILN__OP_EXPAND,
                            KILN__OP_DETACH};
  const kiln__op updates[] = {KILN__OP_ACCUM,        KILN__OP_ASSIGN, KILN__OP_SGD,
                              KILN__OP_SGD_MOMENTUM, KILN__OP_ADAM,   KILN__OP_MUON_MOMENTUM,
                              KILN__OP_MUON};
  for (size_t i = 0; i < sizeof reduce / sizeof *reduce; i++)
    cr_assert_eq(kiln__ops[reduce[i]].kind, KILN__KIND_REDUCE, "%s", kiln__ops[reduce[i]].name);
  for (size_t i = 0; i < sizeof views / sizeof *views; i++)
    cr_assert_eq(kiln__ops[views[i]].kind, KILN__KIND_VIEW, "%s", kiln__ops[views[i]].name);
  for (size_t i = 0; i < sizeof updates / sizeof *updates; i++)
    cr_assert_eq(kiln__ops[updates[i]].kind, KILN__KIND_UPDATE, "%s", kiln__ops[updates[i]].name);
  cr_assert_eq(kiln__ops[KILN__OP_MATMUL].kind, KILN__KIND_MATMUL);
  cr_assert_eq(kiln__ops[KILN__OP_CONCAT].kind, KILN__KIND_LIB);
  cr_assert_eq(kiln__ops[KILN__OP_INDEX_SELECT].kind, KILN__KIND_LIB);
  cr_assert_eq(kiln__ops[KILN__OP_INDEX_SELECT].nin, 2);
  cr_assert_eq(kiln__ops[KILN__OP_FILL].nin, 0, "fill reads no input");
}

Test(optable, backward_rules_where_expected) {
  cr_assert(kiln__has_grad(KILN__OP_ADD));
  cr_assert(kiln__has_grad(KILN__OP_MATMUL));
  cr_assert(kiln__has_grad(KILN__OP_CONCAT));
  cr_assert(kiln__has_grad(KILN__OP_SLICE));
  cr_assert(kiln__has_grad(KILN__OP_DROPOUT));
  cr_assert(!kiln__has_grad(KILN__OP_EQ));
  cr_assert(!kiln__has_grad(KILN__OP_ARGMAX));
  cr_assert(!kiln__has_grad(KILN__OP_DETACH));
  for (int i = 0; i < KILN__OP_COUNT; i++)
    cr_assert_eq(kiln__has_grad((kiln__op)i), !expect_no_grad((kiln__op)i),
                 "op %s: has a backward rule %d, expected %d", kiln__ops[i].name,
                 kiln__has_grad((kiln__op)i), !expect_no_grad((kiln__op)i));
}

/* ---------------------------------------------------------------- saves against the rules */

/* Records one node of op, an op with a backward rule, on persistent f32 inputs that require grad
 * (scratch tensors of shapes the op takes); returns what the op's function returned. */
static kiln_tensor *record_op(kiln_ctx *ctx, kiln__op op) {
  kiln_shape s = KILN_SHAPE(3, 4);
  kiln_tensor *a = th_param(ctx, s);
  switch (op) {
  case KILN__OP_ADD: return kiln_add(a, th_param(ctx, s));
  case KILN__OP_SUB: return kiln_sub(a, th_param(ctx, s));
  case KILN__OP_MUL: return kiln_mul(a, th_param(ctx, s));
  case KILN__OP_DIV: return kiln_div(a, th_param(ctx, s));
  case KILN__OP_MAXIMUM: return kiln_maximum(a, th_param(ctx, s));
  case KILN__OP_MINIMUM: return kiln_minimum(a, th_param(ctx, s));
  case KILN__OP_WHERE: return kiln_where(a, th_param(ctx, s), th_param(ctx, s));
  case KILN__OP_NEG: return kiln_neg(a);
  case KILN__OP_EXP: return kiln_exp(a);
  case KILN__OP_LOG: return kiln_log(a);
  case KILN__OP_SQRT: return kiln_sqrt(a);
  case KILN__OP_RSQRT: return kiln_rsqrt(a);
  case KILN__OP_TANH: return kiln_tanh(a);
  case KILN__OP_SIGMOID: return kiln_sigmoid(a);
  case KILN__OP_RELU: return kiln_relu(a);
  case KILN__OP_GELU_ERF: return kiln_gelu(a, KILN_GELU_ERF);
  case KILN__OP_GELU_TANH: return kiln_gelu(a, KILN_GELU_TANH);
  case KILN__OP_ADD_SCALAR: return kiln_add_scalar(a, 1.5f);
  case KILN__OP_MUL_SCALAR: return kiln_mul_scalar(a, -2.f);
  case KILN__OP_POW_SCALAR: return kiln_pow_scalar(a, 3.f);
  case KILN__OP_CLAMP: return kiln_clamp(a, -0.5f, 0.5f);
  case KILN__OP_ABS: return kiln_abs(a);
  case KILN__OP_SILU: return kiln_silu(a);
  case KILN__OP_ERF: return kiln_erf(a);
  case KILN__OP_LEAKY_RELU: return kiln_leaky_relu(a, 0.01f);
  case KILN__OP_SOFTPLUS: return kiln_softplus(a, 2.f, 10.f);
  case KILN__OP_COPY: return kiln_contiguous(kiln_transpose(a, 0, 1)); /* the copy of a view */
  case KILN__OP_CAST: return kiln_cast(a, KILN_DTYPE_BF16);
  case KILN__OP_DROPOUT: return kiln_dropout(a, 0.5f, 1);
  case KILN__OP_INDEX_SELECT:
    return kiln_index_select(th_param(ctx, KILN_SHAPE(4, 3)), th_i32(ctx, KILN_SHAPE(5)));
  case KILN__OP_SUM: return kiln_sum(a, KILN_AXES(1), 0);
  case KILN__OP_MAX: return kiln_max(a, KILN_AXES(1), 0);
  case KILN__OP_MATMUL:
    return kiln_matmul(th_param(ctx, KILN_SHAPE(4, 3)), th_param(ctx, KILN_SHAPE(3, 5)));
  case KILN__OP_RESHAPE: return kiln_reshape(a, KILN_SHAPE(2, 6));
  case KILN__OP_PERMUTE:
    return kiln_permute(th_param(ctx, KILN_SHAPE(2, 3, 4)), KILN_AXES(2, 0, 1));
  case KILN__OP_SLICE: return kiln_slice(th_param(ctx, KILN_SHAPE(4, 6)), 1, 1, 6, 2);
  case KILN__OP_EXPAND: return kiln_expand(th_param(ctx, KILN_SHAPE(3, 1)), s);
  case KILN__OP_CONCAT: {
    kiln_tensor *in[3] = {th_param(ctx, KILN_SHAPE(2, 4)), th_param(ctx, KILN_SHAPE(1, 4)),
                          th_param(ctx, KILN_SHAPE(2, 4))};
    return kiln_concat(3, in, 0);
  }
  case KILN__OP_IM2COL: /* a weight without a gradient: the product's rule reads no columns */
    return kiln_conv2d(th_param(ctx, KILN_SHAPE(2, 5, 4, 3)), th_f32(ctx, KILN_SHAPE(4, 3, 3, 3)),
                       NULL, &(kiln_conv2d_options){.pad_h = 1, .pad_w = 1});
  case KILN__OP_BN_APPLY:
    return kiln_batch_norm(th_param(ctx, KILN_SHAPE(4, 3)), th_param(ctx, KILN_SHAPE(3)),
                           th_param(ctx, KILN_SHAPE(3)), NULL, NULL, 1, 0.1f, 1e-5f);
  case KILN__OP_MAX_POOL: /* of a value nothing else keeps: the rule reads the windows' positions
                           * behind the output (ops.def: index), not the input */
    return kiln_max_pool2d(
        kiln_mul(th_param(ctx, KILN_SHAPE(2, 4, 4, 3)), th_f32(ctx, KILN_SHAPE(2, 4, 4, 3))),
        &(kiln_pool2d_options){.kernel_h = 2, .kernel_w = 2});
  case KILN__OP_AVG_POOL:
    return kiln_avg_pool2d(th_param(ctx, KILN_SHAPE(2, 4, 4, 3)),
                           &(kiln_pool2d_options){.kernel_h = 2, .kernel_w = 2});
  default:
    cr_assert_fail("op %s has a backward rule but no case in record_op: add one", th_op_name(op));
  }
  return NULL;
}

/* Which of the forward node's tensors (input k: bit k, for k < 3; its output: bit 3) the nodes
 * [first, last) read, directly or through view nodes (reshape, permute, slice, expand, detach)
 * of them. */
static unsigned reads_of(kiln_ctx *ctx, const kiln__node *fwd, int32_t first, int32_t last) {
  unsigned mask = 0;
  for (int32_t i = first; i < last; i++) {
    const kiln__node *n = th_node(ctx, i);
    for (int k = 0; k < n->nin; k++) {
      const kiln_tensor *x = n->in[k];
      while (x) {
        int hit = x == fwd->out ? 3 : -1;
        for (int j = 0; j < fwd->nin && j < 3 && hit < 0; j++)
          if (x == fwd->in[j]) hit = j;
        if (hit >= 0) {
          mask |= 1u << hit;
          break;
        }
        if (x->node < 0 || x->node >= th_tlen(ctx)) break;
        const kiln__node *v = th_node(ctx, x->node);
        x = kiln__ops[v->op].kind == KILN__KIND_VIEW && v->out == x ? v->in[0] : NULL;
      }
    }
  }
  return mask;
}

/* "in0 in1 out" for a saves mask. */
static const char *mask_str(unsigned m, char *buf, size_t n) {
  size_t k = 0;
  buf[0] = 0;
  const char *names[4] = {"in0", "in1", "in2", "out"};
  for (int b = 0; b < 4; b++)
    if (m & (1u << b)) k += (size_t)snprintf(buf + k, n - k, "%s%s", k ? " " : "", names[b]);
  if (!m) snprintf(buf, n, "nothing");
  return buf;
}

/*
 * saves (the last column of ops.def) tells the planner which of an op's values its backward rule
 * reads, so that they are written to memory. For every op with a rule: record it on inputs that
 * require grad, run kiln_backward of sum(out * w) (w a constant, so the rules of the mul and the
 * sum read neither out nor the op's inputs), and collect what the nodes it recorded read of the
 * op's inputs and output. That must be the op's saves, no more (memory kept for nothing) and no
 * less (a value the rule reads would be gone).
 */
Test(optable, saves_is_what_the_backward_rule_reads) {
  char bad[4096] = "";
  size_t k = 0;
  int checked = 0;
  for (int i = 0; i < KILN__OP_COUNT; i++) {
    kiln__op op = (kiln__op)i;
    /* a custom op's rule is its user's backward, which may read anything: the op is a kernel of
     * its own, so its inputs and output are written whatever saves says (test_cpu_custom.c) */
    if (!kiln__has_grad(op) || op == KILN__OP_CUSTOM) continue;
    kiln_ctx *ctx = th_cpu_ctx();
    int32_t n0 = th_tlen(ctx);
    kiln_tensor *y = record_op(ctx, op);
    cr_assert_not_null(y, "op %s: recording it failed: %s", th_op_name(op), th_err(ctx));
    int32_t at = -1;
    for (int32_t j = n0; j < th_tlen(ctx); j++)
      if (th_node(ctx, j)->op == op) {
        cr_assert_lt(at, 0, "op %s: recorded twice", th_op_name(op));
        at = j;
      }
    cr_assert_geq(at, 0, "op %s: its function recorded no %s node", th_op_name(op), th_op_name(op));
    kiln__node fwd = *th_node(ctx, at);
    cr_assert(fwd.out && fwd.out->requires_grad, "op %s: the output does not require grad",
              th_op_name(op));
    kiln_tensor *w = th_f32(ctx, kiln_tensor_shape(y));
    kiln_tensor *loss = th_sum_all(kiln_mul(y, w));
    cr_assert_not_null(loss, "op %s: %s", th_op_name(op), th_err(ctx));
    int32_t first = th_tlen(ctx);
    cr_assert_eq(kiln_backward(loss), KILN_OK, "op %s: kiln_backward: %s", th_op_name(op),
                 th_err(ctx));
    cr_assert_gt(th_count_ops(ctx, first, th_tlen(ctx), KILN__OP_ASSIGN), 0,
                 "op %s: kiln_backward wrote no gradient into the op's inputs", th_op_name(op));
    unsigned got = reads_of(ctx, &fwd, first, th_tlen(ctx));
    unsigned want = kiln__ops[op].saves;
    if (got != want) {
      char gs[32], ws[32];
      int n = snprintf(bad + k, sizeof bad - k,
                       "\n  %s: saves %u (%s) in ops.def, but its backward rule reads %u (%s)",
                       th_op_name(op), want, mask_str(want, ws, sizeof ws), got,
                       mask_str(got, gs, sizeof gs));
      k = n > 0 && k + (size_t)n < sizeof bad ? k + (size_t)n : sizeof bad - 1;
    }
    checked++;
    th_free_scratch();
    th_ctx_free(ctx);
  }
  cr_log_info("saves checked against the backward rules of %d ops", checked);
  cr_assert_gt(checked, 0);
  cr_assert_str_empty(bad, "ops whose saves differ from what their backward rule reads:%s", bad);
}

/* Each row's kernel family and iteration space agree with its kind; a window op holds its
 * geometry in an int attribute win of KILN__WIN_LEN values, and takes an epilogue exactly when it
 * iterates over windows or the image; the attributes a hand-written kernel reads (FK, UK) are
 * step values of ops without an expression. */
Test(optable, renderers_spaces_and_kernel_attributes) {
  int windows = 0;
  for (int i = 0; i < KILN__OP_COUNT; i++) {
    kiln__op op = (kiln__op)i;
    const kiln__op_info *o = &kiln__ops[op];
    switch (o->kind) {
    case KILN__KIND_EW:
      cr_assert(o->renderer == KILN__RENDER_EW && o->space == KILN__SPACE_OUT, "%s", o->name);
      break;
    case KILN__KIND_UPDATE:
      cr_assert(o->renderer == KILN__RENDER_EW && o->space == KILN__SPACE_IN, "%s", o->name);
      break;
    case KILN__KIND_REDUCE:
      cr_assert(o->renderer == KILN__RENDER_REDUCE && o->space == KILN__SPACE_RED, "%s", o->name);
      break;
    case KILN__KIND_MATMUL:
      cr_assert(o->renderer == KILN__RENDER_BLAS && o->space == KILN__SPACE_MAT, "%s", o->name);
      break;
    case KILN__KIND_VIEW:
      cr_assert(o->renderer == KILN__RENDER_NONE && o->space == KILN__SPACE_NONE, "%s", o->name);
      break;
    case KILN__KIND_LIB:
      cr_assert(o->renderer != KILN__RENDER_NONE && o->renderer != KILN__RENDER_EW &&
                    o->renderer != KILN__RENDER_REDUCE && o->renderer != KILN__RENDER_BLAS,
                "library op %s names a family of its own", o->name);
      break;
    }
    bool window = o->renderer == KILN__RENDER_WINDOW;
    windows += window;
    kiln__attr_kind kind;
    int slot;
    bool has_win = kiln__attr_find(op, "win", 3, &kind, &slot);
    cr_assert_eq(window, has_win, "%s: a window op holds its geometry in win", o->name);
    if (window) {
      cr_assert(kind == KILN__ATTR_I &&
                    o->attrs[kiln__attr_index(op, "win")].count == KILN__WIN_LEN,
                "%s", o->name);
      cr_assert(o->space == KILN__SPACE_COLS || o->space == KILN__SPACE_WINDOWS ||
                    o->space == KILN__SPACE_IMAGE,
                "%s", o->name);
    }
    cr_assert_eq(kiln__takes_epilogue(op),
                 window && (o->space == KILN__SPACE_WINDOWS || o->space == KILN__SPACE_IMAGE), "%s",
                 o->name);
    for (int a = 0; a < o->nattr; a++)
      if (o->attrs[a].kernel)
        cr_assert(!o->expr[0] && o->attrs[a].kind != KILN__ATTR_I,
                  "%s: %s is marked as read by a hand-written kernel", o->name, o->attrs[a].name);
  }
  cr_assert_eq(windows, 6, "im2col, col2im, the pools and their gradients");
  cr_assert_eq(kiln__ops[KILN__OP_COL2IM].space, KILN__SPACE_IMAGE);
  cr_assert_eq(kiln__ops[KILN__OP_MAX_POOL].space, KILN__SPACE_WINDOWS);
  cr_assert_eq(kiln__ops[KILN__OP_IM2COL].space, KILN__SPACE_COLS);
  cr_assert_eq(kiln__ops[KILN__OP_MOMENTS].renderer, KILN__RENDER_MOMENTS);
  cr_assert_eq(kiln__ops[KILN__OP_AUGMENT].renderer, KILN__RENDER_AUGMENT);
  cr_assert_eq(kiln__ops[KILN__OP_RESIZE_CROP].renderer, KILN__RENDER_AUGMENT);
  cr_assert_eq(kiln__ops[KILN__OP_CONCAT].renderer, KILN__RENDER_COPY);
  cr_assert_eq(kiln__ops[KILN__OP_INDEX_ADD].renderer, KILN__RENDER_GATHER);
}

/* The attribute slots a kernel takes, from its expression and its FK/UK marks. */
Test(optable, kernel_slots) {
  const struct {
    kiln__op op;
    int nf, ni, nu;
  } want[] = {
      {KILN__OP_ADD, 0, 0, 0},
      {KILN__OP_CLAMP, 2, 0, 0},
      {KILN__OP_DROPOUT, 2, 0, 2},
      {KILN__OP_ONEHOT, 0, 1, 0},
      {KILN__OP_SGD_MOMENTUM, 5, 1, 0},
      {KILN__OP_ADAM, 7, 1, 0},
      {KILN__OP_SGD_MOMENTUM_GUARDED, 4, 1, 0},
      {KILN__OP_ADAM_GUARDED, 5, 1, 0},
      {KILN__OP_SUM, 1, 0, 0},
      {KILN__OP_ARGMAX, 1, 0, 0},
      {KILN__OP_INDEX_SELECT, 0, 0, 1},
      {KILN__OP_AUGMENT, 0, 0, 3},
      {KILN__OP_MAX_POOL, 0, 0, 0},
      {KILN__OP_BN_APPLY, 0, 0, 0},
      {KILN__OP_RESIZE_CROP, 6, 0, 0},
  };
  for (size_t k = 0; k < sizeof want / sizeof want[0]; k++) {
    int nf, ni, nu;
    kiln__kernel_slots(want[k].op, &nf, &ni, &nu);
    cr_assert(nf == want[k].nf && ni == want[k].ni && nu == want[k].nu,
              "%s: %d float, %d int, %d 64-bit slots; expected %d, %d, %d",
              kiln__ops[want[k].op].name, nf, ni, nu, want[k].nf, want[k].ni, want[k].nu);
  }
}

/* Attributes by name: a window op's groups or exclude_pad, found through the table. */
Test(optable, attributes_by_name) {
  kiln__node n = {.op = KILN__OP_COL2IM};
  KILN__I(&n, COL2IM, groups) = 3;
  cr_assert_eq(KILN__I_NAMED(&n, "groups"), 3);
  const kiln__node *cn = &n;
  cr_assert_eq(KILN__I_NAMED(cn, "groups"), 3);
  kiln__win w = {.kh = 3, .kw = 2, .sh = 1, .sw = 2, .ph = 1, .pw = 0, .dh = 2, .dw = 1};
  memcpy(&KILN__IA(&n, COL2IM, win, 0), &w, sizeof w);
  kiln__win back = kiln__win_of(&n);
  cr_assert_eq(memcmp(&back, &w, sizeof w), 0);
  cr_assert(kiln__has_attr(KILN__OP_AVG_POOL, "exclude_pad"));
  cr_assert(!kiln__has_attr(KILN__OP_MAX_POOL, "exclude_pad"));
}

/* An attribute the op does not have is an assertion, never a silent default. */
Test(optable, a_missing_attribute_by_name_aborts, .signal = SIGABRT) {
  kiln__node n = {.op = KILN__OP_MAX_POOL};
  (void)KILN__I_NAMED(&n, "groups");
}
