/*
 * optable.c: the op table of ops.def as data the planner, renderer and autograd read, the lookup
 * of attributes by name, and the facts the table gives about an op's kernel: the tokens of its
 * expression and which attributes its kernel code reads. The backward rules themselves are
 * autograd's (autograd/backward.c holds them by op); the table only says whether an op has one.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Whether a row's backward rule is NONE, decided on the token itself: KILN__NOGRAD_##g is a
 * macro ("~, 1") only for g = NONE, which puts 1 second in KILN__SECOND's arguments; any other
 * rule name pastes to an undefined name, one argument, and 0 comes second. */
#define KILN__NOGRAD_NONE ~, 1
#define KILN__SECOND(a, b, ...) b
#define KILN__SECOND_OF(...) KILN__SECOND(__VA_ARGS__)
#define KILN__RULE_IS_NONE(g) KILN__SECOND_OF(KILN__NOGRAD_##g, 0, ~)

#define F(x) {KILN__ATTR_F, #x, 1, false},
#define FK(x) {KILN__ATTR_F, #x, 1, true},
#define I(x) {KILN__ATTR_I, #x, 1, false},
#define IA(x, n) {KILN__ATTR_I, #x, n, false},
#define U(x) {KILN__ATTR_U, #x, 1, false},
#define UK(x) {KILN__ATTR_U, #x, 1, true},
const kiln__op_info kiln__ops[KILN__OP_COUNT] = {
#define X(id, nm, n, k, r, sp, e, s, g, sv, at)                                                    \
  [KILN__OP_##id] = {.name = nm,                                                                   \
                     .nin = n,                                                                     \
                     .kind = KILN__KIND_##k,                                                       \
                     .renderer = KILN__RENDER_##r,                                                 \
                     .space = KILN__SPACE_##sp,                                                    \
                     .expr = e,                                                                    \
                     .stores = s,                                                                  \
                     .has_grad = !KILN__RULE_IS_NONE(g),                                           \
                     .saves = sv,                                                                  \
                     .nattr = sizeof((kiln__attr[]){at{0}}) / sizeof(kiln__attr) - 1,              \
                     .attrs = {at}},
#include "ops.def"
#undef X
};
#undef F
#undef FK
#undef I
#undef IA
#undef U
#undef UK

/* Every op's attributes fit the node's arrays. */
#define X(id, nm, n, k, r, sp, e, s, g, sv, at)                                                    \
  _Static_assert(offsetof(kiln__fa_##id, kiln__end_) <= KILN__NF &&                                \
                     offsetof(kiln__ia_##id, kiln__end_) <= KILN__NI &&                            \
                     offsetof(kiln__ua_##id, kiln__end_) <= KILN__NU,                              \
                 "too many attributes for op " #id);
#include "ops.def"
#undef X

#define SAME_LAYOUT(A, B)                                                                          \
  _Static_assert(sizeof(kiln__fa_##A) == sizeof(kiln__fa_##B) &&                                   \
                     offsetof(kiln__fa_##A, scale) == offsetof(kiln__fa_##B, scale) &&             \
                     sizeof(kiln__ia_##A) == sizeof(kiln__ia_##B) &&                               \
                     offsetof(kiln__ia_##A, mask) == offsetof(kiln__ia_##B, mask) &&               \
                     offsetof(kiln__ia_##A, keepdim) == offsetof(kiln__ia_##B, keepdim),           \
                 "reductions " #A " and " #B " must share their attribute layout");
SAME_LAYOUT(SUM, MAX)
SAME_LAYOUT(SUM, ARGMAX)

bool kiln__attr_find(kiln__op op, const char *name, size_t len, kiln__attr_kind *kind, int *slot) {
  const kiln__op_info *info = &kiln__ops[op];
  int next[3] = {0, 0, 0}; /* attributes lie in ops.def's order within each kind */
  for (int a = 0; a < info->nattr; a++) {
    const kiln__attr *at = &info->attrs[a];
    if (strlen(at->name) == len && strncmp(at->name, name, len) == 0) {
      *kind = at->kind;
      *slot = next[at->kind];
      return true;
    }
    next[at->kind] += at->count;
  }
  return false;
}

bool kiln__has_attr(kiln__op op, const char *name) {
  kiln__attr_kind kind;
  int slot;
  return kiln__attr_find(op, name, strlen(name), &kind, &slot);
}

/* The slot of n's int attribute called name. */
static int int_slot(const kiln__node *n, const char *name, const char *file, int line) {
  kiln__attr_kind kind;
  int slot;
  if (!n || !kiln__attr_find(n->op, name, strlen(name), &kind, &slot) || kind != KILN__ATTR_I)
    kiln__assert_fail("an int attribute of the node's op", file, line);
  return slot;
}

float *kiln__attr_f(kiln__node *n, const char *name, const char *file, int line) {
  kiln__attr_kind kind;
  int slot;
  if (!n || !kiln__attr_find(n->op, name, strlen(name), &kind, &slot) || kind != KILN__ATTR_F)
    kiln__assert_fail("a float attribute of the node's op", file, line);
  return &n->f[slot];
}

unsigned kiln__update_scalars(kiln__op op) {
  switch (op) {
  case KILN__OP_SCALE:
  case KILN__OP_FOUND_INF: return 2u;
  case KILN__OP_SGD_GUARDED:
  case KILN__OP_MUON_MOMENTUM_GUARDED:
  case KILN__OP_MUON_GUARDED: return 4u;               /* found */
  case KILN__OP_SCALE_GUARDED: return 2u | 4u;         /* the factor, found */
  case KILN__OP_SGD_MOMENTUM_GUARDED: return 8u | 16u; /* found, count */
  case KILN__OP_ADAM_GUARDED: return 16u | 32u;        /* found, count */
  default: return 0u;
  }
}

int64_t *kiln__attr_i(kiln__node *n, const char *name, const char *file, int line) {
  return &n->i[int_slot(n, name, file, line)];
}

const int64_t *kiln__attr_i_c(const kiln__node *n, const char *name, const char *file, int line) {
  return &n->i[int_slot(n, name, file, line)];
}

int kiln__attr_index(kiln__op op, const char *name) {
  for (int a = 0; a < kiln__ops[op].nattr; a++)
    if (strcmp(kiln__ops[op].attrs[a].name, name) == 0) return a;
  KILN_ASSERT(!"an op without the attribute its kernel reads");
  return -1;
}

static bool ident_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

kiln__token kiln__expr_token(kiln__op op, const char *p) {
  kiln__token t = {0};
  while (ident_char(p[t.len]))
    t.len++;
  KILN_ASSERT(t.len > 0);
  if (p[0] >= '0' && p[0] <= '9') {
    t.kind = KILN__TOK_INPUT;
    t.input = atoi(p);
  } else if (t.len == 3 && strncmp(p, "idx", 3) == 0) {
    t.kind = KILN__TOK_IDX;
  } else if (t.len == 1 && p[0] == 'c') {
    t.kind = KILN__TOK_COORD;
  } else if (t.len == 3 && strncmp(p, "err", 3) == 0) {
    t.kind = KILN__TOK_ERR;
  } else {
    t.kind = KILN__TOK_ATTR;
    const kiln__op_info *info = &kiln__ops[op];
    t.attr = -1;
    for (int a = 0; a < info->nattr && t.attr < 0; a++)
      if (strlen(info->attrs[a].name) == t.len && strncmp(info->attrs[a].name, p, t.len) == 0)
        t.attr = a;
    KILN_ASSERT(t.attr >= 0 && "an expression names an attribute its op does not have");
  }
  return t;
}

void kiln__kernel_attrs(kiln__op op, bool *used) {
  const kiln__op_info *info = &kiln__ops[op];
  memset(used, 0, sizeof(bool) * KILN__MAX_ATTRS);
  for (const char *c = info->expr; *c; c++) {
    if (*c != '$') continue;
    kiln__token t = kiln__expr_token(op, c + 1);
    if (t.kind == KILN__TOK_ATTR) used[t.attr] = true;
    c += t.len;
  }
  for (int a = 0; a < info->nattr; a++)
    used[a] = used[a] || info->attrs[a].kernel;
}

void kiln__kernel_slots(kiln__op op, int *nf, int *ni, int *nu) {
  bool used[KILN__MAX_ATTRS];
  kiln__kernel_attrs(op, used);
  int count[3] = {0, 0, 0}; /* a kernel reads an attribute through one slot */
  for (int a = 0; a < kiln__ops[op].nattr; a++)
    if (used[a]) count[kiln__ops[op].attrs[a].kind]++;
  *nf = count[KILN__ATTR_F];
  *ni = count[KILN__ATTR_I];
  *nu = count[KILN__ATTR_U];
}

kiln__node *kiln__node_of(kiln__node *n, kiln__op op, const char *file, int line) {
  if (!n || n->op != op) kiln__assert_fail("node of the accessor's op", file, line);
  return n;
}

const kiln__node *kiln__node_of_c(const kiln__node *n, kiln__op op, const char *file, int line) {
  if (!n || n->op != op) kiln__assert_fail("node of the accessor's op", file, line);
  return n;
}

kiln__node *kiln__red_of(kiln__node *n, const char *file, int line) {
  if (!n || kiln__ops[n->op].kind != KILN__KIND_REDUCE)
    kiln__assert_fail("a reduction", file, line);
  return n;
}

const kiln__node *kiln__red_of_c(const kiln__node *n, const char *file, int line) {
  if (!n || kiln__ops[n->op].kind != KILN__KIND_REDUCE)
    kiln__assert_fail("a reduction", file, line);
  return n;
}
