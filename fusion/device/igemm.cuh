/*
 * igemm.cuh: a convolution's data gradient as an implicit GEMM on tensor cores (mma.sync, sm_80
 * and newer), for the kernels that fuse a product dcols = dY Wk with the col2im that sums
 * dcols into the image gradient dX (fusion/plan.c). No column matrix exists: each block loads,
 * for its 128 image pixels and each tap (i, j) of the window, the rows of dY of the output
 * pixels that read the pixel through that tap (zeros where none does: cp.async's zero fill),
 * and multiplies them by the tap's slice of Wk.
 *
 * As a GEMM: dX (N*H*W, CI) = sum over taps and output channels, K = KH*KW*CO, in tiles of BK
 * output channels of one tap (so CO is a multiple of BK). dY is (N*OH*OW, CO) and Wk (CO, KH*KW*CI)
 * with column (i*KW + j)*CI + c, both dense, in T (f32, multiplied in TF32, or bf16), f32
 * accumulation. A block of 256 threads computes 128 x BN of dX with 8 warps of 32 x BN/2; two
 * stages of shared memory overlap the next tile's loads with this one's products. The geometry is
 * a struct of constants (G) the generated kernel defines, so every division is by a constant.
 */
#ifndef KILN_IGEMM_CUH
#define KILN_IGEMM_CUH

#include "bf16.cuh"
#include "defs.cuh"
#include "mma.cuh"

template <typename T> struct kiln_ig;
template <> struct kiln_ig<float> {
  static constexpr int BK = 16;   /* output channels a k-tile */
  static constexpr int VEC = 4;   /* elements a 16-byte copy */
  static constexpr int KSTEP = 8; /* k of one mma (m16n8k8) */
  static constexpr int APAD = 4;  /* row padding of the A tile: conflict-free fragment reads */
};
template <> struct kiln_ig<kiln_bf16> {
  static constexpr int BK = 32;
  static constexpr int VEC = 8;
  static constexpr int KSTEP = 16; /* m16n8k16 */
  static constexpr int APAD = 8;
};

#define KILN_IG_BM 128 /* image pixels a block */
#define KILN_IG_THREADS 256

/* One k-step (KSTEP) of a warp's 32 x (8 NI) tile: As is [BM][LDA] (k contiguous), Bs [BK][LDB]
 * (n contiguous); the warp's rows start at row0, its columns at col0, k at kk. */
template <int NI, int LDA, int LDB>
KILN__FN void kiln_ig_mma(const float *As, const float *Bs, int row0, int col0, int kk, int lane,
                          float (&acc)[2][NI][4]) {
  const int g = lane >> 2, t = lane & 3;
  unsigned a[2][4], b[NI][2];
#pragma unroll
  for (int mi = 0; mi < 2; mi++) {
    const float *p = As + (row0 + mi * 16 + g) * LDA + kk + t;
    a[mi][0] = kiln_tf32(p[0]);
    a[mi][1] = kiln_tf32(p[8 * LDA]);
    a[mi][2] = kiln_tf32(p[4]);
    a[mi][3] = kiln_tf32(p[8 * LDA + 4]);
  }
#pragma unroll
  for (int ni = 0; ni < NI; ni++) {
    const float *p = Bs + (kk + t) * LDB + col0 + ni * 8 + g;
    b[ni][0] = kiln_tf32(p[0]);
    b[ni][1] = kiln_tf32(p[4 * LDB]);
  }
#pragma unroll
  for (int mi = 0; mi < 2; mi++)
#pragma unroll
    for (int ni = 0; ni < NI; ni++)
      kiln_mma_tf32(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
}

template <int NI, int LDA, int LDB>
KILN__FN void kiln_ig_mma(const kiln_bf16 *As, const kiln_bf16 *Bs, int row0, int col0, int kk,
                          int lane, float (&acc)[2][NI][4]) {
  const int g = lane >> 2, t = lane & 3;
  unsigned a[2][4], b[NI][2];
#pragma unroll
  for (int mi = 0; mi < 2; mi++) {
    const kiln_bf16 *p = As + (row0 + mi * 16 + g) * LDA + kk + 2 * t;
    a[mi][0] = *(const unsigned *)p;
    a[mi][1] = *(const unsigned *)(p + 8 * LDA);
    a[mi][2] = *(const unsigned *)(p + 8);
    a[mi][3] = *(const unsigned *)(p + 8 * LDA + 8);
  }
#pragma unroll
  for (int ni = 0; ni < NI; ni++) {
    const kiln_bf16 *p = Bs + (kk + 2 * t) * LDB + col0 + ni * 8 + g;
    b[ni][0] = kiln_pack2(p[0], p[LDB]);
    b[ni][1] = kiln_pack2(p[8 * LDB], p[9 * LDB]);
  }
#pragma unroll
  for (int mi = 0; mi < 2; mi++)
#pragma unroll
    for (int ni = 0; ni < NI; ni++)
      kiln_mma_bf16(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
}

/* The accumulators of this thread for the block's pixels [m0, m0 + 128) and channels
 * [n0, n0 + G::BN) of dX, M = N*H*W pixels in all. Accumulator acc[mi][ni][2 h + e] is pixel
 * m0 + 32 (warp / 2) + 16 mi + lane / 4 + 8 h, channel n0 + (G::BN / 2) (warp % 2) + 8 ni +
 * 2 (lane % 4) + e. G holds KH, KW, SH, SW, PH, PW, DH, DW, H, W, OH, OW, CO, CI and BN. */
template <typename T, typename G>
KILN__FN void kiln_dgrad(const T *__restrict__ dy, const T *__restrict__ wk, int M, int m0, int n0,
                         float (&acc)[2][G::BN / 16][4]) {
  typedef kiln_ig<T> E;
  constexpr int BM = KILN_IG_BM, BK = E::BK, BN = G::BN, VEC = E::VEC;
  constexpr int LDA = BK + E::APAD, LDB = BN + 8, NI = BN / 16;
  constexpr int ACH = BK * (int)sizeof(T) / 16; /* 16-byte chunks of an A row: 4 */
  constexpr int AROWS = KILN_IG_THREADS / ACH;  /* rows one pass loads: 64 */
  constexpr int BCH = BN * (int)sizeof(T) / 16; /* chunks of a B row */
  constexpr int KT_CO = G::CO / BK, KT = G::KH * G::KW * KT_CO;
  static_assert(G::CO % BK == 0 && G::CI % VEC == 0 && BM % AROWS == 0, "kiln_dgrad's tiles");
  static_assert(BK * BCH <= KILN_IG_THREADS, "one pass loads the B tile");
  __shared__ __align__(16) T As[2][BM * LDA];
  __shared__ __align__(16) T Bs[2][BK * LDB];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int row0 = (warp >> 1) * 32, col0 = (warp & 1) * (BN / 2);
  /* the A rows this thread loads: the output pixel grid's origin for them */
  constexpr int NA = BM / AROWS;
  long long obase[NA]; /* the image's first output pixel */
  int ph[NA], pw[NA];  /* h + PH, w + PW; ph < 0 for rows past M */
#pragma unroll
  for (int s = 0; s < NA; s++) {
    const int m = m0 + tid / ACH + s * AROWS;
    const int mm = m < M ? m : 0;
    const int n = mm / (G::H * G::W), r = mm % (G::H * G::W);
    obase[s] = (long long)n * G::OH * G::OW;
    ph[s] = m < M ? r / G::W + G::PH : -1;
    pw[s] = r % G::W + G::PW;
  }
  const int ach = tid % ACH;
  auto load = [&](int kt, int buf) {
    const int tap = kt / KT_CO, co0 = (kt % KT_CO) * BK, i = tap / G::KW, j = tap % G::KW;
#pragma unroll
    for (int s = 0; s < NA; s++) {
      /* the output pixel (oh, ow) whose tap (i, j) reads this image pixel, if any */
      const int th = ph[s] - i * G::DH, tw = pw[s] - j * G::DW;
      const bool ok = ph[s] >= 0 && th >= 0 && tw >= 0 && th % G::SH == 0 && tw % G::SW == 0 &&
                      th / G::SH < G::OH && tw / G::SW < G::OW;
      const T *src = ok ? dy + (obase[s] + (long long)(th / G::SH) * G::OW + tw / G::SW) * G::CO +
                              co0 + ach * VEC
                        : dy;
      kiln_cp16(&As[buf][(tid / ACH + s * AROWS) * LDA + ach * VEC], src, ok);
    }
    if (tid < BK * BCH) {
      const int brow = tid / BCH, c = n0 + (tid % BCH) * VEC;
      const bool ok = c < G::CI;
      const T *src =
          ok ? wk + (long long)(co0 + brow) * (G::KH * G::KW * G::CI) + tap * G::CI + c : wk;
      kiln_cp16(&Bs[buf][brow * LDB + (tid % BCH) * VEC], src, ok);
    }
    kiln_cp_commit();
  };
#pragma unroll
  for (int mi = 0; mi < 2; mi++)
#pragma unroll
    for (int ni = 0; ni < NI; ni++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        acc[mi][ni][e] = 0.f;
  load(0, 0);
  for (int kt = 0; kt < KT; kt++) {
    if (kt + 1 < KT) {
      load(kt + 1, (kt + 1) & 1);
      kiln_cp_wait<1>();
    } else {
      kiln_cp_wait<0>();
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; kk += E::KSTEP)
      kiln_ig_mma<NI, LDA, LDB>(As[kt & 1], Bs[kt & 1], row0, col0, kk, lane, acc);
    __syncthreads();
  }
}

#endif
