// igemm.cu: a kernel experiment outside the library (DESIGN.md's dev/ lab). A convolution's
// forward product computed as an implicit GEMM on tensor cores (no im2col buffer: each block
// loads its window rows straight from the NHWC image), against what kiln runs today (a generated
// im2col, then cuBLAS), in TF32 and in BF16, on the 3x3 convolutions of DESIGN.md's `cnn` and
// `air` workloads. Prints per shape: the time of each path (median), its TFLOP/s, and the largest
// difference from cuBLAS's result.
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -o igemm dev/conv_igemm/igemm.cu -lcublas && ./igemm
//
// The kernel: Y (M = N*OH*OW, Cout) = A (M, R*S*C) x B, A's row m the window of output pixel m
// in (r, s, c) order, B the weight as (Cout, R, S, C) rows. A block computes 128 x 64 of Y with
// 4 warps (64 x 32 each) of mma.sync m16n8k8 (TF32) or m16n8k16 (BF16), and takes K in tiles of
// 32 channels of one tap (so C must be a multiple of 32), double-buffered with cp.async, whose
// zero-fill gives the padding.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                      \
  do {                                                                                             \
    cudaError_t e_ = (x);                                                                          \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));                  \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)
#define CB(x)                                                                                      \
  do {                                                                                             \
    cublasStatus_t s_ = (x);                                                                       \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                             \
      fprintf(stderr, "%s:%d: cuBLAS %d\n", __FILE__, __LINE__, (int)s_);                          \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

struct conv {
  const char *name;
  int N, H, W, C, K, R, S, pad, stride;
  __host__ __device__ int OH() const { return (H + 2 * pad - R) / stride + 1; }
  __host__ __device__ int OW() const { return (W + 2 * pad - S) / stride + 1; }
  __host__ __device__ long long M() const { return (long long)N * OH() * OW(); }
  __host__ __device__ int KD() const { return R * S * C; }
};

constexpr int BM = 128, BN = 64, BK = 32, THREADS = 128;

// ---------------------------------------------------------------- element types

template <typename T> struct elem;
template <> struct elem<float> {
  static constexpr int PAD = 4;   // row padding (elements): conflict-free fragment reads
  static constexpr int VEC = 4;   // elements per 16-byte copy
  static constexpr int KSTEP = 8; // k of one mma
};
template <> struct elem<__nv_bfloat16> {
  static constexpr int PAD = 8;
  static constexpr int VEC = 8;
  static constexpr int KSTEP = 16;
};

__device__ __forceinline__ uint32_t tf32(float f) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(f));
  return r;
}

__device__ __forceinline__ void cp16(void *smem, const void *gmem, bool valid) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  int bytes = valid ? 16 : 0; // 0: the 16 bytes are filled with zeros (padding)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N> __device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// One k-step of a warp's 64 x 32 tile: 4 x 4 mma tiles. As rows are m, Bs rows are n, both with
// k contiguous.
template <typename T>
__device__ __forceinline__ void mma_step(const T *As, const T *Bs, int ld, int kk, int wm, int wn,
                                         int lane, float acc[4][4][4]) {
  const int g = lane >> 2, t = lane & 3;
  if constexpr (sizeof(T) == 4) {
    uint32_t a[4][4], b[4][2];
    for (int mi = 0; mi < 4; mi++) {
      const float *p = (const float *)As + (wm * 64 + mi * 16 + g) * ld + kk;
      a[mi][0] = tf32(p[t]);
      a[mi][1] = tf32(p[8 * ld + t]);
      a[mi][2] = tf32(p[t + 4]);
      a[mi][3] = tf32(p[8 * ld + t + 4]);
    }
    for (int ni = 0; ni < 4; ni++) {
      const float *p = (const float *)Bs + (wn * 32 + ni * 8 + g) * ld + kk;
      b[ni][0] = tf32(p[t]);
      b[ni][1] = tf32(p[t + 4]);
    }
    for (int mi = 0; mi < 4; mi++)
      for (int ni = 0; ni < 4; ni++)
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(acc[mi][ni][0]), "+f"(acc[mi][ni][1]), "+f"(acc[mi][ni][2]),
                       "+f"(acc[mi][ni][3])
                     : "r"(a[mi][0]), "r"(a[mi][1]), "r"(a[mi][2]), "r"(a[mi][3]),
                       "r"(b[ni][0]), "r"(b[ni][1]));
  } else {
    uint32_t a[4][4], b[4][2];
    for (int mi = 0; mi < 4; mi++) {
      const T *p = As + (wm * 64 + mi * 16 + g) * ld + kk + 2 * t;
      a[mi][0] = *(const uint32_t *)p;
      a[mi][1] = *(const uint32_t *)(p + 8 * ld);
      a[mi][2] = *(const uint32_t *)(p + 8);
      a[mi][3] = *(const uint32_t *)(p + 8 * ld + 8);
    }
    for (int ni = 0; ni < 4; ni++) {
      const T *p = Bs + (wn * 32 + ni * 8 + g) * ld + kk + 2 * t;
      b[ni][0] = *(const uint32_t *)p;
      b[ni][1] = *(const uint32_t *)(p + 8);
    }
    for (int mi = 0; mi < 4; mi++)
      for (int ni = 0; ni < 4; ni++)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(acc[mi][ni][0]), "+f"(acc[mi][ni][1]), "+f"(acc[mi][ni][2]),
                       "+f"(acc[mi][ni][3])
                     : "r"(a[mi][0]), "r"(a[mi][1]), "r"(a[mi][2]), "r"(a[mi][3]),
                       "r"(b[ni][0]), "r"(b[ni][1]));
  }
}

// x (N, H, W, C), w (Cout, R, S, C), bias (Cout), y (M, Cout) f32.
template <typename T>
__global__ void __launch_bounds__(THREADS)
    igemm(const T *__restrict__ x, const T *__restrict__ w, const float *__restrict__ bias,
          float *__restrict__ y, conv p) {
  constexpr int LD = BK + elem<T>::PAD, VEC = elem<T>::VEC;
  constexpr int ACH = BK / VEC;                    // 16-byte chunks of a row's k-tile
  constexpr int AROWS = THREADS / ACH;             // rows one pass of the block loads
  extern __shared__ __align__(16) unsigned char smem[];
  T *As = (T *)smem;                  // [2][BM][LD]
  T *Bs = As + 2 * BM * LD;           // [2][BN][LD]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;
  const int OH = p.OH(), OW = p.OW(), KD = p.KD();
  const long long M = p.M(), m0 = (long long)blockIdx.x * BM;
  const int n0 = blockIdx.y * BN, ch = tid % ACH;
  // the rows this thread loads: their image, and their window's top-left corner
  constexpr int NA = BM / AROWS;
  long long base[NA];
  int h0[NA], w0[NA];
  for (int i = 0; i < NA; i++) {
    long long m = m0 + tid / ACH + i * AROWS;
    bool in = m < M;
    long long mm = in ? m : 0;
    int ow = (int)(mm % OW), oh = (int)((mm / OW) % OH);
    long long n = mm / ((long long)OW * OH);
    base[i] = n * p.H * p.W * p.C;
    h0[i] = in ? oh * p.stride - p.pad : -1000000; // out of range: always padding
    w0[i] = ow * p.stride - p.pad;
  }
  auto load = [&](int kt, int buf) {
    int k0 = kt * BK, tap = k0 / p.C, c0 = k0 % p.C, r = tap / p.S, s = tap % p.S;
    T *a = As + buf * BM * LD;
    for (int i = 0; i < NA; i++) {
      int row = tid / ACH + i * AROWS, h = h0[i] + r, ww = w0[i] + s;
      bool valid = h >= 0 && h < p.H && ww >= 0 && ww < p.W;
      const T *src = valid ? x + base[i] + ((long long)h * p.W + ww) * p.C + c0 + ch * VEC : x;
      cp16(a + row * LD + ch * VEC, src, valid);
    }
    T *b = Bs + buf * BN * LD;
    for (int i = 0; i < BN / AROWS; i++) {
      int row = tid / ACH + i * AROWS;
      bool valid = n0 + row < p.K;
      cp16(b + row * LD + ch * VEC, valid ? w + (long long)(n0 + row) * KD + k0 + ch * VEC : w,
           valid);
    }
    cp_commit();
  };
  float acc[4][4][4] = {};
  const int KT = KD / BK;
  load(0, 0);
  for (int kt = 0; kt < KT; kt++) {
    if (kt + 1 < KT) {
      load(kt + 1, (kt + 1) & 1);
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    const T *a = As + (kt & 1) * BM * LD, *b = Bs + (kt & 1) * BN * LD;
#pragma unroll
    for (int kk = 0; kk < BK; kk += elem<T>::KSTEP)
      mma_step<T>(a, b, LD, kk, wm, wn, lane, acc);
    __syncthreads();
  }
  const int g = lane >> 2, t = lane & 3;
  for (int mi = 0; mi < 4; mi++)
    for (int ni = 0; ni < 4; ni++) {
      int n = n0 + wn * 32 + ni * 8 + 2 * t;
      if (n >= p.K) continue;
      float b0 = bias[n], b1 = bias[n + 1];
      for (int h = 0; h < 2; h++) {
        long long m = m0 + wm * 64 + mi * 16 + g + 8 * h;
        if (m < M)
          *(float2 *)&y[m * p.K + n] =
              make_float2(acc[mi][ni][2 * h] + b0, acc[mi][ni][2 * h + 1] + b1);
      }
    }
}

// ---------------------------------------------------------------- the im2col path (as kiln's)

// 16 bytes of channels a thread (as kiln's generated im2col, with 32-bit indices where they fit).
template <typename T>
__global__ void im2col(const T *__restrict__ x, T *__restrict__ col, conv p) {
  constexpr int VEC = 16 / sizeof(T);
  const int OH = p.OH(), OW = p.OW(), KD = p.KD(), KV = KD / VEC;
  long long total = p.M() * KV;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (long long)gridDim.x * blockDim.x) {
    int k = (int)(e % KV) * VEC;
    long long m = e / KV;
    int c = k % p.C, s = (k / p.C) % p.S, r = k / (p.C * p.S);
    int ow = (int)(m % OW), oh = (int)((m / OW) % OH);
    long long n = m / ((long long)OW * OH);
    int h = oh * p.stride - p.pad + r, w = ow * p.stride - p.pad + s;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (h >= 0 && h < p.H && w >= 0 && w < p.W)
      v = *(const uint4 *)&x[((n * p.H + h) * p.W + w) * p.C + c];
    ((uint4 *)col)[e] = v;
  }
}

__global__ void add_bias(float *y, const float *bias, long long M, int K) {
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < M * K;
       e += (long long)gridDim.x * blockDim.x)
    y[e] += bias[e % K];
}

__global__ void to_bf16(const float *in, __nv_bfloat16 *out, long long n) {
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
       e += (long long)gridDim.x * blockDim.x)
    out[e] = __float2bfloat16(in[e]);
}

// ---------------------------------------------------------------- timing

template <typename F> static float median_ms(F run) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 10; i++)
    run();
  std::vector<float> ms;
  for (int rep = 0; rep < 31; rep++) {
    CK(cudaEventRecord(a));
    for (int i = 0; i < 10; i++)
      run();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t / 10);
  }
  std::sort(ms.begin(), ms.end());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return ms[ms.size() / 2];
}

static float max_rel_diff(const float *a, const float *b, long long n) {
  std::vector<float> ha(n), hb(n);
  CK(cudaMemcpy(ha.data(), a, n * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hb.data(), b, n * 4, cudaMemcpyDeviceToHost));
  double scale = 0, worst = 0;
  for (long long i = 0; i < n; i++)
    scale = std::max(scale, (double)std::fabs(hb[i]));
  for (long long i = 0; i < n; i++)
    worst = std::max(worst, (double)std::fabs(ha[i] - hb[i]));
  return (float)(worst / (scale > 0 ? scale : 1));
}

int main() {
  const conv shapes[] = {
      {"cnn conv2 26x26x32->64", 128, 26, 26, 32, 64, 3, 3, 0, 1},
      {"air 32x32x64->64", 1024, 32, 32, 64, 64, 3, 3, 1, 1},
      {"air 16x16x64->256", 1024, 16, 16, 64, 256, 3, 3, 1, 1},
      {"air 8x8x256->256", 1024, 8, 8, 256, 256, 3, 3, 1, 1},
      {"air 4x4x256->256", 1024, 4, 4, 256, 256, 3, 3, 1, 1},
  };
  cublasHandle_t h;
  CB(cublasCreate(&h));
  printf("| shape | path | ms | TFLOP/s | max diff / max |y| |\n| --- | --- | --- | --- | --- |\n");
  for (const conv &p : shapes) {
    long long nx = (long long)p.N * p.H * p.W * p.C, nw = (long long)p.K * p.KD(), M = p.M();
    double flop = 2.0 * M * p.K * p.KD();
    std::vector<float> hx(nx), hw(nw), hb(p.K);
    uint64_t st = 42;
    auto rnd = [&] {
      st = st * 6364136223846793005ull + 1442695040888963407ull;
      return (float)((st >> 40) / 16777216.0) * 2.f - 1.f;
    };
    for (auto &v : hx) v = rnd();
    for (auto &v : hw) v = rnd() * 0.1f;
    for (auto &v : hb) v = rnd();
    float *x, *w, *b, *col, *y_ref, *y, *y32;
    __nv_bfloat16 *xb, *wb, *colb;
    CK(cudaMalloc(&x, nx * 4));
    CK(cudaMalloc(&w, nw * 4));
    CK(cudaMalloc(&b, p.K * 4));
    CK(cudaMalloc(&col, M * p.KD() * 4));
    CK(cudaMalloc(&y_ref, M * p.K * 4));
    CK(cudaMalloc(&y, M * p.K * 4));
    CK(cudaMalloc(&y32, M * p.K * 4));
    CK(cudaMalloc(&xb, nx * 2));
    CK(cudaMalloc(&wb, nw * 2));
    CK(cudaMalloc(&colb, M * p.KD() * 2));
    CK(cudaMemcpy(x, hx.data(), nx * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(w, hw.data(), nw * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b, hb.data(), p.K * 4, cudaMemcpyHostToDevice));
    to_bf16<<<1024, 256>>>(x, xb, nx);
    to_bf16<<<1024, 256>>>(w, wb, nw);
    const float one = 1.f, zero = 0.f;
    // cuBLAS: Y (M, K) row-major = col (M, KD) x W^T; column-major: Y^T = W (KD x K)^T ... as
    // Y^T (K x M) = W^T' x col^T', with W stored (K, KD) row-major = (KD x K) column-major
    auto gemm = [&](bool bf16) {
      CB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, p.K, (int)M, p.KD(), &one, bf16 ? (void *)wb : w,
                      bf16 ? CUDA_R_16BF : CUDA_R_32F, p.KD(), bf16 ? (void *)colb : col,
                      bf16 ? CUDA_R_16BF : CUDA_R_32F, p.KD(), &zero, y_ref, CUDA_R_32F, p.K,
                      bf16 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32,
                      CUBLAS_GEMM_DEFAULT));
    };
    for (int bf16 = 0; bf16 < 2; bf16++) {
      const char *ty = bf16 ? "bf16" : "tf32";
      // the im2col path: im2col, GEMM, bias (kiln puts the bias in the GEMM's epilogue)
      auto i2c = [&] {
        if (bf16)
          im2col<<<132 * 8, 256>>>(xb, colb, p);
        else
          im2col<<<132 * 8, 256>>>(x, col, p);
      };
      float t_i2c = median_ms(i2c);
      float t_gemm = median_ms([&] { gemm(bf16); });
      add_bias<<<132 * 8, 256>>>(y_ref, b, M, p.K);
      CK(cudaDeviceSynchronize());
      size_t smem = 2 * (BM + BN) * (BK + (bf16 ? 8 : 4)) * (bf16 ? 2 : 4);
      dim3 grid((unsigned)((M + BM - 1) / BM), (p.K + BN - 1) / BN);
      auto ig = [&] {
        if (bf16)
          igemm<__nv_bfloat16><<<grid, THREADS, smem>>>(xb, wb, b, y, p);
        else
          igemm<float><<<grid, THREADS, smem>>>(x, w, b, y, p);
      };
      if (bf16)
        CK(cudaFuncSetAttribute(igemm<__nv_bfloat16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)smem));
      else
        CK(cudaFuncSetAttribute(igemm<float>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)smem));
      ig();
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      float diff = max_rel_diff(y, y_ref, M * p.K);
      if (!bf16) CK(cudaMemcpy(y32, y_ref, M * p.K * 4, cudaMemcpyDeviceToDevice));
      float diff32 = max_rel_diff(y, y32, M * p.K); /* bf16 against the tf32 product */
      float t_ig = median_ms(ig);
      printf("| %s | im2col + cuBLAS %s | %.4f (%.4f + %.4f) | %.1f (GEMM alone %.1f) | - |\n",
             p.name, ty, t_i2c + t_gemm, t_i2c, t_gemm, flop / (t_i2c + t_gemm) / 1e9,
             flop / t_gemm / 1e9);
      printf("| %s | implicit GEMM %s | %.4f | %.1f | %.2e (%.2e from the TF32 product) |\n",
             p.name, ty, t_ig, flop / t_ig / 1e9, diff, diff32);
    }
    cudaFree(x), cudaFree(w), cudaFree(b), cudaFree(col), cudaFree(y_ref), cudaFree(y), cudaFree(y32);
    cudaFree(xb), cudaFree(wb), cudaFree(colb);
  }
  printf("H200 dense peaks (NVIDIA): TF32 494.7 TFLOP/s, BF16 989.4 TFLOP/s; HBM3e 4.8 TB/s\n");
  cublasDestroy(h);
  return 0;
}
