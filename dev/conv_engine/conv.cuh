/*
 * conv.cuh (an experiment of dev/conv_engine, not part of the library, in namespace lab): a
 * convolution's forward product and its weight gradient as implicit GEMMs on tensor cores (bf16
 * operands, f32 accumulators, mma.sync m16n8k16 with ldmatrix, multi-stage cp.async pipelines,
 * sm_80 and newer): the sm_80 path the library does not have yet.
 * No column matrix exists: the tiles of im2col(X) are gathered from the image as they are needed,
 * cp.async's zero fill giving the padding.
 *
 * The image X is (N, H, W, CI), the output Y (N, OH, OW, CO), the filters Wk (CO, K) with
 * column k = (i KW + j) CI + c of tap (i, j) (the order im2col writes, kiln's permuted weight),
 * K = KH KW CI, M = N OH OW output pixels. CI is a multiple of 8, so that every 16-byte chunk
 * of a column lies in one tap.
 *   forward:         Y (M, CO)  = im2col(X) (M, K)  Wk^T (K, CO)
 *   weight gradient: dWt (K, CO) = im2col(X)^T (K, M) dY (M, CO), over the pixels [p0, p1) of
 *                    this block (a split of the reduction; the caller sums the splits)
 * G is a struct of constants the generated kernel defines: N, H, W, CI, OH, OW, CO, KH, KW, SH,
 * SW, PH, PW, DH, DW. Tiles: BM x BN outputs a block, BK = 32 of the reduction a stage, WM x WN
 * warps, each a (BM / WM) x (BN / WN) tile of m16n8 fragments; STAGES stages of shared memory.
 * Shared tiles are rows of 16-byte chunks whose index is XORed with the row (a swizzle), so that
 * the eight rows an ldmatrix reads fall in distinct banks.
 */
#ifndef KILN_LAB_CONV_CUH
#define KILN_LAB_CONV_CUH

#include "../../fusion/device/mma.cuh"

namespace lab { /* apart from the library's conv.cuh, which the lab includes too */

/* A tile config and the fragment counts it implies. */
template <int BM_, int BN_, int WM_, int WN_, int STAGES_> struct kiln_conv_tile {
  static constexpr int BM = BM_, BN = BN_, WM = WM_, WN = WN_, STAGES = STAGES_, BK = 32;
  static constexpr int THREADS = WM * WN * 32;
  static constexpr int MI = BM / WM / 16, NI = BN / WN / 8; /* m16 and n8 fragments a warp */
  static_assert(BM % (16 * WM) == 0 && BN % (16 * WN) == 0, "kiln_conv_tile: warp tiles");
};

/* Element offset of chunk c (8 elements) of row r in a tile whose rows hold CH chunks. */
template <int CH> KILN__FN int kiln_swz(int r, int c) {
  if constexpr (CH == 4)
    return r * 32 + ((c ^ ((r >> 1) & 3)) << 3); /* 64-byte rows: two rows a 128-byte line */
  else
    return r * CH * 8 + ((c ^ (r & 7)) << 3); /* rows of 128 bytes or more */
}

/* The taps of an output pixel: its image's first element and its window's origin. */
struct kiln_conv_px {
  long long base; /* n H W CI */
  int ih, iw;     /* oh SH - PH, ow SW - PW; ih = INT_MIN/2 past the last pixel */
};

template <class G> KILN__FN kiln_conv_px kiln_conv_pixel(long long m, long long M) {
  kiln_conv_px p;
  if (m >= M) {
    p.base = 0;
    p.ih = -(1 << 29);
    p.iw = 0;
    return p;
  }
  const int ow = (int)(m % G::OW);
  const long long r = m / G::OW;
  const int oh = (int)(r % G::OH);
  const long long n = r / G::OH;
  p.base = n * G::H * G::W * G::CI;
  p.ih = oh * G::SH - G::PH;
  p.iw = ow * G::SW - G::PW;
  return p;
}

/* The 16-byte chunk of im2col(X) at pixel p, columns [k, k + 8) (one tap: CI % 8 == 0). */
template <class G>
KILN__FN const kiln_bf16 *kiln_conv_gather(const kiln_bf16 *x, const kiln_conv_px &p, int k,
                                           bool &valid) {
  constexpr int K = G::KH * G::KW * G::CI;
  const int tap = k / G::CI, c = k - tap * G::CI;
  const int ih = p.ih + (tap / G::KW) * G::DH, iw = p.iw + (tap % G::KW) * G::DW;
  valid = k < K && ih >= 0 && ih < G::H && iw >= 0 && iw < G::W;
  return valid ? x + p.base + ((long long)ih * G::W + iw) * G::CI + c : x;
}

/* Copies stage kt of the forward product's operands into As and Bs (tiles whose rows hold CH
 * 16-byte chunks, BK = 8 CH of the reduction): the rows of im2col(X) of the block's pixels px and
 * the rows of Wk from channel n0; this thread copies chunk tid % CH of rows tid / CH + s NT / CH.
 */
template <class G, int CH, int NT, int AP, int BP>
KILN__FN void kiln_conv_fprop_stage(const kiln_bf16 *x, const kiln_bf16 *wk,
                                    const kiln_conv_px (&px)[AP], int n0, int kt, kiln_bf16 *As,
                                    kiln_bf16 *Bs) {
  constexpr int K = G::KH * G::KW * G::CI, ROWS = NT / CH;
  const int chunk = threadIdx.x % CH, row = threadIdx.x / CH, k = kt * CH * 8 + chunk * 8;
#pragma unroll
  for (int s = 0; s < AP; s++) {
    bool ok;
    const kiln_bf16 *src = kiln_conv_gather<G>(x, px[s], k, ok);
    kiln_cp16(&As[kiln_swz<CH>(row + s * ROWS, chunk)], src, ok);
  }
#pragma unroll
  for (int s = 0; s < BP; s++) {
    const int co = n0 + row + s * ROWS;
    const bool ok = co < G::CO && k < K;
    kiln_cp16(&Bs[kiln_swz<CH>(row + s * ROWS, chunk)], ok ? wk + (long long)co * K + k : wk, ok);
  }
}

/* The forward product of the block's pixels [m0, m0 + BM) and output channels [n0, n0 + BN):
 * acc[mi][ni][e] is pixel m0 + (warp / WN) (BM / WM) + 16 mi + lane / 4 + 8 (e / 2), channel
 * n0 + (warp % WN) (BN / WN) + 8 ni + 2 (lane % 4) + e % 2. */
template <class G, class T>
KILN__FN void kiln_conv_fprop(const kiln_bf16 *__restrict__ x, const kiln_bf16 *__restrict__ wk,
                              long long m0, int n0, float (&acc)[T::MI][T::NI][4]) {
  constexpr int BM = T::BM, BN = T::BN, BK = T::BK, S = T::STAGES, NT = T::THREADS;
  constexpr int K = G::KH * G::KW * G::CI, KT = (K + BK - 1) / BK;
  constexpr long long M = (long long)G::N * G::OH * G::OW;
  constexpr int AP = BM * 4 / NT, BP = BN * 4 / NT; /* chunks a thread copies a stage */
  static_assert(G::CI % 8 == 0 && AP * NT == BM * 4 && BP * NT == BN * 4, "kiln_conv_fprop");
  __shared__ __align__(128) kiln_bf16 As[S][BM * BK];
  __shared__ __align__(128) kiln_bf16 Bs[S][BN * BK];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  kiln_conv_px px[AP];
#pragma unroll
  for (int s = 0; s < AP; s++)
    px[s] = kiln_conv_pixel<G>(m0 + (tid >> 2) + s * (NT / 4), M);
  auto load = [&](int kt, int st) {
    kiln_conv_fprop_stage<G, 4, NT, AP, BP>(x, wk, px, n0, kt, As[st], Bs[st]);
  };
#pragma unroll
  for (int mi = 0; mi < T::MI; mi++)
#pragma unroll
    for (int ni = 0; ni < T::NI; ni++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        acc[mi][ni][e] = 0.f;
#pragma unroll
  for (int s = 0; s < S - 1; s++) {
    if (s < KT) load(s, s);
    kiln_cp_commit();
  }
  const int wr = (warp / T::WN) * (BM / T::WM), wc = (warp % T::WN) * (BN / T::WN);
  const int q = lane >> 3, l8 = lane & 7;
  for (int kt = 0; kt < KT; kt++) {
    kiln_cp_wait<S - 2>();
    __syncthreads();
    if (kt + S - 1 < KT) load(kt + S - 1, (kt + S - 1) % S);
    kiln_cp_commit();
    const kiln_bf16 *a = As[kt % S], *b = Bs[kt % S];
#pragma unroll
    for (int kk = 0; kk < BK / 8; kk += 2) {
      unsigned af[T::MI][4], bf[T::NI][2];
#pragma unroll
      for (int mi = 0; mi < T::MI; mi++)
        kiln_ldsm4(&a[kiln_swz<4>(wr + mi * 16 + l8 + (q & 1) * 8, kk + (q >> 1))], af[mi]);
#pragma unroll
      for (int ni = 0; ni < T::NI; ni += 2) {
        unsigned r[4];
        kiln_ldsm4(&b[kiln_swz<4>(wc + ni * 8 + l8 + (q >> 1) * 8, kk + (q & 1))], r);
        bf[ni][0] = r[0], bf[ni][1] = r[1], bf[ni + 1][0] = r[2], bf[ni + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < T::MI; mi++)
#pragma unroll
        for (int ni = 0; ni < T::NI; ni++)
          kiln_mma_bf16(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
    }
  }
  kiln_cp_wait<0>();
}

/* The weight gradient's block: rows [k0, k0 + BM) of dWt (K, CO), its columns [n0, n0 + BN),
 * summed over the pixels [p0, p1) (p1 - p0 a multiple of BK, or the last pixel): acc[mi][ni][e]
 * is row k0 + (warp / WN) (BM / WM) + 16 mi + lane / 4 + 8 (e / 2), column n0 + (warp % WN)
 * (BN / WN) + 8 ni + 2 (lane % 4) + e % 2. */
template <class G, class T>
KILN__FN void kiln_conv_wgrad(const kiln_bf16 *__restrict__ x, const kiln_bf16 *__restrict__ dy,
                              int k0, int n0, long long p0, long long p1,
                              float (&acc)[T::MI][T::NI][4]) {
  constexpr int BM = T::BM, BN = T::BN, BK = T::BK, S = T::STAGES, NT = T::THREADS;
  constexpr int K = G::KH * G::KW * G::CI, ACH = BM / 8, BCH = BN / 8;
  constexpr int AP = BK * ACH / NT, BP = BK * BCH / NT; /* chunks a thread copies a stage */
  static_assert(G::CI % 8 == 0 && G::CO % 8 == 0 && AP * NT == BK * ACH && BP * NT == BK * BCH,
                "kiln_conv_wgrad");
  __shared__ __align__(128) kiln_bf16 As[S][BK * BM]; /* [pixel][k] */
  __shared__ __align__(128) kiln_bf16 Bs[S][BK * BN]; /* [pixel][co] */
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int ac = tid % ACH, bc = tid % BCH; /* the chunks this thread copies */
  const int ka = k0 + ac * 8, cb = n0 + bc * 8;
  const long long M = (long long)G::N * G::OH * G::OW, pend = p1 < M ? p1 : M;
  const int KT = (int)((pend - p0 + BK - 1) / BK);
  auto load = [&](int kt, int st) {
#pragma unroll
    for (int s = 0; s < AP; s++) {
      const int row = tid / ACH + s * (NT / ACH);
      const long long p = p0 + (long long)kt * BK + row;
      const kiln_conv_px px = kiln_conv_pixel<G>(p, pend);
      bool ok;
      const kiln_bf16 *src = kiln_conv_gather<G>(x, px, ka, ok);
      kiln_cp16(&As[st][kiln_swz<ACH>(row, ac)], src, ok);
    }
#pragma unroll
    for (int s = 0; s < BP; s++) {
      const int row = tid / BCH + s * (NT / BCH);
      const long long p = p0 + (long long)kt * BK + row;
      const bool ok = p < pend && cb < G::CO;
      kiln_cp16(&Bs[st][kiln_swz<BCH>(row, bc)], ok ? dy + p * G::CO + cb : dy, ok);
    }
  };
#pragma unroll
  for (int mi = 0; mi < T::MI; mi++)
#pragma unroll
    for (int ni = 0; ni < T::NI; ni++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        acc[mi][ni][e] = 0.f;
#pragma unroll
  for (int s = 0; s < S - 1; s++) {
    if (s < KT) load(s, s);
    kiln_cp_commit();
  }
  const int wr = (warp / T::WN) * (BM / T::WM), wc = (warp % T::WN) * (BN / T::WN);
  const int q = lane >> 3, l8 = lane & 7;
  for (int kt = 0; kt < KT; kt++) {
    kiln_cp_wait<S - 2>();
    __syncthreads();
    if (kt + S - 1 < KT) load(kt + S - 1, (kt + S - 1) % S);
    kiln_cp_commit();
    const kiln_bf16 *a = As[kt % S], *b = Bs[kt % S];
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned af[T::MI][4], bf[T::NI][2];
      /* A (k rows, pixels the reduction) from [pixel][k]: transposed 8x8 loads */
#pragma unroll
      for (int mi = 0; mi < T::MI; mi++)
        kiln_ldsm4_trans(&a[kiln_swz<ACH>(kk + l8 + (q >> 1) * 8, (wr + mi * 16) / 8 + (q & 1))],
                         af[mi]);
#pragma unroll
      for (int ni = 0; ni < T::NI; ni += 2) {
        unsigned r[4];
        kiln_ldsm4_trans(&b[kiln_swz<BCH>(kk + l8 + (q & 1) * 8, (wc + ni * 8) / 8 + (q >> 1))], r);
        bf[ni][0] = r[0], bf[ni][1] = r[1], bf[ni + 1][0] = r[2], bf[ni + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < T::MI; mi++)
#pragma unroll
        for (int ni = 0; ni < T::NI; ni++)
          kiln_mma_bf16(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
    }
  }
  kiln_cp_wait<0>();
}

} // namespace lab

#endif
