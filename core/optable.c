/*
 * optable.c: the op table of ops.def as data the planner, renderer and autograd read, and the
 * lookup of attributes by name. The backward rules themselves are autograd's (autograd/backward.c
 * holds them by op); the table only says whether an op has one.
 */
#include <string.h>

#include "internal.h"

/* Whether a row's backward rule is NONE, decided on the token itself: KILN__NOGRAD_##g is a
 * macro ("~, 1") only for g = NONE, which puts 1 second in KILN__SECOND's arguments; any other
 * rule name pastes to an undefined name, one argument, and 0 comes second. */
#define KILN__NOGRAD_NONE ~, 1
#define KILN__SECOND(a, b, ...) b
#define KILN__SECOND_OF(...) KILN__SECOND(__VA_ARGS__)
#define KILN__RULE_IS_NONE(g) KILN__SECOND_OF(KILN__NOGRAD_##g, 0, ~)

#define F(x) {KILN__ATTR_F, #x, 1},
#define I(x) {KILN__ATTR_I, #x, 1},
#define IA(x, n) {KILN__ATTR_I, #x, n},
#define U(x) {KILN__ATTR_U, #x, 1},
const kiln__op_info kiln__ops[KILN__OP_COUNT] = {
#define X(id, nm, n, k, e, s, g, sv, at)                                                           \
  [KILN__OP_##id] = {.name = nm,                                                                   \
                     .nin = n,                                                                     \
                     .kind = KILN__KIND_##k,                                                       \
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
#undef I
#undef IA
#undef U

/* Every op's attributes fit the node's arrays. */
#define X(id, nm, n, k, e, s, g, sv, at)                                                           \
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
