/*
 * make_imagefolder: an image folder of JPEG files made from CIFAR-10, to measure
 * examples/imagefolder and kiln_image_loader at ImageNet's image sizes without ImageNet:
 *
 *   make_imagefolder CIFAR_DIR OUT [--size N] [--train N] [--val N] [--quality N] [--repeat N]
 *
 * writes OUT/train/<class>/<index>.jpg from the training split (its first --train images, all by
 * default) and OUT/val/<class>/<index>.jpg from the test split (its first --val, all by default),
 * each image scaled from 32x32 to N x N (default 224) by bilinear interpolation and encoded by
 * TurboJPEG at --quality (default 90, 4:2:0 as most photographs are). --repeat N writes each
 * training image N times, copy r mirrored when r is odd and cut to the 28x28 pixels from
 * (r / 2 % 5, r / 2 / 5 % 5) before scaling when r > 1, so that the CIFAR-10 sample's 1000 images
 * make 10,000 different files. CIFAR_DIR is read with kiln_cifar10_read (raw, .gz or .xz batches;
 * a sample holding some batches works).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <turbojpeg.h>

#include "kiln.h"

static const char *const classes[10] = {"airplane", "automobile", "bird",  "cat",  "deer",
                                        "dog",      "frog",       "horse", "ship", "truck"};

static void usage(void) {
  fprintf(stderr, "usage: make_imagefolder CIFAR_DIR OUT [--size N] [--train N] [--val N] "
                  "[--quality N] [--repeat N]\n");
  exit(2);
}

static void make_dir(const char *path) {
  if (mkdir(path, 0755) != 0 && errno != EEXIST) {
    fprintf(stderr, "make_imagefolder: %s: %s\n", path, strerror(errno));
    exit(1);
  }
}

/* Copy r of src (32, 32, 3): mirrored when r is odd, the 28x28 pixels from (r / 2 % 5,
 * r / 2 / 5 % 5) when r > 1; *side is the copy's side. */
static void variant(const uint8_t *src, int r, uint8_t *dst, int *side) {
  int s = r > 1 ? 28 : 32, y0 = r > 1 ? r / 2 % 5 : 0, x0 = r > 1 ? r / 2 / 5 % 5 : 0;
  for (int y = 0; y < s; y++)
    for (int x = 0; x < s; x++)
      memcpy(dst + (y * s + x) * 3, src + ((y0 + y) * 32 + x0 + (r % 2 ? s - 1 - x : x)) * 3, 3);
  *side = s;
}

/* src (s, s, 3) to dst (n, n, 3), bilinear with half-pixel centres, edges clamped. */
static void upscale(const uint8_t *src, int s, uint8_t *dst, int n) {
  for (int y = 0; y < n; y++) {
    double sy = (y + 0.5) * s / n - 0.5;
    int y0 = sy < 0 ? 0 : (int)sy, y1 = y0 + 1 > s - 1 ? s - 1 : y0 + 1;
    double fy = sy < 0 ? 0 : sy - y0;
    for (int x = 0; x < n; x++) {
      double sx = (x + 0.5) * s / n - 0.5;
      int x0 = sx < 0 ? 0 : (int)sx, x1 = x0 + 1 > s - 1 ? s - 1 : x0 + 1;
      double fx = sx < 0 ? 0 : sx - x0;
      for (int c = 0; c < 3; c++) {
        double v =
            (1 - fy) * ((1 - fx) * src[(y0 * s + x0) * 3 + c] + fx * src[(y0 * s + x1) * 3 + c]) +
            fy * ((1 - fx) * src[(y1 * s + x0) * 3 + c] + fx * src[(y1 * s + x1) * 3 + c]);
        dst[((size_t)y * n + x) * 3 + c] = (uint8_t)(v + 0.5);
      }
    }
  }
}

/* Writes the first `limit` images of c (all when limit is 0), each `repeat` times, under
 * dir/<class>/; returns the files written. */
static int64_t write_split(const kiln_cifar10 *c, const char *dir, int64_t limit, int repeat, int n,
                           int quality) {
  make_dir(dir);
  char path[4096];
  for (int k = 0; k < 10; k++) {
    snprintf(path, sizeof path, "%s/%s", dir, classes[k]);
    make_dir(path);
  }
  tjhandle tj = tjInitCompress();
  uint8_t *px = malloc((size_t)n * n * 3), copy[32 * 32 * 3];
  if (!tj || !px) {
    fprintf(stderr, "make_imagefolder: out of memory\n");
    exit(1);
  }
  int64_t count = limit && limit < c->n ? limit : c->n;
  for (int64_t i = 0; i < count; i++)
    for (int r = 0; r < repeat; r++) {
      int side;
      variant(c->images + i * 3072, r, copy, &side);
      upscale(copy, side, px, n);
      unsigned char *jpeg = NULL;
      unsigned long len = 0;
      if (tjCompress2(tj, px, n, n * 3, n, TJPF_RGB, &jpeg, &len, TJSAMP_420, quality, 0) != 0) {
        fprintf(stderr, "make_imagefolder: TurboJPEG: %s\n", tjGetErrorStr2(tj));
        exit(1);
      }
      snprintf(path, sizeof path, "%s/%s/%06lld_%02d.jpg", dir, classes[c->labels[i]], (long long)i,
               r);
      FILE *f = fopen(path, "wb");
      if (!f || fwrite(jpeg, 1, len, f) != len || fclose(f) != 0) {
        fprintf(stderr, "make_imagefolder: %s: cannot write it\n", path);
        exit(1);
      }
      tjFree(jpeg);
    }
  free(px);
  tjDestroy(tj);
  return count * repeat;
}

int main(int argc, char **argv) {
  if (argc < 3) usage();
  const char *cifar = argv[1], *out = argv[2];
  long long size = 224, train = 0, val = 0, quality = 90, repeat = 1;
  for (int i = 3; i < argc; i++) {
    if (i + 1 >= argc) usage();
    char *end;
    long long v = strtoll(argv[i + 1], &end, 10);
    if (*end || v <= 0) usage();
    if (strcmp(argv[i], "--size") == 0 && v <= 4096)
      size = v;
    else if (strcmp(argv[i], "--train") == 0)
      train = v;
    else if (strcmp(argv[i], "--val") == 0)
      val = v;
    else if (strcmp(argv[i], "--quality") == 0 && v <= 100)
      quality = v;
    else if (strcmp(argv[i], "--repeat") == 0 && v <= 50)
      repeat = v;
    else
      usage();
    i++;
  }
  kiln_ctx *ctx = kiln_ctx_new(&(kiln_ctx_options){.no_gpu = 1});
  kiln_cifar10 tr, te;
  /* the whole training split, else the batches a sample holds */
  if (kiln_cifar10_read(ctx, cifar, "train", &tr) != KILN_OK) {
    kiln_ctx_clear_error(ctx);
    if (kiln_cifar10_read(ctx, cifar, "data_batch_1", &tr) != KILN_OK) {
      fprintf(stderr, "make_imagefolder: %s\n", kiln_ctx_error(ctx));
      return 1;
    }
  }
  if (kiln_cifar10_read(ctx, cifar, "test", &te) != KILN_OK) {
    fprintf(stderr, "make_imagefolder: %s\n", kiln_ctx_error(ctx));
    return 1;
  }
  make_dir(out);
  char dir[4096];
  snprintf(dir, sizeof dir, "%s/train", out);
  int64_t a = write_split(&tr, dir, train, (int)repeat, (int)size, (int)quality);
  snprintf(dir, sizeof dir, "%s/val", out);
  int64_t b = write_split(&te, dir, val, 1, (int)size, (int)quality);
  printf("%s: %lld training and %lld validation images of %lldx%lld, JPEG quality %lld\n", out,
         (long long)a, (long long)b, size, size, quality);
  kiln_cifar10_free(&tr);
  kiln_cifar10_free(&te);
  kiln_ctx_free(ctx);
  return 0;
}
