// cluster.cuh: a lab experiment, not yet in the library and not yet run (2026-12-05): the TMA-fed
// weight gradient as a cluster of two blocks that share their A operand. ./lab tmaw (H100) found
// the weight gradient bound by L2: a 128x128 tile brings 32 KB a 64-pixel stage (two im2col boxes
// of X, 16 KB, and two dY panels, 16 KB) for 2 MFLOP, about 7 TB/s over 108 SMs. The two blocks of
// a cluster (1, 2, 1) have the same rows (taps and input channels, blockIdx.x) and pixels
// (blockIdx.z) and neighbouring output channels (blockIdx.y), so their im2col boxes are the same:
// each block copies one of the two and multicasts it into both blocks' shared memory, and brings
// 24 KB a stage from L2 instead of 32. A stage may be refilled only when the consumers of both
// blocks have freed it (the copy writes into both): each block's producer, once its own consumers
// have freed the stage (the library's `empty` barrier), arrives on a `pair` barrier of its own
// block and, remotely, of its peer's, and waits for its own to see both. The multipliers' loop is
// the library's (kiln_tma_consume). Both blocks' barriers exist before either copies (a cluster
// barrier after they are made), and neither block leaves while its peer may still arrive on its
// barriers (a cluster barrier at the end).
#pragma once

#include "../../fusion/device/conv_tma.cuh"

namespace lab {

KILN__FN unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

/* Every thread of the cluster, its shared-memory writes before and reads after. */
KILN__FN void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::
                   : "memory");
}

/* An arrival on the barrier at bar's offset in the shared memory of block `rank` of the cluster. */
KILN__FN void mbar_arrive_at(unsigned long long *bar, unsigned rank) {
  asm volatile("{\n.reg .b32 ra;\n"
               "mapa.shared::cluster.u32 ra, %0, %1;\n"
               "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}\n" ::"r"(
                   kiln_smem_addr(bar)),
               "r"(rank)
               : "memory");
}

/* kiln_tma_im2col4 into the same offset of every block of the cluster in mask, each block's
 * barrier at bar's offset told of the bytes that land in it. */
KILN__FN void tma_im2col4_multicast(void *dst, const kiln_tmap *map, unsigned long long *bar,
                                    int c, int w, int h, int n, int off_w, int off_h,
                                    unsigned short mask) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3, %4, %5}], [%6], {%7, %8}, %9;\n" ::"r"(
          kiln_smem_addr(dst)),
      "l"((unsigned long long)map), "r"(c), "r"(w), "r"(h), "r"(n), "r"(kiln_smem_addr(bar)),
      "h"((unsigned short)off_w), "h"((unsigned short)off_h), "h"(mask)
      : "memory");
}

/* kiln_conv_wgrad_tma for a block of a (1, 2, 1) cluster, the pair's im2col boxes shared: returns
 * whether this thread holds accumulators. Every thread of the block must reach cluster_sync()
 * after it (and after the split sum and the store). Barriers behind the stages: S full, S empty,
 * S pair. */
template <int S> constexpr int pair_smem(int stage) { return S * stage + 24 * S + 1024; }

/* The producer of conv_wgrad_tma_pair: one thread, out of line. ptxas (CUDA 13.0) warns that the
 * pair kernels' wgmma are serialized (C7515: "non wgmma instructions defining accumulator
 * registers"), inline or not, and not for the library's one-block kernel with the same multiplier
 * loop; only when the kernel stores the tile with the lab's store_tile after the split sum. Not
 * yet understood: the lab's timing says whether it costs. */
template <class G, int BN, int S>
__device__ __noinline__ void produce_pair(const kiln_tmap *tx, const kiln_tmap *ty, int k0, int n0,
                                          int p0, int KT, unsigned char *base) {
  constexpr int STAGE = (2 + BN / 64) * 8192;
  unsigned long long *full = (unsigned long long *)(base + S * STAGE), *empty = full + S,
                     *pair = full + 2 * S;
  const unsigned rank = cluster_rank(), peer = rank ^ 1u;
  const int k = k0 + 64 * (int)rank < G::K ? k0 + 64 * (int)rank : G::K - 64;
  const int tap = k / G::CI, ch = k % G::CI;
  for (int kt = 0; kt < KT; kt++) {
    const int st = kt % S, p = p0 + kt * 64;
    unsigned char *as = base + st * STAGE, *bs = as + 2 * 8192;
    if (kt >= S) { /* freed here, then in both blocks */
      const unsigned ph = (kt / S - 1) & 1;
      kiln_tma_mbar_wait(&empty[st], ph);
      kiln_mbar_arrive(&pair[st]);
      mbar_arrive_at(&pair[st], peer);
      kiln_tma_mbar_wait(&pair[st], ph);
    }
    kiln_tma_mbar_expect(&full[st], STAGE); /* both boxes of X (one from the peer) and dY */
    int w, h, n;
    kiln_tma_origin<G>(p, w, h, n);
    tma_im2col4_multicast(as + rank * 8192, tx, &full[st], ch, w, h, n, (tap % G::KW) * G::DW,
                          (tap / G::KW) * G::DH, 3);
#pragma unroll
    for (int q = 0; q < BN / 64; q++)
      kiln_tma_tile2(bs + q * 8192, ty, &full[st], n0 + 64 * q, p);
  }
}

template <class G, int BN, int S>
KILN__FN bool conv_wgrad_tma_pair(const kiln_tmap *tx, const kiln_tmap *ty, int k0, int n0, int p0,
                                  int p1, unsigned char *smem, float (&d)[BN / 2]) {
  constexpr int STAGE = (2 + BN / 64) * 8192;
  static_assert(G::CI % 64 == 0 && BN % 64 == 0 && BN <= 256 && S >= 2, "conv_wgrad_tma_pair");
  unsigned char *base = kiln_align1024(smem);
  unsigned long long *full = (unsigned long long *)(base + S * STAGE), *empty = full + S,
                     *pair = full + 2 * S;
  const int KT = (p1 - p0 + 63) / 64;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; s++) {
      kiln_mbar_init(&full[s], 1);  /* this block's producer, with the stage's bytes */
      kiln_mbar_init(&empty[s], 8); /* this block's multiplying warps */
      kiln_mbar_init(&pair[s], 2);  /* the producers of both blocks */
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  cluster_sync(); /* the peer's barriers are made before a copy or an arrival reaches them */
  if (threadIdx.x >= 256) {
    if (threadIdx.x == 256) produce_pair<G, BN, S>(tx, ty, k0, n0, p0, KT, base);
    return false;
  }
  const int wg = threadIdx.x >> 7;
  kiln_tma_consume<S>(KT, full, d, [&](int st) {
    const unsigned char *t = base + st * STAGE;
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
      kiln_wgmma<BN, 1, 1>(d, kiln_wg_desc<8192, 1024>(t + wg * 8192 + ks * 2048),
                           kiln_wg_desc<8192, 1024>(t + 2 * 8192 + ks * 2048));
  });
  return true;
}

} // namespace lab
