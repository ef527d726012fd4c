// lab_util.h: what the labs of dev/conv_engine share: the shapes, random bf16 operands, float64
// references of the forward product and the weight gradient, the error measure and the timer.
#ifndef KILN_LAB_UTIL_H
#define KILN_LAB_UTIL_H

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../../fusion/device/bf16.cuh"

#define CK(x)                                                                                      \
  do {                                                                                             \
    cudaError_t e = (x);                                                                           \
    if (e != cudaSuccess) {                                                                        \
      fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e));                   \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

template <int N_, int H_, int CI_, int CO_, int K_, int P_, int S_ = 1> struct Shape {
  static constexpr int N = N_, H = H_, W = H_, CI = CI_, CO = CO_, KH = K_, KW = K_;
  static constexpr int SH = S_, SW = S_, PH = P_, PW = P_, DH = 1, DW = 1;
  static constexpr int OH = (H + 2 * P_ - K_) / S_ + 1, OW = OH;
  static constexpr long long M = (long long)N * OH * OW;
  static constexpr int K = KH * KW * CI;
};

/* Stores a thread's accumulators of a 128 x BN tile (the wgmma fragment: rows r and r + 8, two
 * columns of each 8-wide group from n0) as bf16 into a (rows, cols) matrix; r is the thread's
 * first row (the tile's first plus kiln_conv_row0). */
template <int BN>
__device__ void store_rows(kiln_bf16 *out, long long r, int n0, long long rows, int cols,
                           const float (&d)[BN / 2]) {
#pragma unroll
  for (int j = 0; j < BN / 8; j++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const long long m = r + 8 * h;
      const int c = n0 + 8 * j + 2 * (threadIdx.x & 3);
      if (m < rows && c < cols)
        *(unsigned *)&out[m * cols + c] = kiln_bf16x2_bits(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
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
      const int ih = oh * G::SH - G::PH + a * G::DH, iw = ow * G::SW - G::PW + b * G::DW;
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
    const int ih = oh * G::SH - G::PH + a * G::DH, iw = ow * G::SW - G::PW + b * G::DW;
    if (ih < 0 || ih >= G::H || iw < 0 || iw >= G::W) continue;
    s += (double)(float)x[((n * G::H + ih) * G::W + iw) * G::CI + c] *
         (double)(float)dy[m * G::CO + co];
  }
  dwt[i] = (float)s;
}

/* The data gradient dX (N, H, W, CI) of any stride, from dY (M, CO) and the filters. */
template <class G> __global__ void ref_dgrad(const kiln_bf16 *dy, const kiln_bf16 *wk, float *dx) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)G::N * G::H * G::W * G::CI) return;
  const int c = (int)(i % G::CI);
  const long long p = i / G::CI;
  const int w = (int)(p % G::W), h = (int)(p / G::W % G::H);
  const long long n = p / G::W / G::H;
  double s = 0;
  for (int a = 0; a < G::KH; a++)
    for (int b = 0; b < G::KW; b++) {
      const int th = h + G::PH - a * G::DH, tw = w + G::PW - b * G::DW;
      if (th < 0 || tw < 0 || th % G::SH || tw % G::SW) continue;
      const int oh = th / G::SH, ow = tw / G::SW;
      if (oh >= G::OH || ow >= G::OW) continue;
      for (int co = 0; co < G::CO; co++)
        s += (double)(float)dy[((n * G::OH + oh) * G::OW + ow) * G::CO + co] *
             (double)(float)wk[(long long)co * G::K + (a * G::KW + b) * G::CI + c];
    }
  dx[i] = (float)s;
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
    const float v = bf16_to_f(ha[i]);
    if (!std::isfinite(v)) return INFINITY; /* never written (the outputs start as NaN), or worse */
    md = std::max(md, (double)std::fabs(v - hr[i]));
    mr = std::max(mr, (double)std::fabs(hr[i]));
  }
  return mr > 0 ? md / mr : md;
}

/* Shape G's forward product checked: random operands (seeds seed and seed + 1), the output set
 * to NaN first (a value never written shows), run(x, wk, y), then its error against the float64
 * reference (rel_err). */
template <class G, class R> static double fprop_error(unsigned seed, R run) {
  kiln_bf16 *x = random_bf16((size_t)G::N * G::H * G::W * G::CI, 1.f, seed);
  kiln_bf16 *wk = random_bf16((size_t)G::CO * G::K, 0.2f, seed + 1), *y;
  float *ref;
  CK(cudaMalloc(&y, G::M * G::CO * 2));
  CK(cudaMalloc(&ref, G::M * G::CO * 4));
  CK(cudaMemset(y, 0xff, G::M * G::CO * 2));
  run(x, wk, y);
  CK(cudaGetLastError());
  ref_fprop<G><<<(unsigned)((G::M * G::CO + 255) / 256), 256>>>(x, wk, ref);
  CK(cudaDeviceSynchronize());
  const double err = rel_err(y, ref, (size_t)G::M * G::CO);
  cudaFree(x), cudaFree(wk), cudaFree(y), cudaFree(ref);
  return err;
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

/* The air workload's convolutions (3x3, stride 1, padding 1), by batch. */
template <int N> using A1 = Shape<N, 31, 24, 64, 3, 1>;
template <int N> using B1 = Shape<N, 15, 64, 64, 3, 1>;
template <int N> using B2 = Shape<N, 15, 64, 256, 3, 1>;
template <int N> using C1 = Shape<N, 7, 256, 256, 3, 1>;
template <int N> using D1 = Shape<N, 3, 256, 256, 3, 1>;

#endif
