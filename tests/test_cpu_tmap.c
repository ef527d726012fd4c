/*
 * test_cpu_tmap.c: the tensor maps the TMA-fed convolution products ask for (fusion/tmap.c),
 * without a GPU: an im2col map's box corners give exactly the output pixels for every window,
 * and the im2col and tiled maps' layouts (test_cpu_conv_tma.c has the kernels that use them).
 */
#include <string.h>

#include "fusion/fusion.h"
#include "inspect.h"

/* The standard output size of a window along one dimension (PyTorch's formula). */
static int64_t out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d) {
  int64_t span = in + 2 * p - d * (k - 1);
  return span < 1 ? 0 : (span - 1) / s + 1;
}

/* The positions an im2col map's traversal visits along a dimension of size `in`: from the lower
 * corner to in + upper (exclusive), stepped by the stride. */
static int64_t positions(int64_t in, int lower, int upper, uint32_t stride) {
  int64_t span = in + upper - lower;
  return span <= 0 ? 0 : (span + stride - 1) / stride;
}

Test(conv_tma, im2col_maps_visit_exactly_the_output_pixels) {
  int checked = 0;
  for (int64_t k = 1; k <= 7; k++)
    for (int64_t s = 1; s <= 3; s++)
      for (int64_t p = 0; p <= 3; p++)
        for (int64_t d = 1; d <= 2; d++)
          for (int64_t in = 1; in <= 20; in++) {
            int64_t o = out_size(in, k, s, p, d);
            if (o < 1) continue;
            /* height and width differ, so that a swapped corner shows */
            kiln__win w = {.kh = k,
                           .kw = k == 1 ? 1 : k - 1,
                           .sh = s,
                           .sw = s,
                           .ph = p,
                           .pw = p > 0 ? p - 1 : 0,
                           .dh = d,
                           .dw = d};
            int64_t ow = out_size(in + 3, w.kw, w.sw, w.pw, w.dw);
            if (ow < 1) continue;
            const int64_t nhwc[4] = {2, in, in + 3, 64};
            kiln__tmap_desc m = kiln__tmap_im2col(1, nhwc, &w, 128);
            cr_assert_eq(m.rank, 4);
            cr_assert(m.im2col);
            cr_assert_eq(m.operand, 1);
            cr_assert_eq(positions(in, m.lower[1], m.upper[1], m.elem_strides[2]), o,
                         "k %lld s %lld p %lld d %lld in %lld: height", (long long)k, (long long)s,
                         (long long)p, (long long)d, (long long)in);
            cr_assert_eq(positions(in + 3, m.lower[0], m.upper[0], m.elem_strides[1]), ow,
                         "k %lld s %lld p %lld d %lld in %lld: width", (long long)k, (long long)s,
                         (long long)p, (long long)d, (long long)in + 3);
            checked++;
          }
  cr_assert_gt(checked, 1000);
}

Test(conv_tma, im2col_map_layout) {
  kiln__win w = {.kh = 3, .kw = 3, .sh = 2, .sw = 2, .ph = 1, .pw = 0, .dh = 1, .dw = 2};
  const int64_t nhwc[4] = {8, 9, 7, 128};
  kiln__tmap_desc m = kiln__tmap_im2col(0, nhwc, &w, 64);
  /* innermost first: C, W, H, N; strides in bytes of W, H and N */
  cr_assert_eq(m.dims[0], 128);
  cr_assert_eq(m.dims[1], 7);
  cr_assert_eq(m.dims[2], 9);
  cr_assert_eq(m.dims[3], 8);
  cr_assert_eq(m.strides[0], 128 * 2);
  cr_assert_eq(m.strides[1], 7 * 128 * 2);
  cr_assert_eq(m.strides[2], 9 * 7 * 128 * 2);
  /* corners in (W, H) order: -p and p - d (k - 1) */
  cr_assert_eq(m.lower[0], 0);
  cr_assert_eq(m.lower[1], -1);
  cr_assert_eq(m.upper[0], 0 - 2 * 2);
  cr_assert_eq(m.upper[1], 1 - 1 * 2);
  cr_assert_eq(m.elem_strides[0], 1);
  cr_assert_eq(m.elem_strides[1], 2);
  cr_assert_eq(m.elem_strides[2], 2);
  cr_assert_eq(m.elem_strides[3], 1);
  cr_assert_eq(m.box[0], 64, "64 channels a pixel: the 128-byte swizzle's span");
  cr_assert_eq(m.pixels, 64);
}

Test(conv_tma, tiled_map_layout) {
  const int64_t dims[3] = {64, 9, 256};
  kiln__tmap_desc m = kiln__tmap_tiled(4, 3, dims, (const uint32_t[]){64, 1, 64});
  cr_assert_not(m.im2col);
  cr_assert_eq(m.operand, 4);
  cr_assert_eq(m.rank, 3);
  cr_assert_eq(m.strides[0], 64 * 2);
  cr_assert_eq(m.strides[1], 64 * 9 * 2);
  cr_assert_eq(m.box[0], 64);
  cr_assert_eq(m.box[1], 1);
  cr_assert_eq(m.box[2], 64);
  for (int i = 0; i < 3; i++)
    cr_assert_eq(m.elem_strides[i], 1);
}
