/* outside: built against an installed kiln; records a tiny model without a GPU and checks it. */
#include <kiln.h>
#include <stdio.h>
#include <string.h>

int main(void) {
  kiln_ctx *ctx = kiln_ctx_new(&(kiln_ctx_options){.no_gpu = 1});
  kiln_tensor *a = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(4, 3));
  kiln_tensor *b = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(3, 2));
  kiln_tensor *c = kiln_relu(kiln_matmul(a, b));
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d", KILN_VERSION_MAJOR, KILN_VERSION_MINOR,
           KILN_VERSION_PATCH);
  int ok = c && kiln_tensor_dim(c, 0) == 4 && kiln_tensor_dim(c, 1) == 2 &&
           strcmp(kiln_version(), want) == 0 && !kiln_ctx_error(ctx);
  printf("kiln %s from outside: %s\n", kiln_version(), ok ? "ok" : "FAILED");
  kiln_ctx_free(ctx);
  return ok ? 0 : 1;
}
