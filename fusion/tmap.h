/*
 * tmap.h: the tensor maps (CUtensorMap) that the TMA-fed convolution products read their tiles
 * through (fusion/device/conv_tma.cuh). A renderer says what each map holds (kiln__tmap_desc:
 * pure functions of the shapes, testable without a GPU); the executor encodes the maps when it
 * binds a kernel's arguments, the tensors' addresses known, and hands the kernel their device
 * copy.
 */
#ifndef KILN_TMAP_H
#define KILN_TMAP_H

#include <stdbool.h>
#include <stdint.h>

#include "../core/internal.h"

#define KILN__TMAP_BYTES 128 /* sizeof(CUtensorMap), 64-byte aligned */
#define KILN__KMAX_TMAP 2    /* maps a kernel reads */

/* What one map holds: a bf16 tensor of rank 2 to 4, dims innermost first, strides in bytes of
 * dims 1.., read in tiles of box (128-byte swizzle, box[0] 64 values) or, im2col, as the columns
 * of a window: `pixels` pixels of 64 channels a copy, the window's box corners (W, H) and its
 * stride as the traversal's. operand: the kernel argument (a.ptr) whose tensor it reads. */
typedef struct kiln__tmap_desc {
  int operand, rank;
  bool im2col;
  uint64_t dims[4], strides[3];
  uint32_t box[4], elem_strides[4];
  int lower[2], upper[2];
  uint32_t pixels;
} kiln__tmap_desc;

/* An NHWC image (n, h, w, c) read as the columns of window w, `pixels` output pixels a copy:
 * the box corners -p and p - d (k - 1) (W then H), so that the box's positions stepped by the
 * stride are the output pixels. */
kiln__tmap_desc kiln__tmap_im2col(int operand, const int64_t nhwc[4], const kiln__win *w,
                                  int pixels);
/* A dense tensor of `rank` dims (innermost first) read in boxes of box. */
kiln__tmap_desc kiln__tmap_tiled(int operand, int rank, const int64_t *dims, const uint32_t *box);
/* Encodes map d of the tensor at ptr into out (KILN__TMAP_BYTES, 64-byte aligned) with the
 * driver; an error naming the map on failure (an old driver, a geometry it refuses). */
bool kiln__tmap_encode(kiln_ctx *ctx, const kiln__tmap_desc *d, void *ptr, void *out);

#endif
