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

/* The layers' inits with the function their errors name (kiln_seq_* make their layers so). */
kiln_status kiln__linear_make(const char *fn, kiln_linear *l, kiln_params *params,
                              const kiln_linear_options *o);
kiln_status kiln__conv2d_layer_make(const char *fn, kiln_conv2d_layer *l, kiln_params *params,
                                    const kiln_conv2d_layer_options *o);
kiln_status kiln__batch_norm_layer_make(const char *fn, kiln_batch_norm_layer *l,
                                        kiln_params *params,
                                        const kiln_batch_norm_layer_options *o);

#endif
