/*
 * imagefile.c: JPEG and PNG files, in memory, to 8-bit RGB pixels (rows, cols, 3), as
 * torchvision's ImageFolder reads them through PIL's convert("RGB"): gray is repeated over the
 * three channels, a palette is looked up, 16-bit samples are cut to their high byte, an alpha
 * channel is dropped. JPEG goes through libjpeg-turbo's TurboJPEG API (islow DCT, fancy
 * upsampling, as PIL), PNG through libpng (no gamma correction: PIL applies none). The header is
 * read first and an image of more than max_pixels pixels is refused before a byte of it is
 * decoded, so a small file that claims 30000 x 30000 pixels costs nothing. No CUDA, no files: the
 * data readers' byte-level part.
 */
#include <png.h>
#include <setjmp.h>
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

/* A PNG being read from memory: libpng's error handler fills why and jumps back; what was
 * allocated lives here (not in locals, which setjmp would not keep). */
typedef struct png_job {
  const uint8_t *buf;
  size_t len, at;
  char *why;
  size_t wlen;
  uint8_t *px;
  png_bytep *rows;
} png_job;

static void png_read_mem(png_structp png, png_bytep out, size_t n) {
  png_job *j = png_get_io_ptr(png);
  if (n > j->len - j->at) png_error(png, "the file ends early");
  memcpy(out, j->buf + j->at, n);
  j->at += n;
}

static void png_fail(png_structp png, png_const_charp msg) {
  png_job *j = png_get_error_ptr(png);
  if (!j->why[0]) snprintf(j->why, j->wlen, "a truncated or corrupted PNG (libpng: %s)", msg);
  png_longjmp(png, 1);
}

static void png_warned(png_structp png, png_const_charp msg) { (void)png, (void)msg; }

/* libpng's full reader, without its gamma handling (the simplified API converts 16-bit and
 * gamma-tagged images to sRGB; PIL takes samples as they are): palettes and gray expanded to
 * 8-bit RGB, 16-bit samples cut to their high byte, alpha stripped. */
static uint8_t *decode_png(const uint8_t *buf, size_t len, int64_t max_pixels, int *rows, int *cols,
                           char *why, size_t wlen) {
  png_job j = {.buf = buf, .len = len, .why = why, .wlen = wlen};
  why[0] = 0;
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &j, png_fail, png_warned);
  png_infop info = png ? png_create_info_struct(png) : NULL;
  if (!png || !info) {
    png_destroy_read_struct(&png, &info, NULL);
    snprintf(why, wlen, "out of host memory for libpng");
    return NULL;
  }
  if (setjmp(png_jmpbuf(png))) {
    free(j.px);
    free(j.rows);
    png_destroy_read_struct(&png, &info, NULL);
    return NULL;
  }
  png_set_read_fn(png, &j, png_read_mem);
  png_read_info(png, info);
  png_uint_32 w = png_get_image_width(png, info), h = png_get_image_height(png, info);
  *rows = (int)h;
  *cols = (int)w;
  if (!size_ok(h, w, max_pixels, why, wlen)) png_longjmp(png, 1);
  png_set_expand(png);
  png_set_strip_16(png);
  png_set_strip_alpha(png);
  png_set_gray_to_rgb(png);
  (void)png_set_interlace_handling(png);
  png_read_update_info(png, info);
  if (png_get_rowbytes(png, info) != (size_t)w * 3 || png_get_channels(png, info) != 3) {
    snprintf(why, wlen, "a PNG libpng does not give as 8-bit RGB");
    png_longjmp(png, 1);
  }
  j.px = malloc((size_t)w * h * 3);
  j.rows = malloc((size_t)h * sizeof *j.rows);
  if (!j.px || !j.rows) {
    snprintf(why, wlen, "out of host memory for %u x %u pixels", h, w);
    png_longjmp(png, 1);
  }
  for (png_uint_32 r = 0; r < h; r++)
    j.rows[r] = j.px + (size_t)r * w * 3;
  png_read_image(png, j.rows); /* the chunks after the pixels are not read: PIL does not */
  free(j.rows);
  png_destroy_read_struct(&png, &info, NULL);
  return j.px;
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
