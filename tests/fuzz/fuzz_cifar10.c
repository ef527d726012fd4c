/*
 * fuzz_cifar10: libFuzzer target for the CIFAR-10 reader's byte-level parts (data/readers.h): xz
 * (and gzip) decompression and the record checks and unpacking. Any input must either give
 * records whose labels are 0..9 and whose pixels land where the layout says, or fail with a
 * reason; never crash, read out of bounds or leak. Built from host sources only: no CUDA library
 * is linked.
 */
#include <stdlib.h>
#include <string.h>

#include "../../data/readers.h"

static void records(const uint8_t *buf, size_t len) {
  int64_t n = -1;
  char why[512] = "";
  if (!kiln__cifar10_check(buf, len, &n, why, sizeof why)) {
    if (!why[0]) abort(); /* a failure must say why */
    return;
  }
  if (n <= 0 || (size_t)n * KILN__CIFAR10_RECORD != len) abort();
  uint8_t *images = malloc((size_t)n * KILN__CIFAR10_PIXELS), *labels = malloc((size_t)n);
  if (!images || !labels) abort();
  kiln__cifar10_unpack(buf, n, images, labels);
  for (int64_t i = 0; i < n; i++) {
    const uint8_t *rec = buf + (size_t)i * KILN__CIFAR10_RECORD;
    const uint8_t *im = images + (size_t)i * KILN__CIFAR10_PIXELS;
    if (labels[i] > 9 || labels[i] != rec[0]) abort();
    /* the first red, the last blue and a green pixel in the middle */
    if (im[0] != rec[1] || im[3071] != rec[3072] || im[3 * 527 + 1] != rec[1 + 1024 + 527]) abort();
  }
  free(images);
  free(labels);
}

int LLVMFuzzerTestOneInput(const uint8_t *bytes, size_t size) {
  const uint8_t *buf = bytes;
  size_t len = size;
  uint8_t *plain = NULL;
  char why[512] = "";
  if (size >= 1 && bytes[0] == 0xfd) { /* the first byte of the xz magic */
    plain = kiln__unxz(bytes, size, (size_t)1 << 24, &len, why, sizeof why);
    if (!plain) {
      if (!why[0]) abort();
      return 0;
    }
    if (len > (size_t)1 << 24) abort();
    buf = plain;
  } else if (size >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b) {
    plain = kiln__gunzip(bytes, size, (size_t)1 << 24, false, &len, why, sizeof why);
    if (!plain) {
      if (!why[0]) abort();
      return 0;
    }
    buf = plain;
  }
  records(buf, len);
  free(plain);
  return 0;
}
