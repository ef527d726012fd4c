/*
 * fuzz_idx: libFuzzer target for the MNIST-format reader's byte-level parts (data/readers.h):
 * gzip inflation and idx parsing. Any input must either give data of exactly the size its header
 * declares, or fail with a reason; never crash, read out of bounds or leak. Built from host
 * sources only: no CUDA library is linked.
 */
#include <stdlib.h>
#include <string.h>

#include "../../data/readers.h"

static void parse(const uint8_t *buf, size_t len, int ndim) {
  uint32_t dims[3] = {0, 0, 0};
  char why[512] = "";
  uint8_t *data = kiln__idx_parse(buf, len, ndim, dims, why, sizeof why);
  if (!data) {
    if (!why[0]) abort(); /* a failure must say why */
    return;
  }
  size_t total = 1;
  for (int i = 0; i < ndim; i++)
    total *= dims[i];
  if (len != 4 + 4 * (size_t)ndim + total) abort();
  if (total && (data[0] != buf[4 + 4 * ndim] || data[total - 1] != buf[len - 1])) abort();
  free(data);
}

int LLVMFuzzerTestOneInput(const uint8_t *bytes, size_t size) {
  const uint8_t *buf = bytes;
  size_t len = size;
  uint8_t *inflated = NULL;
  if (size >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b) {
    char why[512] = "";
    /* as the reader does: the header first, no more than it declares; and a plain inflation */
    uint8_t *idx = kiln__idx_gunzip(bytes, size, 3, &len, why, sizeof why);
    if (!idx && !why[0]) abort();
    free(idx);
    why[0] = 0;
    inflated = kiln__gunzip(bytes, size, (size_t)1 << 24, false, &len, why, sizeof why);
    if (!inflated) {
      if (!why[0]) abort();
      return 0;
    }
    buf = inflated;
  }
  parse(buf, len, 1);
  parse(buf, len, 3);
  free(inflated);
  return 0;
}
