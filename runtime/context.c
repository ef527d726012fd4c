/*
 * context.c: the context's lifetime and its steps, where recording meets execution.
 * kiln_ctx_new and kiln_ctx_free put core's context and fusion's engine state together and take
 * them apart; kiln_sync and the step calls run the nodes not yet run (flush.c); kiln_step_end
 * runs a whole step through its step graph. Timeline traces (prof/) begin and end here, and
 * hear of every step.
 */
#include <stdlib.h>

#include "../fusion/engine.h"
#include "../prof/prof.h"
#include "runtime.h"

kiln_ctx *kiln_ctx_new(const kiln_ctx_options *opts) {
  kiln_ctx *ctx = kiln__ctx_create(opts);
  if (!ctx) return NULL;
  /* fusion/'s state: with a GPU its BLAS handles too (a failure there leaves has_gpu off) */
  if (kiln__engine_init(ctx) != KILN_OK) ctx->has_gpu = false;
  /* KILN_TRACE: the whole context traced; what stops it is a warning, not the context's error */
  const char *trace = getenv("KILN_TRACE");
  char why[1024];
  if (trace && *trace && kiln__ok(ctx) && kiln__prof_begin(ctx, trace, why, sizeof why) != KILN_OK)
    fprintf(stderr, "kiln: warning: KILN_TRACE=%s: %s; running without a trace\n", trace, why);
  return ctx;
}

void kiln_ctx_free(kiln_ctx *ctx) {
  if (!ctx) return;
  char why[1024];
  if (ctx->prof && kiln__prof_end(ctx, why, sizeof why) != KILN_OK)
    fprintf(stderr, "kiln: %s\n", why);
  kiln__ctx_close(ctx); /* tensors freed; recorded work that never ran is dropped */
  kiln__engine_free(ctx);
  kiln__staging_free(ctx);
  kiln__ctx_destroy(ctx);
}

void kiln_set_graphs(kiln_ctx *ctx, int on) {
  if (!ctx) return;
  ctx->graphs = on != 0;
  /* the cached graphs and their arenas go at the next kiln_step_begin, when nothing of the
   * last step (its loss, say) can be read any more */
  kiln__engine_drop_graphs(ctx, !on);
}
int kiln_graphs(const kiln_ctx *ctx) { return ctx && ctx->graphs; }

void kiln__forget_step_graphs(kiln_ctx *ctx) { kiln__engine_free_graphs(ctx); }

kiln_status kiln_sync(kiln_ctx *ctx) {
  if (!ctx) return KILN_ERR_INVALID;
  kiln_status s = kiln__flush(ctx);
  if (s != KILN_OK) return s;
  if (!ctx->has_gpu) return ctx->status;
  return kiln__wait(ctx);
}

void kiln_step_begin(kiln_ctx *ctx) {
  if (!ctx) return;
  /* Whatever was recorded before the step (an update outside it, say) runs first. */
  if (ctx->has_gpu && ctx->trace.done < ctx->trace.n) kiln__flush(ctx);
  kiln__storages_release(ctx);
  kiln__engine_step_begin(ctx);
  kiln__step_open(ctx);
  if (ctx->prof) kiln__prof_step(ctx->prof, kiln__prof_step_of(ctx), kiln__prof_mode(ctx));
}

kiln_status kiln_trace_begin(kiln_ctx *ctx, const char *path) {
  if (!ctx) return KILN_ERR_INVALID;
  if (!kiln__ok(ctx)) return ctx->status;
  char why[1024];
  kiln_status s = kiln__prof_begin(ctx, path, why, sizeof why);
  return s == KILN_OK ? s : kiln__error(ctx, s, "%s", why);
}

kiln_status kiln_trace_end(kiln_ctx *ctx) {
  if (!ctx) return KILN_ERR_INVALID;
  char why[1024];
  kiln_status s = kiln__prof_end(ctx, why, sizeof why); /* a failed context's trace too */
  return s == KILN_OK ? ctx->status : kiln__error(ctx, s, "%s", why);
}

/* Runs the open step: its graph, or a flush of what it has not run yet (always in anomaly mode,
 * whose checks stop a step part way). */
static kiln_status run_step(kiln_ctx *ctx, bool open, bool whole) {
  if (whole && ctx->graphs && !ctx->anomaly && kiln__ok(ctx) && ctx->trace.n > 0) {
    kiln_status s = kiln__engine_step(ctx);
    ctx->trace.done = ctx->trace.n;
    ctx->stats.flushes++;
    return s;
  }
  /* a step in graph mode run otherwise: in anomaly mode, or after part or all of it ran before
   * its end (a kiln_sync or a host read inside it) */
  if (ctx->graphs && ctx->has_gpu && ctx->trace.n > 0 &&
      (ctx->trace.done < ctx->trace.n || (open && !whole)))
    ctx->stats.eager_steps++;
  return kiln__flush(ctx);
}

kiln_status kiln_step_end(kiln_ctx *ctx) {
  if (!ctx) return KILN_ERR_INVALID;
  bool open = ctx->in_step;
  /* an autocast region carried into the next step would cast that step's ops too: the step fails
   * (nothing runs, its host state is undone) and the regions stay open for the caller to close */
  if (open && ctx->autocast_depth > 0)
    kiln__error(ctx, KILN_ERR_STATE,
                "kiln_step_end: %d autocast region%s open (kiln_autocast_begin without "
                "kiln_autocast_end): close %s inside the step, after the forward pass; the step "
                "is not run",
                ctx->autocast_depth, ctx->autocast_depth == 1 ? " is" : "s are",
                ctx->autocast_depth == 1 ? "it" : "them");
  bool whole = open && ctx->trace.done == 0; /* nothing of the step ran yet */
  ctx->in_step = false;
  kiln_status s = run_step(ctx, open, whole);
  /* a failed step (in recording or running) leaves no host state behind: step counts, gradient
   * flags, RNG offsets and loader positions go back to where the step found them */
  if (open && s != KILN_OK)
    kiln__undo_rollback(ctx);
  else
    kiln__undo_commit(ctx);
  return s;
}
