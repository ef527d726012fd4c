// probe.cu: which of kiln's shared-memory patterns can compute-sanitizer's racecheck run over?
// Issue 24 asks for racecheck on the cnn and air steps with 0 hazards. On the H100 and the H200
// the tool failed ("Internal Sanitizer Error: The Sanitizer failed to handle a hardware
// exception") on every test that runs the TMA-fed or wgmma products, and on air's step the host's
// memory went past 128 GiB within seconds once the tiled casts (k_cast_x*_tiles) were checked,
// though memcheck passes on the same kernels and racecheck on every other family of air's kernels
// reports 0 hazards. Each case below is one of those patterns alone, in the smallest kernel that
// has it, built from the library's own device functions where it has them; each checks its
// values against the host, so a case the tool fails on is a correct kernel.
//
//   nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o probe dev/racecheck/probe.cu
//   ./probe                                            # every case, each checked: "ok" or not
//   compute-sanitizer --tool racecheck ./probe CASE    # one case under the tool
//
// Cases (bench/gpu_figures.sh BUILD racecheck_min runs each under the tool, the host's memory
// watched):
//   control       a block's sum through shared memory between __syncthreads (0 hazards expected)
//   casts         the tiled casts as air's step runs them: nine tensors in one launch (blockIdx.y),
//                 a grid of 8 blocks an SM, the filters' blocks transposed through dynamic shared
//                 memory between two __syncthreads, the input's cast without shared memory
//   casts_small   the same kernel on a grid of 8 x 9 blocks
//   mbar          a producer warp fills S stages with plain stores, the consumers wait for each
//                 on an mbarrier (kiln_mbar_*) and hand it back on another: the products'
//                 protocol without TMA or wgmma
//   tma           the same protocol with each stage a TMA copy of a 64 x 64 bf16 box
//                 (kiln_tma_tile2, kiln_tma_produce), the map a __grid_constant__ parameter (as in
//                 dev/conv_engine's lab)
//   tma_global    the same, the map in global memory behind kiln_tma_acquire (the library's way)
//   wgmma         one warpgroup multiplies 64 x 64 tiles that its threads stored in the 128-byte
//                 swizzle (kiln_wgmma): no TMA, no mbarrier
//   fprop         the library's TMA-fed forward product (kiln_conv_fprop_tma) on a small
//                 convolution, maps as parameters
//   fprop_global  the same, the maps in global memory (the library's generated kernels)
//   fprop_cpasync the library's other forward product (conv.cuh's kiln_conv_fprop: cp.async
//                 gathers and __syncthreads, wgmma) on the same convolution
#include <cuda.h>
#include <cudaTypedefs.h>

/* A lost arrival traps after 60 s (the library's 10, the lab's 2): under the tool, whose checks
 * slow every wait, no deadline may be what fails; a hung case meets the step's time limit. */
#define KILN_TMA_WAIT_NS 60000000000ull
#include "../conv_engine/lab_util.h" /* CK, Shape, fprop_error, store_rows */
#include "../conv_engine/tma.cuh"    /* the library's conv_tma.cuh, tma::tiled_map, im2col_map */

/* ---------------------------------------------------------------- control */

__global__ void k_control(const float *x, int n, float *out) {
  __shared__ float s[256];
  float v = 0.f;
  for (int i = blockIdx.x * 256 + threadIdx.x; i < n; i += gridDim.x * 256)
    v += x[i];
  s[threadIdx.x] = v;
  __syncthreads();
  for (int h = 128; h > 0; h >>= 1) {
    if (threadIdx.x < h) s[threadIdx.x] += s[threadIdx.x + h];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = s[0];
}

/* ---------------------------------------------------------------- casts */

constexpr int CAST_ROWS = 9;

/* Tensor t of a launch: n f32 values cast to bf16; with block > 0, filters of block = C KK values
 * stored (O, C, KK) and written (O, KK, C), one filter at a time through shared memory. air's nine
 * casts of one launch (k_cast_x9_tiles): the input images, its filters, the classifier's weights */
struct cast_row {
  long long n;
  int block, kk;
};
constexpr cast_row CAST[CAST_ROWS] = {
    {1024ll * 32 * 32 * 3, 0, 0}, {24 * 12, 12, 4},      {64 * 216, 216, 9},
    {64 * 576, 576, 9},           {256 * 576, 576, 9},   {256 * 2304, 2304, 9},
    {256 * 2304, 2304, 9},        {256 * 2304, 2304, 9}, {256 * 10, 0, 0}};

struct cast_ptrs {
  const float *x[CAST_ROWS];
  kiln_bf16 *y[CAST_ROWS];
};

/* Tensor T's case, its sizes constants, as the generated kernel's are (each case its own loop
 * and barriers, inlined) */
template <int T> __device__ __forceinline__ void cast_case(const cast_ptrs &a) {
  extern __shared__ float blk[];
  constexpr cast_row r = CAST[T];
  const float *x = a.x[T];
  kiln_bf16 *y = a.y[T];
  if constexpr (r.block == 0) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < r.n;
         i += (long long)gridDim.x * blockDim.x)
      y[i] = (kiln_bf16)x[i];
  } else {
    constexpr int B = r.block, KK = r.kk, C = B / KK;
    for (long long o = blockIdx.x; o < r.n / B; o += gridDim.x) {
      __syncthreads(); /* the last filter's values read */
      for (int j = threadIdx.x; j < B; j += blockDim.x)
        blk[j] = x[o * B + j];
      __syncthreads();
      for (int i = threadIdx.x; i < B; i += blockDim.x)
        y[o * B + i] = (kiln_bf16)blk[i % C * KK + i / C];
    }
  }
}

/* blockIdx.y picks the tensor, as in kiln's multi-tensor casts */
__global__ void __launch_bounds__(256) k_casts(const cast_ptrs a) {
  switch (blockIdx.y) {
  case 0: cast_case<0>(a); break;
  case 1: cast_case<1>(a); break;
  case 2: cast_case<2>(a); break;
  case 3: cast_case<3>(a); break;
  case 4: cast_case<4>(a); break;
  case 5: cast_case<5>(a); break;
  case 6: cast_case<6>(a); break;
  case 7: cast_case<7>(a); break;
  case 8: cast_case<8>(a); break;
  }
}

/* ---------------------------------------------------------------- mbarriers, TMA */

constexpr int STAGES = 3, TILES = 24, BOX = 64 * 64; /* a stage: a 64 x 64 bf16 box, 8 KB */

/* The consumers' half of the protocol (threads 0-255): stage kt's values summed into *sum once
 * its `full` barrier completes, then handed back on `empty` by each warp's lane 0, as
 * kiln_tma_consume does (its count is the eight warps). */
__device__ void consume_stages(unsigned long long *full, const unsigned char *base, float *sum) {
  unsigned long long *empty = full + STAGES;
  float s = 0.f;
  int st = 0, ph = 0;
  for (int kt = 0; kt < TILES; kt++) {
    kiln_tma_mbar_wait(&full[st], ph);
    const kiln_bf16 *v = (const kiln_bf16 *)(base + st * BOX * 2);
    for (int i = threadIdx.x; i < BOX; i += 256)
      s += (float)v[i];
    __syncwarp();
    if ((threadIdx.x & 31) == 0) kiln_mbar_arrive(&empty[st]);
    if (++st == STAGES) st = 0, ph ^= 1;
  }
  sum[blockIdx.x * 256 + threadIdx.x] = s;
}

/* mbar: warp 8 writes each stage with plain stores, all 32 lanes arriving on `full` (count 32). */
__global__ void __launch_bounds__(288, 1) k_mbar(const kiln_bf16 *src, float *sum) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char *base = kiln_align1024(smem);
  unsigned long long *full = (unsigned long long *)(base + STAGES * BOX * 2),
                     *empty = full + STAGES;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; s++) {
      kiln_mbar_init(&full[s], 32);
      kiln_mbar_init(&empty[s], 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x < 256) return consume_stages(full, base, sum);
  const int lane = threadIdx.x & 31;
  int st = 0, ph = 0;
  for (int kt = 0; kt < TILES; kt++) {
    if (kt >= STAGES) kiln_tma_mbar_wait(&empty[st], ph ^ 1);
    kiln_bf16 *v = (kiln_bf16 *)(base + st * BOX * 2);
    for (int i = lane; i < BOX; i += 32)
      v[i] = src[(long long)kt * BOX + i];
    kiln_mbar_arrive(&full[st]);
    if (++st == STAGES) st = 0, ph ^= 1;
  }
}

/* tma: thread 256 copies each stage (a box of rows [64 kt, 64 kt + 64) of a (64 TILES, 64)
 * matrix) through the library's producer loop; the barriers as kiln_tma_init_barriers makes them */
__device__ void tma_stages(const kiln_tmap *map, float *sum) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char *base = kiln_align1024(smem);
  unsigned long long *full = (unsigned long long *)(base + STAGES * BOX * 2);
  kiln_tma_init_barriers<STAGES>(full);
  if (threadIdx.x < 256) return consume_stages(full, base, sum);
  if (threadIdx.x == 256)
    kiln_tma_produce<STAGES>(TILES, full, BOX * 2, [&](int kt, int st) {
      kiln_tma_tile2(base + st * BOX * 2, map, &full[st], 0, kt * 64);
    });
}
__global__ void __launch_bounds__(288, 1)
    k_tma(const __grid_constant__ CUtensorMap map, float *sum) {
  tma_stages((const kiln_tmap *)&map, sum);
}
__global__ void __launch_bounds__(288, 1) k_tma_global(const kiln_tmap *map, float *sum) {
  if (threadIdx.x == 256) kiln_tma_acquire(map);
  tma_stages(map, sum);
}

/* ---------------------------------------------------------------- wgmma */

/* D (64 x 64) = A (64 x 64) B^T, A and B row-major bf16 with the reduction contiguous (K-major),
 * stored by the warpgroup's threads into the 128-byte swizzle (kiln_sw128), multiplied as the
 * forward product's stages are (kiln_tma_fprop_mma: four products 16 deep, 32 bytes apart). */
__global__ void __launch_bounds__(128, 1)
    k_wgmma(const kiln_bf16 *A, const kiln_bf16 *B, float *D) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char *base = kiln_align1024(smem), *as = base, *bs = base + 64 * 128;
  for (int i = threadIdx.x; i < 64 * 8; i += 128) { /* 16-byte chunk i % 8 of row i / 8 */
    const int r = i / 8, c = i % 8;
    *(uint4 *)(as + kiln_sw128(r, c)) = *(const uint4 *)(A + r * 64 + c * 8);
    *(uint4 *)(bs + kiln_sw128(r, c)) = *(const uint4 *)(B + r * 64 + c * 8);
  }
  kiln_fence_async_smem();
  __syncthreads();
  float d[32];
  for (int i = 0; i < 32; i++)
    d[i] = 0.f;
  const unsigned long long da = kiln_wg_desc<16, 1024>(as), db = kiln_wg_desc<16, 1024>(bs);
  kiln_wg_fence();
  for (int ks = 0; ks < 4; ks++)
    kiln_wgmma<64, 0, 0>(d, kiln_wg_desc_plus(da, ks * 32), kiln_wg_desc_plus(db, ks * 32));
  kiln_wg_commit();
  kiln_wg_wait<0>();
  kiln_wg_pin(d);
  const int r0 = kiln_conv_row0<false>(), lane = threadIdx.x & 31;
  for (int j = 0; j < 8; j++)
    for (int e = 0; e < 4; e++)
      D[(r0 + 8 * (e / 2)) * 64 + 8 * j + 2 * (lane & 3) + e % 2] = d[4 * j + e];
}

/* ---------------------------------------------------------------- the forward product */

using FG = Shape<2, 8, 64, 64, 3, 1>; /* 2 images of 8 x 8 x 64, 3 x 3 filters into 64, padding 1 */
constexpr int FBN = 64, FS = 3;
constexpr int FSMEM = KILN_TMA_SMEM((128 + FBN) * 128, FS);

__device__ void fprop_tile(const kiln_tmap *ta, const kiln_tmap *tb, kiln_bf16 *y) {
  extern __shared__ unsigned char smem[];
  float d[FBN / 2];
  const int m0 = blockIdx.x * 128, n0 = blockIdx.y * FBN;
  if (kiln_conv_fprop_tma<FG, FBN, FS>(ta, tb, m0, n0, smem, d))
    store_rows<FBN>(y, m0 + kiln_conv_row0<false>(), n0, FG::M, FG::CO, d);
}
__global__ void __launch_bounds__(KILN_TMA_THREADS, 1)
    k_fprop(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb,
            kiln_bf16 *y) {
  fprop_tile((const kiln_tmap *)&ta, (const kiln_tmap *)&tb, y);
}
__global__ void __launch_bounds__(KILN_TMA_THREADS, 1)
    k_fprop_global(const kiln_tmap *tm, kiln_bf16 *y) {
  if (threadIdx.x == 256)
    for (int i = 0; i < 2; i++)
      kiln_tma_acquire(tm + i);
  fprop_tile(tm, tm + 1, y);
}

/* conv.cuh's: 256 threads, every one gathering with cp.async and multiplying */
__global__ void __launch_bounds__(256, 1)
    k_fprop_cpasync(const kiln_bf16 *x, const kiln_bf16 *wk, kiln_bf16 *y) {
  extern __shared__ unsigned char smem[];
  float d[FBN / 2];
  const int m0 = blockIdx.x * 128, n0 = blockIdx.y * FBN;
  if (kiln_conv_fprop<FG, FBN, FS>(x, wk, m0, n0, smem, d))
    store_rows<FBN>(y, m0 + kiln_conv_row0<false>(), n0, FG::M, FG::CO, d);
}

/* ---------------------------------------------------------------- host */

static float h_bf16(float f) { /* f rounded to bf16 (to nearest, ties to even), as a float */
  unsigned u;
  memcpy(&u, &f, 4);
  u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
  memcpy(&f, &u, 4);
  return f;
}

static std::vector<float> h_random(size_t n, unsigned seed) { /* in [-1, 1), never all zeros */
  std::vector<float> v(n);
  for (size_t i = 0; i < n; i++) {
    seed = seed * 1664525u + 1013904223u;
    v[i] = (seed >> 8) * (2.f / 16777216.f) - 1.f;
  }
  return v;
}

template <class T> static T *upload(const std::vector<T> &h) {
  T *d;
  CK(cudaMalloc(&d, h.size() * sizeof(T)));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <class T> static std::vector<T> download(const T *d, size_t n) {
  std::vector<T> h(n);
  CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

static std::vector<unsigned short> bf16_bits(const std::vector<float> &v) {
  std::vector<unsigned short> b(v.size());
  for (size_t i = 0; i < v.size(); i++) {
    const float r = h_bf16(v[i]);
    unsigned u;
    memcpy(&u, &r, 4);
    b[i] = (unsigned short)(u >> 16);
  }
  return b;
}

static bool report(const char *name, double err, double tol) {
  const bool ok = err <= tol;
  printf("%-13s %s (error %.2e, tolerance %.0e)\n", name, ok ? "ok" : "WRONG", err, tol);
  return ok;
}

static bool run_control() {
  const int n = 1 << 20, blocks = 64;
  std::vector<float> h = h_random(n, 11);
  float *x = upload(h), *out;
  CK(cudaMalloc(&out, blocks * sizeof(float)));
  k_control<<<blocks, 256>>>(x, n, out);
  CK(cudaGetLastError());
  std::vector<float> s = download(out, blocks);
  double got = 0, want = 0, mag = 0;
  for (float v : s)
    got += v;
  for (float v : h)
    want += v, mag += std::fabs(v);
  cudaFree(x), cudaFree(out);
  return report("control", std::fabs(got - want) / mag, 1e-5);
}

/* the nine casts of CAST in one launch, each tensor's values checked */
static bool run_casts(bool small) {
  cast_ptrs a;
  std::vector<std::vector<float>> h(CAST_ROWS);
  int most = 0;
  for (int t = 0; t < CAST_ROWS; t++) {
    h[t] = h_random((size_t)CAST[t].n, 100 + t);
    a.x[t] = upload(h[t]);
    CK(cudaMalloc(&a.y[t], CAST[t].n * 2));
    most = std::max(most, CAST[t].block);
  }
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const dim3 grid(small ? 8 : sms * 8, CAST_ROWS); /* kiln__grid_for: 8 blocks an SM at most */
  k_casts<<<grid, 256, most * sizeof(float)>>>(a);
  CK(cudaGetLastError());
  long long wrong = 0;
  for (int t = 0; t < CAST_ROWS; t++) {
    std::vector<unsigned short> got = download((const unsigned short *)a.y[t], (size_t)CAST[t].n),
                                want = bf16_bits(h[t]);
    const int B = CAST[t].block, KK = CAST[t].kk;
    for (long long i = 0; i < CAST[t].n; i++) {
      long long from = i;
      if (B) from = i / B * B + (i % B) % (B / KK) * KK + (i % B) / (B / KK);
      wrong += got[i] != want[from];
    }
    cudaFree((void *)a.x[t]), cudaFree(a.y[t]);
  }
  return report(small ? "casts_small" : "casts", (double)wrong, 0);
}

/* mbar, tma and tma_global: the consumers' 256 sums against the host's (a box's values in the
 * 128-byte swizzle land in other places, so a thread's sum is not the host's: the total is) */
static bool run_stages(const char *name) {
  std::vector<float> h = h_random((size_t)TILES * BOX, 21);
  std::vector<unsigned short> b = bf16_bits(h);
  kiln_bf16 *src = (kiln_bf16 *)upload(b);
  float *sum;
  CK(cudaMalloc(&sum, 256 * sizeof(float)));
  const int smem = STAGES * BOX * 2 + 16 * STAGES + 1024;
  const cuuint64_t dims[2] = {64, (cuuint64_t)TILES * 64};
  const cuuint32_t box[2] = {64, 64};
  kiln_tmap *gmap = nullptr;
  if (!strcmp(name, "mbar")) {
    CK(cudaFuncSetAttribute(k_mbar, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    k_mbar<<<1, 288, smem>>>(src, sum);
  } else {
    const CUtensorMap map = tma::tiled_map(src, 2, dims, box);
    if (!strcmp(name, "tma")) {
      CK(cudaFuncSetAttribute(k_tma, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      k_tma<<<1, 288, smem>>>(map, sum);
    } else {
      CK(cudaMalloc(&gmap, sizeof(kiln_tmap)));
      CK(cudaMemcpy(gmap, &map, sizeof map, cudaMemcpyHostToDevice));
      CK(cudaFuncSetAttribute(k_tma_global, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      k_tma_global<<<1, 288, smem>>>(gmap, sum);
    }
  }
  CK(cudaGetLastError());
  std::vector<float> s = download(sum, 256);
  double got = 0, want = 0, mag = 0;
  for (float v : s)
    got += v;
  for (unsigned short u : b) {
    const float f = bf16_to_f(u);
    want += f, mag += std::fabs(f);
  }
  cudaFree(src), cudaFree(sum), cudaFree(gmap);
  return report(name, std::fabs(got - want) / mag, 1e-5);
}

static bool run_wgmma() {
  std::vector<float> a = h_random(64 * 64, 31), b = h_random(64 * 64, 32);
  std::vector<unsigned short> ab = bf16_bits(a), bb = bf16_bits(b);
  kiln_bf16 *A = (kiln_bf16 *)upload(ab), *B = (kiln_bf16 *)upload(bb);
  float *D;
  CK(cudaMalloc(&D, 64 * 64 * sizeof(float)));
  const int smem = 2 * 64 * 128 + 1024;
  k_wgmma<<<1, 128, smem>>>(A, B, D);
  CK(cudaGetLastError());
  std::vector<float> d = download(D, 64 * 64);
  double err = 0, mag = 0;
  for (int i = 0; i < 64; i++)
    for (int j = 0; j < 64; j++) {
      double s = 0;
      for (int k = 0; k < 64; k++)
        s += (double)bf16_to_f(ab[i * 64 + k]) * bf16_to_f(bb[j * 64 + k]);
      err = std::max(err, std::fabs(d[i * 64 + j] - s)), mag = std::max(mag, std::fabs(s));
    }
  cudaFree(A), cudaFree(B), cudaFree(D);
  return report("wgmma", err / mag, 1e-5);
}

/* kind 0: TMA, maps as parameters; 1: TMA, maps in global memory; 2: cp.async */
static bool run_fprop(int kind) {
  const dim3 grid((unsigned)((FG::M + 127) / 128), FG::CO / FBN);
  kiln_tmap *tm = nullptr; /* kind 1's maps, freed once the product has run */
  const double err = fprop_error<FG>(41, [&](const kiln_bf16 *x, const kiln_bf16 *wk,
                                             kiln_bf16 *y) {
    if (kind == 2) {
      constexpr int smem = KILN_CONV_SMEM(FBN, FS);
      CK(cudaFuncSetAttribute(k_fprop_cpasync, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      k_fprop_cpasync<<<grid, 256, smem>>>(x, wk, y);
      return;
    }
    const cuuint64_t dims[2] = {(cuuint64_t)FG::K, (cuuint64_t)FG::CO};
    const cuuint32_t box[2] = {64, (cuuint32_t)FBN};
    const CUtensorMap maps[2] = {tma::im2col_map(x, FG::N, FG::H, FG::W, FG::CI, FG::KH, FG::KW,
                                                 FG::SH, FG::PH, FG::DH, 128),
                                 tma::tiled_map(wk, 2, dims, box)};
    if (kind == 1) {
      CK(cudaMalloc(&tm, sizeof maps));
      CK(cudaMemcpy(tm, maps, sizeof maps, cudaMemcpyHostToDevice));
      CK(cudaFuncSetAttribute(k_fprop_global, cudaFuncAttributeMaxDynamicSharedMemorySize, FSMEM));
      k_fprop_global<<<grid, KILN_TMA_THREADS, FSMEM>>>(tm, y);
    } else {
      CK(cudaFuncSetAttribute(k_fprop, cudaFuncAttributeMaxDynamicSharedMemorySize, FSMEM));
      k_fprop<<<grid, KILN_TMA_THREADS, FSMEM>>>(maps[0], maps[1], y);
    }
  });
  cudaFree(tm);
  const char *name[] = {"fprop", "fprop_global", "fprop_cpasync"};
  return report(name[kind], err, 1e-2); /* bf16 outputs */
}

int main(int argc, char **argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0); /* each line at once, between the sanitizer's reports */
  const char *names[] = {"control",    "casts", "casts_small", "mbar",         "tma",
                         "tma_global", "wgmma", "fprop",       "fprop_global", "fprop_cpasync"};
  const char *only = argc > 1 ? argv[1] : nullptr;
  bool known = !only, ok = true;
  for (const char *n : names) {
    if (only && strcmp(only, n)) continue;
    known = true;
    if (!strcmp(n, "control"))
      ok &= run_control();
    else if (!strncmp(n, "casts", 5))
      ok &= run_casts(n[5] != 0);
    else if (!strcmp(n, "wgmma"))
      ok &= run_wgmma();
    else if (!strncmp(n, "fprop", 5))
      ok &= run_fprop(!n[5] ? 0 : n[6] == 'g' ? 1 : 2);
    else
      ok &= run_stages(n);
  }
  if (!known) {
    fprintf(stderr,
            "probe: no case '%s' (control, casts, casts_small, mbar, tma, tma_global, "
            "wgmma, fprop, fprop_global, fprop_cpasync)\n",
            only);
    return 2;
  }
  return ok ? 0 : 1;
}
