/*
 * idx.h: synthetic MNIST files for the reader tests: idx images and labels in memory, written raw
 * or through gzip, a valid "train" split in a temporary directory, and the checks that a failed
 * read zeroed its result and named the file.
 */
#ifndef KILN_TEST_IDX_H
#define KILN_TEST_IDX_H

#include "helpers.h"

#define TH_IDX_IMAGES "train-images-idx3-ubyte"
#define TH_IDX_LABELS "train-labels-idx1-ubyte"
/* the synthetic split: 100 images of 28 x 20 */
#define TH_IDX_N 100
#define TH_IDX_ROWS 28
#define TH_IDX_COLS 20

/* An idx file in memory; 64 spare bytes follow its n for tests that append to it. */
typedef struct th_blob {
  unsigned char *p;
  size_t n;
} th_blob;

/* Writes v big-endian at p. */
void th_be32_put(unsigned char *p, uint32_t v);
/* Pixel i of the synthetic images; pseudo-random so that gzip cannot shrink them much. */
unsigned char th_idx_pixel(uint64_t i);
th_blob th_idx_images(uint32_t n, uint32_t rows, uint32_t cols);
/* Labels (i * 7 + 3) % 10. */
th_blob th_idx_labels(uint32_t n);
/* Writes dir/name raw, or dir/name.gz through zlib. */
void th_idx_put(const char *dir, const char *name, th_blob b, bool gz);
/* A fresh temporary directory (th_tmpdir) with a valid synthetic "train" split, raw or gzip. */
void th_idx_synthetic(char *dir, size_t n, bool gz);

void th_assert_mnist_zeroed(const kiln_mnist *m);
/* Reads dir's "train" split with a fresh no-GPU context and asserts that it fails with status
 * want, a message naming file and holding every substring (the list ends with NULL), and a
 * zeroed struct. */
void th_expect_mnist_error(const char *dir, kiln_status want, const char *file, ...);
#define TH_EXPECT_MNIST_ERROR(dir, status, file, ...)                                              \
  th_expect_mnist_error((dir), (status), (file), __VA_ARGS__, (const char *)NULL)

#endif
