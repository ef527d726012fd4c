/*
 * anomaly.c: anomaly mode (kiln_set_anomaly, KILN_DEBUG=nan). Its flushes are planned unfused
 * (exec.c) and run eagerly (the runtime bypasses step graphs), so that every node's values reach
 * memory. After each launch, a check kernel (device/anomaly.cuh) scans the values its nodes
 * wrote and records the first node that wrote a NaN or an Inf in a record on the device; the host
 * reads it before every in-place update and at the end of the flush, and stops there with an
 * error naming the node, the function that recorded it, and which of its inputs already held such
 * values (a second scan, once it is found). Infinities that descend from a constant of the step
 * (a fill of -inf, a mask) are allowed: each node's byte in allow[] says whether its values held
 * such infinities, and ended flushes leave theirs to later ones of the step in held[].
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "../core/cuda_check.h"
#include "render.h" /* kiln__grid_for */

#define NREC (1 + KILN__MAX_IN) /* the flush's record, then one per input scanned after it */

struct kiln__anomaly {
  kiln__kernel *check;    /* k_anomaly_check */
  kiln__anomaly_rec *rec; /* device: NREC records */
  unsigned char *allow;   /* device: one byte per node of the flush */
  int32_t allow_cap;
  unsigned char *held; /* host: one byte per trace node of flushes that ended */
  int32_t held_cap;
  uint64_t gen; /* the step generation held[] is of */
};

static const char check_source[] = "#include \"prelude.cuh\"\n#include \"anomaly.cuh\"\n";

bool kiln__anomaly_kernel(kiln_ctx *ctx) {
  kiln__fusion *fs = ctx->fusion_state;
  if (!fs->anomaly && !(fs->anomaly = calloc(1, sizeof *fs->anomaly)))
    return !kiln__error(ctx, KILN_ERR_OOM, "kiln_flush: out of host memory");
  kiln__anomaly *an = fs->anomaly;
  if (!an->check)
    an->check = kiln__compile(ctx, "k_anomaly_check", check_source,
                              "// anomaly mode: a node's written values scanned for NaN and Inf\n",
                              false, 0);
  return an->check != NULL;
}

void kiln__anomaly_free(kiln_ctx *ctx) {
  kiln__anomaly *an = ctx->fusion_state->anomaly;
  if (!an) return;
  if (an->rec) cudaFree(an->rec);
  if (an->allow) cudaFree(an->allow);
  free(an->held);
  free(an);
  ctx->fusion_state->anomaly = NULL;
}

bool kiln__anomaly_begin(kiln_ctx *ctx, const kiln__program *pg) {
  if (!kiln__anomaly_kernel(ctx)) return false;
  kiln__anomaly *an = ctx->fusion_state->anomaly;
  int32_t nodes = pg->plan.last - pg->plan.first;
  if (!an->rec && KILN_CUDA_FAILED(ctx, cudaMalloc((void **)&an->rec, NREC * sizeof *an->rec)))
    return false;
  if (nodes > an->allow_cap) {
    if (an->allow) cudaFree(an->allow);
    an->allow = NULL;
    an->allow_cap = 0;
    if (KILN_CUDA_FAILED(ctx, cudaMalloc((void **)&an->allow, (size_t)nodes * 2))) return false;
    an->allow_cap = nodes * 2;
  }
  if (ctx->trace.n > an->held_cap) {
    unsigned char *h = realloc(an->held, (size_t)ctx->trace.cap);
    if (!h) return !kiln__error(ctx, KILN_ERR_OOM, "kiln_flush: out of host memory");
    memset(h + an->held_cap, 0, (size_t)(ctx->trace.cap - an->held_cap));
    an->held = h;
    an->held_cap = ctx->trace.cap;
  }
  if (an->held && (an->gen != ctx->gen || pg->plan.first == 0)) /* a new step: nothing held */
    memset(an->held, 0, (size_t)an->held_cap);
  an->gen = ctx->gen;
  cudaStream_t stream = ctx->stream;
  return !KILN_CUDA_FAILED(ctx, cudaMemsetAsync(an->rec, 0xff, NREC * sizeof *an->rec, stream)) &&
         !KILN_CUDA_FAILED(ctx, cudaMemsetAsync(an->allow, 0, (size_t)an->allow_cap, stream));
}

/* Queues the check of the values in t's memory (a view's whole storage) into record rec as node
 * tag's; slot: the node's byte in allow[] (-1: none), ok: infinities allowed, ins: the bytes of
 * its inputs of the flush (n of them). An output or an updated tensor is its whole storage. */
static bool launch_check(kiln_ctx *ctx, const kiln_tensor *t, int rec, int64_t tag, int slot,
                         bool ok, const int32_t *ins, int n) {
  if (!kiln__is_float(t->dtype) || !t->st->ptr) return true;
  int64_t count = (int64_t)((t->st->bytes - t->st->tail) / kiln_dtype_size(t->dtype));
  if (count == 0) return true;
  kiln__anomaly *an = ctx->fusion_state->anomaly;
  kiln__kargs a;
  memset(&a, 0, sizeof a);
  a.ptr[0] = t->st->ptr;
  a.ptr[1] = an->rec + rec;
  a.ptr[2] = an->allow;
  a.n = count;
  a.nred = tag;
  a.i[0] = t->dtype == KILN_DTYPE_BF16;
  a.i[1] = slot;
  a.i[2] = ok;
  a.i[3] = n;
  for (int q = 0; q < n; q++)
    a.st[q / KILN__KMAX_DIMS][q % KILN__KMAX_DIMS] = ins[q];
  kiln__target target = {.num_sms = ctx->num_sms};
  dim3 grid = {kiln__grid_for(&target, count), 1, 1}, block = {KILN__BLOCK, 1, 1};
  void *params[1] = {&a};
  return !KILN_CUDA_FAILED(
      ctx, cudaLaunchKernel(kiln__kernel_fn(an->check), grid, block, params, 0, ctx->stream));
}

/* The checks of node i, whose last launch has been queued: its output, or the inputs an update
 * writes in place (infinities are never allowed there: persistent state must stay finite). */
static bool check_node(kiln_ctx *ctx, const kiln__plan *p, int32_t i) {
  const kiln__node *n = &ctx->trace.nodes[i];
  const kiln__op_info *info = &kiln__ops[n->op];
  if (info->kind == KILN__KIND_UPDATE) {
    for (int q = 0; q < n->nin; q++)
      if ((info->stores >> q & 1u) && !launch_check(ctx, n->in[q], 0, i, -1, false, NULL, 0))
        return false;
    return true;
  }
  if (!n->out || info->kind == KILN__KIND_VIEW || !p->store[i - p->first]) return true;
  int32_t ins[KILN__MAX_IN];
  int nins = 0;
  bool ok = n->op == KILN__OP_FILL; /* a constant the program asked for */
  for (int q = 0; q < n->nin; q++) {
    int32_t j = kiln__owner(ctx, n->in[q]);
    if (j >= p->first && j < p->last)
      ins[nins++] = j - p->first;
    else if (j >= 0)
      ok = ok || ctx->fusion_state->anomaly->held[j];
  }
  return launch_check(ctx, n->out, 0, i, i - p->first, ok, ins, nins);
}

bool kiln__anomaly_check(kiln_ctx *ctx, const kiln__program *pg, int k) {
  const kiln__plan *p = &pg->plan;
  const kiln__group *g = &p->g[k];
  int nm = g->n ? g->n : 1;
  for (int m = 0; m < nm; m++) {
    int32_t i = g->n ? p->members[g->first + m] : g->node;
    if (p->group_of[i - p->first] == k && !check_node(ctx, p, i)) return false;
  }
  return true;
}

/* Reads records [0, n) into r, after the stream's work. */
static bool read_records(kiln_ctx *ctx, kiln__anomaly_rec *r, int n) {
  cudaStream_t stream = ctx->stream;
  return !KILN_CUDA_FAILED(ctx, cudaMemcpyAsync(r, ctx->fusion_state->anomaly->rec, n * sizeof *r,
                                                cudaMemcpyDeviceToHost, stream)) &&
         !KILN_CUDA_FAILED(ctx, cudaStreamSynchronize(stream));
}

static const char *what_of(unsigned long long first) {
  static const char *const w[] = {"NaN", "+Inf", "-Inf", "?"};
  return w[first & 3u];
}

/* Appends what t is: "node #12 (exp [128,10] f32)", or "'fc1.weight' [512,784] f32, from outside
 * the step", of the value a view shows (with " (through a view)"). */
static size_t put_value(char *buf, size_t len, const kiln_ctx *ctx, const kiln_tensor *t) {
  const kiln_tensor *base = t;
  for (int32_t i = base->node; i >= 0 && i < ctx->trace.n && ctx->trace.nodes[i].out == base &&
                               kiln__ops[ctx->trace.nodes[i].op].kind == KILN__KIND_VIEW;
       i = base->node)
    base = ctx->trace.nodes[i].in[0];
  char sh[96];
  const char *view = base != t ? " (through a view)" : "";
  int32_t j = kiln__owner(ctx, base);
  if (j >= 0)
    return (size_t)snprintf(
        buf, len, "node #%d (%s %s %s)%s", j, kiln__ops[ctx->trace.nodes[j].op].name,
        kiln__shape_of(base, sh, sizeof sh), kiln_dtype_name(base->dtype), view);
  return (size_t)snprintf(buf, len, "'%s' %s %s, from outside the step%s", kiln__name(base),
                          kiln__shape_of(base, sh, sizeof sh), kiln_dtype_name(base->dtype), view);
}

/* The error naming node r.node: what it is, what it wrote, and what its inputs hold (scanned
 * now, each into a record of its own). */
static bool report(kiln_ctx *ctx, kiln__anomaly_rec r) {
  kiln__anomaly *an = ctx->fusion_state->anomaly;
  int32_t i = (int32_t)r.node;
  KILN_ASSERT(i >= 0 && i < ctx->trace.n);
  const kiln__node *n = &ctx->trace.nodes[i];
  bool update = kiln__ops[n->op].kind == KILN__KIND_UPDATE;
  kiln__anomaly_rec in[NREC];
  bool scanned = !KILN_CUDA_FAILED(
      ctx, cudaMemsetAsync(an->rec + 1, 0xff, KILN__MAX_IN * sizeof *an->rec, ctx->stream));
  for (int q = 0; q < n->nin && scanned; q++)
    scanned = launch_check(ctx, n->in[q], 1 + q, 0, -1, false, NULL, 0);
  scanned = scanned && read_records(ctx, in, NREC);
  char msg[1024], from[160] = "", sh[96];
  if (n->from >= 0)
    snprintf(from, sizeof from, ", in kiln_backward of node #%d (%s)", n->from,
             kiln__ops[ctx->trace.nodes[n->from].op].name);
  const kiln_tensor *t = update ? n->in[0] : n->out;
  size_t k = (size_t)snprintf(
      msg, sizeof msg,
      "kiln_flush: anomaly mode: node #%d of the step, %s %s %s (recorded by %s%s), wrote %s "
      "first at element %llu of %s; no in-place update after it ran (gradients, optimizer state, "
      "parameters). Its inputs:",
      i, kiln__ops[n->op].name, kiln__shape_of(t, sh, sizeof sh), kiln_dtype_name(t->dtype),
      n->fn ? n->fn : "kiln", from, what_of(r.first), r.first >> 2,
      update ? "a tensor it updates in place (that write happened)" : "its output");
  for (int q = 0; q < n->nin && k < sizeof msg; q++) {
    k += (size_t)snprintf(msg + k, sizeof msg - k, "%s %d: ", q ? ";" : "", q);
    if (k < sizeof msg) k += put_value(msg + k, sizeof msg - k, ctx, n->in[q]);
    if (k >= sizeof msg) break;
    if (!scanned || !kiln__is_float(n->in[q]->dtype))
      k += (size_t)snprintf(msg + k, sizeof msg - k, "%s", scanned ? "" : ", not scanned");
    else if (in[1 + q].node < 0)
      k += (size_t)snprintf(msg + k, sizeof msg - k, ", finite");
    else
      k += (size_t)snprintf(msg + k, sizeof msg - k, ", holds %s at element %llu",
                            what_of(in[1 + q].first), in[1 + q].first >> 2);
  }
  kiln__error(ctx, KILN_ERR_NONFINITE, "%s", msg);
  return false;
}

bool kiln__anomaly_gate(kiln_ctx *ctx, const kiln__program *pg, int k) {
  const kiln__plan *p = &pg->plan;
  const kiln__group *g = &p->g[k];
  int nm = g->n ? g->n : 1;
  bool writes = false;
  for (int m = 0; m < nm && !writes; m++)
    writes = kiln__ops[ctx->trace.nodes[g->n ? p->members[g->first + m] : g->node].op].kind ==
             KILN__KIND_UPDATE;
  if (!writes) return true;
  kiln__anomaly_rec r;
  if (!read_records(ctx, &r, 1)) return false;
  return r.node < 0 || report(ctx, r);
}

bool kiln__anomaly_end(kiln_ctx *ctx, const kiln__program *pg) {
  kiln__anomaly *an = ctx->fusion_state->anomaly;
  const kiln__plan *p = &pg->plan;
  kiln__anomaly_rec r;
  if (!read_records(ctx, &r, 1)) return false;
  if (r.node >= 0) return report(ctx, r);
  if (p->last == p->first) return true;
  cudaStream_t stream =
      ctx->stream; /* the flush's allowed infinities, for the step's next flushes */
  return !KILN_CUDA_FAILED(ctx, cudaMemcpyAsync(an->held + p->first, an->allow,
                                                (size_t)(p->last - p->first),
                                                cudaMemcpyDeviceToHost, stream)) &&
         !KILN_CUDA_FAILED(ctx, cudaStreamSynchronize(stream));
}
