/*
 * linear.c: the fully connected layer, y = x W^T + b, initialised as torch.nn.Linear:
 * kaiming_uniform_(a=sqrt(5)) for W, which is U(-1/sqrt(in), 1/sqrt(in)), and the same bound for b.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"

static kiln_tensor *uniform_param(kiln_ctx *ctx, kiln_shape shape, double bound) {
  int64_t n = kiln__numel(shape.ndim, shape.d);
  float *h = malloc((size_t)(n > 0 ? n : 1) * sizeof *h);
  if (!h) {
    kiln__error(ctx, KILN_ERR_OOM, "kiln_linear_init: out of host memory");
    return NULL;
  }
  for (int64_t i = 0; i < n; i++)
    h[i] = (float)((kiln__rng_uniform(ctx) * 2.0 - 1.0) * bound);
  kiln_tensor *t = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, shape, h);
  free(h);
  if (t) kiln_tensor_set_requires_grad(t, 1);
  return t;
}

kiln_status kiln_linear_init(kiln_linear *l, kiln_params *params, const char *name,
                             int64_t in_features, int64_t out_features, int bias) {
  if (!l || !params) return KILN_ERR_INVALID;
  kiln_ctx *ctx = kiln_params_ctx(params);
  if (!kiln__ok(ctx)) return ctx->status;
  memset(l, 0, sizeof *l);
  if (in_features <= 0 || out_features <= 0)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "kiln_linear_init: '%s': in_features %lld and out_features %lld must be > 0",
                       name ? name : "", (long long)in_features, (long long)out_features);
  double bound = 1.0 / sqrt((double)in_features);
  char full[128];
  l->weight = uniform_param(ctx, KILN_SHAPE(out_features, in_features), bound);
  snprintf(full, sizeof full, "%s.weight", name ? name : "linear");
  if (!l->weight || kiln_params_add(params, full, l->weight) != KILN_OK) {
    kiln_tensor_free(l->weight);
    l->weight = NULL;
    return ctx->status;
  }
  if (bias) {
    l->bias = uniform_param(ctx, KILN_SHAPE(out_features), bound);
    snprintf(full, sizeof full, "%s.bias", name ? name : "linear");
    if (!l->bias || kiln_params_add(params, full, l->bias) != KILN_OK) {
      kiln_tensor_free(l->bias);
      l->bias = NULL;
      return ctx->status;
    }
  }
  l->in_features = in_features;
  l->out_features = out_features;
  return KILN_OK;
}

kiln_tensor *kiln_linear_forward(const kiln_linear *l, kiln_tensor *x) {
  if (!l || !l->weight || !x) return NULL;
  kiln_ctx *ctx = kiln_tensor_ctx(x);
  if (ctx && kiln__ok(ctx) && kiln_tensor_dim(x, -1) != l->in_features) {
    char sh[96];
    kiln__error(ctx, KILN_ERR_SHAPE,
                "kiln_linear_forward: input %s, layer '%s' takes %lld features",
                kiln__shape_of(x, sh, sizeof sh), l->weight->name, (long long)l->in_features);
    return NULL;
  }
  kiln_tensor *y = kiln_matmul(x, kiln_transpose(l->weight, 0, 1));
  return l->bias ? kiln_add(y, l->bias) : y;
}
