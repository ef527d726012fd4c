/*
 * params.h: what nn/'s layers need of a parameter list beyond kiln.h.
 */
#ifndef KILN_PARAMS_H
#define KILN_PARAMS_H

#include "../core/internal.h"

/* Removes the last parameter added and frees its tensor (a layer's init undoing itself). */
void kiln__params_pop(kiln_params *p);

/* A persistent f32 tensor of shape, U(-bound, bound) from the context's RNG, requiring grad;
 * NULL with an error naming fn. */
kiln_tensor *kiln__uniform_param(kiln_ctx *ctx, const char *fn, kiln_shape shape, double bound);
/* A persistent f32 tensor of shape filled with value. */
kiln_tensor *kiln__full_param(kiln_ctx *ctx, const char *fn, kiln_shape shape, float value);

#endif
