/*
 * wgmma.cuh (an experiment of dev/conv_engine, not part of the library): the forward product of
 * conv.cuh on Hopper's warpgroup MMA (wgmma.mma_async, sm_90a). A block of two warpgroups takes
 * 128 output pixels x BN output channels; each stage holds 64 of the reduction for both operands
 * in the 128-byte swizzle wgmma reads (rows of 128 bytes, chunk c of row r at c ^ (r % 8)),
 * gathered with cp.async as in conv.cuh, STAGES stages in dynamic shared memory (above 48 KB:
 * the launcher raises the limit). Each warpgroup multiplies its 64 rows by the stage's BN columns,
 * four m64nBNk16 instructions a stage.
 */
#ifndef KILN_WGMMA_CUH
#define KILN_WGMMA_CUH

#include "conv.cuh"

/* A shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart. */
KILN__FN unsigned long long kiln_wg_desc(const void *smem) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
  return (unsigned long long)((a & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) |
         (1ull << 62);
}
KILN__FN void kiln_wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
KILN__FN void kiln_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> KILN__FN void kiln_wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* Orders this thread's shared-memory writes before the async proxy's reads (wgmma). */
KILN__FN void kiln_fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
/* Keeps the compiler from moving accumulator registers across the asynchronous MMA. */
template <int N> KILN__FN void kiln_wg_pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; i++)
    asm volatile("" : "+f"(d[i])::"memory");
}

/* d += A B for one m64n64k16 tile, A and B K-major in shared memory (descriptors). */
KILN__FN void kiln_wgmma_n64(float (&d)[32], unsigned long long da, unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(1)
      : "memory");
}

/* d += A B for one m64n128k16 tile, A and B K-major in shared memory (descriptors). */
KILN__FN void kiln_wgmma_n128(float (&d)[64], unsigned long long da, unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(da), "l"(db), "r"(1)
      : "memory");
}

/* d += A B for one m64n256k16 tile, A and B K-major in shared memory (descriptors). */
KILN__FN void kiln_wgmma_n256(float (&d)[128], unsigned long long da, unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "
      "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "
      "%92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "
      "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, "
      "%123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(1)
      : "memory");
}

template <int BN>
KILN__FN void kiln_wgmma(float (&d)[BN / 2], unsigned long long da, unsigned long long db) {
  if constexpr (BN == 64)
    kiln_wgmma_n64(d, da, db);
  else if constexpr (BN == 128)
    kiln_wgmma_n128(d, da, db);
  else
    kiln_wgmma_n256(d, da, db);
}

/* Shared memory the block needs (and 1024 bytes to align it). */
template <int BN, int S> constexpr int kiln_wg_smem() { return S * (128 + BN) * 64 * 2 + 1024; }

/* The forward product of pixels [m0, m0 + 128) and channels [n0, n0 + BN): this thread's
 * d[4 j + e] is pixel m0 + 64 (warp / 4) + 16 (warp % 4) + lane / 4 + 8 (e / 2), channel
 * n0 + 8 j + 2 (lane % 4) + e % 2. smem: kiln_wg_smem<BN, S>() bytes of dynamic shared memory. */
template <class G, int BN, int S>
KILN__FN void kiln_conv_fprop_wg(const kiln_bf16 *__restrict__ x, const kiln_bf16 *__restrict__ wk,
                                 long long m0, int n0, unsigned char *smem, float (&d)[BN / 2]) {
  constexpr int BM = 128, BK = 64, NT = 256;
  constexpr int K = G::KH * G::KW * G::CI, KT = (K + BK - 1) / BK;
  constexpr long long M = (long long)G::N * G::OH * G::OW;
  constexpr int AP = BM * 8 / NT, BP = BN * 8 / NT; /* chunks a thread copies a stage */
  static_assert(G::CI % 8 == 0 && BP * NT == BN * 8 && S >= 3, "kiln_conv_fprop_wg");
  kiln_bf16 *base = (kiln_bf16 *)(((unsigned long long)smem + 1023) & ~1023ull);
  kiln_bf16 *As = base, *Bs = base + S * BM * BK; /* stage s: As + s BM BK, Bs + s BN BK */
  const int tid = threadIdx.x, wg = tid >> 7;
  kiln_conv_px px[AP];
#pragma unroll
  for (int s = 0; s < AP; s++)
    px[s] = kiln_conv_pixel<G>(m0 + (tid >> 3) + s * (NT / 8), M);
  auto load = [&](int kt, int st) {
    kiln_conv_fprop_stage<G, 8, NT, AP, BP>(x, wk, px, n0, kt, As + st * BM * BK,
                                            Bs + st * BN * BK);
  };
#pragma unroll
  for (int i = 0; i < BN / 2; i++)
    d[i] = 0.f;
    /* loads run S - 2 stages ahead: the stage they fill was read by the products two stages back,
     * which every warpgroup has waited for before the barrier */
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
    const kiln_bf16 *a = As + (kt % S) * BM * BK + wg * 64 * BK, *b = Bs + (kt % S) * BN * BK;
    kiln_wg_pin(d);
    kiln_wg_fence();
#pragma unroll
    for (int ks = 0; ks < BK / 16; ks++)
      kiln_wgmma<BN>(d, kiln_wg_desc(a + ks * 16), kiln_wg_desc(b + ks * 16));
    kiln_wg_commit();
    kiln_wg_wait<1>(); /* this stage's products may run on; the previous stage's are done */
    kiln_wg_pin(d);
  }
  kiln_wg_wait<0>();
  kiln_wg_pin(d);
  kiln_cp_wait<0>();
}

#endif
