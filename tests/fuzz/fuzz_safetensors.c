/*
 * fuzz_safetensors: libFuzzer target for the safetensors header parser and the checkpoint
 * metadata parser. Any input must either parse into entries whose byte ranges lie inside the
 * input, or fail with an error message; never crash, read out of bounds or leak
 * (AddressSanitizer watches).
 */
#include <stdlib.h>
#include <string.h>

#include "../../io/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* a context used only as the sink of error messages */
  static kiln_ctx *ctx;
  if (!ctx) ctx = calloc(1, sizeof *ctx);
  kiln__st_file f;
  if (kiln__st_parse(ctx, "fuzz", "input", data, size, &f) == KILN_OK) {
    unsigned sum = 0;
    for (int i = 0; i < f.n; i++) {
      if (f.data + f.e[i].end > data + size) abort();
      for (uint64_t b = f.e[i].begin; b < f.e[i].end; b++)
        sum += f.data[b];
      if (!kiln__st_find(&f, f.e[i].name)) abort();
    }
    (void)sum;
    /* the checkpoint metadata parser, without an optimizer, with one and with two: it answers
     * or says why */
    static const char *const names[2] = {"w", "b"}, *const kinds[2] = {"adam", "muon"};
    for (int k = 0; k < 3; k++) {
      kiln__ckpt_meta cm;
      char why[512] = "";
      const char *e = kiln__ckpt_meta_parse(f.metadata, kinds, k, 2, names, &cm, why, sizeof why);
      if (e && !e[0]) abort();
      kiln__ckpt_meta_free(&cm);
    }
    kiln__st_free(&f);
  } else if (ctx->status == KILN_OK || ctx->error[0] == 0) {
    abort(); /* a failure must say why */
  }
  ctx->status = KILN_OK;
  ctx->error[0] = 0;
  return 0;
}
