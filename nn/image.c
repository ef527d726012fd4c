/*
 * image.c: the layers beyond linear: convolution (torch.nn.Conv2d's init), batch norm (its
 * running statistics are buffers), layer norm, and embedding (torch.nn.Embedding). Each init adds
 * all of its tensors to the list or none of them.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "params.h"

/* A layer's tensor to add: its name suffix, the tensor, whether it is a buffer. */
typedef struct member {
  const char *suffix;
  kiln_tensor *t;
  bool buffer;
} member;

/* Adds "base.suffix" for each of the n members (NULL tensors skipped), or, when any name is
 * taken or a tensor is missing, nothing: what was made is freed. */
static kiln_status add_all(kiln_params *params, const char *fn, const char *base, member *m, int n,
                           bool made) {
  kiln_ctx *ctx = kiln_params_ctx(params);
  char *names[4] = {0};
  KILN_ASSERT(n <= 4);
  for (int i = 0; i < n && made && kiln__ok(ctx); i++) {
    names[i] = kiln__strf("%s.%s", base, m[i].suffix);
    if (!names[i])
      kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
    else if (m[i].t && kiln_params_find(params, names[i]))
      kiln__error(ctx, KILN_ERR_INVALID, "%s: the name '%s' is taken", fn, names[i]);
  }
  int added = 0;
  bool ok = made && kiln__ok(ctx);
  for (int i = 0; i < n && ok; i++) {
    if (!m[i].t) continue;
    kiln_status s = m[i].buffer ? kiln_params_add_buffer(params, names[i], m[i].t)
                                : kiln_params_add(params, names[i], m[i].t);
    if (s != KILN_OK)
      ok = false;
    else {
      m[i].t = NULL; /* the list owns it */
      added++;
    }
  }
  if (!ok)
    while (added-- > 0)
      kiln__params_pop(params);
  for (int i = 0; i < n; i++) {
    if (!ok) kiln_tensor_free(m[i].t);
    free(names[i]);
  }
  if (!ok && kiln__ok(ctx)) kiln__error(ctx, KILN_ERR_OOM, "%s: out of memory", fn);
  return ok ? KILN_OK : ctx->status;
}

static const char *base_of(const char *name, const char *dflt) {
  return name && *name ? name : dflt;
}

/* ---------------------------------------------------------------- convolution */

/* One axis of a square option (kernel, stride, padding, dilation): the axis's field when set,
 * else the square one's; false with the error set when either is negative, or both are set and
 * differ. */
static bool axis_of(kiln_ctx *ctx, const char *fn, const char *base, const char *sq_name, int sq,
                    const char *ax_name, int ax, int *out) {
  if (sq < 0 || ax < 0)
    return !kiln__error(ctx, KILN_ERR_INVALID, "%s: '%s': %s %d must be >= 0", fn, base,
                        sq < 0 ? sq_name : ax_name, sq < 0 ? sq : ax);
  if (sq && ax && sq != ax)
    return !kiln__error(ctx, KILN_ERR_INVALID,
                        "%s: '%s': %s %d and %s %d disagree (set one, or both the same)", fn, base,
                        sq_name, sq, ax_name, ax);
  *out = ax ? ax : sq;
  return true;
}

kiln_status kiln__conv2d_layer_make(const char *fn, kiln_conv2d_layer *l, kiln_params *params,
                                    const kiln_conv2d_layer_options *o) {
  if (!l || !params) return KILN_ERR_INVALID;
  kiln_ctx *ctx = kiln_params_ctx(params);
  if (!kiln__ok(ctx)) return ctx->status;
  memset(l, 0, sizeof *l);
  if (!o)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL options (in, out and kernel are required)",
                       fn);
  const char *base = base_of(o->name, "conv");
  int kernel_h = 0, kernel_w = 0;
  kiln_conv2d_options opt = {.groups = o->groups};
  if (!axis_of(ctx, fn, base, "kernel", o->kernel, "kernel_h", o->kernel_h, &kernel_h) ||
      !axis_of(ctx, fn, base, "kernel", o->kernel, "kernel_w", o->kernel_w, &kernel_w) ||
      !axis_of(ctx, fn, base, "stride", o->stride, "stride_h", o->stride_h, &opt.stride_h) ||
      !axis_of(ctx, fn, base, "stride", o->stride, "stride_w", o->stride_w, &opt.stride_w) ||
      !axis_of(ctx, fn, base, "padding", o->padding, "pad_h", o->pad_h, &opt.pad_h) ||
      !axis_of(ctx, fn, base, "padding", o->padding, "pad_w", o->pad_w, &opt.pad_w) ||
      !axis_of(ctx, fn, base, "dilation", o->dilation, "dilation_h", o->dilation_h,
               &opt.dilation_h) ||
      !axis_of(ctx, fn, base, "dilation", o->dilation, "dilation_w", o->dilation_w,
               &opt.dilation_w) ||
      !kiln__flag_ok(ctx, fn, base, "no_bias", o->no_bias))
    return ctx->status;
  int64_t in_channels = o->in, out_channels = o->out, groups = o->groups ? o->groups : 1;
  int bias = !o->no_bias;
  if (in_channels <= 0 || out_channels <= 0 || kernel_h <= 0 || kernel_w <= 0)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: '%s': in %lld, out %lld, kernel %d x %d: the channels and the kernel "
                       "are required, > 0",
                       fn, base, (long long)in_channels, (long long)out_channels, kernel_h,
                       kernel_w);
  if (groups < 0)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: '%s': groups %d must be >= 0", fn, base,
                       o->groups);
  if (in_channels % groups || out_channels % groups)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: '%s': in %lld and out %lld must be multiples of groups %lld", fn, base,
                       (long long)in_channels, (long long)out_channels, (long long)groups);
  int64_t cg = in_channels / groups;
  double bound = 1.0 / sqrt((double)cg * kernel_h * kernel_w); /* 1 / sqrt(fan_in) */
  member m[2] = {{"weight", NULL, false}, {"bias", NULL, false}};
  m[0].t = kiln__uniform_param(ctx, fn, KILN_SHAPE(out_channels, cg, kernel_h, kernel_w), bound);
  if (m[0].t && bias) m[1].t = kiln__uniform_param(ctx, fn, KILN_SHAPE(out_channels), bound);
  kiln_tensor *w = m[0].t, *b = m[1].t;
  kiln_status s = add_all(params, fn, base, m, 2, w && (!bias || b));
  if (s != KILN_OK) return s;
  l->weight = w;
  l->bias = b;
  l->in_channels = in_channels;
  l->out_channels = out_channels;
  l->kernel_h = kernel_h;
  l->kernel_w = kernel_w;
  l->opt = opt;
  return KILN_OK;
}

kiln_status kiln_conv2d_layer_init(kiln_conv2d_layer *l, kiln_params *params,
                                   const kiln_conv2d_layer_options *o) {
  return kiln__conv2d_layer_make(__func__, l, params, o);
}

/* Whether layer l (with its weight) may run: an error naming fn otherwise. */
static bool layer_ok(kiln_ctx *ctx, const char *fn, const void *l, const kiln_tensor *weight,
                     const char *init) {
  if (l && weight) return true;
  if (ctx && kiln__ok(ctx))
    kiln__error(ctx, KILN_ERR_INVALID, "%s: %s", fn,
                !l ? "NULL layer" : init); /* a layer that was never (successfully) made */
  return false;
}

kiln_tensor *kiln_conv2d_layer_forward(const kiln_conv2d_layer *l, kiln_tensor *x) {
  const char *fn = __func__;
  kiln_ctx *ctx = kiln_tensor_ctx(x);
  if (!x || !layer_ok(ctx, fn, l, l ? l->weight : NULL,
                      "the layer has no weight (was kiln_conv2d_layer_init called, and did it "
                      "succeed?)"))
    return NULL;
  if (kiln__ok(ctx) && (kiln_tensor_ndim(x) != 4 || kiln_tensor_dim(x, 3) != l->in_channels)) {
    char sh[96];
    kiln__error(ctx, KILN_ERR_SHAPE,
                "%s: input %s; layer '%s' takes (N, H, W, %lld) images (channels last)", fn,
                kiln__shape_of(x, sh, sizeof sh), kiln__name(l->weight), (long long)l->in_channels);
    return NULL;
  }
  return kiln_conv2d(x, l->weight, l->bias, &l->opt);
}

/* ---------------------------------------------------------------- batch norm */

#define KILN__BN_MOMENTUM 0.1f /* PyTorch's defaults */
#define KILN__NORM_EPS 1e-5f

/* A norm layer's eps by the header's rule (0: 1e-5, KILN_ZERO: 0); false with the error set
 * when it is negative or NAN. */
static bool eps_of(kiln_ctx *ctx, const char *fn, const char *base, float given, float *eps) {
  *eps = kiln__opt_or(given, KILN__NORM_EPS);
  if (*eps >= 0.f) return true;
  return !kiln__error(ctx, KILN_ERR_INVALID, "%s: '%s': eps %g must be >= 0", fn, base, given);
}

kiln_status kiln__batch_norm_layer_make(const char *fn, kiln_batch_norm_layer *l,
                                        kiln_params *params,
                                        const kiln_batch_norm_layer_options *o) {
  if (!l || !params) return KILN_ERR_INVALID;
  kiln_ctx *ctx = kiln_params_ctx(params);
  if (!kiln__ok(ctx)) return ctx->status;
  memset(l, 0, sizeof *l);
  if (!o) return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL options (features is required)", fn);
  const char *base = base_of(o->name, "bn");
  int64_t channels = o->features;
  int affine = !o->no_affine;
  float momentum = kiln__opt_or(o->momentum, KILN__BN_MOMENTUM), eps;
  if (channels <= 0)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: '%s': features %lld must be > 0", fn, base,
                       (long long)channels);
  if (!(momentum >= 0.f && momentum <= 1.f))
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: '%s': momentum %g must be in [0, 1]", fn, base,
                       o->momentum);
  if (!eps_of(ctx, fn, base, o->eps, &eps) ||
      !kiln__flag_ok(ctx, fn, base, "no_affine", o->no_affine))
    return ctx->status;
  kiln_shape c = KILN_SHAPE(channels);
  member m[4] = {{"weight", NULL, false},
                 {"bias", NULL, false},
                 {"running_mean", NULL, true},
                 {"running_var", NULL, true}};
  bool made = true;
  if (affine) {
    made = (m[0].t = kiln__full_param(ctx, fn, c, 1.f)) &&
           (m[1].t = kiln__full_param(ctx, fn, c, 0.f));
  }
  made = made && (m[2].t = kiln__full_param(ctx, fn, c, 0.f)) &&
         (m[3].t = kiln__full_param(ctx, fn, c, 1.f));
  kiln_tensor *t[4] = {m[0].t, m[1].t, m[2].t, m[3].t};
  kiln_status s = add_all(params, fn, base, m, 4, made);
  if (s != KILN_OK) return s;
  l->weight = t[0];
  l->bias = t[1];
  l->running_mean = t[2];
  l->running_var = t[3];
  l->channels = channels;
  l->momentum = momentum;
  l->eps = eps;
  return KILN_OK;
}

kiln_status kiln_batch_norm_layer_init(kiln_batch_norm_layer *l, kiln_params *params,
                                       const kiln_batch_norm_layer_options *o) {
  return kiln__batch_norm_layer_make(__func__, l, params, o);
}

kiln_tensor *kiln_batch_norm_layer_forward(const kiln_batch_norm_layer *l, kiln_tensor *x) {
  const char *fn = __func__;
  kiln_ctx *ctx = kiln_tensor_ctx(x);
  if (!x || !layer_ok(ctx, fn, l, l ? l->running_mean : NULL,
                      "the layer has no statistics (was kiln_batch_norm_layer_init called, and "
                      "did it succeed?)"))
    return NULL;
  /* the struct holds the values in use: an exact 0 is passed on as one */
  return kiln_batch_norm(x, l->weight, l->bias, l->running_mean, l->running_var, kiln_training(ctx),
                         l->momentum == 0.f ? KILN_ZERO : l->momentum,
                         l->eps == 0.f ? KILN_ZERO : l->eps);
}

/* ---------------------------------------------------------------- layer norm */

kiln_status kiln_layer_norm_layer_init(kiln_layer_norm_layer *l, kiln_params *params,
                                       const kiln_layer_norm_layer_options *o) {
  const char *fn = __func__;
  if (!l || !params) return KILN_ERR_INVALID;
  kiln_ctx *ctx = kiln_params_ctx(params);
  if (!kiln__ok(ctx)) return ctx->status;
  memset(l, 0, sizeof *l);
  if (!o) return kiln__error(ctx, KILN_ERR_INVALID, "%s: NULL options (features is required)", fn);
  const char *base = base_of(o->name, "ln");
  int64_t channels = o->features;
  float eps;
  if (channels <= 0)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: '%s': features %lld must be > 0", fn, base,
                       (long long)channels);
  if (!eps_of(ctx, fn, base, o->eps, &eps)) return ctx->status;
  kiln_shape c = KILN_SHAPE(channels);
  member m[2] = {{"weight", NULL, false}, {"bias", NULL, false}};
  bool made =
      (m[0].t = kiln__full_param(ctx, fn, c, 1.f)) && (m[1].t = kiln__full_param(ctx, fn, c, 0.f));
  kiln_tensor *w = m[0].t, *b = m[1].t;
  kiln_status s = add_all(params, fn, base, m, 2, made);
  if (s != KILN_OK) return s;
  l->weight = w;
  l->bias = b;
  l->channels = channels;
  l->eps = eps;
  return KILN_OK;
}

kiln_tensor *kiln_layer_norm_layer_forward(const kiln_layer_norm_layer *l, kiln_tensor *x) {
  const char *fn = __func__;
  kiln_ctx *ctx = kiln_tensor_ctx(x);
  if (!x || !layer_ok(ctx, fn, l, l ? l->weight : NULL,
                      "the layer has no weight (was kiln_layer_norm_layer_init called, and did it "
                      "succeed?)"))
    return NULL;
  return kiln_layer_norm(x, l->weight, l->bias, l->eps == 0.f ? KILN_ZERO : l->eps);
}

/* ---------------------------------------------------------------- embedding */

kiln_status kiln_embedding_init(kiln_embedding *e, kiln_params *params,
                                const kiln_embedding_options *o) {
  const char *fn = __func__;
  if (!e || !params) return KILN_ERR_INVALID;
  kiln_ctx *ctx = kiln_params_ctx(params);
  if (!kiln__ok(ctx)) return ctx->status;
  memset(e, 0, sizeof *e);
  if (!o)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: NULL options (num_embeddings and dim are required)", fn);
  const char *base = base_of(o->name, "embedding");
  int64_t num_embeddings = o->num_embeddings, dim = o->dim;
  if (num_embeddings <= 0 || dim <= 0)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: '%s': num_embeddings %lld and dim %lld must be > 0", fn, base,
                       (long long)num_embeddings, (long long)dim);
  member m[1] = {{"weight", NULL, false}};
  m[0].t = kiln__full_param(ctx, fn, KILN_SHAPE(num_embeddings, dim), 0.f);
  if (m[0].t && kiln_init_normal(m[0].t, 0.f, 1.f) != KILN_OK) { /* torch's N(0, 1) */
    kiln_tensor_free(m[0].t);
    return ctx->status;
  }
  kiln_tensor *w = m[0].t;
  kiln_status s = add_all(params, fn, base, m, 1, w != NULL);
  if (s != KILN_OK) return s;
  e->weight = w;
  e->num_embeddings = num_embeddings;
  e->dim = dim;
  return KILN_OK;
}

kiln_tensor *kiln_embedding_forward(const kiln_embedding *e, kiln_tensor *idx) {
  const char *fn = __func__;
  kiln_ctx *ctx = kiln_tensor_ctx(idx);
  if (!idx || !layer_ok(ctx, fn, e, e ? e->weight : NULL,
                        "the layer has no weight (was kiln_embedding_init called, and did it "
                        "succeed?)"))
    return NULL;
  kiln_shape out = kiln_tensor_shape(idx);
  if (out.ndim >= KILN_MAX_DIMS) {
    char sh[96];
    kiln_shape_str(out, sh, sizeof sh);
    kiln__error(ctx, KILN_ERR_SHAPE, "%s: indices %s have too many dims to add one", fn, sh);
    return NULL;
  }
  out.d[out.ndim++] = e->dim;
  kiln_tensor *flat = kiln_reshape(idx, KILN_SHAPE(kiln_tensor_numel(idx)));
  return kiln_reshape(kiln_index_select(e->weight, flat), out);
}
