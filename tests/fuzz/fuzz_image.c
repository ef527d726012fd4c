/*
 * fuzz_image: libFuzzer target for the image decoder of image folders (data/imagefile.c, through
 * data/readers.h): JPEG through TurboJPEG, PNG through libpng. Any input must either decode to
 * rows x cols RGB pixels within the pixel limit, or fail with a reason; never crash, read out of
 * bounds, leak or allocate more than the limit allows. Built from host sources only: no CUDA
 * library is linked.
 */
#include <stdlib.h>

#include "../../data/readers.h"

#define MAX_PIXELS ((int64_t)1 << 20) /* the fuzzer's memory limit, not the library's default */

int LLVMFuzzerTestOneInput(const uint8_t *bytes, size_t size) {
  int rows = -1, cols = -1;
  char why[512] = "";
  uint8_t *px = kiln__image_decode(bytes, size, MAX_PIXELS, &rows, &cols, why, sizeof why);
  if (!px) {
    if (!why[0]) abort(); /* a failure must say why */
    return 0;
  }
  if (rows <= 0 || cols <= 0 || (int64_t)rows * cols > MAX_PIXELS) abort();
  if (kiln__image_sniff(bytes, size) == KILN__IMAGE_UNKNOWN) abort();
  /* every byte is there to read (ASan checks the last) */
  volatile uint8_t last = px[(size_t)rows * cols * 3 - 1];
  (void)last;
  free(px);
  return 0;
}
