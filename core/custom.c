/*
 * custom.c: custom ops (include/kiln_custom.h). Their options are checked and copied here, the
 * context keeps them in a list (a node names its op by its index there), and kiln_custom records
 * a call: every check first (the callbacks' output and launch included), then the node. The
 * kernel is compiled when the op is made (runtime/custom.c asks the engine), rendered like kiln's
 * own (fusion/render_custom.c), and differentiated by the op's backward (autograd/rules.c).
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define KILN__GRID_X_MAX 2147483647u /* CUDA's limits on a grid */
#define KILN__GRID_YZ_MAX 65535u
#define KILN__BLOCK_MAX 1024

static bool identifier(const char *s, size_t max) {
  size_t n = s ? strlen(s) : 0;
  if (n == 0 || n > max || (s[0] >= '0' && s[0] <= '9')) return false;
  for (size_t k = 0; k < n; k++) {
    char c = s[k];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'))
      return false;
  }
  return true;
}

static char *dup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = malloc(n);
  if (d) memcpy(d, s, n);
  return d;
}

kiln_custom_op *kiln__custom_create(kiln_ctx *ctx, const kiln_custom_op_options *o) {
  static const char fn[] = "kiln_custom_op_new";
  if (!ctx || !kiln__ok(ctx)) return NULL;
  if (!o) return kiln__error(ctx, KILN_ERR_INVALID, "%s: the options are NULL", fn), NULL;
  if (!identifier(o->name, KILN__CUSTOM_NAME_MAX))
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: name '%s' is not an identifier of 1 to %d characters ([A-Za-z_] then "
                       "[A-Za-z0-9_])",
                       fn, o->name ? o->name : "(null)", KILN__CUSTOM_NAME_MAX),
           NULL;
  const char *name = o->name;
  if (!identifier(o->entry, KILN__CUSTOM_ENTRY_MAX) || strncmp(o->entry, "kiln", 4) == 0)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: op '%s': entry '%s' is not an identifier of 1 to %d characters, or "
                       "starts with 'kiln' (kiln's own device functions' prefix)",
                       fn, name, o->entry ? o->entry : "(null)", KILN__CUSTOM_ENTRY_MAX),
           NULL;
  if (!o->source || !o->source[0])
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: op '%s' has no source", fn, name), NULL;
  if (o->nin < 1 || o->nin > KILN_CUSTOM_MAX_IN)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: op '%s': nin %d is outside [1, %d]", fn, name,
                       o->nin, KILN_CUSTOM_MAX_IN),
           NULL;
  if (o->max_block < 0 || o->max_block > KILN__BLOCK_MAX)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: op '%s': max_block %d is outside [0, %d]", fn,
                       name, o->max_block, KILN__BLOCK_MAX),
           NULL;
  if (o->zero_output != 0 && o->zero_output != 1)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: op '%s': zero_output is %d; 0 or 1", fn, name,
                       o->zero_output),
           NULL;
  if (!o->output)
    return kiln__error(ctx, KILN_ERR_INVALID,
                       "%s: op '%s' has no output function (it gives the output's shape)", fn,
                       name),
           NULL;
  kiln_custom_op *op = calloc(1, sizeof *op);
  char *n = dup(o->name), *src = dup(o->source), *entry = dup(o->entry);
  if (!op || !n || !src || !entry) {
    free(op), free(n), free(src), free(entry);
    return kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn), NULL;
  }
  op->ctx = ctx;
  op->id = -1;
  op->o = *o;
  op->o.name = op->name = n;
  op->o.source = op->source = src;
  op->o.entry = op->entry = entry;
  op->max_block = o->max_block ? o->max_block : KILN__CUSTOM_BLOCK;
  return op;
}

bool kiln__custom_register(kiln_custom_op *op) {
  kiln_ctx *ctx = op->ctx;
  if (!KILN__GROW(ctx->customs, ctx->cap_custom, ctx->ncustom + 1))
    return !kiln__error(ctx, KILN_ERR_OOM, "kiln_custom_op_new: out of host memory");
  op->id = ctx->ncustom;
  ctx->customs[ctx->ncustom++] = op;
  return true;
}

void kiln__custom_destroy(kiln_custom_op *op) {
  if (!op) return;
  free(op->name);
  free(op->source);
  free(op->entry);
  free(op);
}

void kiln__customs_free(kiln_ctx *ctx) {
  for (int k = 0; k < ctx->ncustom; k++)
    kiln__custom_destroy(ctx->customs[k]);
  free(ctx->customs);
  ctx->customs = NULL;
  ctx->ncustom = ctx->cap_custom = 0;
}

const kiln_custom_op *kiln__custom_of(const kiln_ctx *ctx, const kiln__node *n) {
  int64_t id = KILN__I(n, CUSTOM, id);
  KILN_ASSERT(id >= 0 && id < ctx->ncustom);
  return ctx->customs[id];
}

const char *kiln_custom_op_name(const kiln_custom_op *op) { return op ? op->o.name : NULL; }

/* "[4,5] f32, [5] bf16" for the call's inputs. */
static const char *describe_inputs(int nin, kiln_tensor *const *in, char *buf, size_t len) {
  size_t k = 0;
  buf[0] = 0;
  for (int q = 0; q < nin && k < len; q++) {
    char sh[96];
    k += (size_t)snprintf(buf + k, len - k, "%s%s %s", q ? ", " : "",
                          kiln__shape_of(in[q], sh, sizeof sh), kiln_dtype_name(in[q]->dtype));
  }
  return buf;
}

/* The call's launch, from the op's launch function or one thread per output element; checked
 * against CUDA's limits and the op's. */
static bool launch_of(const kiln_custom_op *op, const kiln_custom_call *c, const kiln_shape *out,
                      const char *ins, kiln_custom_launch *l) {
  int64_t numel = kiln__numel(out->ndim, out->d);
  kiln_ctx *ctx = op->ctx;
  static const char fn[] = "kiln_custom";
  const char *name = op->o.name;
  memset(l, 0, sizeof *l);
  if (!op->o.launch) {
    int64_t blocks = (numel + op->max_block - 1) / op->max_block;
    if (blocks > KILN__GRID_X_MAX)
      return !kiln__error(ctx, KILN_ERR_SHAPE,
                          "%s: op '%s': an output of %" PRId64 " elements is more than one thread "
                          "each can cover (%" PRId64
                          " blocks of %d); give the op a launch function",
                          fn, name, numel, blocks, op->max_block);
    *l = (kiln_custom_launch){.grid = {(uint32_t)blocks, 1, 1}, .block = (uint32_t)op->max_block};
    return true;
  }
  kiln_status s = op->o.launch(c, out, l);
  if (!kiln__ok(ctx)) return false;
  if (s != KILN_OK)
    return !kiln__error(ctx, s, "%s: op '%s': its launch function returned %s for inputs %s", fn,
                        name, kiln_status_name(s), ins);
  for (int d = 1; d < 3; d++)
    if (l->grid[d] == 0) l->grid[d] = 1;
  if (l->grid[0] < 1 || l->grid[0] > KILN__GRID_X_MAX || l->grid[1] > KILN__GRID_YZ_MAX ||
      l->grid[2] > KILN__GRID_YZ_MAX || l->block < 1 || l->block > (uint32_t)op->max_block ||
      l->smem > op->smem_max)
    return !kiln__error(ctx, KILN_ERR_INVALID,
                        "%s: op '%s': launch grid (%u, %u, %u), block %u, %u bytes of shared "
                        "memory for inputs %s; the grid must be within (2^31 - 1, 65535, 65535) "
                        "and at least 1, the block within [1, %d] (max_block), the shared memory "
                        "at most %u bytes",
                        fn, name, l->grid[0], l->grid[1], l->grid[2], l->block, l->smem, ins,
                        op->max_block, op->smem_max);
  return true;
}

/* t where the kernel can read it in place (contiguous, its first element 16-byte aligned), else
 * a recorded copy. */
static kiln_tensor *readable(kiln_ctx *ctx, kiln_tensor *t) {
  if (kiln__is_contiguous(t) && (t->offset * (int64_t)kiln_dtype_size(t->dtype)) % 16 == 0)
    return t;
  kiln_tensor *c = kiln__tensor_intermediate(ctx, "kiln_custom", t->dtype, t->ndim, t->shape);
  return c && kiln__record(ctx, KILN__OP_COPY, 1, &t, c) ? c : NULL;
}

kiln_tensor *kiln_custom(kiln_custom_op *op, kiln_tensor *const *in, const int64_t *param) {
  static const char fn[] = "kiln_custom";
  if (!op) return NULL;
  kiln_ctx *ctx = op->ctx;
  const char *name = op->o.name;
  int nin = op->o.nin;
  if (!kiln__ok(ctx)) return NULL;
  if (!in)
    return kiln__error(ctx, KILN_ERR_INVALID, "%s: op '%s': in is NULL; the op takes %d inputs", fn,
                       name, nin),
           NULL;
  for (int q = 0; q < nin; q++) {
    if (!in[q])
      return kiln__error(ctx, KILN_ERR_INVALID, "%s: op '%s': input %d of %d is NULL", fn, name, q,
                         nin),
             NULL;
    if (!kiln__check(ctx, in[q], fn)) return NULL;
  }
  int64_t par[KILN_CUSTOM_PARAMS] = {0};
  if (param) memcpy(par, param, sizeof par);
  char ins[512];
  describe_inputs(nin, in, ins, sizeof ins);
  kiln_custom_call c = {.op = op, .nin = nin, .in = in, .param = par, .user = op->o.user};
  kiln_shape shape = {0};
  kiln_dtype dt = KILN_DTYPE_F32;
  kiln_status s = op->o.output(&c, &shape, &dt);
  if (!kiln__ok(ctx)) return NULL;
  if (s != KILN_OK)
    return kiln__error(ctx, s, "%s: op '%s': its output function returned %s for inputs %s", fn,
                       name, kiln_status_name(s), ins),
           NULL;
  if (dt != KILN_DTYPE_F32 && dt != KILN_DTYPE_BF16 && dt != KILN_DTYPE_I32)
    return kiln__error(ctx, KILN_ERR_DTYPE,
                       "%s: op '%s': its output function gave dtype %d for inputs %s; an output is "
                       "f32, bf16 or i32",
                       fn, name, (int)dt, ins),
           NULL;
  if (!kiln__valid_shape(ctx, fn, shape.ndim, shape.d)) return NULL;
  int64_t numel = kiln__numel(shape.ndim, shape.d);
  kiln_custom_launch l = {0};
  if (numel > 0 && !launch_of(op, &c, &shape, ins, &l)) return NULL;
  bool grad = false;
  for (int q = 0; q < nin; q++)
    grad = grad || in[q]->requires_grad;
  if (grad && ctx->no_grad_depth == 0 && !op->o.backward) {
    int q = 0;
    while (!in[q]->requires_grad)
      q++;
    return kiln__error(ctx, KILN_ERR_STATE,
                       "%s: op '%s' has no backward, and input %d (%s) requires grad; give the op "
                       "a backward, or call it under kiln_no_grad_begin or on a detached input",
                       fn, name, q, kiln__name(in[q])),
           NULL;
  }
  kiln_tensor *src[KILN__MAX_IN];
  for (int q = 0; q < nin; q++)
    if (!(src[q] = readable(ctx, in[q]))) return NULL;
  kiln_tensor *out = kiln__tensor_intermediate(ctx, fn, dt, shape.ndim, shape.d);
  kiln__node *n = out ? kiln__record(ctx, KILN__OP_CUSTOM, nin, src, out) : NULL;
  if (!n) return NULL;
  KILN__I(n, CUSTOM, id) = op->id;
  KILN__IA(n, CUSTOM, launch, 0) = l.grid[0];
  KILN__IA(n, CUSTOM, launch, 1) = l.grid[1];
  KILN__IA(n, CUSTOM, launch, 2) = l.grid[2];
  KILN__IA(n, CUSTOM, launch, 3) = l.block;
  KILN__IA(n, CUSTOM, launch, 4) = l.smem;
  for (int k = 0; k < KILN_CUSTOM_PARAMS; k++)
    KILN__IA(n, CUSTOM, param, k) = par[k];
  return out;
}
