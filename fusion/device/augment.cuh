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

#endif
