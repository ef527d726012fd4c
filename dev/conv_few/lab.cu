// lab.cu: the forward product of airbench's first 3x3 conv (31x31, 24 channels into 64, padding
// 1), bf16, from a halo tile (fusion/device/conv_few.cuh, KILN_CONV_FEW; first written here as
// few.cuh, 414c42e, with a variant storing 4 bytes a lane), beside conv.cuh's kernel for it
// (the wgmma product, BN 64, 4 stages, as render_conv.c takes it without KILN_CONV_FEW; and with
// KILN_CONV_AHEAD's loop),
// at batch 1024 (the air workload) and 2000 (the CIFAR-10 example's muon step). Each kernel is
// checked first against a float64-accumulating reference on the whole output at batch 8 and at
// the timed batch; the timed operands are random, never zero.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/lab_few dev/conv_few/lab.cu
//   /tmp/lab_few          the forward products (air's first conv, ResNet-18's stem, and two 3x3
//                         convs over 64 channels, which the library leaves to its TMA kernel)
//   /tmp/lab_few wgrad    conv_few.cuh's weight gradient from the same halo tiles
//   (KILN_CONV_FEW_WGRAD)
//
// Prints one line a kernel and batch: us (median of 15 timings of 10 launches), TFLOP/s (2 M CO K),
// GB/s over the bytes a kernel must move at least (image, filters, output once), the grid, and
// the largest error against the reference relative to the largest |ref|.
#include <cuda_runtime.h>

#include "../../fusion/device/conv.cuh"     /* the library's wgmma products */
#include "../../fusion/device/conv_few.cuh" /* and its halo-tile one */
#include "../conv_engine/lab_util.h"

/* conv_few.cuh's weight gradient as render_conv.c's render_few_wgrad wraps it: part holds the
 * blocks' partial dWt, cnt two counters, zero between launches */
template <class G, int TH, int TW>
__global__ void __launch_bounds__(256, 2)
    few_wgrad(const kiln_bf16 *x, const kiln_bf16 *dy, kiln_bf16 *dw, float *part, unsigned *cnt) {
  extern __shared__ __align__(16) unsigned char smem[];
  kiln_conv_few_wgrad<G, TH, TW>(x, dy, dw, part, cnt, smem);
}

/* conv_few.cuh's forward product as render_conv.c's render_few wraps it (MINB 2; 3: the registers
 * cut to 85 a thread, to see whether a third block an SM pays) */
template <class G, int TH, int TW, int MINB = 2>
__global__ void __launch_bounds__(256, MINB)
    few_fprop(const kiln_bf16 *x, const kiln_bf16 *wk, kiln_bf16 *y) {
  extern __shared__ __align__(16) unsigned char smem[];
  kiln_conv_few<G, TH, TW>(x, wk, y, smem);
}

template <class G, int BN, int S, bool AHEAD>
__global__ void __launch_bounds__(256, 1)
    fprop_lib(const kiln_bf16 *x, const kiln_bf16 *wk, kiln_bf16 *y) {
  extern __shared__ unsigned char smem[];
  float d[BN / 2];
  const int m0 = (int)blockIdx.x * 128, n0 = (int)blockIdx.y * BN;
  if (!kiln_conv_fprop<G, BN, S, false, false, AHEAD>(x, wk, m0, n0, smem, d)) return;
  store_rows<BN>(y, m0 + kiln_conv_row0<false>(), n0, G::M, G::CO, d);
}

/* A kernel of the experiment: its launch for shape G, and its name. */
struct Lib {
  template <class G, bool AHEAD> static void setup() {
    CK(cudaFuncSetAttribute(fprop_lib<G, 64, 4, AHEAD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            KILN_CONV_SMEM(64, 4)));
  }
  template <class G, bool AHEAD>
  static unsigned launch(const kiln_bf16 *x, const kiln_bf16 *wk, kiln_bf16 *y) {
    const unsigned grid = (unsigned)((G::M + 127) / 128);
    fprop_lib<G, 64, 4, AHEAD><<<grid, 256, KILN_CONV_SMEM(64, 4)>>>(x, wk, y);
    return grid;
  }
};

static int num_sms() {
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  return p.multiProcessorCount;
}

/* few_fprop's grid: as many blocks as fit the GPU at once (at most one a tile), or `per_sm` an SM
 */
template <class G, int TH, int TW, int MINB> static unsigned few_grid(int per_sm) {
  constexpr int smem = kiln_few<G, TH, TW>::SMEM;
  CK(cudaFuncSetAttribute(few_fprop<G, TH, TW, MINB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          smem));
  int fit = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, few_fprop<G, TH, TW, MINB>, 256, smem));
  if (per_sm > 0 && per_sm < fit) fit = per_sm;
  const long long g = (long long)fit * num_sms();
  return (unsigned)(g < kiln_few<G, TH, TW>::TILES ? g : kiln_few<G, TH, TW>::TILES);
}

template <class G, int TH, int TW, int MINB>
static unsigned few_launch(const kiln_bf16 *x, const kiln_bf16 *wk, kiln_bf16 *y, int per_sm) {
  const unsigned grid = few_grid<G, TH, TW, MINB>(per_sm);
  few_fprop<G, TH, TW, MINB><<<grid, 256, kiln_few<G, TH, TW>::SMEM>>>(x, wk, y);
  return grid;
}

/* max |y - ref| / max |ref| of launch's output on random operands of shape G (y starts as NaN) */
template <class G, class L> static double check(L launch) {
  kiln_bf16 *x = random_bf16((size_t)G::N * G::H * G::W * G::CI, 1.f, 11);
  kiln_bf16 *wk = random_bf16((size_t)G::CO * G::K, 0.2f, 12), *y;
  float *ref;
  CK(cudaMalloc(&y, G::M * G::CO * 2));
  CK(cudaMemset(y, 0xff, G::M * G::CO * 2));
  CK(cudaMalloc(&ref, G::M * G::CO * 4));
  launch(x, wk, y);
  ref_fprop<G><<<(unsigned)((G::M * G::CO + 255) / 256), 256>>>(x, wk, ref);
  CK(cudaDeviceSynchronize());
  const double e = rel_err(y, ref, (size_t)G::M * G::CO);
  cudaFree(x), cudaFree(wk), cudaFree(y), cudaFree(ref);
  return e;
}

/* checked at batch 8 and at G's, then timed at G's */
template <class G, class G8, class L, class L8>
static void run(const char *name, const char *kernel, L launch, L8 launch8) {
  const double e8 = check<G8>(launch8), e = check<G>(launch);
  kiln_bf16 *x = random_bf16((size_t)G::N * G::H * G::W * G::CI, 1.f, 3);
  kiln_bf16 *wk = random_bf16((size_t)G::CO * G::K, 0.2f, 4), *y;
  CK(cudaMalloc(&y, G::M * G::CO * 2));
  unsigned grid = 0;
  const float us = time_us([&] { grid = launch(x, wk, y); });
  const double tf = 2.0 * G::M * G::CO * G::K / (us * 1e-6) / 1e12;
  const double bytes =
      2.0 * ((double)G::N * G::H * G::W * G::CI + G::CO * G::K + (double)G::M * G::CO);
  printf("| %s | %s | %.1f | %.1f | %.0f | %u | %.1e, %.1e |\n", name, kernel, us, tf,
         bytes / (us * 1e-6) / 1e9, grid, e8, e);
  cudaFree(x), cudaFree(wk), cudaFree(y);
}

/* ResNet-18's stem as kiln runs it (KILN_CONV_S2D): 4x4 over the 16 channels of the image's 2x2
 * blocks, 115x115 into 112x112, no padding (profile_step's batch 128) */
template <int N> using Stem = Shape<N, 115, 16, 64, 4, 0>;

/* ResNet-18's first stage (layer1): 3x3 over 64 channels into 64 at 56x56 */
template <int N> using L1 = Shape<N, 56, 64, 64, 3, 1>;

/* conv.cuh's forward product on shape G (checked at G8's batch and G's), under name */
template <class G, class G8, bool AHEAD> static void run_lib(const char *name, const char *kernel) {
  Lib::setup<G, AHEAD>(), Lib::setup<G8, AHEAD>();
  run<G, G8>(
      name, kernel,
      [](const kiln_bf16 *x, const kiln_bf16 *w, kiln_bf16 *y) {
        return Lib::launch<G, AHEAD>(x, w, y);
      },
      [](const kiln_bf16 *x, const kiln_bf16 *w, kiln_bf16 *y) {
        return Lib::launch<G8, AHEAD>(x, w, y);
      });
}

/* every kernel on shape G (checked at G8's batch and G's), under name */
template <class G, class G8> static void shape(const char *name) {
  run_lib<G, G8, false>(name, "library: conv.cuh wgmma 128x64, 4 stages");
  run_lib<G, G8, true>(name, "library, KILN_CONV_AHEAD's loop");
#define FEW(TH, TW, PER_SM, MINB)                                                                  \
  run<G, G8>(                                                                                      \
      name,                                                                                        \
      "conv_few.cuh, halo " #TH "x" #TW ", " #PER_SM " an SM (0: all that fit), bounds " #MINB,    \
      [](const kiln_bf16 *x, const kiln_bf16 *w, kiln_bf16 *y) {                                   \
        return few_launch<G, TH, TW, MINB>(x, w, y, PER_SM);                                       \
      },                                                                                           \
      [](const kiln_bf16 *x, const kiln_bf16 *w, kiln_bf16 *y) {                                   \
        return few_launch<G8, TH, TW, MINB>(x, w, y, PER_SM);                                      \
      })
  FEW(4, 32, 0, 2);
  FEW(8, 16, 0, 2);
  if constexpr (G::CI == 24) { /* air's: the variants of the first run */
    FEW(4, 32, 1, 2);
    FEW(4, 32, 0, 3);
  }
#undef FEW
}

/* ./lab_few wgrad: conv_few.cuh's weight gradient (its partial products and their sum in one
 * kernel) at batch G::N, checked against float64 at batch 8 and at G::N, then timed */
template <class G, int TH, int TW>
static unsigned wgrad_launch(const kiln_bf16 *x, const kiln_bf16 *dy, kiln_bf16 *dw, float *part,
                             unsigned *cnt) {
  constexpr int smem = kiln_few_w<G, TH, TW>::SMEM;
  CK(cudaFuncSetAttribute(few_wgrad<G, TH, TW>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const long long most = 2LL * num_sms(), tiles = kiln_few<G, TH, TW>::TILES;
  const unsigned grid = (unsigned)(tiles < most ? tiles : most);
  few_wgrad<G, TH, TW><<<grid, 256, smem>>>(x, dy, dw, part, cnt);
  return grid;
}

/* max |dW - ref| / max |ref| of the weight gradient on random operands of shape G (dW starts as
 * NaN; the reference is dWt (K, CO), the result dW (CO, K)) */
template <class G, int TH, int TW> static double check_wgrad(float *part, unsigned *cnt) {
  if (G::M > 2000000) return NAN; /* the reference's threads each sum M products: too slow */
  kiln_bf16 *x = random_bf16((size_t)G::N * G::H * G::W * G::CI, 1.f, 21);
  kiln_bf16 *dy = random_bf16((size_t)G::M * G::CO, 1.f, 22), *dw;
  float *ref;
  CK(cudaMalloc(&dw, (size_t)G::K * G::CO * 2));
  CK(cudaMemset(dw, 0xff, (size_t)G::K * G::CO * 2));
  CK(cudaMalloc(&ref, (size_t)G::K * G::CO * 4));
  wgrad_launch<G, TH, TW>(x, dy, dw, part, cnt);
  ref_wgrad<G><<<(G::K * G::CO + 255) / 256, 256>>>(x, dy, ref);
  CK(cudaDeviceSynchronize());
  std::vector<unsigned short> hd((size_t)G::K * G::CO);
  std::vector<float> hr((size_t)G::K * G::CO);
  CK(cudaMemcpy(hd.data(), dw, hd.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hr.data(), ref, hr.size() * 4, cudaMemcpyDeviceToHost));
  double md = 0, mr = 0;
  for (int k = 0; k < G::K; k++)
    for (int co = 0; co < G::CO; co++) {
      const float v = bf16_to_f(hd[(size_t)co * G::K + k]), r = hr[(size_t)k * G::CO + co];
      md = std::isfinite(v) ? std::max(md, (double)std::fabs(v - r)) : INFINITY;
      mr = std::max(mr, (double)std::fabs(r));
    }
  cudaFree(x), cudaFree(dy), cudaFree(dw), cudaFree(ref);
  return mr > 0 ? md / mr : md;
}

template <class G, class G8, int TH, int TW> static void run_wgrad(const char *name) {
  float *part;
  unsigned *cnt;
  CK(cudaMalloc(&part, (size_t)32 << 20)); /* the library's KILN__CONV_WS_BYTES */
  CK(cudaMalloc(&cnt, 64));
  CK(cudaMemset(cnt, 0, 64));
  const double e8 = check_wgrad<G8, TH, TW>(part, cnt), e = check_wgrad<G, TH, TW>(part, cnt);
  unsigned left[2];
  CK(cudaMemcpy(left, cnt, sizeof left, cudaMemcpyDeviceToHost));
  kiln_bf16 *x = random_bf16((size_t)G::N * G::H * G::W * G::CI, 1.f, 23);
  kiln_bf16 *dy = random_bf16((size_t)G::M * G::CO, 1.f, 24), *dw;
  CK(cudaMalloc(&dw, (size_t)G::K * G::CO * 2));
  unsigned grid = 0;
  const float us = time_us([&] { grid = wgrad_launch<G, TH, TW>(x, dy, dw, part, cnt); });
  const double tf = 2.0 * G::M * G::CO * G::K / (us * 1e-6) / 1e12;
  const double bytes = 2.0 * ((double)G::N * G::H * G::W * G::CI + (double)G::M * G::CO);
  printf("| %s | conv_few.cuh halo %dx%d | %.1f | %.1f | %.0f | %u | %.1e, %.1e | %u %u |\n", name,
         TH, TW, us, tf, bytes / (us * 1e-6) / 1e9, grid, e8, e, left[0], left[1]);
  cudaFree(x), cudaFree(dy), cudaFree(dw), cudaFree(part), cudaFree(cnt);
}

static int main_wgrad() {
  printf("| conv 31x31x24->64, 3x3, weight gradient | kernel | us | TFLOP/s | GB/s (X and dY once) "
         "| grid | max err / max |ref| (batch 8, timed batch) | counters after (0 0) |\n");
  printf("| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  run_wgrad<A1<1024>, A1<8>, 4, 32>("batch 1024");
  run_wgrad<A1<1024>, A1<8>, 8, 16>("batch 1024");
  run_wgrad<A1<2000>, A1<8>, 4, 32>("batch 2000");
  printf("(the library's cp.async weight gradient in the steps' traces on the H100: 206.5 us at "
         "batch 1024, 337.7 at 2000)\n\n");
  printf("| ResNet-18's stem, 115x115x16->64 4x4 | kernel | us | TFLOP/s | GB/s | grid | max err / "
         "max |ref| (batch 8, batch 128: not checked) | counters after (0 0) |\n");
  printf("| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  run_wgrad<Stem<128>, Stem<8>, 4, 32>("batch 128");
  run_wgrad<Stem<128>, Stem<8>, 8, 16>("batch 128");
  return 0;
}

/* A forward-product table's header, for the shapes named by what */
static void table(const char *what) {
  printf("\n| %s | kernel | us | TFLOP/s | GB/s (least bytes) | grid | max err / max |ref| (batch "
         "8, timed batch) |\n",
         what);
  printf("| --- | --- | --- | --- | --- | --- | --- |\n");
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "wgrad") == 0) return main_wgrad();
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  printf("%s, %d SMs; bf16 dense peak 989.4 TFLOP/s (H200 and H100 SXM), HBM 4.8 TB/s (H200) or "
         "3.35 (H100)\n",
         p.name, p.multiProcessorCount);
  table("conv 31x31x24->64, 3x3");
  shape<A1<1024>, A1<8>>("batch 1024");
  shape<A1<2000>, A1<8>>("batch 2000");
  table("ResNet-18's stem, 115x115x16->64 4x4");
  shape<Stem<128>, Stem<8>>("batch 128");
  /* 64 input channels, past the library's gate (kiln__conv_few_shape: fewer than 64; the TMA
   * kernel takes these): whether a halo tile pays there too, with 152 KB of shared memory a
   * block (filters of 576 values, two halos, the staged rows): one block an SM */
  table("3x3 64->64, padding 1");
  shape<B1<1024>, B1<8>>("air's 15x15, batch 1024");
  shape<L1<128>, L1<8>>("ResNet-18's 56x56, batch 128");
  printf("(the library's TMA kernel on air's 15x15x64->64 in the step's trace on the H100, "
         "2026-12-06: 76.5 us; cuDNN 51.2)\n");
  return 0;
}
