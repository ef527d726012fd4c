/*
 * window.cuh: the sliding-window ops over images (N, H, W, C) (fusion/render_window.c): im2col,
 * col2im, max and average pooling and their gradients. Each computes the V neighbouring channels
 * (lanes) of one output element, lane group e of the kernel's grid-stride loop, and hands them
 * to store(n, a, b, c, lanes): the element's coordinates in the output, (n, h, w, c) for an image
 * (col2im, the gradients), (n, oh, ow, c) for windows, (n, oh, ow, k) for im2col's columns. The
 * store is the generated kernel's lambda: a plain store, or the elementwise epilogue fused after
 * the op. Lanes are read four at a time (kiln_load4) when V is 4.
 *
 * G is a struct of constants the generated kernel defines: the index type ix, the window (KH,
 * KW, stride SH, SW, padding PH, PW, dilation DH, DW), V, the image's H, W, C, the windows' OH,
 * OW, KP (the values a window has in the windows' tensor: C, or im2col's columns a row, which
 * may end in zero columns), im2col's and col2im's GROUPS and average pooling's EXCLUDE_PAD, so that
 * every division is by a constant. Out-of-image taps read nothing; max pooling keeps the window's
 * first maximum, NaN winning (PyTorch's rule). Its gradient finds each window's maximum again in
 * the pooled image, or reads its position from the bytes the forward pass wrote behind its output's
 * values (kiln_max_pool_at): then the pooled image need not be kept for the backward pass.
 */
#ifndef KILN_WINDOW_CUH
#define KILN_WINDOW_CUH

#include "bf16.cuh"
#include "defs.cuh"

/* V lanes from p[off]: one 16-byte (f32) or 8-byte (bf16) access when V is 4, else one a lane. */
template <int V, typename T, typename ix>
KILN__FN void kiln_win_load(const T *p, ix off, float (&v)[V]) {
  if constexpr (V == 4)
    kiln_load4(&p[off], v);
  else
#pragma unroll
    for (int l = 0; l < V; l++)
      v[l] = (float)p[off + l];
}

/* V lanes of one load, kept as loaded (kiln_fetch4's 8 bytes of bf16, 16 of f32, when V is 4)
 * and widened where a lane is read: the registers of a thread that holds several loads in flight
 * at once. */
template <int V, typename T> struct kiln_win_lanes {
  float v[V];
  template <typename ix> __device__ __forceinline__ void load(const T *p, ix off) {
    kiln_win_load<V>(p, off, v);
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int l = 0; l < V; l++)
      v[l] = 0.f;
  }
  __device__ __forceinline__ float operator[](int l) const { return v[l]; }
};
template <typename T> struct kiln_win_lanes<4, T> {
  decltype(kiln_raw4((const T *)nullptr)) r;
  template <typename ix> __device__ __forceinline__ void load(const T *p, ix off) {
    kiln_fetch4(&p[off], r);
  }
  __device__ __forceinline__ void zero() { r = {}; }
  __device__ __forceinline__ float operator[](int l) const {
    float v[4];
    kiln_unpack4(r, v);
    return v[l];
  }
};

/* V lanes to p[off]. */
template <int V, typename T, typename ix> KILN__FN void kiln_win_put(T *p, ix off, const float *v) {
  if constexpr (V == 4)
    kiln_store4(&p[off], v);
  else if constexpr (V % 8 == 0) /* a row of kiln_im2col_row's, off a multiple of 8 */
#pragma unroll
    for (int l = 0; l < V; l += 4)
      kiln_store4(&p[off + l], v + l);
  else
#pragma unroll
    for (int l = 0; l < V; l++)
      p[off + l] = (T)v[l];
}

/* Lane group e over (N, A, B, C / V): its n, a, b and first channel c. */
template <class G>
KILN__FN void kiln_win_split(typename G::ix e, typename G::ix A, typename G::ix B,
                             typename G::ix &n, typename G::ix &a, typename G::ix &b,
                             typename G::ix &c) {
  typedef typename G::ix ix;
  ix m = e;
  c = (m % (G::C / G::V)) * G::V;
  m /= G::C / G::V;
  b = m % B;
  m /= B;
  a = m % A;
  n = m / A;
}

/* Calls tap(i, j, oh, ow) for every window (oh, ow) that reads image pixel (h, w) through its tap
 * (i, j). */
template <class G, class F>
KILN__FN void kiln_win_taps_of_pixel(typename G::ix h, typename G::ix w, F tap) {
  typedef typename G::ix ix;
#pragma unroll
  for (int i = 0; i < G::KH; i++) {
    const ix th = h + G::PH - i * G::DH;
    if (th < 0 || th % G::SH != 0 || th / G::SH >= G::OH) continue;
#pragma unroll
    for (int j = 0; j < G::KW; j++) {
      const ix tw = w + G::PW - j * G::DW;
      if (tw < 0 || tw % G::SW != 0 || tw / G::SW >= G::OW) continue;
      tap(i, j, th / G::SH, tw / G::SW);
    }
  }
}

/* Calls tap(i, j, h, w) for every tap (i, j) of window (oh, ow) that lies inside the image, at
 * pixel (h, w). */
template <class G, class F>
KILN__FN void kiln_win_taps_of_window(typename G::ix oh, typename G::ix ow, F tap) {
  typedef typename G::ix ix;
  for (int i = 0; i < G::KH; i++) {
    const ix h = oh * G::SH - G::PH + i * G::DH;
    if (h < 0 || h >= G::H) continue;
    for (int j = 0; j < G::KW; j++) {
      const ix w = ow * G::SW - G::PW + j * G::DW;
      if (w < 0 || w >= G::W) continue;
      tap(i, j, h, w);
    }
  }
}

/* The loader of V lanes of element o from x (c, the element's channel, unused). */
template <class G, typename T> struct kiln_win_reader {
  const T *x;
  __device__ __forceinline__ void operator()(typename G::ix o, typename G::ix,
                                             float (&v)[G::V]) const {
    kiln_win_load<G::V>(x, o, v);
  }
};

/* Calls tap(p, q, inside) for every tap (p, q) of window (oh, ow), in order, inside telling
 * whether it lies inside the image, after load(o, c, xv[p][q]) has given each tap's lanes (element
 * o, channel c): every tap loaded first, one outside the image at the image's pixel nearest it
 * (never used), so that the loads are in flight at once, not one after another behind the taps'
 * branches (H100: ResNet's stem pool, with its batch norm and ReLU computed as it reads, took
 * 261 us for 282 MB). With many taps (over 64 values), one at a time. */
template <class G, class L, class F>
KILN__FN void kiln_win_each_tap(L load, typename G::ix n, typename G::ix oh, typename G::ix ow,
                                typename G::ix c, F tap) {
  typedef typename G::ix ix;
  if constexpr (G::KH * G::KW * G::V <= 64) {
    float xv[G::KH][G::KW][G::V];
#pragma unroll
    for (int p = 0; p < G::KH; p++)
#pragma unroll
      for (int q = 0; q < G::KW; q++) {
        const ix h = oh * G::SH - G::PH + p * G::DH, w = ow * G::SW - G::PW + q * G::DW;
        const ix hc = h < 0       ? 0
                      : h >= G::H ? G::H - 1
                                  : h,
                 wc = w < 0       ? 0
                      : w >= G::W ? G::W - 1
                                  : w;
        load(((n * G::H + hc) * G::W + wc) * G::C + c, c, xv[p][q]);
      }
#pragma unroll
    for (int p = 0; p < G::KH; p++)
#pragma unroll
      for (int q = 0; q < G::KW; q++) {
        const ix h = oh * G::SH - G::PH + p * G::DH, w = ow * G::SW - G::PW + q * G::DW;
        tap(p, q, h >= 0 && h < G::H && w >= 0 && w < G::W, xv[p][q]);
      }
  } else {
    kiln_win_taps_of_window<G>(oh, ow, [&](int p, int q, ix h, ix w) {
      float xv[G::V];
      load(((n * G::H + h) * G::W + w) * G::C + c, c, xv);
      tap(p, q, true, xv);
    });
  }
}

/* The position p * KW + q of window (oh, ow)'s first maximum in each lane (-1: no tap inside the
 * image), NaN winning; best gets the maxima (-infinity for no tap), the values kiln_max_pool
 * finds. load(o, c, lanes) gives the lanes of the image's element o (channel c): an elementwise
 * prologue's loader in a generated kernel (render_window.c), the image's values computed where
 * they are read ... */
template <class G, class L>
KILN__FN void kiln_win_argmax_by(L load, typename G::ix n, typename G::ix oh, typename G::ix ow,
                                 typename G::ix c, float (&best)[G::V], int (&at)[G::V]) {
#pragma unroll
  for (int l = 0; l < G::V; l++) {
    at[l] = -1;
    best[l] = -__int_as_float(0x7f800000);
  }
  kiln_win_each_tap<G>(load, n, oh, ow, c, [&](int p, int q, bool inside, const float(&xv)[G::V]) {
#pragma unroll
    for (int l = 0; l < G::V; l++)
      if (inside && (at[l] < 0 || xv[l] > best[l] || isnan(xv[l]))) {
        best[l] = xv[l];
        at[l] = p * G::KW + q;
      }
  });
}

/* ... or read from x. */
template <class G, typename T>
KILN__FN void kiln_win_argmax(const T *x, typename G::ix n, typename G::ix oh, typename G::ix ow,
                              typename G::ix c, float (&best)[G::V], int (&at)[G::V]) {
  kiln_win_argmax_by<G>(kiln_win_reader<G, T>{x}, n, oh, ow, c, best, at);
}

/* im2col with a thread a row (V = KP, one group): e over (N, OH, OW); every tap's C values,
 * then the zero columns, stored at once (a few channels: an image's blocks, core/conv.c's
 * to_blocks, 12 values and 4 zeros a row, written a bf16 a thread before). */
template <class G, typename T, class S>
KILN__FN void kiln_im2col_row(const T *x, typename G::ix e, S store) {
  typedef typename G::ix ix;
  const ix ow = e % G::OW, m = e / G::OW, oh = m % G::OH, n = m / G::OH;
  float y[G::KP];
#pragma unroll
  for (int i = 0; i < G::KH; i++)
#pragma unroll
    for (int j = 0; j < G::KW; j++) {
      const ix h = oh * G::SH - G::PH + i * G::DH, w = ow * G::SW - G::PW + j * G::DW;
      const int k = (i * G::KW + j) * G::C;
      if (h >= 0 && h < G::H && w >= 0 && w < G::W) {
#pragma unroll
        for (int c = 0; c < G::C; c++)
          y[k + c] = (float)x[((n * G::H + h) * G::W + w) * G::C + c];
      } else {
#pragma unroll
        for (int c = 0; c < G::C; c++)
          y[k + c] = 0.f;
      }
    }
#pragma unroll
  for (int k = G::KH * G::KW * G::C; k < G::KP; k++)
    y[k] = 0.f;
  store(n, oh, ow, (ix)0, y);
}

/* im2col: e over (N, OH, OW, KP / V), K = KH KW C values in the order (group, i, j, channel of
 * the group), then KP - K zero columns (a product's K padded to a multiple of 8: kiln_conv2d). */
template <class G, typename T, class S>
KILN__FN void kiln_im2col(const T *x, typename G::ix e, S store) {
  typedef typename G::ix ix;
  if constexpr (G::V == G::KP && G::GROUPS == 1 && G::KP > 4) {
    kiln_im2col_row<G>(x, e, store);
    return;
  }
  const ix CG = G::C / G::GROUPS, K = G::KH * G::KW * G::C;
  static_assert(G::KP >= K && G::KP % G::V == 0, "kiln_im2col: the columns' count");
  const ix k0 = (e % (G::KP / G::V)) * G::V;
  ix k = k0, m = e / (G::KP / G::V);
  const ix ow = m % G::OW;
  m /= G::OW;
  const ix oh = m % G::OH, n = m / G::OH;
  const ix cg = k % CG;
  k /= CG;
  const int j = (int)(k % G::KW);
  k /= G::KW;
  const int i = (int)(k % G::KH);
  const ix c = (k / G::KH) * CG + cg;
  const ix h = oh * G::SH - G::PH + i * G::DH, w = ow * G::SW - G::PW + j * G::DW;
  float y[G::V];
  if (k0 < K && h >= 0 && h < G::H && w >= 0 && w < G::W) {
    kiln_win_load<G::V>(x, ((n * G::H + h) * G::W + w) * G::C + c, y);
  } else {
#pragma unroll
    for (int l = 0; l < G::V; l++)
      y[l] = 0.f;
  }
  store(n, oh, ow, k0, y);
}

/* col2im: e over the image; each pixel sums the columns that read it (rows of KP columns, the
 * zero columns past K read by none). With few taps (at most 64 values) every tap's loads are
 * issued before the first sum, so that they are in flight at once; the sums in the same order. */
template <class G, typename T, class S>
KILN__FN void kiln_col2im(const T *col, typename G::ix e, S store) {
  typedef typename G::ix ix;
  const ix CG = G::C / G::GROUPS, K = G::KP;
  ix n, h, w, c;
  kiln_win_split<G>(e, G::H, G::W, n, h, w, c);
  const ix g = c / CG, cg = c % CG;
  float acc[G::V] = {};
  const auto off = [&](int i, int j, ix oh, ix ow) {
    return ((n * G::OH + oh) * G::OW + ow) * K + ((g * G::KH + i) * G::KW + j) * CG + cg;
  };
  if constexpr (G::KH * G::KW * G::V <= 64) { /* every tap's loads issued, then the sums */
    kiln_win_lanes<G::V, T> cv[G::KH][G::KW];
    kiln_win_taps_of_pixel<G>(
        h, w, [&](int i, int j, ix oh, ix ow) { cv[i][j].load(col, off(i, j, oh, ow)); });
    kiln_win_taps_of_pixel<G>(h, w, [&](int i, int j, ix, ix) {
#pragma unroll
      for (int l = 0; l < G::V; l++)
        acc[l] += cv[i][j][l];
    });
  } else {
    kiln_win_taps_of_pixel<G>(h, w, [&](int i, int j, ix oh, ix ow) {
      float cv[G::V];
      kiln_win_load<G::V>(col, off(i, j, oh, ow), cv);
#pragma unroll
      for (int l = 0; l < G::V; l++)
        acc[l] += cv[l];
    });
  }
  store(n, h, w, c, acc);
}

/* max pooling: e over the windows, the image's values given by load (kiln_win_argmax_by's) ... */
template <class G, class L, class S>
KILN__FN void kiln_max_pool_by(L load, typename G::ix e, S store) {
  typedef typename G::ix ix;
  ix n, oh, ow, c;
  kiln_win_split<G>(e, G::OH, G::OW, n, oh, ow, c);
  float best[G::V];
#pragma unroll
  for (int l = 0; l < G::V; l++)
    best[l] = -__int_as_float(0x7f800000);
  kiln_win_each_tap<G>(load, n, oh, ow, c, [&](int, int, bool inside, const float(&xv)[G::V]) {
#pragma unroll
    for (int l = 0; l < G::V; l++)
      if (inside && (xv[l] > best[l] || isnan(xv[l]))) best[l] = xv[l];
  });
  store(n, oh, ow, c, best);
}

/* ... or read from x. */
template <class G, typename T, class S>
KILN__FN void kiln_max_pool(const T *x, typename G::ix e, S store) {
  kiln_max_pool_by<G>(kiln_win_reader<G, T>{x}, e, store);
}

/* max pooling that also writes, for its gradient, each value's window position p * KW + q (255:
 * the window has no tap inside the image) as a byte at `at`, indexed like the output; the image's
 * values given by load ... */
template <class G, class L, class S>
KILN__FN void kiln_max_pool_at_by(L load, unsigned char *at, typename G::ix e, S store) {
  typedef typename G::ix ix;
  ix n, oh, ow, c;
  kiln_win_split<G>(e, G::OH, G::OW, n, oh, ow, c);
  float best[G::V];
  int pos[G::V];
  kiln_win_argmax_by<G>(load, n, oh, ow, c, best, pos);
  const ix o = ((n * G::OH + oh) * G::OW + ow) * G::C + c;
  if constexpr (G::V == 4) {
    unsigned int four = 0;
#pragma unroll
    for (int l = 0; l < 4; l++)
      four |= (unsigned int)(pos[l] & 255) << (8 * l);
    *(unsigned int *)&at[o] = four;
  } else {
    at[o] = (unsigned char)(pos[0] & 255);
  }
  store(n, oh, ow, c, best);
}

/* ... or read from x. */
template <class G, typename T, class S>
KILN__FN void kiln_max_pool_at(const T *x, unsigned char *at, typename G::ix e, S store) {
  kiln_max_pool_at_by<G>(kiln_win_reader<G, T>{x}, at, e, store);
}

/* Where the maxima of window (oh, ow) are, for max pooling's gradient: searched again in the
 * pooled image x ... */
template <class G, typename TX> struct kiln_win_search {
  const TX *x;
  __device__ __forceinline__ void operator()(typename G::ix n, typename G::ix oh, typename G::ix ow,
                                             typename G::ix c, int (&pos)[G::V]) const {
    float best[G::V];
    kiln_win_argmax<G>(x, n, oh, ow, c, best, pos);
  }
};

/* ... or read from the bytes kiln_max_pool_at wrote (255 is no position). */
template <class G> struct kiln_win_positions {
  const unsigned char *at;
  __device__ __forceinline__ void operator()(typename G::ix n, typename G::ix oh, typename G::ix ow,
                                             typename G::ix c, int (&pos)[G::V]) const {
    const typename G::ix o = ((n * G::OH + oh) * G::OW + ow) * G::C + c;
    if constexpr (G::V == 4) {
      const unsigned int four = *(const unsigned int *)&at[o];
#pragma unroll
      for (int l = 0; l < 4; l++)
        pos[l] = (int)((four >> (8 * l)) & 255);
    } else {
      pos[0] = at[o];
    }
#pragma unroll
    for (int l = 0; l < G::V; l++)
      if (pos[l] == 255) pos[l] = -1;
  }
};

/* max pooling's gradient: e over the image; each pixel sums the gradients of the windows whose
 * first maximum it is. dy is the output's gradient, find the windows' maxima. */
template <class G, typename T, class F, class S>
KILN__FN void kiln_max_pool_grad_from(const T *dy, F find, typename G::ix e, S store) {
  typedef typename G::ix ix;
  ix n, h, w, c;
  kiln_win_split<G>(e, G::H, G::W, n, h, w, c);
  float acc[G::V] = {};
  kiln_win_taps_of_pixel<G>(h, w, [&](int i, int j, ix oh, ix ow) {
    float gv[G::V];
    int at[G::V];
    find(n, oh, ow, c, at);
    kiln_win_load<G::V>(dy, ((n * G::OH + oh) * G::OW + ow) * G::C + c, gv);
#pragma unroll
    for (int l = 0; l < G::V; l++)
      if (at[l] == i * G::KW + j) acc[l] += gv[l];
  });
  store(n, h, w, c, acc);
}

/* max pooling's gradient a block of SH x SW pixels a thread (stride 2 or less, no dilation, H and
 * W multiples of the stride): e over the blocks; each window that reaches the block finds its
 * maximum and loads its gradient once, not once for each of the block's pixels it covers, and
 * adds it to the pixel of its maximum if that is in the block. The windows come last first, the
 * order in which kiln_max_pool_grad_from sums a pixel's: the sums are the same bit for bit. */
template <class G, typename T, class F, class S>
KILN__FN void kiln_max_pool_grad_blocks_from(const T *dy, F find, typename G::ix e, S store) {
  typedef typename G::ix ix;
  static_assert(G::DH == 1 && G::DW == 1 && G::H % G::SH == 0 && G::W % G::SW == 0 && G::SH <= 2 &&
                    G::SW <= 2,
                "kiln_max_pool_grad_blocks: the windows' geometry");
  ix n, bh, bw, c;
  kiln_win_split<G>(e, G::H / G::SH, G::W / G::SW, n, bh, bw, c);
  const ix h0 = bh * G::SH, w0 = bw * G::SW;
  float acc[G::SH][G::SW][G::V] = {};
  /* the last window whose first row (column) is in the block or above (left of) it, back to the
   * first whose last row (column) is in the block: at most NH (NW) of them, a fixed count that
   * unrolls. Every window's maxima and gradient are loaded first (those past the image give no
   * position), then added, so that all the loads are in flight at once. */
  constexpr int NH = (G::KH + 2 * G::SH - 2) / G::SH, NW = (G::KW + 2 * G::SW - 2) / G::SW;
  const ix oh1 = (h0 + G::SH - 1 + G::PH) / G::SH, ow1 = (w0 + G::SW - 1 + G::PW) / G::SW;
  kiln_win_lanes<G::V, T> gv[NH][NW];
  int at[NH][NW][G::V];
#pragma unroll
  for (int a = 0; a < NH; a++)
#pragma unroll
    for (int b = 0; b < NW; b++) {
      const ix oh = oh1 - a, ow = ow1 - b;
      if (oh >= 0 && oh < G::OH && oh * G::SH - G::PH + G::KH > h0 && ow >= 0 && ow < G::OW &&
          ow * G::SW - G::PW + G::KW > w0) {
        find(n, oh, ow, c, at[a][b]);
        gv[a][b].load(dy, ((n * G::OH + oh) * G::OW + ow) * G::C + c);
      } else {
        gv[a][b].zero();
#pragma unroll
        for (int l = 0; l < G::V; l++)
          at[a][b][l] = -1;
      }
    }
#pragma unroll
  for (int a = 0; a < NH; a++)
#pragma unroll
    for (int b = 0; b < NW; b++)
#pragma unroll
      for (int l = 0; l < G::V; l++) {
        /* the maximum's pixel, relative to the block (none: outside it) */
        const int t = at[a][b][l];
        const int p = t < 0 ? -1 : (int)((oh1 - a) * G::SH - G::PH - h0) + t / G::KW;
        const int q = t < 0 ? -1 : (int)((ow1 - b) * G::SW - G::PW - w0) + t % G::KW;
#pragma unroll
        for (int i = 0; i < G::SH; i++)
#pragma unroll
          for (int j = 0; j < G::SW; j++)
            if (p == i && q == j) acc[i][j][l] += gv[a][b][l];
      }
#pragma unroll
  for (int i = 0; i < G::SH; i++)
#pragma unroll
    for (int j = 0; j < G::SW; j++)
      store(n, h0 + i, w0 + j, c, acc[i][j]);
}

/* max pooling's gradient over windows that tile the image (stride = kernel, no padding or
 * dilation): e over the windows; each finds its maximum once and writes its own pixels, the last
 * window of a row or column also the zeros of the pixels no window covers. load(o, c, gv) gives
 * the lanes of dy at its element o (channel c). */
template <class G, class L, class F, class S>
KILN__FN void kiln_max_pool_grad_tiled_by(L load, F find, typename G::ix e, S store) {
  typedef typename G::ix ix;
  ix n, oh, ow, c;
  kiln_win_split<G>(e, G::OH, G::OW, n, oh, ow, c);
  float gv[G::V];
  int at[G::V];
  find(n, oh, ow, c, at);
  load(((n * G::OH + oh) * G::OW + ow) * G::C + c, c, gv);
  const ix hend = G::H == G::OH * G::KH || oh < G::OH - 1 ? oh * G::KH + G::KH : G::H;
  const ix wend = G::W == G::OW * G::KW || ow < G::OW - 1 ? ow * G::KW + G::KW : G::W;
  for (ix h = oh * G::KH; h < hend; h++)
    for (ix w = ow * G::KW; w < wend; w++) {
      const int p = (int)(h - oh * G::KH), q = (int)(w - ow * G::KW);
      float d[G::V];
#pragma unroll
      for (int l = 0; l < G::V; l++)
        d[l] = p < G::KH && q < G::KW && at[l] == p * G::KW + q ? gv[l] : 0.f;
      store(n, h, w, c, d);
    }
}

/* The same with dy read from memory. */
template <class G, typename T, class F, class S>
KILN__FN void kiln_max_pool_grad_tiled_from(const T *dy, F find, typename G::ix e, S store) {
  kiln_max_pool_grad_tiled_by<G>(
      [&](typename G::ix o, typename G::ix, float(&gv)[G::V]) { kiln_win_load<G::V>(dy, o, gv); },
      find, e, store);
}

/* The gradient from the pooled image x, whose windows it searches again (the unfused reference,
 * and pools without positions) ... */
template <class G, typename T, typename TX, class S>
KILN__FN void kiln_max_pool_grad(const T *dy, const TX *x, typename G::ix e, S store) {
  kiln_max_pool_grad_from<G>(dy, kiln_win_search<G, TX>{x}, e, store);
}
template <class G, typename T, typename TX, class S>
KILN__FN void kiln_max_pool_grad_tiled(const T *dy, const TX *x, typename G::ix e, S store) {
  kiln_max_pool_grad_tiled_from<G>(dy, kiln_win_search<G, TX>{x}, e, store);
}

template <class G, typename T, typename TX, class S>
KILN__FN void kiln_max_pool_grad_blocks(const T *dy, const TX *x, typename G::ix e, S store) {
  kiln_max_pool_grad_blocks_from<G>(dy, kiln_win_search<G, TX>{x}, e, store);
}

/* ... or from the positions the forward pass wrote (kiln_max_pool_at). */
template <class G, typename T, class S>
KILN__FN void kiln_max_pool_grad_at(const T *dy, const unsigned char *at, typename G::ix e,
                                    S store) {
  kiln_max_pool_grad_from<G>(dy, kiln_win_positions<G>{at}, e, store);
}
template <class G, typename T, class S>
KILN__FN void kiln_max_pool_grad_tiled_at(const T *dy, const unsigned char *at, typename G::ix e,
                                          S store) {
  kiln_max_pool_grad_tiled_from<G>(dy, kiln_win_positions<G>{at}, e, store);
}

template <class G, typename T, class S>
KILN__FN void kiln_max_pool_grad_blocks_at(const T *dy, const unsigned char *at, typename G::ix e,
                                           S store) {
  kiln_max_pool_grad_blocks_from<G>(dy, kiln_win_positions<G>{at}, e, store);
}

/* ... with dy computed where it is read: load(o, c, gv) gives the lanes of dy's element o, channel
 * c (an elementwise prologue, render_window.c). */
template <class G, class L, class S>
KILN__FN void kiln_max_pool_grad_tiled_at_by(L load, const unsigned char *at, typename G::ix e,
                                             S store) {
  kiln_max_pool_grad_tiled_by<G>(load, kiln_win_positions<G>{at}, e, store);
}

/* average pooling: e over the windows, divided by the window's size, or with EXCLUDE_PAD by its
 * taps inside the image. */
template <class G, typename T, class S>
KILN__FN void kiln_avg_pool(const T *x, typename G::ix e, S store) {
  typedef typename G::ix ix;
  ix n, oh, ow, c;
  kiln_win_split<G>(e, G::OH, G::OW, n, oh, ow, c);
  float acc[G::V] = {};
  int inside = 0;
  /* the window's taps inside the image (average pooling has no dilation: DH = DW = 1) */
  kiln_win_taps_of_window<G>(oh, ow, [&](int, int, ix h, ix w) {
    inside++;
    float xv[G::V];
    kiln_win_load<G::V>(x, ((n * G::H + h) * G::W + w) * G::C + c, xv);
#pragma unroll
    for (int l = 0; l < G::V; l++)
      acc[l] += xv[l];
  });
#pragma unroll
  for (int l = 0; l < G::V; l++)
    acc[l] /= (float)(G::EXCLUDE_PAD ? inside : G::KH * G::KW);
  store(n, oh, ow, c, acc);
}

/* average pooling's gradient: e over the image; each pixel sums its windows' gradients, each
 * over that window's divisor. */
template <class G, typename T, class S>
KILN__FN void kiln_avg_pool_grad(const T *dy, typename G::ix e, S store) {
  typedef typename G::ix ix;
  ix n, h, w, c;
  kiln_win_split<G>(e, G::H, G::W, n, h, w, c);
  float acc[G::V] = {};
  kiln_win_taps_of_pixel<G>(h, w, [&](int, int, ix oh, ix ow) {
    float div = (float)(G::KH * G::KW);
    if (G::EXCLUDE_PAD) {
      const ix h0 = oh * G::SH - G::PH, w0 = ow * G::SW - G::PW;
      const ix nh = (h0 + G::KH < G::H ? h0 + G::KH : G::H) - (h0 > 0 ? h0 : 0);
      const ix nw = (w0 + G::KW < G::W ? w0 + G::KW : G::W) - (w0 > 0 ? w0 : 0);
      div = (float)(nh * nw);
    }
    float gv[G::V];
    kiln_win_load<G::V>(dy, ((n * G::OH + oh) * G::OW + ow) * G::C + c, gv);
#pragma unroll
    for (int l = 0; l < G::V; l++)
      acc[l] += gv[l] / div;
  });
  store(n, h, w, c, acc);
}

#endif
