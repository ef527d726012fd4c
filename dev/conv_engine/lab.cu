// lab.cu: on the air workload's convolutions (bf16, batch 1024), each tile config timed and
// checked against a float64-accumulating reference on a batch of 8 (the same kernels, the same
// geometry):
//   - the mma.sync forward product and weight gradient of this folder's conv.cuh (sm_80 and
//     newer; the weight gradient's splits summed by a second kernel, in order);
//   - the library's wgmma forward product and weight gradient (fusion/device/conv.cuh, sm_90a;
//     the weight gradient's splits summed inside the kernel);
//   - kiln's path before them: an im2col kernel and cuBLAS (cublasGemmEx) on the columns.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o lab dev/conv_engine/lab.cu -lcublas
//   ./lab            the mma.sync and wgmma configs
//   ./lab wgmma      the wgmma forward configs alone
//   ./lab wgrad      im2col + cuBLAS, the best wgmma forward configs, every wgmma weight gradient
//   ./lab dw         the wgmma weight gradients alone
//   ./lab ws         the warp-specialized wgmma products beside the others' best and cuBLAS
//   ./lab tma [NAME] the TMA-fed products (tma.cuh: im2col-mode copies, a producer warp) beside
//                    cuBLAS on im2col's columns (col2im after it for the data gradient) and the
//                    library's wgmma kernels, every product checked first (batch 8 and 2);
//                    NAME: only the shapes whose name holds it. -DLAB_TMA_ONLY builds this alone.
//                    Among the forward products: one-tile blocks, persistent blocks (persist.cuh)
//                    storing from the registers or through a room of shared memory, and for 64
//                    output channels persistent blocks with the filters resident (resident.cuh).
//
// Prints one line per shape, product and config: us (median of 15 timings of 10 launches each),
// TFLOP/s (2 M N K), and the largest error against the reference relative to the largest |ref|.

#include <cublas_v2.h>

#include "lab_util.h"

#include "../../fusion/device/conv.cuh" /* the library's wgmma products */
#include "conv.cuh"                     /* the mma.sync experiments (namespace lab) */
#include "tma.cuh"                      /* the TMA-fed products' maps (namespace tma) */
#include "persist.cuh"                  /* the persistent forward product */
#include "resident.cuh"                 /* ... with the filters resident (not yet run) */
#include "cluster.cuh"                  /* the weight gradient by pairs of blocks (not yet run) */

template <class G, class T>
__global__ void __launch_bounds__(T::THREADS)
    fprop(const kiln_bf16 *x, const kiln_bf16 *wk, kiln_bf16 *y) {
  float acc[T::MI][T::NI][4];
  const long long m0 = (long long)blockIdx.x * T::BM;
  const int n0 = blockIdx.y * T::BN;
  lab::kiln_conv_fprop<G, T>(x, wk, m0, n0, acc);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wr = (warp / T::WN) * (T::BM / T::WM), wc = (warp % T::WN) * (T::BN / T::WN);
#pragma unroll
  for (int mi = 0; mi < T::MI; mi++)
#pragma unroll
    for (int ni = 0; ni < T::NI; ni++)
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const long long m = m0 + wr + mi * 16 + (lane >> 2) + 8 * h;
        const int c = n0 + wc + ni * 8 + 2 * (lane & 3);
        if (m < G::M && c < G::CO)
          *(unsigned *)&y[m * G::CO + c] =
              kiln_bf16x2_bits(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
      }
}

/* threads and dynamic shared memory of a wgmma kernel, warp-specialized or not */
#define WG_THREADS(WS) ((WS) ? KILN_CONV_WS_THREADS : 256)
#define WG_SMEM(BN, S, WS) ((WS) ? KILN_CONV_SMEM_WS(BN, S) : KILN_CONV_SMEM(BN, S))

template <class G, int BN, int S, bool WS>
__global__ void __launch_bounds__(WG_THREADS(WS), 1)
    fprop_wg(const kiln_bf16 *x, const kiln_bf16 *wk, kiln_bf16 *y) {
  extern __shared__ unsigned char smem[];
  float d[BN / 2];
  const long long m0 = (long long)blockIdx.x * 128;
  const int n0 = blockIdx.y * BN;
  if (!kiln_conv_fprop<G, BN, S, false, WS>(x, wk, (int)m0, n0, smem, d)) return;
  store_rows<BN>(y, m0 + kiln_conv_row0<WS>(), n0, G::M, G::CO, d);
}

template <class G, class T>
__global__ void __launch_bounds__(T::THREADS)
    wgrad(const kiln_bf16 *x, const kiln_bf16 *dy, float *part, long long chunk) {
  float acc[T::MI][T::NI][4];
  const int k0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN;
  const long long p0 = (long long)blockIdx.z * chunk;
  lab::kiln_conv_wgrad<G, T>(x, dy, k0, n0, p0, p0 + chunk, acc);
  float *out = part + (long long)blockIdx.z * G::K * G::CO;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wr = (warp / T::WN) * (T::BM / T::WM), wc = (warp % T::WN) * (T::BN / T::WN);
#pragma unroll
  for (int mi = 0; mi < T::MI; mi++)
#pragma unroll
    for (int ni = 0; ni < T::NI; ni++)
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int k = k0 + wr + mi * 16 + (lane >> 2) + 8 * h;
        const int c = n0 + wc + ni * 8 + 2 * (lane & 3);
        if (k < G::K && c < G::CO)
          *(float2 *)&out[(long long)k * G::CO + c] =
              make_float2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
      }
}

__global__ void sum_splits(const float *part, int splits, int n, kiln_bf16 *out) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    float s = 0.f;
    for (int z = 0; z < splits; z++)
      s += part[(long long)z * n + i];
    out[i] = (kiln_bf16)s;
  }
}

/* One forward config on shape G (timed at G's batch) and GC (checked at batch 8). */
template <class G, class GC, class T> static void run_fprop(const char *name, const char *cfg) {
  dim3 block(T::THREADS);
  double err;
  {
    kiln_bf16 *x = random_bf16((size_t)GC::N * GC::H * GC::W * GC::CI, 1.f, 1);
    kiln_bf16 *wk = random_bf16((size_t)GC::CO * GC::K, 0.2f, 2), *y;
    float *ref;
    CK(cudaMalloc(&y, GC::M * GC::CO * 2));
    CK(cudaMalloc(&ref, GC::M * GC::CO * 4));
    dim3 grid((unsigned)((GC::M + T::BM - 1) / T::BM), (GC::CO + T::BN - 1) / T::BN);
    fprop<GC, T><<<grid, block>>>(x, wk, y);
    ref_fprop<GC><<<(unsigned)((GC::M * GC::CO + 255) / 256), 256>>>(x, wk, ref);
    CK(cudaDeviceSynchronize());
    err = rel_err(y, ref, (size_t)GC::M * GC::CO);
    cudaFree(x), cudaFree(wk), cudaFree(y), cudaFree(ref);
  }
  kiln_bf16 *x = random_bf16((size_t)G::N * G::H * G::W * G::CI, 1.f, 3);
  kiln_bf16 *wk = random_bf16((size_t)G::CO * G::K, 0.2f, 4), *y;
  CK(cudaMalloc(&y, G::M * G::CO * 2));
  dim3 grid((unsigned)((G::M + T::BM - 1) / T::BM), (G::CO + T::BN - 1) / T::BN);
  float us = time_us([&] { fprop<G, T><<<grid, block>>>(x, wk, y); });
  double tf = 2.0 * G::M * G::CO * G::K / (us * 1e-6) / 1e12;
  printf("| %s | fwd | %s | %.1f | %.1f | %.1e |\n", name, cfg, us, tf, err);
  cudaFree(x), cudaFree(wk), cudaFree(y);
}

/* The wgmma forward, checked at batch 8 and timed at G's batch. */
template <class G, class GC, int BN, int S, bool WS = false> static void run_fprop_wg(const char *name) {
  constexpr int smem = WG_SMEM(BN, S, WS), nt = WG_THREADS(WS);
  CK(cudaFuncSetAttribute(fprop_wg<G, BN, S, WS>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(fprop_wg<GC, BN, S, WS>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  double err;
  {
    kiln_bf16 *x = random_bf16((size_t)GC::N * GC::H * GC::W * GC::CI, 1.f, 1);
    kiln_bf16 *wk = random_bf16((size_t)GC::CO * GC::K, 0.2f, 2), *y;
    float *ref;
    CK(cudaMalloc(&y, GC::M * GC::CO * 2));
    CK(cudaMalloc(&ref, GC::M * GC::CO * 4));
    dim3 grid((unsigned)((GC::M + 127) / 128), (GC::CO + BN - 1) / BN);
    fprop_wg<GC, BN, S, WS><<<grid, nt, smem>>>(x, wk, y);
    ref_fprop<GC><<<(unsigned)((GC::M * GC::CO + 255) / 256), 256>>>(x, wk, ref);
    CK(cudaDeviceSynchronize());
    err = rel_err(y, ref, (size_t)GC::M * GC::CO);
    cudaFree(x), cudaFree(wk), cudaFree(y), cudaFree(ref);
  }
  kiln_bf16 *x = random_bf16((size_t)G::N * G::H * G::W * G::CI, 1.f, 3);
  kiln_bf16 *wk = random_bf16((size_t)G::CO * G::K, 0.2f, 4), *y;
  CK(cudaMalloc(&y, G::M * G::CO * 2));
  dim3 grid((unsigned)((G::M + 127) / 128), (G::CO + BN - 1) / BN);
  float us = time_us([&] { fprop_wg<G, BN, S, WS><<<grid, nt, smem>>>(x, wk, y); });
  double tf = 2.0 * G::M * G::CO * G::K / (us * 1e-6) / 1e12;
  printf("| %s | fwd | wgmma%s 128x%d, %d stages | %.1f | %.1f | %.1e |\n", name, WS ? " ws" : "",
         BN, S, us, tf, err);
  cudaFree(x), cudaFree(wk), cudaFree(y);
}


template <class G, int BN, int S, bool WS>
__global__ void __launch_bounds__(WG_THREADS(WS), 1)
    wgrad_wg(const kiln_bf16 *x, const kiln_bf16 *dy, kiln_bf16 *dwt, float *part, unsigned *cnt,
             int chunk) {
  extern __shared__ unsigned char smem[];
  float d[BN / 2];
  const int k0 = blockIdx.x * 128, n0 = blockIdx.y * BN;
  const int p0 = blockIdx.z * chunk, p1 = p0 + chunk < G::M ? p0 + chunk : (int)G::M;
  if (!kiln_conv_wgrad<G, BN, S, WS>(x, dy, k0, n0, p0, p1, smem, d)) return;
  if (!kiln_conv_split_sum<BN, WS>(d, part, cnt)) return;
  store_rows<BN>(dwt, k0 + kiln_conv_row0<WS>(), n0, G::K, G::CO, d);
}

/* kiln's path today, for comparison: im2col into a column matrix (16 bytes a thread), then
 * cuBLAS. */
template <class G> __global__ void im2col(const kiln_bf16 *x, kiln_bf16 *cols) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; /* chunk of 8 */
  if (i >= G::M * (G::K / 8)) return;
  const int k = (int)(i % (G::K / 8)) * 8;
  const long long m = i / (G::K / 8);
  const int tap = k / G::CI, c = k % G::CI;
  const int ow = (int)(m % G::OW), oh = (int)(m / G::OW % G::OH);
  const long long n = m / G::OW / G::OH;
  const int ih = oh * G::SH - G::PH + tap / G::KW, iw = ow * G::SW - G::PW + tap % G::KW;
  uint4 v = make_uint4(0, 0, 0, 0);
  if (ih >= 0 && ih < G::H && iw >= 0 && iw < G::W)
    v = *(const uint4 *)&x[((n * G::H + ih) * G::W + iw) * G::CI + c];
  *(uint4 *)&cols[m * G::K + k] = v;
}

template <class G, class T> static long long wgrad_chunk(int splits) {
  long long c = (G::M + splits - 1) / splits;
  return (c + T::BK - 1) / T::BK * T::BK;
}

template <class G, class GC, class T>
static void run_wgrad(const char *name, const char *cfg, int splits) {
  dim3 block(T::THREADS);
  double err;
  {
    kiln_bf16 *x = random_bf16((size_t)GC::N * GC::H * GC::W * GC::CI, 1.f, 5);
    kiln_bf16 *dy = random_bf16((size_t)GC::M * GC::CO, 1.f, 6), *out;
    float *part, *ref;
    int s = 4;
    long long chunk = wgrad_chunk<GC, T>(s);
    CK(cudaMalloc(&part, (size_t)s * GC::K * GC::CO * 4));
    CK(cudaMalloc(&out, (size_t)GC::K * GC::CO * 2));
    CK(cudaMalloc(&ref, (size_t)GC::K * GC::CO * 4));
    dim3 grid((GC::K + T::BM - 1) / T::BM, (GC::CO + T::BN - 1) / T::BN, s);
    wgrad<GC, T><<<grid, block>>>(x, dy, part, chunk);
    sum_splits<<<264, 256>>>(part, s, GC::K * GC::CO, out);
    ref_wgrad<GC><<<(GC::K * GC::CO + 255) / 256, 256>>>(x, dy, ref);
    CK(cudaDeviceSynchronize());
    err = rel_err(out, ref, (size_t)GC::K * GC::CO);
    cudaFree(x), cudaFree(dy), cudaFree(out), cudaFree(part), cudaFree(ref);
  }
  kiln_bf16 *x = random_bf16((size_t)G::N * G::H * G::W * G::CI, 1.f, 7);
  kiln_bf16 *dy = random_bf16((size_t)G::M * G::CO, 1.f, 8), *out;
  float *part;
  long long chunk = wgrad_chunk<G, T>(splits);
  CK(cudaMalloc(&part, (size_t)splits * G::K * G::CO * 4));
  CK(cudaMalloc(&out, (size_t)G::K * G::CO * 2));
  dim3 grid((G::K + T::BM - 1) / T::BM, (G::CO + T::BN - 1) / T::BN, splits);
  float us_main = time_us([&] { wgrad<G, T><<<grid, block>>>(x, dy, part, chunk); });
  float us = time_us([&] {
    wgrad<G, T><<<grid, block>>>(x, dy, part, chunk);
    sum_splits<<<264, 256>>>(part, splits, G::K * G::CO, out);
  });
  double tf = 2.0 * G::M * G::CO * G::K / (us * 1e-6) / 1e12;
  printf("| %s | dw | %s, %d splits | %.1f (%.1f + sum) | %.1f | %.1e |\n", name, cfg, splits, us,
         us_main, tf, err);
  cudaFree(x), cudaFree(dy), cudaFree(out), cudaFree(part);
}

typedef lab::kiln_conv_tile<128, 128, 2, 4, 3> T128x128;
typedef lab::kiln_conv_tile<128, 64, 4, 2, 4> T128x64;
typedef lab::kiln_conv_tile<64, 128, 2, 4, 4> T64x128;
typedef lab::kiln_conv_tile<64, 64, 2, 2, 4> T64x64;


/* The library's wgmma weight gradient (fusion/device/conv.cuh) with its in-kernel split-K:
 * checked at batch 8, timed at G's batch. */
template <class G, class GC, int BN, int S, bool WS = false>
static void run_wgrad_wg(const char *name, int splits) {
  constexpr int smem = WG_SMEM(BN, S, WS), nt = WG_THREADS(WS);
  CK(cudaFuncSetAttribute(wgrad_wg<G, BN, S, WS>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(wgrad_wg<GC, BN, S, WS>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  float *part;
  unsigned *cnt;
  CK(cudaMalloc(&part, (size_t)64 << 20));
  CK(cudaMalloc(&cnt, 65536));
  CK(cudaMemset(cnt, 0, 65536));
  double err;
  {
    kiln_bf16 *x = random_bf16((size_t)GC::N * GC::H * GC::W * GC::CI, 1.f, 5);
    kiln_bf16 *dy = random_bf16((size_t)GC::M * GC::CO, 1.f, 6), *out;
    float *ref;
    CK(cudaMalloc(&out, (size_t)GC::K * GC::CO * 2));
    CK(cudaMalloc(&ref, (size_t)GC::K * GC::CO * 4));
    ref_wgrad<GC><<<(GC::K * GC::CO + 255) / 256, 256>>>(x, dy, ref);
    const int s = 3, chunk = (int)((GC::M + s * 64 - 1) / (s * 64) * 64);
    dim3 grid((GC::K + 127) / 128, (GC::CO + BN - 1) / BN, s);
    wgrad_wg<GC, BN, S, WS><<<grid, nt, smem>>>(x, dy, out, part, cnt, chunk);
    CK(cudaDeviceSynchronize());
    err = rel_err(out, ref, (size_t)GC::K * GC::CO);
    cudaFree(x), cudaFree(dy), cudaFree(out), cudaFree(ref);
  }
  kiln_bf16 *x = random_bf16((size_t)G::N * G::H * G::W * G::CI, 1.f, 7);
  kiln_bf16 *dy = random_bf16((size_t)G::M * G::CO, 1.f, 8), *out;
  CK(cudaMalloc(&out, (size_t)G::K * G::CO * 2));
  const int chunk = (int)((G::M + splits * 64 - 1) / (splits * 64) * 64);
  dim3 grid((G::K + 127) / 128, (G::CO + BN - 1) / BN, splits);
  float us =
      time_us([&] { wgrad_wg<G, BN, S, WS><<<grid, nt, smem>>>(x, dy, out, part, cnt, chunk); });
  double tf = 2.0 * G::M * G::CO * G::K / (us * 1e-6) / 1e12;
  printf("| %s | dw | wgmma%s 128x%d, %d stages, %d splits (%u blocks) | %.1f | %.1f | %.1e |\n",
         name, WS ? " ws" : "", BN, S, splits, grid.x * grid.y * grid.z, us, tf, err);
  cudaFree(x), cudaFree(dy), cudaFree(out), cudaFree(part), cudaFree(cnt);
}

/* kiln's path today: im2col, then cuBLAS for the forward product and the weight gradient (bf16,
 * f32 accumulation), each timed alone. */
template <class G> static void run_cublas(const char *name) {
  static cublasHandle_t h;
  if (!h) cublasCreate(&h);
  kiln_bf16 *x = random_bf16((size_t)G::N * G::H * G::W * G::CI, 1.f, 9);
  kiln_bf16 *wk = random_bf16((size_t)G::CO * G::K, 0.2f, 10);
  kiln_bf16 *dy = random_bf16((size_t)G::M * G::CO, 1.f, 11), *cols, *y, *dwt;
  CK(cudaMalloc(&cols, (size_t)G::M * G::K * 2));
  CK(cudaMalloc(&y, (size_t)G::M * G::CO * 2));
  CK(cudaMalloc(&dwt, (size_t)G::K * G::CO * 2));
  const unsigned blocks = (unsigned)((G::M * (G::K / 8) + 255) / 256);
  const float one = 1.f, zero = 0.f;
  float us_i = time_us([&] { im2col<G><<<blocks, 256>>>(x, cols); });
  float us_f = time_us([&] {
    cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, G::CO, (int)G::M, G::K, &one, wk, CUDA_R_16BF, G::K,
                 cols, CUDA_R_16BF, G::K, &zero, y, CUDA_R_16BF, G::CO, CUBLAS_COMPUTE_32F,
                 CUBLAS_GEMM_DEFAULT);
  });
  float us_w = time_us([&] {
    cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, G::CO, G::K, (int)G::M, &one, dy, CUDA_R_16BF, G::CO,
                 cols, CUDA_R_16BF, G::K, &zero, dwt, CUDA_R_16BF, G::CO, CUBLAS_COMPUTE_32F,
                 CUBLAS_GEMM_DEFAULT);
  });
  const double f = 2.0 * G::M * G::CO * G::K;
  printf("| %s | im2col | %.0f MB | %.1f | %.0f GB/s | |\n", name, G::M * G::K * 2 / 1e6, us_i,
         (G::M * G::K * 2.0 + G::N * G::H * G::W * G::CI * 2.0) / (us_i * 1e-6) / 1e9);
  printf("| %s | fwd | cuBLAS on the columns | %.1f | %.1f | |\n", name, us_f, f / (us_f * 1e-6) / 1e12);
  printf("| %s | dw | cuBLAS on the columns | %.1f | %.1f | |\n", name, us_w, f / (us_w * 1e-6) / 1e12);
  cudaFree(x), cudaFree(wk), cudaFree(dy), cudaFree(cols), cudaFree(y), cudaFree(dwt);
}

/* ./lab wgrad: the wgmma weight gradient's configs beside kiln's path today (im2col + cuBLAS) and
 * the wgmma forward's best configs. */
[[maybe_unused]] static bool dw_only; /* ./lab dw: the wgmma weight gradient's configs alone */
template <template <int> class S> static void shape_wgrad(const char *name, bool wide) {
  typedef S<1024> G;
  typedef S<8> GC;
  if (!dw_only) run_cublas<G>(name);
  if (wide && !dw_only) {
    run_fprop_wg<G, GC, 128, 3>(name);
    run_fprop_wg<G, GC, 256, 4>(name);
  } else if (!dw_only) {
    run_fprop_wg<G, GC, 64, 4>(name);
  }
  for (int splits : {1, 2, 4, 8, 16, 32, 64}) {
    const int tiles = (G::K + 127) / 128 * ((G::CO + 127) / 128);
    if (tiles * splits > 1200 || (long long)splits * 64 * 4 > G::M) continue;
    run_wgrad_wg<G, GC, 64, 4>(name, splits);
    if (G::CO >= 128) {
      run_wgrad_wg<G, GC, 128, 3>(name, splits);
      run_wgrad_wg<G, GC, 128, 4>(name, splits);
    }
  }
}

/* ./lab ws: the warp-specialized wgmma products (WS in conv.cuh) beside the others' best configs
 * and im2col + cuBLAS. */
template <template <int> class S> static void shape_ws(const char *name, bool wide) {
  typedef S<1024> G;
  typedef S<8> GC;
  run_cublas<G>(name);
  if (wide) {
    run_fprop_wg<G, GC, 128, 3>(name);
    run_fprop_wg<G, GC, 256, 4>(name);
    run_fprop_wg<G, GC, 128, 4, true>(name);
    run_fprop_wg<G, GC, 128, 6, true>(name);
    run_fprop_wg<G, GC, 256, 3, true>(name);
    run_fprop_wg<G, GC, 256, 4, true>(name);
  } else {
    run_fprop_wg<G, GC, 64, 4>(name);
    run_fprop_wg<G, GC, 64, 4, true>(name);
    run_fprop_wg<G, GC, 64, 8, true>(name);
  }
  for (int splits : {1, 2, 4, 8, 16, 32, 64}) {
    const int tiles = (G::K + 127) / 128 * ((G::CO + 127) / 128);
    if (tiles * splits > 600 || (long long)splits * 64 * 4 > G::M) continue;
    if (G::CO >= 128) {
      run_wgrad_wg<G, GC, 128, 4>(name, splits);
      run_wgrad_wg<G, GC, 128, 4, true>(name, splits);
      run_wgrad_wg<G, GC, 128, 6, true>(name, splits);
    } else {
      run_wgrad_wg<G, GC, 64, 4>(name, splits);
      run_wgrad_wg<G, GC, 64, 4, true>(name, splits);
      run_wgrad_wg<G, GC, 64, 8, true>(name, splits);
    }
  }
}

/* ---- ./lab tma ---- */

/* Stores a 128 x BN tile of accumulators (threads 0-255) as bf16 rows of a (rows, cols) matrix. */
template <int BN>
__device__ void store_tile(kiln_bf16 *out, long long m0, int n0, long long rows, int cols,
                           const float (&d)[BN / 2]) {
  store_rows<BN>(out, m0 + kiln_conv_row0<false>(), n0, rows, cols, d);
}

template <class G, int BN, int S, bool SE>
__global__ void __launch_bounds__(KILN_TMA_THREADS, 1)
    fprop_tma(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
              kiln_bf16 *y) {
  extern __shared__ unsigned char smem[];
  float d[BN / 2];
  const int m0 = blockIdx.x * 128, n0 = blockIdx.y * BN;
  if (!kiln_conv_fprop_tma<G, BN, S>((const kiln_tmap *)&ta, (const kiln_tmap *)&tb, m0, n0,
                                     smem, d))
    return;
  if constexpr (SE)
    kiln_tma_store_tile<BN>(y, m0, n0, G::M, G::CO, d, kiln_align1024(smem)); /* the library's */
  else
    store_tile<BN>(y, m0, n0, G::M, G::CO, d);
}

template <class G, int BN, int S>
__global__ void __launch_bounds__(KILN_TMA_THREADS, 1)
    dgrad_tma(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tw,
              kiln_bf16 *dx) {
  extern __shared__ unsigned char smem[];
  float d[BN / 2];
  const int m0 = blockIdx.x * 128, n0 = blockIdx.y * BN;
  if (kiln_conv_dgrad_tma<G, BN, S>((const kiln_tmap *)&ta, (const kiln_tmap *)&tw, m0, n0, smem, d))
    store_tile<BN>(dx, m0, n0, (long long)G::N * G::H * G::W, G::CI, d);
}

template <class G, int BN, int S>
__global__ void __launch_bounds__(KILN_TMA_THREADS, 1)
    wgrad_tma(const __grid_constant__ CUtensorMap tx, const __grid_constant__ CUtensorMap ty,
              kiln_bf16 *dwt, float *part, unsigned *cnt, int chunk) {
  extern __shared__ unsigned char smem[];
  float d[BN / 2];
  const int k0 = blockIdx.x * 128, n0 = blockIdx.y * BN;
  const int p0 = blockIdx.z * chunk, p1 = p0 + chunk < G::M ? p0 + chunk : (int)G::M;
  if (!kiln_conv_wgrad_tma<G, BN, S>((const kiln_tmap *)&tx, (const kiln_tmap *)&ty, k0, n0, p0, p1, smem, d)) return;
  if (kiln_conv_split_sum<BN, false, true>(d, part, cnt)) store_tile<BN>(dwt, k0, n0, G::K, G::CO, d);
}

/* wgrad_tma by clusters of two blocks along the output channels that share their im2col boxes
 * (lab::conv_wgrad_tma_pair, cluster.cuh). */
template <class G, int BN, int S>
__global__ void __cluster_dims__(1, 2, 1) __launch_bounds__(KILN_TMA_THREADS, 1)
    wgrad_tma_pair(const __grid_constant__ CUtensorMap tx, const __grid_constant__ CUtensorMap ty,
                   kiln_bf16 *dwt, float *part, unsigned *cnt, int chunk) {
  extern __shared__ unsigned char smem[];
  float d[BN / 2];
  const int k0 = blockIdx.x * 128, n0 = blockIdx.y * BN;
  const int p0 = blockIdx.z * chunk, p1 = p0 + chunk < G::M ? p0 + chunk : (int)G::M;
  if (!lab::conv_wgrad_tma_pair<G, BN, S>((const kiln_tmap *)&tx, (const kiln_tmap *)&ty, k0, n0,
                                          p0, p1, smem, d)) {
    lab::cluster_sync(); /* the peer may still arrive on this block's barriers until then */
    return;
  }
  if (kiln_conv_split_sum<BN, false, true>(d, part, cnt)) store_tile<BN>(dwt, k0, n0, G::K, G::CO, d);
  lab::cluster_sync();
}

/* The maps of each product for shape G's buffers. */
template <class G> static CUtensorMap map_image(const kiln_bf16 *x, int pixels) {
  return tma::im2col_map(x, G::N, G::H, G::W, G::CI, G::KH, G::KW, G::SH, G::PH, G::DH, pixels);
}
template <class G> static CUtensorMap map_filters(const kiln_bf16 *wk, int bn) {
  const cuuint64_t dims[2] = {(cuuint64_t)G::K, (cuuint64_t)G::CO};
  const cuuint32_t box[2] = {64, (cuuint32_t)bn};
  return tma::tiled_map(wk, 2, dims, box);
}
template <class G> static CUtensorMap map_dy_image(const kiln_bf16 *dy) { /* the data gradient's */
  return tma::im2col_map(dy, G::N, G::OH, G::OW, G::CO, G::KH, G::KW, 1,
                         G::DH * (G::KH - 1) - G::PH, G::DH, 128);
}
template <class G> static CUtensorMap map_flipped(const kiln_bf16 *wk) {
  const cuuint64_t dims[3] = {(cuuint64_t)G::CI, (cuuint64_t)(G::KH * G::KW), (cuuint64_t)G::CO};
  const cuuint32_t box[3] = {64, 1, 64};
  return tma::tiled_map(wk, 3, dims, box);
}
template <class G> static CUtensorMap map_dy_rows(const kiln_bf16 *dy) {
  const cuuint64_t dims[2] = {(cuuint64_t)G::CO, (cuuint64_t)G::M};
  const cuuint32_t box[2] = {64, 64};
  return tma::tiled_map(dy, 2, dims, box);
}

/* SE: 0 4-byte stores, 1 through shared memory, 2 persistent, 3 persistent through shared memory,
 * 4 persistent with the filters resident (64 channels: resident.cuh) */
template <class G, int BN, int S, int SE> constexpr int lab_fprop_smem() {
  return SE == 4 ? LAB_TMA_RB_SMEM(G, S)
         : SE == 3 ? LAB_TMA_PS_SMEM(BN, S)
                   : KILN_TMA_SMEM((128 + BN) * 128, S);
}
template <class G, int BN, int S, int SE>
static void launch_fprop_tma(const CUtensorMap &a, const CUtensorMap &b, kiln_bf16 *y) {
  constexpr int smem = lab_fprop_smem<G, BN, S, SE>();
  static_assert(SE != 1 || 128 * (BN * 2 + 16) <= S * (128 + BN) * 128, "the tile fits the stages");
  dim3 grid((unsigned)((G::M + 127) / 128), (G::CO + BN - 1) / BN);
  if (SE >= 2) { /* a block an SM looping over the tiles */
    static int sms;
    if (!sms) CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const unsigned tiles = grid.x * grid.y, blocks = tiles < (unsigned)sms ? tiles : sms;
    if constexpr (SE == 4)
      fprop_tma_rb<G, S><<<blocks, KILN_TMA_THREADS, smem>>>(a, b, y);
    else
      fprop_tma_p<G, BN, S, SE == 3><<<blocks, KILN_TMA_THREADS, smem>>>(a, b, y);
  } else
    fprop_tma<G, BN, S, SE == 1><<<grid, KILN_TMA_THREADS, smem>>>(a, b, y);
}

template <class G, class GC, int BN, int S, int SE = 0> static void run_fprop_tma(const char *name) {
  constexpr int smem = KILN_TMA_SMEM((128 + BN) * 128, S);
  CK(cudaFuncSetAttribute(fprop_tma<G, BN, S, SE == 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(fprop_tma<GC, BN, S, SE == 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  if constexpr (SE == 4) {
    static_assert(BN == 64 && lab_fprop_smem<G, BN, S, SE>() <= 232448, "fprop_tma_rb's room");
    CK(cudaFuncSetAttribute(fprop_tma_rb<G, S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            lab_fprop_smem<G, BN, S, SE>()));
    CK(cudaFuncSetAttribute(fprop_tma_rb<GC, S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            lab_fprop_smem<GC, BN, S, SE>()));
  } else if constexpr (SE >= 2) {
    constexpr int ps = lab_fprop_smem<G, BN, S, SE>();
    static_assert(ps <= 232448, "the stages (and the room) fit an SM's 227 KB");
    CK(cudaFuncSetAttribute(fprop_tma_p<G, BN, S, SE == 3>,
                            cudaFuncAttributeMaxDynamicSharedMemorySize, ps));
    CK(cudaFuncSetAttribute(fprop_tma_p<GC, BN, S, SE == 3>,
                            cudaFuncAttributeMaxDynamicSharedMemorySize, ps));
  }
  const double err = fprop_error<GC>(1, [](const kiln_bf16 *x, const kiln_bf16 *wk, kiln_bf16 *y) {
    launch_fprop_tma<GC, BN, S, SE>(map_image<GC>(x, 128), map_filters<GC>(wk, BN), y);
  });
  kiln_bf16 *x = random_bf16((size_t)G::N * G::H * G::W * G::CI, 1.f, 3);
  kiln_bf16 *wk = random_bf16((size_t)G::CO * G::K, 0.2f, 4), *y;
  CK(cudaMalloc(&y, G::M * G::CO * 2));
  const CUtensorMap a = map_image<G>(x, 128), b = map_filters<G>(wk, BN);
  float us = time_us([&] { launch_fprop_tma<G, BN, S, SE>(a, b, y); });
  double tf = 2.0 * G::M * G::CO * G::K / (us * 1e-6) / 1e12;
  printf("| %s | fwd | tma 128x%d, %d stages%s | %.1f | %.1f | %.1e |\n", name, BN, S,
         SE == 1   ? ", stores through shared memory"
         : SE == 2 ? ", a block an SM over the tiles"
         : SE == 3 ? ", a block an SM over the tiles, stores through a room of its own"
         : SE == 4 ? ", a block an SM over the tiles, the filters resident, stores through a room"
                   : "",
         us, tf, err);
  cudaFree(x), cudaFree(wk), cudaFree(y);
}

template <class G, int BN, int S> static void launch_dgrad_tma(const CUtensorMap &a, const CUtensorMap &w, kiln_bf16 *dx) {
  constexpr int smem = KILN_TMA_SMEM((128 + BN) * 128, S);
  const long long px = (long long)G::N * G::H * G::W;
  dim3 grid((unsigned)((px + 127) / 128), (G::CI + BN - 1) / BN);
  dgrad_tma<G, BN, S><<<grid, KILN_TMA_THREADS, smem>>>(a, w, dx);
}

template <class G, class GC, int BN, int S> static void run_dgrad_tma(const char *name) {
  constexpr int smem = KILN_TMA_SMEM((128 + BN) * 128, S);
  CK(cudaFuncSetAttribute(dgrad_tma<G, BN, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(dgrad_tma<GC, BN, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  double err;
  {
    const size_t nx = (size_t)GC::N * GC::H * GC::W * GC::CI;
    kiln_bf16 *dy = random_bf16((size_t)GC::M * GC::CO, 1.f, 12);
    kiln_bf16 *wk = random_bf16((size_t)GC::CO * GC::K, 0.2f, 13), *dx;
    float *ref;
    CK(cudaMalloc(&dx, nx * 2));
    CK(cudaMalloc(&ref, nx * 4));
    CK(cudaMemset(dx, 0xff, nx * 2));
    launch_dgrad_tma<GC, BN, S>(map_dy_image<GC>(dy), map_flipped<GC>(wk), dx);
    ref_dgrad<GC><<<(unsigned)((nx + 255) / 256), 256>>>(dy, wk, ref);
    CK(cudaDeviceSynchronize());
    err = rel_err(dx, ref, nx);
    cudaFree(dy), cudaFree(wk), cudaFree(dx), cudaFree(ref);
  }
  const size_t nx = (size_t)G::N * G::H * G::W * G::CI;
  kiln_bf16 *dy = random_bf16((size_t)G::M * G::CO, 1.f, 14);
  kiln_bf16 *wk = random_bf16((size_t)G::CO * G::K, 0.2f, 15), *dx;
  CK(cudaMalloc(&dx, nx * 2));
  const CUtensorMap a = map_dy_image<G>(dy), w = map_flipped<G>(wk);
  float us = time_us([&] { launch_dgrad_tma<G, BN, S>(a, w, dx); });
  double tf = 2.0 * G::M * G::CO * G::K / (us * 1e-6) / 1e12;
  printf("| %s | dx | tma 128x%d, %d stages | %.1f | %.1f | %.1e |\n", name, BN, S, us, tf, err);
  cudaFree(dy), cudaFree(wk), cudaFree(dx);
}

/* The library's data gradient today (stride 1): conv.cuh's forward product of dY with the filters
 * flipped (FLIP), cp.async gathers, geometry GD. */
template <class G> struct Flipped {
  static constexpr int N = G::N, H = G::OH, W = G::OW, CI = G::CO, OH = G::H, OW = G::W, CO = G::CI;
  static constexpr int KH = G::KH, KW = G::KW, SH = 1, SW = 1, PH = G::KH - 1 - G::PH,
                       PW = G::KW - 1 - G::PW, DH = 1, DW = 1;
};

template <class G, int BN, int S>
__global__ void __launch_bounds__(256, 1) dgrad_wg(const kiln_bf16 *dy, const kiln_bf16 *wk,
                                                   kiln_bf16 *dx) {
  extern __shared__ unsigned char smem[];
  float d[BN / 2];
  const int m0 = blockIdx.x * 128, n0 = blockIdx.y * BN;
  if (kiln_conv_fprop<Flipped<G>, BN, S, true>(dy, wk, m0, n0, smem, d))
    store_tile<BN>(dx, m0, n0, (long long)G::N * G::H * G::W, G::CI, d);
}

/* The cp.async data gradient (checked at GC's batch, timed at G's), beside the TMA-fed one. */
template <class G, class GC, int BN, int S> static void run_dgrad_wg(const char *name) {
  constexpr int smem = KILN_CONV_SMEM(BN, S);
  CK(cudaFuncSetAttribute(dgrad_wg<G, BN, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(dgrad_wg<GC, BN, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  double err;
  {
    const size_t nx = (size_t)GC::N * GC::H * GC::W * GC::CI;
    kiln_bf16 *dy = random_bf16((size_t)GC::M * GC::CO, 1.f, 12);
    kiln_bf16 *wk = random_bf16((size_t)GC::CO * GC::K, 0.2f, 13), *dx;
    float *ref;
    CK(cudaMalloc(&dx, nx * 2));
    CK(cudaMalloc(&ref, nx * 4));
    CK(cudaMemset(dx, 0xff, nx * 2));
    dim3 grid((unsigned)((GC::N * GC::H * GC::W + 127) / 128), (GC::CI + BN - 1) / BN);
    dgrad_wg<GC, BN, S><<<grid, 256, smem>>>(dy, wk, dx);
    ref_dgrad<GC><<<(unsigned)((nx + 255) / 256), 256>>>(dy, wk, ref);
    CK(cudaDeviceSynchronize());
    err = rel_err(dx, ref, nx);
    cudaFree(dy), cudaFree(wk), cudaFree(dx), cudaFree(ref);
  }
  const size_t nx = (size_t)G::N * G::H * G::W * G::CI;
  kiln_bf16 *dy = random_bf16((size_t)G::M * G::CO, 1.f, 14);
  kiln_bf16 *wk = random_bf16((size_t)G::CO * G::K, 0.2f, 15), *dx;
  CK(cudaMalloc(&dx, nx * 2));
  dim3 grid((unsigned)(((long long)G::N * G::H * G::W + 127) / 128), (G::CI + BN - 1) / BN);
  float us = time_us([&] { dgrad_wg<G, BN, S><<<grid, 256, smem>>>(dy, wk, dx); });
  double tf = 2.0 * G::M * G::CO * G::K / (us * 1e-6) / 1e12;
  printf("| %s | dx | wgmma (cp.async) 128x%d, %d stages | %.1f | %.1f | %.1e |\n", name, BN, S,
         us, tf, err);
  cudaFree(dy), cudaFree(wk), cudaFree(dx);
}

template <class G, int BN, int S>
static void launch_wgrad_tma(const CUtensorMap &a, const CUtensorMap &b, kiln_bf16 *dwt,
                             float *part, unsigned *cnt, int splits, bool pair = false) {
  constexpr int smem = KILN_TMA_SMEM((2 + BN / 64) * 8192, S);
  const int chunk = (int)((G::M + splits * 64 - 1) / (splits * 64) * 64);
  const unsigned z = (unsigned)((G::M + chunk - 1) / chunk); /* as the library: no empty split */
  dim3 grid((G::K + 127) / 128, (G::CO + BN - 1) / BN, z);
  if (pair)
    wgrad_tma_pair<G, BN, S><<<grid, KILN_TMA_THREADS, lab::pair_smem<S>((2 + BN / 64) * 8192)>>>(
        a, b, dwt, part, cnt, chunk);
  else
    wgrad_tma<G, BN, S><<<grid, KILN_TMA_THREADS, smem>>>(a, b, dwt, part, cnt, chunk);
}

/* pair: by clusters of two blocks sharing their im2col boxes (needs an even count of BN-wide
 * column tiles) */
template <class G, class GC, int BN, int S>
static void run_wgrad_tma(const char *name, int splits, bool pair = false) {
  constexpr int smem = KILN_TMA_SMEM((2 + BN / 64) * 8192, S);
  constexpr int psmem = lab::pair_smem<S>((2 + BN / 64) * 8192);
  CK(cudaFuncSetAttribute(wgrad_tma<G, BN, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(wgrad_tma<GC, BN, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(wgrad_tma_pair<G, BN, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, psmem));
  CK(cudaFuncSetAttribute(wgrad_tma_pair<GC, BN, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, psmem));
  float *part;
  unsigned *cnt;
  CK(cudaMalloc(&part, (size_t)64 << 20));
  CK(cudaMalloc(&cnt, 65536));
  CK(cudaMemset(cnt, 0, 65536));
  double err;
  {
    kiln_bf16 *x = random_bf16((size_t)GC::N * GC::H * GC::W * GC::CI, 1.f, 5);
    kiln_bf16 *dy = random_bf16((size_t)GC::M * GC::CO, 1.f, 6), *out;
    float *ref;
    CK(cudaMalloc(&out, (size_t)GC::K * GC::CO * 2));
    CK(cudaMalloc(&ref, (size_t)GC::K * GC::CO * 4));
    CK(cudaMemset(out, 0xff, (size_t)GC::K * GC::CO * 2));
    ref_wgrad<GC><<<(GC::K * GC::CO + 255) / 256, 256>>>(x, dy, ref);
    launch_wgrad_tma<GC, BN, S>(map_image<GC>(x, 64), map_dy_rows<GC>(dy), out, part, cnt, 3, pair);
    CK(cudaDeviceSynchronize());
    err = rel_err(out, ref, (size_t)GC::K * GC::CO);
    cudaFree(x), cudaFree(dy), cudaFree(out), cudaFree(ref);
  }
  kiln_bf16 *x = random_bf16((size_t)G::N * G::H * G::W * G::CI, 1.f, 7);
  kiln_bf16 *dy = random_bf16((size_t)G::M * G::CO, 1.f, 8), *out;
  CK(cudaMalloc(&out, (size_t)G::K * G::CO * 2));
  const CUtensorMap a = map_image<G>(x, 64), b = map_dy_rows<G>(dy);
  float us = time_us([&] { launch_wgrad_tma<G, BN, S>(a, b, out, part, cnt, splits, pair); });
  double tf = 2.0 * G::M * G::CO * G::K / (us * 1e-6) / 1e12;
  printf("| %s | dw | tma 128x%d, %d stages, %d splits%s | %.1f | %.1f | %.1e |\n", name, BN, S,
         splits, pair ? ", pairs sharing X" : "", us, tf, err);
  cudaFree(x), cudaFree(dy), cudaFree(out), cudaFree(part), cudaFree(cnt);
}

/* kiln's data gradient today: cuBLAS's dcols = dY Wk (M, K), then col2im (a thread per 8
 * channels of dX, summing its taps' columns). */
template <class G> __global__ void col2im(const kiln_bf16 *cols, kiln_bf16 *dx) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; /* chunk of 8 */
  if (i >= (long long)G::N * G::H * G::W * (G::CI / 8)) return;
  const int c = (int)(i % (G::CI / 8)) * 8;
  const long long p = i / (G::CI / 8);
  const int w = (int)(p % G::W), h = (int)(p / G::W % G::H);
  const long long n = p / G::W / G::H;
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int a = 0; a < G::KH; a++)
    for (int b = 0; b < G::KW; b++) {
      const int th = h + G::PH - a, tw = w + G::PW - b;
      if (th < 0 || tw < 0 || th % G::SH || tw % G::SW) continue;
      const int oh = th / G::SH, ow = tw / G::SW;
      if (oh >= G::OH || ow >= G::OW) continue;
      const uint4 v = *(const uint4 *)&cols[((n * G::OH + oh) * G::OW + ow) * G::K +
                                            (a * G::KW + b) * G::CI + c];
      const kiln_bf16 *e = (const kiln_bf16 *)&v;
      for (int q = 0; q < 8; q++)
        s[q] += (float)e[q];
    }
  for (int q = 0; q < 8; q += 2)
    *(unsigned *)&dx[p * G::CI + c + q] = kiln_bf16x2_bits(s[q], s[q + 1]);
}

template <class G> static void run_cublas_dgrad(const char *name) {
  static cublasHandle_t h;
  if (!h) cublasCreate(&h);
  kiln_bf16 *dy = random_bf16((size_t)G::M * G::CO, 1.f, 16);
  kiln_bf16 *wk = random_bf16((size_t)G::CO * G::K, 0.2f, 17), *cols, *dx;
  const size_t nx = (size_t)G::N * G::H * G::W * G::CI;
  CK(cudaMalloc(&cols, (size_t)G::M * G::K * 2));
  CK(cudaMalloc(&dx, nx * 2));
  const float one = 1.f, zero = 0.f;
  float us_g = time_us([&] {
    cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, G::K, (int)G::M, G::CO, &one, wk, CUDA_R_16BF, G::K,
                 dy, CUDA_R_16BF, G::CO, &zero, cols, CUDA_R_16BF, G::K, CUBLAS_COMPUTE_32F,
                 CUBLAS_GEMM_DEFAULT);
  });
  const unsigned blocks = (unsigned)((nx / 8 + 255) / 256);
  float us_c = time_us([&] { col2im<G><<<blocks, 256>>>(cols, dx); });
  const double f = 2.0 * G::M * G::CO * G::K;
  printf("| %s | dx | cuBLAS dcols + col2im | %.1f (%.1f + %.1f) | %.1f | |\n", name, us_g + us_c,
         us_g, us_c, f / ((us_g + us_c) * 1e-6) / 1e12);
  cudaFree(dy), cudaFree(wk), cudaFree(cols), cudaFree(dx);
}

/* ./lab tma: the forward product and data gradient's baselines and TMA configs. */
template <class G, class GC> static void tma_products(const char *name, bool wide) {
  run_cublas_dgrad<G>(name);
  if (wide) {
    run_fprop_wg<G, GC, 128, 3>(name);
    run_fprop_wg<G, GC, 256, 4>(name);
    run_fprop_tma<G, GC, 128, 3>(name); /* two blocks an SM */
    run_fprop_tma<G, GC, 128, 4>(name);
    run_fprop_tma<G, GC, 128, 6>(name);
    run_fprop_tma<G, GC, 256, 3>(name);
    run_fprop_tma<G, GC, 256, 4>(name);
    run_fprop_tma<G, GC, 128, 6, 1>(name);
    run_fprop_tma<G, GC, 256, 4, 1>(name);
    run_fprop_tma<G, GC, 128, 6, 2>(name);
    run_fprop_tma<G, GC, 256, 4, 2>(name);
    run_fprop_tma<G, GC, 128, 4, 3>(name);
    run_fprop_tma<G, GC, 256, 3, 3>(name);
  } else {
    run_fprop_wg<G, GC, 64, 4>(name);
    run_fprop_tma<G, GC, 64, 4>(name);
    run_fprop_tma<G, GC, 64, 8>(name);
    run_fprop_tma<G, GC, 64, 8, 1>(name);
    run_fprop_tma<G, GC, 64, 8, 2>(name);
    run_fprop_tma<G, GC, 64, 8, 3>(name);
    if constexpr (G::CO == 64) {
      run_fprop_tma<G, GC, 64, 6, 4>(name);
      run_fprop_tma<G, GC, 64, 8, 4>(name);
    }
    run_fprop_tma<G, GC, 128, 4>(name);
  }
  if constexpr (G::SH == 1) {
    constexpr int WBN = G::CI <= 64 ? 64 : G::CI <= 128 ? 128 : 256; /* as render_conv.c */
    run_dgrad_wg<G, GC, WBN, WBN == 128 ? 3 : 4>(name);                /* the library's today */
    run_dgrad_tma<G, GC, 64, 4>(name);
    run_dgrad_tma<G, GC, 64, 8>(name);
    run_dgrad_tma<G, GC, 128, 3>(name);
    run_dgrad_tma<G, GC, 128, 4>(name);
    if (G::CI >= 256) run_dgrad_tma<G, GC, 256, 4>(name);
  }
}

static bool tma_wgrad_only; /* ./lab tmaw */

/* ./lab tma: one shape's baselines and TMA configs (CI % 64 == 0 shapes). */
template <template <int> class S, int NB = 1024> static void shape_tma(const char *name, bool wide) {
  typedef S<NB> G;
  typedef S<2> GC;
  run_cublas<G>(name);
  if (!tma_wgrad_only) tma_products<G, GC>(name, wide);
  if (!tma_wgrad_only)
    for (int splits : {1, 2, 4, 8, 16, 32}) {
      const int tiles = (G::K + 127) / 128 * ((G::CO + 127) / 128);
      if (tiles * splits > 600 || (long long)splits * 64 * 4 > G::M) continue;
      if (G::CO >= 128) {
        run_wgrad_wg<G, GC, 128, 4>(name, splits);
        run_wgrad_tma<G, GC, 128, 4>(name, splits);
        run_wgrad_tma<G, GC, 128, 6>(name, splits); /* the library's (8 stages: past 227 KB) */
        if (G::CO >= 256) run_wgrad_tma<G, GC, 256, 4>(name, splits);
      } else {
        run_wgrad_wg<G, GC, 64, 4>(name, splits);
        run_wgrad_tma<G, GC, 64, 4>(name, splits);
        run_wgrad_tma<G, GC, 64, 8>(name, splits);
      }
    }
  else /* ./lab tmaw: the TMA weight gradient over every split count that keeps 32 stages a split */
    for (int splits = 1; splits <= 32 && (long long)splits * 64 * 32 <= G::M; splits++) {
      if (G::CO >= 128) {
        run_wgrad_tma<G, GC, 128, 4>(name, splits); /* the library's */
        if ((G::CO + 127) / 128 % 2 == 0) run_wgrad_tma<G, GC, 128, 4>(name, splits, true);
        if (G::CO >= 256) run_wgrad_tma<G, GC, 256, 4>(name, splits);
      } else {
        run_wgrad_tma<G, GC, 64, 8>(name, splits); /* the library's */
      }
    }
}

/* ResNet-18's shapes at batch 128 (224 px): a stride-2 3x3 and two stride-1 ones. */
template <int N> using R2 = Shape<N, 56, 64, 128, 3, 1, 2>;
template <int N> using R3 = Shape<N, 28, 128, 128, 3, 1>;
template <int N> using R4 = Shape<N, 14, 256, 256, 3, 1>;

[[maybe_unused]] static bool only_wgmma; /* ./lab wgmma: the wgmma forward configs alone */

template <template <int> class S> static void shape(const char *name, bool wide) {
  typedef S<1024> G;
  typedef S<8> GC;
  if (wide) {
    run_fprop_wg<G, GC, 128, 3>(name);
    run_fprop_wg<G, GC, 128, 4>(name);
    run_fprop_wg<G, GC, 128, 5>(name);
    run_fprop_wg<G, GC, 256, 3>(name);
    run_fprop_wg<G, GC, 256, 4>(name);
  } else {
    run_fprop_wg<G, GC, 64, 4>(name);
    run_fprop_wg<G, GC, 64, 5>(name);
    run_fprop_wg<G, GC, 64, 8>(name);
  }
  if (only_wgmma) return;
  if (wide) {
    run_fprop<G, GC, T128x128>(name, "128x128 2x4 s3");
    run_fprop<G, GC, T64x128>(name, "64x128 2x4 s4");
  }
  run_fprop<G, GC, T128x64>(name, "128x64 4x2 s4");
  run_fprop<G, GC, T64x64>(name, "64x64 2x2 s4");
  for (int splits : {1, 4, 8, 16}) {
    if (wide) run_wgrad<G, GC, T128x128>(name, "128x128 2x4 s3", splits);
    run_wgrad<G, GC, T128x64>(name, "128x64 4x2 s4", splits);
  }
}

/* One shape's experiment: the warp-specialized loop, the weight gradient alone, or every product. */
enum Run { ALL, WGRAD, WS };
template <template <int> class S> static void run_shape(Run run, const char *name, bool wide) {
  if (run == WS)
    shape_ws<S>(name, wide);
  else if (run == WGRAD)
    shape_wgrad<S>(name, wide);
  else
    shape<S>(name, wide);
}

/* ./lab tma [NAME]: the TMA experiment on every shape, or on those whose name holds NAME; ./lab
 * tmaw [NAME]: the weight gradient alone, over every split count. */
static int main_tma(const char *only) {
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  printf("%s, %d SMs; bf16 dense peak 989.4 TFLOP/s\n\n", p.name, p.multiProcessorCount);
  printf("| conv (batch 1024; ResNet's 128) | product | kernel | us | TFLOP/s | max err / max |ref| |\n");
  printf("| --- | --- | --- | --- | --- | --- |\n");
  auto want = [&](const char *name) { return !only || strstr(name, only); };
  if (want("15x15x64->64")) shape_tma<B1>("15x15x64->64", false);
  if (want("15x15x64->256")) shape_tma<B2>("15x15x64->256", true);
  if (want("7x7x256->256")) shape_tma<C1>("7x7x256->256", true);
  if (want("3x3x256->256")) shape_tma<D1>("3x3x256->256", true);
  if (want("56x56x64->128 s2")) shape_tma<R2, 128>("56x56x64->128 s2", true);
  if (want("28x28x128->128")) shape_tma<R3, 128>("28x28x128->128", true);
  if (want("14x14x256->256")) shape_tma<R4, 128>("14x14x256->256", true);
  return 0;
}

int main(int argc, char **argv) {
  tma_wgrad_only = argc > 1 && strcmp(argv[1], "tmaw") == 0;
  if (argc > 1 && (strcmp(argv[1], "tma") == 0 || tma_wgrad_only))
    return main_tma(argc > 2 ? argv[2] : nullptr);
#ifndef LAB_TMA_ONLY /* -DLAB_TMA_ONLY: the TMA experiment alone, a quarter of the build time */
  only_wgmma = argc > 1 && strcmp(argv[1], "wgmma") == 0;
  dw_only = argc > 1 && strcmp(argv[1], "dw") == 0;
  const bool wgrad = dw_only || (argc > 1 && strcmp(argv[1], "wgrad") == 0);
  const bool ws = argc > 1 && strcmp(argv[1], "ws") == 0;
  const Run run = ws ? WS : wgrad ? WGRAD : ALL;
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  printf("%s, %d SMs; bf16 dense peak 989.4 TFLOP/s\n\n", p.name, p.multiProcessorCount);
  printf("| conv (batch 1024) | product | tiles | us | TFLOP/s | max err / max |ref| |\n");
  printf("| --- | --- | --- | --- | --- | --- |\n");
  run_shape<A1>(run, "31x31x24->64", false);
  run_shape<B1>(run, "15x15x64->64", false);
  run_shape<B2>(run, "15x15x64->256", true);
  run_shape<C1>(run, "7x7x256->256", true);
  run_shape<D1>(run, "3x3x256->256", true);
#endif
  return 0;
}
