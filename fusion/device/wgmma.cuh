/*
 * wgmma.cuh: Hopper's warpgroup matrix multiply (wgmma.mma_async, sm_90a only: kernels that
 * include it are compiled for the arch-specific target) for the convolution kernels of conv.cuh.
 * A warpgroup (four warps, 128 threads) multiplies a 64 x N tile of A by an N-wide tile of B,
 * 16 deep, both read from shared memory through descriptors, into f32 accumulators that stay in
 * registers: d[4 j + e] of thread t is row 16 (warp % 4) + lane / 4 + 8 (e / 2), column 8 j +
 * 2 (lane % 4) + e % 2 (warp and lane within the warpgroup).
 *
 * Shared tiles use the 128-byte swizzle: rows of 128 bytes (64 bf16 values), 16-byte chunk c of
 * row r stored at chunk c ^ (r % 8), 8-row groups of 1024 bytes, 1024-byte aligned. A K-major
 * operand (the reduction contiguous: the forward product's) has one row per M or N index; an
 * MN-major one (the weight gradient's, whose operands arrive pixel-major) has one row per step of
 * the reduction and panels of 64 M or N indices. Everything here is a template, instantiated only
 * by the kernels that use it.
 */
#ifndef KILN_WGMMA_CUH
#define KILN_WGMMA_CUH

#include "defs.cuh"

/* A shared-memory descriptor in the 128-byte swizzle. K-major: sbo the distance between 8-row
 * groups (1024), lbo unused. MN-major: lbo the distance between 64-wide panels, sbo that between
 * groups of 8 reduction rows (1024). */
template <int LBO, int SBO> KILN__FN unsigned long long kiln_wg_desc(const void *smem) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
  return (unsigned long long)((a & 0x3FFFF) >> 4) | ((unsigned long long)(LBO >> 4) << 16) |
         ((unsigned long long)(SBO >> 4) << 32) | (1ull << 62);
}
/* The descriptor of the operand `bytes` (a multiple of 16) past desc's: the start address field
 * (bits 0-13, the shared address / 16) plus bytes / 16, a carry-free add, as a block's shared
 * memory ends below 256 KB. A stage's products take one descriptor an operand and step it along
 * the reduction with this, instead of masking and shifting each product's address again: fewer
 * instructions between a stage's arrival and its products. */
KILN__FN unsigned long long kiln_wg_desc_plus(unsigned long long desc, int bytes) {
  return desc + (unsigned long long)(bytes >> 4);
}

template <int U = 0> KILN__FN void kiln_wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
template <int U = 0> KILN__FN void kiln_wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
/* Waits until at most N committed groups of this warpgroup's products are in flight. */
template <int N> KILN__FN void kiln_wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* Orders this thread's shared-memory writes (cp.async's, once waited for) before the async
 * proxy's reads (wgmma). */
template <int U = 0> KILN__FN void kiln_fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
/* Keeps the compiler from moving accumulator registers across the asynchronous products. */
template <int N> KILN__FN void kiln_wg_pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; i++)
    asm volatile("" : "+f"(d[i])::"memory");
}

/* A shared-memory pointer's address in the shared window (what PTX's shared:: operands take). */
KILN__FN unsigned kiln_smem_addr(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

/* p rounded up to 1,024 bytes by adding to it (not through an integer), so that the compiler still
   knows the result points into shared memory and emits ld.shared/st.shared for what reads it */
KILN__FN unsigned char *kiln_align1024(unsigned char *p) {
  return p + ((1024u - (kiln_smem_addr(p) & 1023u)) & 1023u);
}

/* mbarriers in shared memory (64-bit words) for the warp-specialized main loop of conv.cuh. */
KILN__FN void kiln_mbar_init(unsigned long long *bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(kiln_smem_addr(bar)), "r"(count)
               : "memory");
}
/* Whether the barrier's phase of parity `parity` has completed (acquire, CTA scope), after a
 * wait of the hardware's choosing. */
KILN__FN bool kiln_mbar_try(unsigned long long *bar, unsigned parity) {
  unsigned done;
  asm volatile("{\n.reg .pred p;\n"
               "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
               "selp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done)
               : "r"(kiln_smem_addr(bar)), "r"(parity)
               : "memory");
  return done != 0;
}
/* Waits until the barrier's phase of parity `parity` has completed. */
KILN__FN void kiln_mbar_wait(unsigned long long *bar, unsigned parity) {
  while (!kiln_mbar_try(bar, parity)) {
  }
}
KILN__FN void kiln_mbar_arrive(unsigned long long *bar) {
  asm volatile(
      "{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(kiln_smem_addr(bar))
      : "memory");
}
/* Arrives on the barrier once this thread's cp.async copies so far have landed, without adding
 * an expected arrival: the barrier's count includes this one. */
KILN__FN void kiln_mbar_arrive_cp(unsigned long long *bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(kiln_smem_addr(bar))
               : "memory");
}
/* Gives this warpgroup's registers back to the pool (DEC) or takes more (INC): warp
 * specialization's split of the register file, sm_90a. */
template <int R> KILN__FN void kiln_regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R> KILN__FN void kiln_regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
/* A barrier among the `count` threads that name barrier `id` (1-15; 0 is __syncthreads'). */
KILN__FN void kiln_named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

#define KILN_WG_R8(b)                                                                              \
  "+f"(d[b + 0]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]),  \
      "+f"(d[b + 6]), "+f"(d[b + 7])
#define KILN_WG_R32(b) KILN_WG_R8(b), KILN_WG_R8(b + 8), KILN_WG_R8(b + 16), KILN_WG_R8(b + 24)
/* the operand names %b0 .. %b9 */
#define KILN_WG_L10(b)                                                                             \
  "%" #b "0, %" #b "1, %" #b "2, %" #b "3, %" #b "4, %" #b "5, %" #b "6, %" #b "7, %" #b "8, "     \
  "%" #b "9, "

/* d += A B, m64nNk16, bf16 operands, f32 accumulators; TA, TB: the operand is MN-major. */
template <int TA, int TB>
KILN__FN void kiln_wgmma_n64(float (&d)[32], unsigned long long da, unsigned long long db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %36, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, " KILN_WG_L10(1)
                   KILN_WG_L10(2) "%30, %31}, %32, %33, p, 1, 1, %34, %35;\n}\n"
               : KILN_WG_R32(0)
               : "l"(da), "l"(db), "n"(TA), "n"(TB), "r"(1)
               : "memory");
}
template <int TA, int TB>
KILN__FN void kiln_wgmma_n128(float (&d)[64], unsigned long long da, unsigned long long db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %68, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, " KILN_WG_L10(1) KILN_WG_L10(2)
                   KILN_WG_L10(3) KILN_WG_L10(4) KILN_WG_L10(5) "%60, %61, %62, %63}, %64, %65, p, "
                                                                "1, 1, %66, %67;\n}\n"
               : KILN_WG_R32(0), KILN_WG_R32(32)
               : "l"(da), "l"(db), "n"(TA), "n"(TB), "r"(1)
               : "memory");
}
template <int TA, int TB>
KILN__FN void kiln_wgmma_n256(float (&d)[128], unsigned long long da, unsigned long long db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %132, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, " KILN_WG_L10(1) KILN_WG_L10(2)
                   KILN_WG_L10(3) KILN_WG_L10(4) KILN_WG_L10(5) KILN_WG_L10(6) KILN_WG_L10(7)
                       KILN_WG_L10(8) KILN_WG_L10(9) KILN_WG_L10(10)
                           KILN_WG_L10(11) "%120, %121, %122, %123, %124, %125, %126, %127}, "
                                           "%128, %129, p, 1, 1, %130, %131;\n}\n"
               : KILN_WG_R32(0), KILN_WG_R32(32), KILN_WG_R32(64), KILN_WG_R32(96)
               : "l"(da), "l"(db), "n"(TA), "n"(TB), "r"(1)
               : "memory");
}
template <int BN, int TA, int TB>
KILN__FN void kiln_wgmma(float (&d)[BN / 2], unsigned long long da, unsigned long long db) {
  if constexpr (BN == 64)
    kiln_wgmma_n64<TA, TB>(d, da, db);
  else if constexpr (BN == 128)
    kiln_wgmma_n128<TA, TB>(d, da, db);
  else
    kiln_wgmma_n256<TA, TB>(d, da, db);
}

#endif
