/*
 * conv.cuh: a convolution's forward product, data gradient (stride 1) and weight gradient as
 * implicit GEMMs on Hopper's warpgroup MMA (wgmma.cuh; bf16 operands, f32 accumulators, sm_90a).
 * No column matrix exists: each stage gathers its tile of im2col(X) from the image with 16-byte
 * cp.async copies, whose zero fill is the padding.
 *
 * X is (N, H, W, CI), Y and dY (N, OH, OW, CO), the filters Wk (CO, K) with column
 * k = (i KW + j) CI + c of tap (i, j) (im2col's order), K = KH KW CI, M = N OH OW pixels:
 *   forward:         Y (M, CO)  = im2col(X) (M, K)  Wk^T (K, CO)
 *   weight gradient: dWt (K, CO) = im2col(X)^T (K, M) dY (M, CO)
 * CI and CO are multiples of 8, so a 16-byte chunk of a column lies in one tap. G is a struct
 * of constants the generated kernel defines (N, H, W, CI, OH, OW, CO, KH, KW, SH, SW, PH, PW, DH,
 * DW), so every division is by a constant; every index fits in an int (the planner checks).
 *
 * A block is two warpgroups (256 threads) over 128 rows of the result (warpgroup w: rows 64 w
 * to 64 w + 63) and BN columns, each stage 64 deep in the reduction, S stages in dynamic shared
 * memory (KILN_CONV_SMEM), the loads running S - 2 stages ahead: the stage a load fills was last
 * read by the products two stages back, which every warpgroup has waited for before the barrier
 * that precedes the load. Accumulator d[4 j + e] of a thread is row 64 (warp / 4) + 16 (warp % 4)
 * + lane / 4 + 8 (e / 2), column 8 j + 2 (lane % 4) + e % 2 of the block's tile.
 *
 * WS (warp specialization): a block of three warpgroups instead, 384 threads (KILN_CONV_WS_THREADS,
 * KILN_CONV_SMEM_WS). Warpgroup 0 gathers: its 128 threads issue every copy of a stage, and the
 * stage's `full` mbarrier completes when they have landed. Warpgroups 1 and 2 multiply: each waits
 * for `full`, issues its products, and once the products of the stage before are done its warps
 * arrive on that stage's `empty` mbarrier, which the gatherers wait for before they refill it. No
 * block-wide barrier is left in the loop, so the gathers run up to S stages ahead of the products
 * and neither waits for the other's slowest thread; the gatherers give registers to the
 * multipliers (setmaxnreg). The accumulators are the multipliers': a thread's rows are those of
 * the two-warpgroup block for threadIdx.x - 128 (kiln_conv_row0), and the gatherers return false.
 * Measured on the H200 (dev/README.md), its forward products are slower than the plain loop's on
 * every air shape (128 threads issue every gather and its address arithmetic, where 256 shared
 * them), so the renderer takes it only with KILN_CONV_WS=1; a producer that gathers with one
 * instruction (im2col-mode TMA) is what it waits for.
 */
#ifndef KILN_CONV_CUH
#define KILN_CONV_CUH

#include "bf16.cuh"
#include "defs.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

/* Dynamic shared memory of a block with S stages of 128 + BN rows of 128 bytes, and 1024 bytes
 * to align it. */
#define KILN_CONV_SMEM(BN, S) ((S) * (128 + (BN)) * 128 + 1024)

/* Warp specialization's block and its dynamic shared memory: the stages, then 2 S mbarriers. */
#define KILN_CONV_WS_THREADS 384
#define KILN_CONV_SMEM_WS(BN, S) (KILN_CONV_SMEM(BN, S) + 16 * (S))

/* The first row (of 128) of the block's tile this thread's accumulators start at: d[4 j + e] is
 * row kiln_conv_row0 + 8 (e / 2), column 8 j + 2 (lane % 4) + e % 2. */
template <bool WS = false> KILN__FN int kiln_conv_row0() {
  const int t = WS ? threadIdx.x - 128 : threadIdx.x, warp = t >> 5, lane = t & 31;
  return 64 * (warp >> 2) + 16 * (warp & 3) + (lane >> 2);
}

/* Byte offset of 16-byte chunk c of row r in a 128-byte-swizzled tile. */
KILN__FN int kiln_sw128(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

/* An output pixel's image offset (n H W CI) and window origin; ih below any row past the end. */
struct kiln_conv_px {
  int base, ih, iw;
};

template <class G> KILN__FN kiln_conv_px kiln_conv_pixel(int m) {
  constexpr int M = G::N * G::OH * G::OW;
  kiln_conv_px p;
  if (m >= M) {
    p.base = 0, p.ih = -(1 << 29), p.iw = 0;
    return p;
  }
  const int ow = m % G::OW, r = m / G::OW, oh = r % G::OH, n = r / G::OH;
  p.base = n * G::H * G::W * G::CI;
  p.ih = oh * G::SH - G::PH;
  p.iw = ow * G::SW - G::PW;
  return p;
}

/* The main loop both products share: d zeroed, then KT steps of 64 of the reduction through S
 * stages. load(kt, st) fills stage st with step kt (its cp.async copies; steps come in order),
 * mma(st) issues the warpgroup's products on stage st. With AHEAD and KT <= S no stage is used
 * twice, so every step's copies are issued before the first product (a short reduction, such as
 * 3x3 over 24 channels, is otherwise four waits on memory a tile, S - 2 steps ahead). */
template <int S, bool AHEAD = false, int N, class L, class M>
KILN__FN void kiln_conv_mainloop(int KT, float (&d)[N], L load, M mma) {
#pragma unroll
  for (int i = 0; i < N; i++)
    d[i] = 0.f;
  auto product = [&](int st) { /* stage st's copies landed and seen by every thread */
                               kiln_wg_pin(d);
                               kiln_wg_fence();
                               mma(st);
                               kiln_wg_commit();
                               kiln_wg_wait<1>(); /* this stage's products may run on; the previous
                                                     stage's are done */
                               kiln_wg_pin(d);
  };
  if (AHEAD && KT <= S) {
#pragma unroll
    for (int s = 0; s < S; s++)
      if (s < KT) {
        load(s, s);
        kiln_cp_commit();
      }
#pragma unroll
    for (int kt = 0; kt < S; kt++) {
      if (kt >= KT) break;
      kiln_cp_wait_upto(KT - 1 - kt); /* step kt's copies, the later ones may fly on */
      kiln_fence_async_smem();
      __syncthreads();
      product(kt);
    }
  } else {
#pragma unroll
    for (int s = 0; s < S - 2; s++) {
      if (s < KT) load(s, s);
      kiln_cp_commit();
    }
    for (int kt = 0; kt < KT; kt++) {
      kiln_cp_wait<S - 3>();
      kiln_fence_async_smem();
      __syncthreads();
      if (kt + S - 2 < KT) load(kt + S - 2, (kt + S - 2) % S);
      kiln_cp_commit();
      product(kt % S);
    }
  }
  kiln_wg_wait<0>();
  kiln_wg_pin(d);
  kiln_cp_wait<0>();
}

/* The warp-specialized main loop (WS above): load(kt, st) runs on warpgroup 0 alone, mma(st) on
 * warpgroups 1 and 2, which get d; bar is 2 S mbarriers in shared memory. Returns whether this
 * thread multiplied (holds accumulators). */
template <int S, int N, class L, class M>
KILN__FN bool kiln_conv_mainloop_ws(int KT, float (&d)[N], unsigned long long *bar, L load, M mma) {
  /* the gatherers keep 104 registers a thread (fewer spill: they hold a stage's addresses), the
   * multipliers take the rest of the 64 K */
  constexpr int GATHER_REGS = 104, MMA_REGS = (65536 - 128 * GATHER_REGS) / 256 / 8 * 8;
  unsigned long long *full = bar, *empty = bar + S;
  const int tid = threadIdx.x;
  if (tid == 0)
    for (int s = 0; s < S; s++) {
      kiln_mbar_init(&full[s], 128); /* every gatherer's copies */
      kiln_mbar_init(&empty[s], 8);  /* every multiplying warp */
    }
  __syncthreads();
  if (tid < 128) {
    kiln_regs_dec<GATHER_REGS>();
    for (int kt = 0; kt < KT; kt++) {
      const int st = kt % S;
      if (kt >= S) kiln_mbar_wait(&empty[st], (kt / S - 1) & 1);
      load(kt, st);
      kiln_mbar_arrive_cp(&full[st]);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return false;
  }
  kiln_regs_inc<MMA_REGS>();
#pragma unroll
  for (int i = 0; i < N; i++)
    d[i] = 0.f;
  for (int kt = 0; kt < KT; kt++) {
    const int st = kt % S;
    kiln_mbar_wait(&full[st], (kt / S) & 1);
    kiln_fence_async_smem(); /* the copies, seen through the barrier, before wgmma's reads */
    kiln_wg_pin(d);
    kiln_wg_fence();
    mma(st);
    kiln_wg_commit();
    kiln_wg_wait<1>(); /* the previous stage's products are done: its tile may be refilled */
    kiln_wg_pin(d);
    if (kt > 0 && (tid & 31) == 0) kiln_mbar_arrive(&empty[(kt - 1) % S]);
  }
  kiln_wg_wait<0>();
  kiln_wg_pin(d);
  return true;
}

/* Either main loop: WS's, or the one every thread both loads and multiplies in (with AHEAD, a
 * reduction that fits the stages issued all at once). */
template <int S, bool WS, bool AHEAD = false, int N, class L, class M>
KILN__FN bool kiln_conv_run(int KT, float (&d)[N], unsigned char *base, int stage_bytes, L load,
                            M mma) {
  if constexpr (WS)
    return kiln_conv_mainloop_ws<S>(KT, d, (unsigned long long *)(base + S * stage_bytes), load,
                                    mma);
  kiln_conv_mainloop<S, AHEAD>(KT, d, load, mma);
  return true;
}

/* The forward product of pixels [m0, m0 + 128) and channels [n0, n0 + BN).
 *
 * FLIP: the data gradient of a stride-1 convolution instead, which is the forward product of dY
 * with the filters flipped and transposed: dX (n, h, w, ci) = sum over taps (i', j') and co of
 * dY (n, h - PH' + i', w - PW' + j', co) Wk (co, KH KW - 1 - tap', ci), PH' = KH - 1 - PH. G is
 * then that product's geometry (the image dY, CI the forward's output channels, CO its input
 * channels, the padding PH'), and wk the forward's filters, read as they are: row k' = tap' CI +
 * c of the flipped filters is a row of CO contiguous values of Wk, so its B tile is MN-major. */
template <class G, int BN, int S, bool FLIP = false, bool WS = false, bool AHEAD = false>
KILN__FN bool kiln_conv_fprop(const kiln_bf16 *__restrict__ x, const kiln_bf16 *__restrict__ wk,
                              int m0, int n0, unsigned char *smem, float (&d)[BN / 2]) {
  /* NT threads load (all, or WS's gatherers) */
  constexpr int BM = 128, NT = WS ? 128 : 256, K = G::KH * G::KW * G::CI, KT = (K + 63) / 64;
  constexpr int AP = BM * 8 / NT, BP = BN * 8 / NT, ROWS = NT / 8; /* chunks a thread copies */
  constexpr int STAGE = (BM + BN) * 128;
  static_assert(G::CI % 8 == 0 && G::CO % 8 == 0 && S >= 3 && BN % 64 == 0 && BN <= 256,
                "kiln_conv_fprop");
  unsigned char *base = kiln_align1024(smem);
  const int tid = threadIdx.x, wg = (tid >> 7) - WS, chunk = tid & 7, row = tid >> 3;
  kiln_conv_px px[AP];
#pragma unroll
  for (int s = 0; s < AP; s++)
    px[s] = kiln_conv_pixel<G>(m0 + row + s * ROWS);
  auto load = [&](int kt, int st) {
    unsigned char *As = base + st * STAGE, *Bs = As + BM * 128;
    const int k = kt * 64 + chunk * 8, tap = k / G::CI, c = k - tap * G::CI;
    const int di = (tap / G::KW) * G::DH, dj = (tap % G::KW) * G::DW;
#pragma unroll
    for (int s = 0; s < AP; s++) {
      const int ih = px[s].ih + di, iw = px[s].iw + dj;
      const bool ok = k < K && ih >= 0 && ih < G::H && iw >= 0 && iw < G::W;
      kiln_cp16(As + kiln_sw128(row + s * ROWS, chunk),
                ok ? x + px[s].base + (ih * G::W + iw) * G::CI + c : x, ok);
    }
    if constexpr (!FLIP) {
#pragma unroll
      for (int s = 0; s < BP; s++) {
        const int co = n0 + row + s * ROWS;
        const bool ok = co < G::CO && k < K;
        kiln_cp16(Bs + kiln_sw128(row + s * ROWS, chunk), ok ? wk + co * K + k : wk, ok);
      }
    } else { /* 64 rows k' of BN columns, in panels of 64 */
      constexpr int CB = BN / 8, RB = NT / CB, TAPS = G::KH * G::KW;
      const int qb = tid % CB, n = n0 + qb * 8;
#pragma unroll
      for (int s = 0; s < 64 / RB; s++) {
        const int r = tid / CB + RB * s, kk = kt * 64 + r, t = kk / G::CI, c = kk - t * G::CI;
        const bool ok = kk < K && n < G::CO;
        kiln_cp16(Bs + (qb >> 3) * 8192 + kiln_sw128(r, qb & 7),
                  ok ? wk + (c * TAPS + TAPS - 1 - t) * G::CO + n : wk, ok);
      }
    }
  };
  return kiln_conv_run<S, WS, AHEAD>(KT, d, base, STAGE, load, [&](int st) {
    const unsigned char *a = base + st * STAGE + wg * 64 * 128, *b = base + st * STAGE + BM * 128;
    const unsigned long long da = kiln_wg_desc<16, 1024>(a),
                             db = FLIP ? kiln_wg_desc<8192, 1024>(b) : kiln_wg_desc<16, 1024>(b);
#pragma unroll
    for (int ks = 0; ks < 4; ks++) /* 16 of the reduction: 32 bytes along A's rows */
      if constexpr (!FLIP)
        kiln_wgmma<BN, 0, 0>(d, kiln_wg_desc_plus(da, ks * 32), kiln_wg_desc_plus(db, ks * 32));
      else /* B: 16 rows of 128 bytes */
        kiln_wgmma<BN, 0, 1>(d, kiln_wg_desc_plus(da, ks * 32), kiln_wg_desc_plus(db, ks * 2048));
  });
}

/* The weight gradient's partial sum over pixels [p0, p1) for rows [k0, k0 + 128) of dWt and
 * columns [n0, n0 + BN). Both operands are MN-major: a stage is 64 pixel rows of 128 bytes in
 * panels of 64 columns (two panels of im2col(X)'s columns, BN / 64 of dY's), chunk c of pixel
 * row p at c ^ (p % 8). */
template <class G, int BN, int S, bool WS = false>
KILN__FN bool kiln_conv_wgrad(const kiln_bf16 *__restrict__ x, const kiln_bf16 *__restrict__ dy,
                              int k0, int n0, int p0, int p1, unsigned char *smem,
                              float (&d)[BN / 2]) {
  constexpr int K = G::KH * G::KW * G::CI, NT = WS ? 128 : 256, BK = 64, PA = 2, PB = BN / 64;
  constexpr int RA = NT / 16, PASSES = BK / RA; /* im2col(X)'s rows a pass, passes a stage */
  constexpr int STAGE = (PA + PB) * 8192, CB = BN / 8, RB = NT / CB; /* dY: chunks a row, rows */
  static_assert(G::CI % 8 == 0 && G::CO % 8 == 0 && S >= 3 && BN % 64 == 0 && BN <= 256,
                "kiln_conv_wgrad");
  unsigned char *base = kiln_align1024(smem);
  const int tid = threadIdx.x, wg = (tid >> 7) - WS;
  /* this thread's chunk q of im2col(X)'s 16 a row: one tap and 8 channels, every stage */
  const int q = tid & 15, ka = k0 + q * 8, tap = ka / G::CI, ch = ka - tap * G::CI;
  const int ta = (tap / G::KW) * G::DH - G::PH, tb = (tap % G::KW) * G::DW - G::PW;
  const bool kok = ka < K;
  const int qb = tid % CB, cb = n0 + qb * 8;
  const bool cok = cb < G::CO;
  const int KT = (p1 - p0 + BK - 1) / BK;
  /* the output pixel of each of this thread's PASSES rows of im2col(X), advanced by a stage's
   * 64 pixels after each load: a carry, not a division */
  constexpr int PIX = G::OH * G::OW, DN = BK / PIX, DOH = BK % PIX / G::OW, DOW = BK % G::OW;
  int pn[PASSES], poh[PASSES], pw[PASSES], pp[PASSES];
#pragma unroll
  for (int s = 0; s < PASSES; s++) {
    pp[s] = p0 + (tid >> 4) + RA * s;
    pn[s] = pp[s] / PIX;
    poh[s] = pp[s] % PIX / G::OW;
    pw[s] = pp[s] % G::OW;
  }
  int pb = p0; /* the stage's first pixel (dY's rows) */
  auto load =
      [&](int, int st) { /* the steps come in order: each row advances by a stage */
                         unsigned char *As = base + st * STAGE, *Bs = As + PA * 8192;
#pragma unroll
                         for (int s = 0; s < PASSES; s++) {
                           const int ih = poh[s] * G::SH + ta, iw = pw[s] * G::SW + tb;
                           const bool ok =
                               kok && pp[s] < p1 && ih >= 0 && ih < G::H && iw >= 0 && iw < G::W;
                           kiln_cp16(As + (q >> 3) * 8192 + kiln_sw128((tid >> 4) + RA * s, q & 7),
                                     ok ? x + ((pn[s] * G::H + ih) * G::W + iw) * G::CI + ch : x,
                                     ok);
                           pp[s] += BK;
                           pw[s] += DOW;
                           const bool c1 = pw[s] >= G::OW;
                           pw[s] -= c1 ? G::OW : 0;
                           poh[s] += DOH + c1;
                           const bool c2 = poh[s] >= G::OH;
                           poh[s] -= c2 ? G::OH : 0;
                           pn[s] += DN + c2;
                         }
#pragma unroll
                         for (int s = 0; s < BK / RB; s++) {
                           const int r = tid / CB + RB * s, p = pb + r;
                           const bool ok = cok && p < p1;
                           kiln_cp16(Bs + (qb >> 3) * 8192 + kiln_sw128(r, qb & 7),
                                     ok ? dy + p * G::CO + cb : dy, ok);
                         }
                         pb += BK;
      };
  return kiln_conv_run<S, WS>(KT, d, base, STAGE, load, [&](int st) {
    const unsigned char *a = base + st * STAGE + wg * 8192, *b = base + st * STAGE + PA * 8192;
    const unsigned long long da = kiln_wg_desc<8192, 1024>(a), db = kiln_wg_desc<8192, 1024>(b);
#pragma unroll
    for (int ks = 0; ks < BK / 16; ks++) /* 16 pixels: 16 rows of 128 bytes */
      kiln_wgmma<BN, 1, 1>(d, kiln_wg_desc_plus(da, ks * 2048), kiln_wg_desc_plus(db, ks * 2048));
  });
}

/* Split-K inside the kernel: with gridDim.z > 1 splits, each block writes its partial tile to
 * part (gridDim.x gridDim.y gridDim.z tiles of 128 x BN floats) and counts itself in on its
 * tile's counter in cnt; the last block of a tile gets true back with d the sum of the partials
 * in split order (the same sum whichever block comes last) and resets the counter, so that every
 * launch finds the counters zero. The others get false. The last block reads a split's whole
 * partial (a thread's BN / 2 floats) before adding it, so that those loads are in flight
 * together, not a value's splits one after another; the additions are the same, in the same
 * order. H100, traced steps: ResNet-18's 1x1/2 weight gradient over 56x56x64 (49 splits of one
 * tile) 118.2 -> 79.7 us, its 3x3/2 one 116.8 -> 79.8, air's 15x15x64->256 163.7 -> 137.7; the
 * resnet18 step 7.81 -> 7.44-7.47 ms, air's 2.503 -> 2.430. */
template <int BN, bool WS = false, bool ALONE = WS>
KILN__FN bool kiln_conv_split_sum(float (&d)[BN / 2], float *part, unsigned *cnt) {
  const int splits = gridDim.z, tile = blockIdx.x + gridDim.x * blockIdx.y;
  if (splits == 1) return true;
  /* ALONE: the multipliers are alone (WS's gatherers, conv_tma.cuh's producer warp have left):
   * a named barrier of their 256 threads */
  auto sync = [] {
    if constexpr (ALONE)
      kiln_named_sync(1, 256);
    else
      __syncthreads();
  };
  const int first = WS ? 128 : 0, r0 = kiln_conv_row0<WS>(), c0 = 2 * (threadIdx.x & 3);
  float *all = part + (long long)tile * splits * 128 * BN, *mine = all + blockIdx.z * 128 * BN;
#pragma unroll
  for (int j = 0; j < BN / 8; j++)
#pragma unroll
    for (int h = 0; h < 2; h++)
      *(float2 *)&mine[(r0 + 8 * h) * BN + 8 * j + c0] =
          make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
  __threadfence();
  sync();
  __shared__ unsigned last;
  if (threadIdx.x == first) last = atomicAdd(&cnt[tile], 1u) == (unsigned)splits - 1;
  sync();
  if (!last) return false;
  __threadfence();
#pragma unroll
  for (int i = 0; i < BN / 2; i++)
    d[i] = 0.f;
  for (int z = 0; z < splits; z++) {
    float2 v[BN / 8][2];
#pragma unroll
    for (int j = 0; j < BN / 8; j++)
#pragma unroll
      for (int h = 0; h < 2; h++)
        v[j][h] = __ldcg((const float2 *)&all[z * 128 * BN + (r0 + 8 * h) * BN + 8 * j + c0]);
#pragma unroll
    for (int j = 0; j < BN / 8; j++)
#pragma unroll
      for (int h = 0; h < 2; h++)
        d[4 * j + 2 * h] += v[j][h].x, d[4 * j + 2 * h + 1] += v[j][h].y;
  }
  if (threadIdx.x == first) cnt[tile] = 0;
  return true;
}

#endif
