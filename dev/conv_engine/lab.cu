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
//
// Prints one line per shape, product and config: us (median of 15 timings of 10 launches each),
// TFLOP/s (2 M N K), and the largest error against the reference relative to the largest |ref|.

#include <cublas_v2.h>

#include "lab_util.h"

#include "../../fusion/device/conv.cuh" /* the library's wgmma products */
#include "conv.cuh"                     /* the mma.sync experiments (namespace lab) */

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
  const int lane = threadIdx.x & 31;
  const long long r = m0 + kiln_conv_row0<WS>();
#pragma unroll
  for (int j = 0; j < BN / 8; j++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const long long m = r + 8 * h;
      const int c = n0 + 8 * j + 2 * (lane & 3);
      if (m < G::M && c < G::CO)
        *(unsigned *)&y[m * G::CO + c] = kiln_bf16x2_bits(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
    }
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
  const int lane = threadIdx.x & 31;
  const int r0 = kiln_conv_row0<WS>();
#pragma unroll
  for (int j = 0; j < BN / 8; j++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int k = k0 + r0 + 8 * h, c = n0 + 8 * j + 2 * (lane & 3);
      if (k < G::K && c < G::CO)
        *(unsigned *)&dwt[(long long)k * G::CO + c] =
            kiln_bf16x2_bits(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
    }
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
  const int ih = oh - G::PH + tap / G::KW, iw = ow - G::PW + tap % G::KW;
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
static bool dw_only; /* ./lab dw: the wgmma weight gradient's configs alone */
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

static bool only_wgmma; /* ./lab wgmma: the wgmma forward configs alone */

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

int main(int argc, char **argv) {
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
  return 0;
}
