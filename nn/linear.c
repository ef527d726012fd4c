/*
 * linear.c: the fully connected layer, y = x W^T + b, initialised as torch.nn.Linear:
 * kaiming_uniform_(a=sqrt(5)) for W, which is U(-1/sqrt(in), 1/sqrt(in)), and the same bound for b.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "params.h"

kiln_status kiln__linear_make(const char *fn, kiln_linear *l, kiln_params *params,
                              const kiln_linear_options *o) {
  if (!l || !params) return KILN_ERR_INVALID;
  kiln_ctx *ctx = kiln_params_ctx(params);
  if (!kiln__ok(ctx)) return ctx->status;
  memset(l, 0, sizeof *l);
  if (!o)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL options (in and out are required)", fn);
  const char *base = o->name && *o->name ? o->name : "linear"; /* as the layers of image.c */
  int64_t in_features = o->in, out_features = o->out;
  int bias = !o->no_bias;
  if (in_features <= 0 || out_features <= 0)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: '%s': in %lld and out %lld must be > 0", fn,
                       base, (long long)in_features, (long long)out_features);
  if (!kiln__flag_ok(ctx, fn, base, "no_bias", o->no_bias)) return ctx->status;
  double bound = 1.0 / sqrt((double)in_features);
  size_t len = strlen(base) + 8;
  char *wname = malloc(len), *bname = malloc(len);
  if (!wname || !bname) {
    free(wname);
    free(bname);
    return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  }
  snprintf(wname, len, "%s.weight", base);
  snprintf(bname, len, "%s.bias", base);
  /* nothing is added to the list unless both parameters are made and their names are free */
  if (kiln_params_find(params, wname) || (bias && kiln_params_find(params, bname)))
    kiln__error(ctx, KILN_ERR_INVALID, "%s: the name '%s' is taken", fn,
                kiln_params_find(params, wname) ? wname : bname);
  kiln_tensor *w = kiln__ok(ctx)
                       ? kiln__uniform_param(ctx, fn, KILN_SHAPE(out_features, in_features), bound)
                       : NULL;
  kiln_tensor *b = w && bias ? kiln__uniform_param(ctx, fn, KILN_SHAPE(out_features), bound) : NULL;
  if (w && (!bias || b) && kiln_params_add(params, wname, w) == KILN_OK) {
    if (!b || kiln_params_add(params, bname, b) == KILN_OK) {
      l->weight = w;
      l->bias = b;
      l->in_features = in_features;
      l->out_features = out_features;
      free(wname);
      free(bname);
      return KILN_OK;
    }
    kiln__params_pop(params); /* the weight, which the list now owns */
  }
  kiln_tensor_free(w);
  kiln_tensor_free(b);
  free(wname);
  free(bname);
  return ctx->status;
}

kiln_status kiln_linear_init(kiln_linear *l, kiln_params *params, const kiln_linear_options *o) {
  return kiln__linear_make(__func__, l, params, o);
}

kiln_tensor *kiln_linear_forward(const kiln_linear *l, kiln_tensor *x) {
  kiln_ctx *ctx = kiln_tensor_ctx(x);
  if (!l || !l->weight || !x) {
    if (ctx && kiln__ok(ctx))
      kiln__error(ctx, KILN_ERR_INVALID, "kiln_linear_forward: %s",
                  !l ? "NULL layer"
                     : "the layer has no weight (was "
                       "kiln_linear_init called, and did it succeed?)");
    return NULL;
  }
  if (ctx && kiln__ok(ctx) && kiln_tensor_dim(x, -1) != l->in_features) {
    char sh[96];
    kiln__error(ctx, KILN_ERR_SHAPE,
                "kiln_linear_forward: input %s, layer '%s' takes %lld features",
                kiln__shape_of(x, sh, sizeof sh), kiln__name(l->weight), (long long)l->in_features);
    return NULL;
  }
  kiln_tensor *y = kiln_matmul(x, kiln_transpose(l->weight, 0, 1));
  /* a bf16 product (an autocast region) adds the bias in bf16, as torch.autocast's linear */
  return l->bias && y ? kiln_add(y, kiln_cast(l->bias, y->dtype)) : y;
}
