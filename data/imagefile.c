/*
 * imagefile.c: JPEG and PNG files, in memory, to 8-bit RGB pixels (rows, cols, 3), as
 * torchvision's ImageFolder reads them through PIL's convert("RGB"): gray is repeated over the
 * three channels, a palette is looked up, 16-bit samples become 8-bit, an alpha channel is
 * dropped. JPEG goes through libjpeg-turbo's TurboJPEG API (islow DCT, fancy upsampling, as PIL),
 * PNG through libpng's simplified API. The header is read first and an image of more than
 * max_pixels pixels is refused before a byte of it is decoded, so a small file that claims
 * 30000 x 30000 pixels costs nothing. No CUDA, no files: the data readers' byte-level part.
 */
#include <png.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <turbojpeg.h>

#include "readers.h"

kiln__image_kind kiln__image_sniff(const uint8_t *buf, size_t len) {
  static const uint8_t png_sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (len >= 3 && buf[0] == 0xff && buf[1] == 0xd8 && buf[2] == 0xff) return KILN__IMAGE_JPEG;
  if (len >= 8 && memcmp(buf, png_sig, 8) == 0) return KILN__IMAGE_PNG;
  return KILN__IMAGE_UNKNOWN;
}

/* Checks rows x cols against max_pixels, and that the RGB bytes fit a size_t. */
static bool size_ok(int64_t rows, int64_t cols, int64_t max_pixels, char *why, size_t wlen) {
  if (rows <= 0 || cols <= 0) {
    snprintf(why, wlen, "an image of %lld x %lld pixels", (long long)rows, (long long)cols);
    return false;
  }
  if (rows > max_pixels / cols) {
    snprintf(why, wlen,
             "%lld x %lld pixels is more than the %lld an image may have (the max_pixels option)",
             (long long)rows, (long long)cols, (long long)max_pixels);
    return false;
  }
  return true;
}

static uint8_t *decode_jpeg(const uint8_t *buf, size_t len, int64_t max_pixels, int *rows,
                            int *cols, char *why, size_t wlen) {
  if (len > (size_t)0xffffffffu) { /* TurboJPEG takes an unsigned long size: 32 bits on some */
    snprintf(why, wlen, "a JPEG file of %zu bytes is too large", len);
    return NULL;
  }
  tjhandle tj = tjInitDecompress();
  if (!tj) {
    snprintf(why, wlen, "TurboJPEG: %s", tjGetErrorStr2(NULL));
    return NULL;
  }
  uint8_t *px = NULL;
  int w = 0, h = 0, subsamp = 0, space = 0;
  if (tjDecompressHeader3(tj, buf, (unsigned long)len, &w, &h, &subsamp, &space) != 0) {
    snprintf(why, wlen, "not a JPEG image kiln can read (%s)", tjGetErrorStr2(tj));
  } else if (space == TJCS_CMYK || space == TJCS_YCCK) {
    snprintf(why, wlen, "a CMYK JPEG: convert it to RGB (kiln reads gray, RGB and YCbCr)");
  } else if (size_ok(h, w, max_pixels, why, wlen) && !(px = malloc((size_t)w * (size_t)h * 3))) {
    snprintf(why, wlen, "out of host memory for %d x %d pixels", h, w);
  } else if (px && tjDecompress2(tj, buf, (unsigned long)len, px, w, w * 3, h, TJPF_RGB, 0) != 0) {
    /* a warning too (a premature end: a truncated file): what it decoded is not the image */
    snprintf(why, wlen, "a truncated or corrupted JPEG (%s)", tjGetErrorStr2(tj));
    free(px);
    px = NULL;
  }
  tjDestroy(tj);
  *rows = h;
  *cols = w;
  return px;
}

static uint8_t *decode_png(const uint8_t *buf, size_t len, int64_t max_pixels, int *rows, int *cols,
                           char *why, size_t wlen) {
  png_image im;
  memset(&im, 0, sizeof im);
  im.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&im, buf, len)) {
    snprintf(why, wlen, "not a PNG image kiln can read (libpng: %s)", im.message);
    png_image_free(&im);
    return NULL;
  }
  *rows = (int)im.height;
  *cols = (int)im.width;
  if (!size_ok(im.height, im.width, max_pixels, why, wlen)) {
    png_image_free(&im);
    return NULL;
  }
  /* RGBA, then the alpha dropped (PIL's convert("RGB") drops it; libpng would composite) */
  size_t n = (size_t)im.width * im.height;
  im.format = PNG_FORMAT_RGBA;
  uint8_t *px = malloc(n * 4);
  if (!px) {
    snprintf(why, wlen, "out of host memory for %u x %u pixels", im.height, im.width);
    png_image_free(&im);
    return NULL;
  }
  if (!png_image_finish_read(&im, NULL, px, 0, NULL)) {
    snprintf(why, wlen, "a truncated or corrupted PNG (libpng: %s)", im.message);
    png_image_free(&im);
    free(px);
    return NULL;
  }
  for (size_t i = 0; i < n; i++) {
    px[3 * i] = px[4 * i];
    px[3 * i + 1] = px[4 * i + 1];
    px[3 * i + 2] = px[4 * i + 2];
  }
  uint8_t *shrunk = realloc(px, n * 3);
  return shrunk ? shrunk : px;
}

uint8_t *kiln__image_decode(const uint8_t *buf, size_t len, int64_t max_pixels, int *rows,
                            int *cols, char *why, size_t wlen) {
  *rows = *cols = 0;
  if (len == 0) {
    snprintf(why, wlen, "an empty file");
    return NULL;
  }
  switch (kiln__image_sniff(buf, len)) {
  case KILN__IMAGE_JPEG: return decode_jpeg(buf, len, max_pixels, rows, cols, why, wlen);
  case KILN__IMAGE_PNG: return decode_png(buf, len, max_pixels, rows, cols, why, wlen);
  default: snprintf(why, wlen, "neither a JPEG nor a PNG image (by its first bytes)"); return NULL;
  }
}
