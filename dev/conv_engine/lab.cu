// lab.cu: the implicit-GEMM forward product and weight gradient of conv.cuh (mma.sync) and the
// forward product of wgmma.cuh (Hopper's wgmma) on the
// air workload's convolutions (bf16, batch 1024), each tile config timed, and each checked
// against a float64-accumulating reference on a batch of 8 (the same kernels, the same
// geometry). The weight gradient splits the pixels over blockIdx.z; a second kernel sums the
// splits in order (deterministic).
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o lab dev/conv_engine/lab.cu
//   ./lab [wgmma]
//
// Prints one line per shape, product and config: us (median of 15 timings of 10 launches each),
// TFLOP/s (2 M N K), and the largest error against the reference relative to the largest |ref|.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "wgmma.cuh"

#define CK(x)                                                                                      \
  do {                                                                                             \
    cudaError_t e = (x);                                                                           \
    if (e != cudaSuccess) {                                                                        \
      fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e));                   \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

template <int N_, int H_, int CI_, int CO_, int K_, int P_> struct Shape {
  static constexpr int N = N_, H = H_, W = H_, CI = CI_, CO = CO_, KH = K_, KW = K_;
  static constexpr int SH = 1, SW = 1, PH = P_, PW = P_, DH = 1, DW = 1;
  static constexpr int OH = H + 2 * P_ - K_ + 1, OW = OH;
  static constexpr long long M = (long long)N * OH * OW;
  static constexpr int K = KH * KW * CI;
};

template <class G, class T>
__global__ void __launch_bounds__(T::THREADS)
    fprop(const kiln_bf16 *x, const kiln_bf16 *wk, kiln_bf16 *y) {
  float acc[T::MI][T::NI][4];
  const long long m0 = (long long)blockIdx.x * T::BM;
  const int n0 = blockIdx.y * T::BN;
  kiln_conv_fprop<G, T>(x, wk, m0, n0, acc);
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

template <class G, int BN, int S>
__global__ void __launch_bounds__(256)
    fprop_wg(const kiln_bf16 *x, const kiln_bf16 *wk, kiln_bf16 *y) {
  extern __shared__ unsigned char smem[];
  float d[BN / 2];
  const long long m0 = (long long)blockIdx.x * 128;
  const int n0 = blockIdx.y * BN;
  kiln_conv_fprop_wg<G, BN, S>(x, wk, m0, n0, smem, d);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long r = m0 + 64 * (warp >> 2) + 16 * (warp & 3) + (lane >> 2);
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
  kiln_conv_wgrad<G, T>(x, dy, k0, n0, p0, p0 + chunk, acc);
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

template <class G> __global__ void ref_fprop(const kiln_bf16 *x, const kiln_bf16 *wk, float *y) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= G::M * G::CO) return;
  const int co = (int)(i % G::CO);
  const long long m = i / G::CO;
  const int ow = (int)(m % G::OW), oh = (int)(m / G::OW % G::OH);
  const long long n = m / G::OW / G::OH;
  double s = 0;
  for (int a = 0; a < G::KH; a++)
    for (int b = 0; b < G::KW; b++) {
      const int ih = oh - G::PH + a, iw = ow - G::PW + b;
      if (ih < 0 || ih >= G::H || iw < 0 || iw >= G::W) continue;
      for (int c = 0; c < G::CI; c++)
        s += (double)(float)x[((n * G::H + ih) * G::W + iw) * G::CI + c] *
             (double)(float)wk[(long long)co * G::K + (a * G::KW + b) * G::CI + c];
    }
  y[i] = (float)s;
}

template <class G> __global__ void ref_wgrad(const kiln_bf16 *x, const kiln_bf16 *dy, float *dwt) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= G::K * G::CO) return;
  const int co = i % G::CO, k = i / G::CO;
  const int tap = k / G::CI, c = k % G::CI, a = tap / G::KW, b = tap % G::KW;
  double s = 0;
  for (long long m = 0; m < G::M; m++) {
    const int ow = (int)(m % G::OW), oh = (int)(m / G::OW % G::OH);
    const long long n = m / G::OW / G::OH;
    const int ih = oh - G::PH + a, iw = ow - G::PW + b;
    if (ih < 0 || ih >= G::H || iw < 0 || iw >= G::W) continue;
    s += (double)(float)x[((n * G::H + ih) * G::W + iw) * G::CI + c] *
         (double)(float)dy[m * G::CO + co];
  }
  dwt[i] = (float)s;
}

static kiln_bf16 *random_bf16(size_t n, float scale, unsigned seed) {
  std::vector<unsigned short> h(n);
  unsigned s = seed;
  for (size_t i = 0; i < n; i++) {
    s = s * 1664525u + 1013904223u;
    float f = ((s >> 8) * (1.f / 16777216.f) * 2.f - 1.f) * scale;
    unsigned u;
    memcpy(&u, &f, 4);
    h[i] = (unsigned short)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  }
  kiln_bf16 *d;
  CK(cudaMalloc(&d, n * 2));
  CK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
  return d;
}

static float bf16_to_f(unsigned short b) {
  unsigned u = (unsigned)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* max |a - ref| / max |ref|: a bf16 on the device, ref f32 on the device */
static double rel_err(const kiln_bf16 *a, const float *ref, size_t n) {
  std::vector<unsigned short> ha(n);
  std::vector<float> hr(n);
  CK(cudaMemcpy(ha.data(), a, n * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hr.data(), ref, n * 4, cudaMemcpyDeviceToHost));
  double md = 0, mr = 0;
  for (size_t i = 0; i < n; i++) {
    md = std::max(md, (double)std::fabs(bf16_to_f(ha[i]) - hr[i]));
    mr = std::max(mr, (double)std::fabs(hr[i]));
  }
  return mr > 0 ? md / mr : md;
}

template <class F> static float time_us(F launch) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; i++)
    launch();
  std::vector<float> t;
  for (int r = 0; r < 15; r++) {
    CK(cudaEventRecord(e0));
    for (int i = 0; i < 10; i++)
      launch();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms * 100.f);
  }
  CK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
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
template <class G, class GC, int BN, int S> static void run_fprop_wg(const char *name) {
  constexpr int smem = kiln_wg_smem<BN, S>();
  CK(cudaFuncSetAttribute(fprop_wg<G, BN, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(fprop_wg<GC, BN, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  double err;
  {
    kiln_bf16 *x = random_bf16((size_t)GC::N * GC::H * GC::W * GC::CI, 1.f, 1);
    kiln_bf16 *wk = random_bf16((size_t)GC::CO * GC::K, 0.2f, 2), *y;
    float *ref;
    CK(cudaMalloc(&y, GC::M * GC::CO * 2));
    CK(cudaMalloc(&ref, GC::M * GC::CO * 4));
    dim3 grid((unsigned)((GC::M + 127) / 128), (GC::CO + BN - 1) / BN);
    fprop_wg<GC, BN, S><<<grid, 256, smem>>>(x, wk, y);
    ref_fprop<GC><<<(unsigned)((GC::M * GC::CO + 255) / 256), 256>>>(x, wk, ref);
    CK(cudaDeviceSynchronize());
    err = rel_err(y, ref, (size_t)GC::M * GC::CO);
    cudaFree(x), cudaFree(wk), cudaFree(y), cudaFree(ref);
  }
  kiln_bf16 *x = random_bf16((size_t)G::N * G::H * G::W * G::CI, 1.f, 3);
  kiln_bf16 *wk = random_bf16((size_t)G::CO * G::K, 0.2f, 4), *y;
  CK(cudaMalloc(&y, G::M * G::CO * 2));
  dim3 grid((unsigned)((G::M + 127) / 128), (G::CO + BN - 1) / BN);
  float us = time_us([&] { fprop_wg<G, BN, S><<<grid, 256, smem>>>(x, wk, y); });
  double tf = 2.0 * G::M * G::CO * G::K / (us * 1e-6) / 1e12;
  printf("| %s | fwd | wgmma 128x%d, %d stages | %.1f | %.1f | %.1e |\n", name, BN, S, us, tf, err);
  cudaFree(x), cudaFree(wk), cudaFree(y);
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

typedef kiln_conv_tile<128, 128, 2, 4, 3> T128x128;
typedef kiln_conv_tile<128, 64, 4, 2, 4> T128x64;
typedef kiln_conv_tile<64, 128, 2, 4, 4> T64x128;
typedef kiln_conv_tile<64, 64, 2, 2, 4> T64x64;

template <int N> using A1 = Shape<N, 31, 24, 64, 3, 1>;
template <int N> using B1 = Shape<N, 15, 64, 64, 3, 1>;
template <int N> using B2 = Shape<N, 15, 64, 256, 3, 1>;
template <int N> using C1 = Shape<N, 7, 256, 256, 3, 1>;
template <int N> using D1 = Shape<N, 3, 256, 256, 3, 1>;

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

int main(int argc, char **argv) {
  only_wgmma = argc > 1 && strcmp(argv[1], "wgmma") == 0;
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  printf("%s, %d SMs; bf16 dense peak 989.4 TFLOP/s\n\n", p.name, p.multiProcessorCount);
  printf("| conv (batch 1024) | product | tiles | us | TFLOP/s | max err / max |ref| |\n");
  printf("| --- | --- | --- | --- | --- | --- |\n");
  shape<A1>("31x31x24->64", false);
  shape<B1>("15x15x64->64", false);
  shape<B2>("15x15x64->256", true);
  shape<C1>("7x7x256->256", true);
  shape<D1>("3x3x256->256", true);
  return 0;
}
