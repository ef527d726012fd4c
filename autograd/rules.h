/*
 * rules.h: autograd's backward rules (autograd/rules.c), one per ops.def row that names one, and
 * the table by op that kiln_backward calls them through (autograd/backward.c). A rule records the
 * gradients of node n's inputs from g, the gradient of its output, into gin (NULL where an input
 * needs none), with the ordinary op functions.
 */
#ifndef KILN_RULES_H
#define KILN_RULES_H

#include "../core/internal.h"

typedef struct kiln__bw kiln__bw; /* a backward walk (autograd/backward.c) */
typedef void (*kiln__grad_fn)(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin);

#define X(id, name, nin, kind, renderer, space, expr, stores, grad, saves, attrs)                  \
  void kiln__grad_##grad(kiln__bw *b, const kiln__node *n, kiln_tensor *g, kiln_tensor **gin);
#include "../core/ops.def"
#undef X

/* Sums g over the axes that broadcasting added or stretched, so that it has shape s. */
kiln_tensor *kiln__unbroadcast(kiln_tensor *g, int ndim, const int64_t *shape);

#endif
