/*
 * test_cpu_optable.c: the op table (core/ops.def) against itself and against the backward rules:
 * names, kinds, expressions and their placeholders, the in-place stores of update ops, and which
 * ops have a backward rule. No GPU needed.
 */
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
  case KILN__OP_FILL:
  case KILN__OP_CAST:
  case KILN__OP_ONEHOT:
  case KILN__OP_ACCUM:
  case KILN__OP_ASSIGN:
  case KILN__OP_SGD:
  case KILN__OP_SGD_MOMENTUM:
  case KILN__OP_ADAM:
  case KILN__OP_ARGMAX:
  case KILN__OP_DETACH:
  case KILN__OP_INDEX_SELECT: return true;
  default: return false;
  }
}

Test(optable, names_are_unique_identifiers) {
  for (int i = 0; i < KILN__OP_COUNT; i++) {
    const char *n = kiln__ops[i].name;
    cr_assert(n && *n, "op %d has no name", i);
    for (const char *p = n; *p; p++)
      cr_assert((*p >= 'a' && *p <= 'z') || *p == '_',
                "op %d's name '%s' is not a lower-case identifier (it names kernels)", i, n);
    for (int j = 0; j < i; j++)
      cr_assert_str_neq(n, kiln__ops[j].name, "ops %d and %d are both named '%s'", j, i, n);
    cr_assert(kiln__ops[i].nin >= 0 && kiln__ops[i].nin <= KILN__MAX_IN, "op %s: nin %d", n,
              kiln__ops[i].nin);
  }
}

/* Checks an expression's placeholders: $N below nin, $fK/$iK/$uK within the attributes. */
static void check_placeholders(const kiln__op_info *o) {
  for (const char *p = o->expr; *p; p++) {
    if (*p != '$') continue;
    char c = p[1];
    if (strncmp(p + 1, "idx", 3) == 0 || c == 'c') {
      continue; /* the linear index, the coordinate along i[7] */
    } else if (c >= '0' && c <= '9') {
      cr_assert(c - '0' < o->nin, "op %s: '%s' reads $%c but has %d inputs", o->name, o->expr, c,
                o->nin);
    } else if (c == 'f' || c == 'i' || c == 'u') {
      int k = p[2] - '0', lim = c == 'f' ? KILN__NF : c == 'i' ? KILN__NI : KILN__NU;
      cr_assert(k >= 0 && k < lim, "op %s: '%s' reads $%c%c beyond its attributes", o->name,
                o->expr, c, p[2]);
    } else {
      cr_assert_fail("op %s: unknown placeholder in '%s'", o->name, o->expr);
    }
  }
}

Test(optable, kinds_expressions_and_stores) {
  int counts[KILN__KIND_LIB + 1] = {0};
  for (int i = 0; i < KILN__OP_COUNT; i++) {
    const kiln__op_info *o = &kiln__ops[i];
    cr_assert_not_null(o->expr, "op %s has a NULL expression", o->name);
    cr_assert_not_null(o->grad, "op %s has a NULL backward rule", o->name);
    counts[o->kind]++;
    switch (o->kind) {
    case KILN__KIND_EW:
      cr_assert(o->expr[0], "elementwise op %s has no expression", o->name);
      cr_assert_eq(o->stores, 0u, "elementwise op %s stores into inputs", o->name);
      check_placeholders(o);
      break;
    case KILN__KIND_UPDATE:
      cr_assert(o->expr[0], "update op %s has no expression", o->name);
      cr_assert_neq(o->stores, 0u, "update op %s stores nothing", o->name);
      cr_assert_eq(o->stores & ~((1u << o->nin) - 1), 0u,
                   "update op %s stores 0x%x beyond its %d inputs", o->name, o->stores, o->nin);
      cr_assert(o->stores & 1u, "update op %s does not write its input 0", o->name);
      cr_assert(!kiln__has_grad((kiln__op)i), "update op %s has a backward rule", o->name);
      check_placeholders(o);
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
  /* the reductions combine with expressions, except argmax whose kernel is special */
  cr_assert_str_eq(kiln__ops[KILN__OP_SUM].expr, "a + b");
  cr_assert_str_empty(kiln__ops[KILN__OP_ARGMAX].expr);
  cr_assert_eq(kiln__ops[KILN__OP_CONCAT].nin, KILN__MAX_IN);
  cr_assert_eq(kiln__ops[KILN__OP_SGD_MOMENTUM].stores, 5u); /* p and the momentum buffer */
  cr_assert_eq(kiln__ops[KILN__OP_ADAM].stores, 13u);        /* p, m and v */
  cr_assert_eq(counts[KILN__KIND_MATMUL], 1, "one matmul row");
  /* the rows of each kind that the planner and the executor special-case */
  const kiln__op reduce[] = {KILN__OP_SUM, KILN__OP_MAX, KILN__OP_ARGMAX};
  const kiln__op views[] = {KILN__OP_RESHAPE, KILN__OP_PERMUTE, KILN__OP_SLICE, KILN__OP_EXPAND,
                            KILN__OP_DETACH};
  const kiln__op updates[] = {KILN__OP_ACCUM, KILN__OP_ASSIGN, KILN__OP_SGD, KILN__OP_SGD_MOMENTUM,
                              KILN__OP_ADAM};
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
