/*
 * augment.cuh: image augmentation (kiln_augment, fusion/render_augment.c): images x (N, H, W, C)
 * to y of their shape, each translated by (dy, dx) and flipped left-right or not. One call moves
 * the V neighbouring channels of one output pixel, lane group e (in one 16-byte or 8-byte access
 * when VEC). Every thread of image n draws the image's Philox block (seed, offset, n) itself: the
 * same numbers in each, so that no thread waits for another.
 *
 * G is a struct of constants the generated kernel defines: the index type ix; H, W, C; V and VEC;
 * PAD (a random translation, each of dy and dx uniform in [-PAD, PAD]) or SHIFT_H, SHIFT_W (a
 * fixed one, with PAD 0); REFLECT (the border reflects, else it is zeros); FLIP: 0 none, 1 half
 * the images at random, 2 all, 3 alternating (a fixed bit of each image's data-set index, idx[n],
 * complemented on odd epochs).
 */
#ifndef KILN_AUGMENT_CUH
#define KILN_AUGMENT_CUH

#include "bf16.cuh"
#include "defs.cuh"
#include "philox.cuh"

template <class G, typename T>
KILN__FN void kiln_augment(const T *x, const int *idx, T *y, typename G::ix e,
                           unsigned long long seed, unsigned long long offset,
                           unsigned long long epoch) {
  typedef typename G::ix ix;
  constexpr bool moves = G::PAD > 0 || G::SHIFT_H != 0 || G::SHIFT_W != 0;
  constexpr bool zero_fill = moves && !G::REFLECT;
  ix m = e;
  const ix c = (m % (G::C / G::V)) * G::V;
  m /= G::C / G::V;
  const ix w = m % G::W;
  m /= G::W;
  const ix h = m % G::H, n = m / G::H;
  unsigned int r[4]; /* image n's draws */
  if constexpr (G::PAD > 0 || G::FLIP == 1) kiln_philox4(seed, offset, (unsigned long long)n, r);
  int dy = G::SHIFT_H, dx = G::SHIFT_W;
  if constexpr (G::PAD > 0) {
    dy = (int)kiln_philox_below(r[0], 2 * G::PAD + 1) - G::PAD;
    dx = (int)kiln_philox_below(r[1], 2 * G::PAD + 1) - G::PAD;
  }
  bool flip = G::FLIP == 2;
  if constexpr (G::FLIP == 1) flip = (r[2] >> 31) != 0u;
  if constexpr (G::FLIP == 3)
    flip = ((kiln_philox(seed, KILN_PHILOX_FLIP_OFFSET, (unsigned int)idx[n]) >> 31) ^
            (unsigned int)(epoch & 1ull)) != 0u;
  /* the source: pixel (h + dy, w + dx) of the image, flipped or not, reflected or 0 outside */
  ix sh = h + dy, sw = w + dx;
  bool inside = true;
  if constexpr (moves && G::REFLECT) {
    sh = sh < 0 ? -sh : (sh >= G::H ? 2 * (G::H - 1) - sh : sh);
    sw = sw < 0 ? -sw : (sw >= G::W ? 2 * (G::W - 1) - sw : sw);
  } else if constexpr (moves) {
    inside = sh >= 0 && sh < G::H && sw >= 0 && sw < G::W;
  }
  if (flip) sw = G::W - 1 - sw;
  const ix src = ((n * G::H + sh) * G::W + sw) * G::C + c;
  if constexpr (G::VEC) {
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (!zero_fill || inside) kiln_load4(&x[src], v);
    kiln_store4(&y[e * 4], v);
  } else {
#pragma unroll
    for (int l = 0; l < G::V; l++)
      y[e * G::V + l] = !zero_fill || inside ? x[src + l] : (T)0.f;
  }
}

/*
 * The image loader's batch to the network's input (kiln__resize_crop, data/imageloader.c): one
 * call makes the three channels of output pixel e of y (N, G::OH, G::OW, 3). Image n's row of
 * the table (G::COLS ints, its columns named by G::OFF and the rest) says where its staged 8-bit
 * RGB pixels start in raw and how its source (rows x cols) maps onto the output: resized to
 * rrows x rcols by the antialiased bilinear filter of PIL (and of torchvision's antialias=True),
 * then the output's window from (oy, ox), flipped left-right or not. Each channel is then
 * v mul + add (the normalisation).
 */
struct kiln_resize_axis {
  float center, fs; /* the tap's centre in the source, and the filter's scale (>= 1) */
  int lo, hi;       /* the source pixels [lo, hi) it reads */
};

/* The taps of output coordinate o (in the resized image) of a source of `in` pixels resized to
 * rs: the triangle filter widened by the scale when shrinking, cut at the source's edges. */
KILN__FN kiln_resize_axis kiln_resize_taps(int o, int in, int rs) {
  kiln_resize_axis a;
  const float scale = (float)in / (float)rs;
  a.fs = scale > 1.f ? scale : 1.f;
  a.center = ((float)o + 0.5f) * scale;
  const int lo = (int)(a.center - a.fs + 0.5f), hi = (int)(a.center + a.fs + 0.5f);
  a.lo = lo < 0 ? 0 : lo;
  a.hi = hi > in ? in : hi;
  return a;
}

KILN__FN float kiln_resize_weight(const kiln_resize_axis &a, int x) {
  const float t = fabsf(((float)x - a.center + 0.5f) / a.fs);
  return t < 1.f ? 1.f - t : 0.f;
}

template <class G, typename T>
KILN__FN void kiln_resize_crop(const unsigned char *raw, const int *table, T *y, typename G::ix e,
                               float mul0, float mul1, float mul2, float add0, float add1,
                               float add2) {
  typedef typename G::ix ix;
  ix m = e;
  const int j = (int)(m % G::OW);
  m /= G::OW;
  const int i = (int)(m % G::OH);
  const ix n = m / G::OH;
  const int *row = table + n * G::COLS;
  const int jj = row[G::FLIP] ? G::OW - 1 - j : j;
  const kiln_resize_axis ay = kiln_resize_taps(row[G::OY] + i, row[G::ROWS], row[G::RROWS]);
  const kiln_resize_axis ax = kiln_resize_taps(row[G::OX] + jj, row[G::SRC_COLS], row[G::RCOLS]);
  const int sw = row[G::SW], r0 = row[G::R0], c0 = row[G::C0];
  const unsigned char *staged = raw + row[G::OFF]; /* source pixel (r0, c0) */
  float wx_sum = 0.f;
  for (int x = ax.lo; x < ax.hi; x++)
    wx_sum += kiln_resize_weight(ax, x);
  float acc0 = 0.f, acc1 = 0.f, acc2 = 0.f, wy_sum = 0.f;
  for (int yy = ay.lo; yy < ay.hi; yy++) {
    const float wy = kiln_resize_weight(ay, yy);
    const unsigned char *p = staged + ((long long)(yy - r0) * sw + (ax.lo - c0)) * 3;
    float r = 0.f, g = 0.f, b = 0.f;
    for (int x = ax.lo; x < ax.hi; x++, p += 3) {
      const float wx = kiln_resize_weight(ax, x);
      r += wx * (float)p[0];
      g += wx * (float)p[1];
      b += wx * (float)p[2];
    }
    acc0 += wy * r;
    acc1 += wy * g;
    acc2 += wy * b;
    wy_sum += wy;
  }
  const float norm = 1.f / (wx_sum * wy_sum);
  y[e * 3] = (T)(acc0 * norm * mul0 + add0);
  y[e * 3 + 1] = (T)(acc1 * norm * mul1 + add1);
  y[e * 3 + 2] = (T)(acc2 * norm * mul2 + add2);
}

#endif
