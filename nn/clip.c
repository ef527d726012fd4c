/*
 * clip.c: gradient clipping by global norm, as torch.nn.utils.clip_grad_norm_ with norm_type 2.
 * It is recorded like every op: the norm and the clipping coefficient are device values, and the
 * gradients are scaled in place by consecutive scale nodes (one multi-tensor launch), so no value
 * is read on the host and a step that clips replays as its CUDA graph whatever the norm comes to.
 */
#include <math.h>
#include <stdlib.h>

#include "../core/internal.h"

kiln_tensor *kiln_clip_grad_norm(kiln_params *p, float max_norm) {
  const char *fn = __func__;
  kiln_ctx *ctx = kiln_params_ctx(p);
  if (!ctx || !kiln__ok(ctx)) return NULL;
  if (!(max_norm > 0.f) || !isfinite(max_norm)) {
    kiln__error(ctx, KILN_ERR_INVALID, "%s: max_norm %g must be finite and > 0", fn, max_norm);
    return NULL;
  }
  int n = kiln_params_count(p), ng = 0;
  kiln_tensor **grads = malloc((size_t)(n > 0 ? 2 * n : 1) * sizeof *grads); /* and the sums */
  if (!grads) {
    kiln__error(ctx, KILN_ERR_OOM, "%s: out of host memory", fn);
    return NULL;
  }
  for (int i = 0; i < n; i++) { /* buffers are never trained: their gradients do not count */
    kiln_tensor *g = kiln_tensor_grad(kiln_params_get(p, i));
    if (g && !kiln_params_is_buffer(p, i)) grads[ng++] = g;
  }
  kiln_no_grad_begin(ctx);
  /* () the sum of every gradient's squares: the sums first, then their total, so that the
   * scalar arithmetic below is one elementwise kernel */
  kiln_tensor **sums = grads + n;
  for (int k = 0; k < ng; k++)
    sums[k] = kiln_sum(kiln_mul(grads[k], grads[k]), KILN_ALL_AXES, 0);
  kiln_tensor *sq = ng ? sums[0] : NULL;
  for (int k = 1; k < ng; k++)
    sq = kiln_add(sq, sums[k]);
  kiln_tensor *total = ng ? kiln_sqrt(sq) : kiln_full(ctx, KILN_SCALAR_SHAPE, 0.f); /* () */
  if (total) total->keep = true; /* read after the step, though the coefficient consumes it */
  /* coef = min(max_norm / (total + 1e-6), 1), as torch; a coefficient of 1 leaves g bitwise */
  kiln_tensor *coef = ng ? kiln_minimum(kiln_div(kiln_full(ctx, KILN_SCALAR_SHAPE, max_norm),
                                                 kiln_add_scalar(total, 1e-6f)),
                                        kiln_full(ctx, KILN_SCALAR_SHAPE, 1.f))
                         : NULL;
  /* consecutive in-place scales: one multi-tensor launch for all the gradients */
  for (int k = 0; k < ng && coef; k++) {
    kiln_tensor *in[2] = {grads[k], coef};
    if (!kiln__update(KILN__OP_SCALE, fn, 2, in)) break;
  }
  kiln_no_grad_end(ctx);
  free(grads);
  return kiln__ok(ctx) ? total : NULL;
}
