/*
 * imgfolder.c: image files and folders for the image-folder tests, and the resize's float64
 * reference (imgfolder.h).
 */
#include "imgfolder.h"

#include <criterion/criterion.h>
#include <math.h>
#include <png.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <turbojpeg.h>

void tf_write_png(const char *path, const uint8_t *px, int rows, int cols, int channels) {
  png_image im;
  memset(&im, 0, sizeof im);
  im.version = PNG_IMAGE_VERSION;
  im.width = (png_uint_32)cols;
  im.height = (png_uint_32)rows;
  im.format = channels == 1 ? PNG_FORMAT_GRAY : (channels == 4 ? PNG_FORMAT_RGBA : PNG_FORMAT_RGB);
  cr_assert(png_image_write_to_file(&im, path, 0, px, 0, NULL), "libpng cannot write %s: %s", path,
            im.message);
}

void tf_write_png_full(const char *path, const uint8_t *px, int rows, int cols, int channels,
                       int depth, double gamma) {
  FILE *f = fopen(path, "wb");
  cr_assert_not_null(f, "cannot write %s", path);
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
  png_infop info = png_create_info_struct(png);
  cr_assert(png && info);
  cr_assert_eq(setjmp(png_jmpbuf(png)), 0, "libpng cannot write %s", path);
  png_init_io(png, f);
  png_set_IHDR(png, info, (png_uint_32)cols, (png_uint_32)rows, depth,
               channels == 1 ? PNG_COLOR_TYPE_GRAY : PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  if (gamma > 0) png_set_gAMA(png, info, gamma);
  png_write_info(png, info);
  size_t stride = (size_t)cols * channels * (depth / 8);
  for (int r = 0; r < rows; r++)
    png_write_row(png, px + (size_t)r * stride);
  png_write_end(png, NULL);
  png_destroy_write_struct(&png, &info);
  fclose(f);
}

uint8_t *tf_jpeg_bytes(const uint8_t *px, int rows, int cols, int quality, size_t *len) {
  tjhandle tj = tjInitCompress();
  cr_assert_not_null(tj);
  unsigned char *buf = NULL;
  unsigned long n = 0;
  cr_assert_eq(
      tjCompress2(tj, px, cols, cols * 3, rows, TJPF_RGB, &buf, &n, TJSAMP_444, quality, 0), 0,
      "TurboJPEG: %s", tjGetErrorStr2(tj));
  tjDestroy(tj);
  uint8_t *out = malloc(n);
  cr_assert_not_null(out);
  memcpy(out, buf, n);
  tjFree(buf);
  *len = n;
  return out;
}

void tf_write_jpeg(const char *path, const uint8_t *px, int rows, int cols, int quality) {
  size_t n;
  uint8_t *b = tf_jpeg_bytes(px, rows, cols, quality, &n);
  FILE *f = fopen(path, "wb");
  cr_assert_not_null(f, "cannot write %s", path);
  cr_assert_eq(fwrite(b, 1, n, f), n);
  fclose(f);
  free(b);
}

uint8_t *tf_cifar_image(int k, int rows, int cols) {
  static kiln_cifar10 c;
  static int loaded;
  if (!loaded) {
    const char *dir = getenv("KILN_CIFAR10_SAMPLE");
    if (!dir) cr_skip_test("needs KILN_CIFAR10_SAMPLE (the CIFAR-10 sample's folder)");
    kiln_ctx_options no = {.no_gpu = 1};
    kiln_ctx *ctx = kiln_ctx_new(&no);
    cr_assert_eq(kiln_cifar10_read(ctx, dir, "data_batch_1", &c), KILN_OK, "%s",
                 kiln_ctx_error(ctx));
    kiln_ctx_free(ctx);
    loaded = 1;
  }
  cr_assert_lt(k, c.n);
  uint8_t *px = malloc((size_t)rows * cols * 3);
  cr_assert_not_null(px);
  for (int r = 0; r < rows; r++)
    for (int q = 0; q < cols; q++)
      memcpy(px + ((size_t)r * cols + q) * 3,
             c.images + (size_t)k * 3072 + ((size_t)(r * 32 / rows) * 32 + q * 32 / cols) * 3, 3);
  return px;
}

void tf_size_of(int k, int *rows, int *cols) {
  *rows = 32 + 8 * (k % 6);
  *cols = 32 + 12 * ((k / 2) % 4);
}

void tf_make_folder(const char *root, int classes, int per_class, int jpeg_every) {
  char path[1200];
  mkdir(root, 0755);
  for (int c = 0; c < classes; c++) {
    snprintf(path, sizeof path, "%s/class_%d", root, c);
    cr_assert(mkdir(path, 0755) == 0, "cannot make %s", path);
    for (int j = 0; j < per_class; j++) {
      int k = c * per_class + j, rows, cols;
      tf_size_of(k, &rows, &cols);
      uint8_t *px = tf_cifar_image(k, rows, cols);
      bool jpeg = jpeg_every > 0 && k % jpeg_every == jpeg_every - 1;
      snprintf(path, sizeof path, "%s/class_%d/img_%03d.%s", root, c, k, jpeg ? "jpg" : "png");
      if (jpeg)
        tf_write_jpeg(path, px, rows, cols, 95);
      else
        tf_write_png(path, px, rows, cols, 3);
      free(px);
    }
  }
}

/* The taps of output coordinate o of a source of n pixels resized to rs (PIL's bilinear filter,
 * support 1 widened by the scale when shrinking): weights w[0 .. *count) from source pixel *lo,
 * normalised to sum 1. */
static void taps(int o, int n, int rs, int *lo, int *count, double *w) {
  double scale = (double)n / rs, fs = scale > 1 ? scale : 1, center = (o + 0.5) * scale;
  int a = (int)(center - fs + 0.5), b = (int)(center + fs + 0.5);
  a = a < 0 ? 0 : a;
  b = b > n ? n : b;
  double sum = 0;
  for (int x = a; x < b; x++) {
    double t = fabs((x - center + 0.5) / fs);
    w[x - a] = t < 1 ? 1 - t : 0;
    sum += w[x - a];
  }
  for (int x = a; x < b; x++)
    w[x - a] /= sum;
  *lo = a;
  *count = b - a;
}

void tf_ref_resize(const uint8_t *px, int rows, int cols, int rrows, int rcols, int oy, int ox,
                   int height, int width, int flip, const float mean[3], const float std[3],
                   double *out) {
  int cap = 2 * (rows + cols) + 8;
  double *wy = malloc(cap * sizeof *wy), *wx = malloc(cap * sizeof *wx);
  cr_assert(wy && wx);
  for (int i = 0; i < height; i++) {
    int ylo, yn;
    taps(oy + i, rows, rrows, &ylo, &yn, wy);
    for (int j = 0; j < width; j++) {
      int xlo, xn, jj = flip ? width - 1 - j : j;
      taps(ox + jj, cols, rcols, &xlo, &xn, wx);
      for (int c = 0; c < 3; c++) {
        double v = 0;
        for (int a = 0; a < yn; a++)
          for (int b = 0; b < xn; b++)
            v += wy[a] * wx[b] * px[((size_t)(ylo + a) * cols + xlo + b) * 3 + c];
        out[((size_t)i * width + j) * 3 + c] = (v / 255.0 - mean[c]) / std[c];
      }
    }
  }
  free(wy);
  free(wx);
}
