/*
 * imgfolder.h: image files and folders for the image-folder tests, written with the libraries
 * kiln reads them with (libpng's simplified API, TurboJPEG): CIFAR-10 sample images scaled to
 * assorted sizes, in class folders, and the hostile files of the reader's contract. The float64
 * reference of the loader's resize (PIL's antialiased bilinear filter) is here too, so that the
 * no-GPU and GPU tests share it.
 */
#ifndef KILN_TEST_IMGFOLDER_H
#define KILN_TEST_IMGFOLDER_H

#include <stdint.h>

#include "kiln.h"

/* Writes pixels (rows, cols, channels) as an 8-bit PNG: 1 gray, 3 RGB, 4 RGBA channels. */
void tf_write_png(const char *path, const uint8_t *px, int rows, int cols, int channels);
/* Writes samples (rows, cols, channels) with libpng's full API: bit depth 8 (px bytes) or 16
 * (px big-endian pairs), 1 or 3 channels, and a gAMA chunk of the given gamma when gamma > 0. */
void tf_write_png_full(const char *path, const uint8_t *px, int rows, int cols, int channels,
                       int depth, double gamma);
/* Writes RGB pixels (rows, cols, 3) as a baseline JPEG, 4:4:4, of the given quality. */
void tf_write_jpeg(const char *path, const uint8_t *px, int rows, int cols, int quality);
/* The JPEG bytes tf_write_jpeg would write (malloc'd), *len their count. */
uint8_t *tf_jpeg_bytes(const uint8_t *px, int rows, int cols, int quality, size_t *len);

/* CIFAR-10 sample image k (of the first batch of $KILN_CIFAR10_SAMPLE; the test skips without
 * it) scaled by nearest neighbour to rows x cols, RGB (malloc'd). */
uint8_t *tf_cifar_image(int k, int rows, int cols);
/* The size image k of a made folder has: 32 to 72 rows and columns, never all square. */
void tf_size_of(int k, int *rows, int *cols);

/* A folder root/<class>/ with `classes` class folders ("class_<c>", sorted as numbered) and
 * per_class images each, image k of the folder (class k / per_class) written as
 * class_<c>/img_<k>.png (lossless, so that decoding gives back tf_cifar_image(k, size_of(k)))
 * or .jpg (quality 95) where jpeg_every > 0 and k % jpeg_every == jpeg_every - 1. */
void tf_make_folder(const char *root, int classes, int per_class, int jpeg_every);

/* The loader's resize in float64: image px (rows, cols, 3) resized to rrows x rcols by PIL's
 * antialiased bilinear filter, output (height, width, 3) the window from (oy, ox), flipped
 * left-right or not, then (v / 255 - mean[c]) / std[c]. */
void tf_ref_resize(const uint8_t *px, int rows, int cols, int rrows, int rcols, int oy, int ox,
                   int height, int width, int flip, const float mean[3], const float std[3],
                   double *out);

#endif
