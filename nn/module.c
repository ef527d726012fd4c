/*
 * module.c: modules, a C-shaped torch.nn.Sequential. A container's children run in order; each
 * layer added to it names its parameters as PyTorch's state_dict would (child k of the root is
 * "k.weight", of a nested container "features" "features.k.weight"), so that weights go between
 * kiln and a PyTorch model of the same structure unchanged (kiln_params_save / _load). A module
 * only holds its layer (nn/image.c, nn/linear.c) or its children; the parameters are the list's.
 */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "params.h"

typedef enum kind {
  SEQUENTIAL,
  CONV2D,
  BATCH_NORM,
  LINEAR,
  RELU,
  GELU,
  MAX_POOL,
  AVG_POOL,
  GLOBAL_AVG_POOL,
  DROPOUT,
  FLATTEN,
  CUSTOM
} kind;

struct kiln_module {
  kind kind;
  kiln_params *params;
  kiln_module *parent;
  char *prefix; /* the names' start: "" for the root, "features." for a child called features */
  char *key;    /* its name in its parent ("3", "features"); NULL for the root */
  kiln_module **child;
  int nchild, cap;
  union {
    kiln_conv2d_layer conv;
    kiln_batch_norm_layer bn;
    kiln_linear linear;
    kiln_pool2d_options pool;
    kiln_gelu_approx gelu;
    float p; /* dropout */
    struct {
      kiln_module_fn fn;
      void *state;
    } custom;
  } u;
  char *label; /* a custom module's printed name */
};

static kiln_module *make(kiln_params *p, kind k) {
  kiln_module *m = calloc(1, sizeof *m);
  if (m) {
    m->kind = k;
    m->params = p;
  }
  return m;
}

kiln_module *kiln_sequential_new(kiln_params *p) {
  if (!p) return NULL;
  kiln_ctx *ctx = kiln_params_ctx(p);
  if (!kiln__ok(ctx)) return NULL;
  kiln_module *m = make(p, SEQUENTIAL);
  if (m && !(m->prefix = kiln__strf("%s", ""))) {
    free(m);
    m = NULL;
  }
  if (!m) kiln__error(ctx, KILN_ERR_OOM, "kiln_sequential_new: out of host memory");
  return m;
}

static void module_free(kiln_module *m) {
  if (!m) return;
  for (int i = 0; i < m->nchild; i++)
    module_free(m->child[i]);
  free(m->child);
  free(m->prefix);
  free(m->key);
  free(m->label);
  free(m);
}

void kiln_module_free(kiln_module *m) {
  if (!m) return;
  if (m->parent) { /* a child goes with its root */
    kiln__error(kiln_params_ctx(m->params), KILN_ERR_INVALID,
                "kiln_module_free: '%s%s' is a child of a container: free the root (the model "
                "is kept)",
                m->parent->prefix, m->key);
    return;
  }
  module_free(m);
}

/* The next child's key in seq (name, or its index) and its parameters' base name; false with
 * the error set when seq is no container, the key is taken or memory runs out. */
static bool next_names(kiln_module *seq, const char *fn, const char *name, char **key,
                       char **base) {
  kiln_ctx *ctx = kiln_params_ctx(seq->params);
  *key = *base = NULL;
  if (seq->kind != SEQUENTIAL)
    return !kiln__error(ctx, KILN_ERR_INVALID,
                        "%s: layers are added to a container, not to a "
                        "layer",
                        fn);
  if (name && (!*name || strchr(name, '.')))
    return !kiln__error(ctx, KILN_ERR_INVALID,
                        "%s: a child's name '%s' must be nonempty and without '.'", fn, name);
  *key = name ? kiln__strf("%s", name) : kiln__strf("%d", seq->nchild);
  if (*key)
    for (int i = 0; i < seq->nchild; i++)
      if (strcmp(seq->child[i]->key, *key) == 0) {
        kiln__error(ctx, KILN_ERR_INVALID, "%s: the container already has a child '%s%s'", fn,
                    seq->prefix, *key);
        free(*key);
        *key = NULL;
        return false;
      }
  *base = *key ? kiln__strf("%s%s", seq->prefix, *key) : NULL;
  if (!*base || !KILN__GROW(seq->child, seq->cap, seq->nchild + 1)) {
    free(*key);
    free(*base);
    *key = *base = NULL;
    return !kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
  }
  return true;
}

/* Makes a child of kind k in seq, named by name (NULL: its index); init (if any) sets its layer
 * up with the base name of its parameters. NULL with the error set, and seq unchanged. */
static kiln_module *add(kiln_module *seq, const char *fn, kind k, const char *name,
                        kiln_status (*init)(kiln_module *m, const char *base, const void *o),
                        const void *o) {
  if (!seq || !kiln__ok(kiln_params_ctx(seq->params))) return NULL;
  kiln_ctx *ctx = kiln_params_ctx(seq->params);
  char *key, *base;
  if (!next_names(seq, fn, name, &key, &base)) return NULL;
  kiln_module *m = make(seq->params, k);
  if (!m) {
    free(key);
    free(base);
    return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn), NULL;
  }
  m->key = key;
  if (init && init(m, base, o) != KILN_OK) {
    free(base);
    module_free(m);
    return NULL;
  }
  if (k == SEQUENTIAL && !(m->prefix = kiln__strf("%s.", base))) {
    free(base);
    module_free(m);
    return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn), NULL;
  }
  free(base);
  m->parent = seq;
  seq->child[seq->nchild++] = m;
  return m;
}

kiln_module *kiln_seq_sequential(kiln_module *seq, const char *name) {
  return add(seq, __func__, SEQUENTIAL, name, NULL, NULL);
}

/* ---------------------------------------------------------------- layers with parameters */

/* Each layer is made by its init from the same options, named by its place in the tree. */
static kiln_status conv_init(kiln_module *m, const char *base, const void *opt) {
  kiln_conv2d_layer_options o = *(const kiln_conv2d_layer_options *)opt;
  o.name = base;
  return kiln__conv2d_layer_make("kiln_seq_conv2d", &m->u.conv, m->params, &o);
}

kiln_module *kiln_seq_conv2d(kiln_module *seq, const kiln_conv2d_layer_options *o) {
  if (!seq) return NULL;
  if (!o)
    return kiln__error(kiln_params_ctx(seq->params), KILN_ERR_INVALID,
                       "kiln_seq_conv2d: NULL options (in, out and kernel are required)"),
           NULL;
  return add(seq, __func__, CONV2D, o->name, conv_init, o);
}

static kiln_status bn_init(kiln_module *m, const char *base, const void *opt) {
  kiln_batch_norm_layer_options o = *(const kiln_batch_norm_layer_options *)opt;
  o.name = base;
  return kiln__batch_norm_layer_make("kiln_seq_batch_norm", &m->u.bn, m->params, &o);
}

kiln_module *kiln_seq_batch_norm(kiln_module *seq, const kiln_batch_norm_layer_options *o) {
  if (!seq) return NULL;
  if (!o)
    return kiln__error(kiln_params_ctx(seq->params), KILN_ERR_INVALID,
                       "kiln_seq_batch_norm: NULL options (features is required)"),
           NULL;
  return add(seq, __func__, BATCH_NORM, o->name, bn_init, o);
}

static kiln_status linear_init(kiln_module *m, const char *base, const void *opt) {
  kiln_linear_options o = *(const kiln_linear_options *)opt;
  o.name = base;
  return kiln__linear_make("kiln_seq_linear", &m->u.linear, m->params, &o);
}

kiln_module *kiln_seq_linear(kiln_module *seq, const kiln_linear_options *o) {
  if (!seq) return NULL;
  if (!o)
    return kiln__error(kiln_params_ctx(seq->params), KILN_ERR_INVALID,
                       "kiln_seq_linear: NULL options (in and out are required)"),
           NULL;
  return add(seq, __func__, LINEAR, o->name, linear_init, o);
}

/* ---------------------------------------------------------------- layers without */

kiln_module *kiln_seq_relu(kiln_module *seq) { return add(seq, __func__, RELU, NULL, NULL, NULL); }

static kiln_status gelu_init(kiln_module *m, const char *base, const void *o) {
  (void)base;
  m->u.gelu = *(const kiln_gelu_approx *)o;
  return KILN_OK;
}

kiln_module *kiln_seq_gelu(kiln_module *seq, kiln_gelu_approx approx) {
  return add(seq, __func__, GELU, NULL, gelu_init, &approx);
}

static kiln_status pool_init(kiln_module *m, const char *base, const void *o) {
  const kiln_pool2d_options *p = o;
  if (!p || p->kernel_h <= 0 || p->kernel_w <= 0)
    return kiln__error(kiln_params_ctx(m->params), KILN_ERR_INVALID,
                       "kiln_seq_%s_pool2d: '%s': kernel_h %d and kernel_w %d must be > 0",
                       m->kind == MAX_POOL ? "max" : "avg", base, p ? p->kernel_h : 0,
                       p ? p->kernel_w : 0);
  m->u.pool = *p;
  return KILN_OK;
}

kiln_module *kiln_seq_max_pool2d(kiln_module *seq, const kiln_pool2d_options *o) {
  return add(seq, __func__, MAX_POOL, NULL, pool_init, o);
}

kiln_module *kiln_seq_avg_pool2d(kiln_module *seq, const kiln_pool2d_options *o) {
  return add(seq, __func__, AVG_POOL, NULL, pool_init, o);
}

kiln_module *kiln_seq_global_avg_pool2d(kiln_module *seq) {
  return add(seq, __func__, GLOBAL_AVG_POOL, NULL, NULL, NULL);
}

static kiln_status dropout_init(kiln_module *m, const char *base, const void *o) {
  float p = *(const float *)o;
  if (!(p >= 0.f && p < 1.f))
    return kiln__error(kiln_params_ctx(m->params), KILN_ERR_INVALID,
                       "kiln_seq_dropout: '%s': p %g must be in [0, 1)", base, p);
  m->u.p = p;
  return KILN_OK;
}

kiln_module *kiln_seq_dropout(kiln_module *seq, float p) {
  return add(seq, __func__, DROPOUT, NULL, dropout_init, &p);
}

kiln_module *kiln_seq_flatten(kiln_module *seq) {
  return add(seq, __func__, FLATTEN, NULL, NULL, NULL);
}

typedef struct custom_args {
  const char *label;
  kiln_module_fn fn;
  void *state;
} custom_args;

static kiln_status custom_init(kiln_module *m, const char *base, const void *o) {
  const custom_args *a = o;
  kiln_ctx *ctx = kiln_params_ctx(m->params);
  if (!a->fn)
    return kiln__error(ctx, KILN_ERR_INVALID, "kiln_seq_custom: '%s': NULL function", base);
  m->u.custom.fn = a->fn;
  m->u.custom.state = a->state;
  if (!(m->label = kiln__strf("%s", a->label ? a->label : "Custom")))
    return kiln__error(ctx, KILN_ERR_OOM, "kiln_seq_custom: out of host memory");
  return KILN_OK;
}

kiln_module *kiln_seq_custom(kiln_module *seq, const char *label, kiln_module_fn fn, void *state) {
  custom_args a = {label, fn, state};
  return add(seq, __func__, CUSTOM, NULL, custom_init, &a);
}

/* ---------------------------------------------------------------- forward */

kiln_tensor *kiln_module_forward(const kiln_module *m, kiln_tensor *x) {
  if (!m || !x) return NULL;
  switch (m->kind) {
  case SEQUENTIAL:
    for (int i = 0; i < m->nchild && x; i++)
      x = kiln_module_forward(m->child[i], x);
    return x;
  case CONV2D: return kiln_conv2d_layer_forward(&m->u.conv, x);
  case BATCH_NORM: return kiln_batch_norm_layer_forward(&m->u.bn, x);
  case LINEAR: return kiln_linear_forward(&m->u.linear, x);
  case RELU: return kiln_relu(x);
  case GELU: return kiln_gelu(x, m->u.gelu);
  case MAX_POOL: return kiln_max_pool2d(x, &m->u.pool);
  case AVG_POOL: return kiln_avg_pool2d(x, &m->u.pool);
  case GLOBAL_AVG_POOL: return kiln_global_avg_pool2d(x);
  case DROPOUT: return kiln_dropout(x, m->u.p, KILN_TRAINING_MODE);
  case FLATTEN: return kiln_flatten(x);
  case CUSTOM: return m->u.custom.fn(m->u.custom.state, x);
  }
  return NULL;
}

kiln_tensor *kiln_module_call(void *module, kiln_tensor *x) {
  if (!module && x)
    return kiln__error(kiln_tensor_ctx(x), KILN_ERR_INVALID, "kiln_module_call: NULL module"), NULL;
  return kiln_module_forward(module, x);
}

/* ---------------------------------------------------------------- counts and printing */

static int64_t numel(const kiln_tensor *t) { return t ? kiln_tensor_numel(t) : 0; }

int64_t kiln_module_parameters(const kiln_module *m) {
  if (!m) return 0;
  switch (m->kind) {
  case SEQUENTIAL: {
    int64_t n = 0;
    for (int i = 0; i < m->nchild; i++)
      n += kiln_module_parameters(m->child[i]);
    return n;
  }
  case CONV2D: return numel(m->u.conv.weight) + numel(m->u.conv.bias);
  case BATCH_NORM: return numel(m->u.bn.weight) + numel(m->u.bn.bias); /* not the running stats */
  case LINEAR: return numel(m->u.linear.weight) + numel(m->u.linear.bias);
  default: return 0;
  }
}

/* PyTorch's repr of m's layer (not a container's). */
static void describe(const kiln_module *m, kiln__sb *b) {
  switch (m->kind) {
  case CONV2D: {
    const kiln_conv2d_layer *c = &m->u.conv;
    const kiln_conv2d_options *o = &c->opt;
    int sh = o->stride_h ? o->stride_h : 1, sw = o->stride_w ? o->stride_w : 1;
    kiln__sb_printf(b, "Conv2d(%lld, %lld, kernel_size=(%d, %d), stride=(%d, %d)",
                    (long long)c->in_channels, (long long)c->out_channels, c->kernel_h, c->kernel_w,
                    sh, sw);
    if (o->pad_h || o->pad_w) kiln__sb_printf(b, ", padding=(%d, %d)", o->pad_h, o->pad_w);
    if ((o->dilation_h > 1) || (o->dilation_w > 1))
      kiln__sb_printf(b, ", dilation=(%d, %d)", o->dilation_h ? o->dilation_h : 1,
                      o->dilation_w ? o->dilation_w : 1);
    if (o->groups > 1) kiln__sb_printf(b, ", groups=%d", o->groups);
    if (!c->bias) kiln__sb_printf(b, ", bias=False");
    kiln__sb_printf(b, ")");
    break;
  }
  case BATCH_NORM:
    kiln__sb_printf(b,
                    "BatchNorm2d(%lld, eps=%g, momentum=%g, affine=%s, track_running_stats=True)",
                    (long long)m->u.bn.channels, m->u.bn.eps, m->u.bn.momentum,
                    m->u.bn.weight ? "True" : "False");
    break;
  case LINEAR: {
    kiln_shape s = kiln_tensor_shape(m->u.linear.weight);
    kiln__sb_printf(b, "Linear(in_features=%lld, out_features=%lld, bias=%s)", (long long)s.d[1],
                    (long long)s.d[0], m->u.linear.bias ? "True" : "False");
    break;
  }
  case RELU: kiln__sb_printf(b, "ReLU()"); break;
  case GELU:
    kiln__sb_printf(b, "GELU(approximate='%s')", m->u.gelu == KILN_GELU_TANH ? "tanh" : "none");
    break;
  case MAX_POOL:
  case AVG_POOL: {
    /* PyTorch prints a square window's sizes as one number, else as pairs */
    const kiln_pool2d_options *p = &m->u.pool;
    int sh = p->stride_h ? p->stride_h : p->kernel_h, sw = p->stride_w ? p->stride_w : p->kernel_w;
    int dh = p->dilation_h ? p->dilation_h : 1, dw = p->dilation_w ? p->dilation_w : 1;
    bool square = p->kernel_h == p->kernel_w && sh == sw && p->pad_h == p->pad_w && dh == dw;
    kiln__sb_printf(b, "%s(", m->kind == MAX_POOL ? "MaxPool2d" : "AvgPool2d");
    if (square)
      kiln__sb_printf(b, "kernel_size=%d, stride=%d, padding=%d", p->kernel_h, sh, p->pad_h);
    else
      kiln__sb_printf(b, "kernel_size=(%d, %d), stride=(%d, %d), padding=(%d, %d)", p->kernel_h,
                      p->kernel_w, sh, sw, p->pad_h, p->pad_w);
    if (m->kind == MAX_POOL && square)
      kiln__sb_printf(b, ", dilation=%d, ceil_mode=False)", dh);
    else if (m->kind == MAX_POOL)
      kiln__sb_printf(b, ", dilation=(%d, %d), ceil_mode=False)", dh, dw);
    else
      kiln__sb_printf(b, "%s)", p->exclude_pad ? ", count_include_pad=False" : "");
    break;
  }
  case GLOBAL_AVG_POOL: kiln__sb_printf(b, "AdaptiveAvgPool2d(output_size=1)"); break;
  case DROPOUT: kiln__sb_printf(b, "Dropout(p=%g, inplace=False)", m->u.p); break;
  case FLATTEN: kiln__sb_printf(b, "Flatten(start_dim=1, end_dim=-1)"); break;
  case CUSTOM: kiln__sb_printf(b, "%s()", m->label); break;
  case SEQUENTIAL: break;
  }
}

static void print_tree(const kiln_module *m, kiln__sb *b, int depth) {
  if (m->kind != SEQUENTIAL) {
    describe(m, b);
    return;
  }
  if (m->nchild == 0) {
    kiln__sb_printf(b, "Sequential()");
    return;
  }
  kiln__sb_printf(b, "Sequential(\n");
  for (int i = 0; i < m->nchild; i++) {
    kiln__sb_printf(b, "%*s(%s): ", 2 * (depth + 1), "", m->child[i]->key);
    print_tree(m->child[i], b, depth + 1);
    kiln__sb_printf(b, "\n");
  }
  kiln__sb_printf(b, "%*s)", 2 * depth, "");
}

/* A line a parameter of m's tree: its name, shape and elements (batch norm's running statistics
 * are buffers, not listed). */
static void list_params(const kiln_module *m, kiln__sb *b) {
  const kiln_tensor *t[2] = {NULL, NULL};
  switch (m->kind) {
  case SEQUENTIAL:
    for (int i = 0; i < m->nchild; i++)
      list_params(m->child[i], b);
    return;
  case CONV2D: t[0] = m->u.conv.weight, t[1] = m->u.conv.bias; break;
  case BATCH_NORM: t[0] = m->u.bn.weight, t[1] = m->u.bn.bias; break;
  case LINEAR: t[0] = m->u.linear.weight, t[1] = m->u.linear.bias; break;
  default: return;
  }
  for (int j = 0; j < 2; j++)
    if (t[j]) {
      char s[96];
      kiln__sb_printf(b, "  %s%s.%s %s %lld\n", m->parent ? m->parent->prefix : "",
                      m->key ? m->key : "", j ? "bias" : "weight",
                      kiln__shape_of(t[j], s, sizeof s), (long long)numel(t[j]));
    }
}

char *kiln_module_describe(const kiln_module *m) {
  if (!m) return NULL;
  kiln__sb b = {0};
  print_tree(m, &b, 0);
  kiln__sb_printf(&b, "\n");
  list_params(m, &b);
  kiln__sb_printf(&b, "%lld parameters\n", (long long)kiln_module_parameters(m));
  if (b.oom) {
    kiln__sb_free(&b);
    kiln__error(kiln_params_ctx(m->params), KILN_ERR_OOM,
                "kiln_module_describe: out of host memory");
    return NULL;
  }
  return b.s;
}
