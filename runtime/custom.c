/*
 * custom.c (runtime): making a custom op (include/kiln_custom.h). core checks and copies the
 * options, the engine compiles the kernel, and only then does the op join the context's list: a
 * failed call leaves nothing behind.
 */
#include "../fusion/engine.h"
#include "runtime.h"

kiln_custom_op *kiln_custom_op_new(kiln_ctx *ctx, const kiln_custom_op_options *o) {
  kiln_custom_op *op = kiln__custom_create(ctx, o);
  if (!op) return NULL;
  if (kiln__engine_compile_custom(ctx, op) != KILN_OK || !kiln__custom_register(op)) {
    kiln__custom_destroy(op);
    return NULL;
  }
  return op;
}
