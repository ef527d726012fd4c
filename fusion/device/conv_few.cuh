/*
 * conv_few.cuh: the forward product of a stride-1 convolution with few input channels (in 16-byte
 * chunks, fewer than a 64-channel stage) into 64 output channels, from a halo tile in shared
 * memory on mma.sync (bf16, f32 accumulators): airbench's first 3x3 conv, 24 channels into 64.
 * conv.cuh's kernel gathers every tap of every pixel from L2 (27 chunks of 16 bytes a pixel at
 * 3x3x24), and on the H100 took 243 us at batch 1024 where this takes 105 (dev/conv_few).
 *
 * A block (256 threads, two an SM) is persistent: it keeps the filters in shared memory for every
 * tile it takes (tiles blockIdx.x, + gridDim.x, ...; a tile is TH x TW output pixels of one
 * image), loads a tile's window of the image (the halo, (TH + KH - 1) x (TW + KW - 1) pixels, zeros
 * past the image) once, the next tile's while it multiplies this one (two buffers), and feeds the
 * products with ldmatrix straight from the halo: lane l gives the address of its pixel's chunk for
 * the tap, so the A operand of tap (i, j) is the halo shifted by (i, j), never copied.
 *
 * The reduction runs over K = KH KW CI in chunks of 8 channels (q: tap q / (CI / 8), channels
 * 8 (q % (CI / 8)) on), two chunks a k16 step, from one tap or two, the last step's second chunk a
 * zero chunk when their count is odd: 3x3x24 takes 14 steps (27 chunks). Wk (CO, K), K innermost,
 * is 64 rows of those chunks, as its copy in shared memory. Each warp computes 32 pixels x 32
 * channels (warp % 4: pixels, warp / 4: channels); the results go through shared memory (rows
 * padded to 144 bytes: no bank conflicts) and out 16 bytes a lane. Every output value is one
 * thread's sum in a fixed order: the same bits every run.
 *
 * G is conv.cuh's geometry (render_conv.c's conv_operands). x is (N, H, W, CI), y (M, CO) bf16.
 * The generated kernel (render_conv.c's render_few) launches 256 threads a block with
 * kiln_few<G, TH, TW>::SMEM bytes of dynamic shared memory and at most two blocks an SM's
 * worth of tiles a grid.
 *
 * The weight gradient of the same convolutions (kiln_conv_few_wgrad; KILN_CONV_FEW_WGRAD=0: not;
 * on the H100 131 us at batch 1024 where conv.cuh's cp.async kernel takes 206.5) takes the same
 * tiles: dWt (K, CO) = im2col(X)^T dY, a sum over the pixels.
 * Each persistent block loads a tile's halo and its 128 rows of dY (both double buffered) and
 * adds the tile's products into accumulators that hold the block's whole dWt (K padded to whole
 * 16-row tiles, x 64): warp w takes the 16-row tiles w % 4, + 4, ... and 32 of the columns
 * (w / 4). A product step is 16 pixels: A (16 rows of K = two chunks, by 16 pixels) is the
 * halo's chunks of those pixels read transposed by ldmatrix.trans, B their rows of dY, transposed
 * too. Then each block stores its partial dWt (f32) to the workspace and takes a ticket; the last
 * KILN_FEW_SLICES blocks to arrive wait for the others' partials and each adds one slice of all of
 * them, in block order (the same sum every run), into dW (CO, K) bf16; the last of those resets
 * the two counters for the next launch. Only those few blocks wait: they never hold every SM.
 */
#ifndef KILN_CONV_FEW_CUH
#define KILN_CONV_FEW_CUH

#include "bf16.cuh"
#include "defs.cuh"
#include "mma.cuh"
#include "pool2.cuh"

template <class G, int TH, int TW> struct kiln_few {
  static_assert(G::CI % 8 == 0 && G::CO == 64 && G::SH == 1 && G::SW == 1 && G::DH == 1 &&
                    G::DW == 1 && TH * TW == 128 && TW % 16 == 0,
                "conv_few.cuh: stride 1, no dilation, 64 output channels, 128-pixel tiles");
  static constexpr int CH = G::CI / 8;           /* chunks a pixel */
  static constexpr int NCH = G::KH * G::KW * CH; /* chunks a window: a row of Wk */
  static constexpr int KS = (NCH + 1) / 2;       /* k16 steps */
  static constexpr int HH = TH + G::KH - 1, HW = TW + G::KW - 1;
  /* a pixel's stride in the halo, in chunks: odd (CH, or CH + 1 with a chunk of padding), so the
   * eight rows an ldmatrix reads, one chunk of eight pixels in a row, fall in eight different
   * 16-byte bank groups (at 16 channels, a 32-byte stride had two pixels share each) */
  static constexpr int PX = CH | 1;
  static constexpr int HALO = HH * HW * PX; /* chunks of a halo, padding included */
  static constexpr int TILES_W = (G::OW + TW - 1) / TW, TILES_H = (G::OH + TH - 1) / TH;
  static constexpr int TILES = G::N * TILES_H * TILES_W;
  static constexpr int ROW = G::CO * 2 + 16; /* bytes of a staged output row */
  /* a filter's row in shared memory, in chunks: odd too (NCH, or NCH + 1), for the eight rows of
   * an ldmatrix of B (at ResNet's stem, 32 chunks, 512-byte rows put all eight in one bank group:
   * 543 us against 265 on the cp.async kernel, dev/conv_few) */
  static constexpr int FR = NCH | 1;
  static constexpr int F_BYTES = G::CO * FR * 16;
  static constexpr int SMEM = F_BYTES + 16 + 2 * HALO * 16 + 128 * ROW;
  /* byte offset in the halo of chunk q of a window, from the window's first pixel */
  __host__ __device__ static constexpr int off(int q) {
    return ((q / CH / G::KW) * HW + q / CH % G::KW) * PX * 16 + q % CH * 16;
  }
};

/* The halo of tile `tile` into buf: its chunks' copies, issued by the block; zeros past the image.
 */
template <class G, int TH, int TW>
KILN__FN void kiln_few_halo(const kiln_bf16 *x, int tile, unsigned char *buf) {
  using F = kiln_few<G, TH, TW>;
  const int tw = tile % F::TILES_W, r = tile / F::TILES_W, n = r / F::TILES_H;
  const int h0 = r % F::TILES_H * TH - G::PH, w0 = tw * TW - G::PW;
  for (int i = threadIdx.x; i < F::HH * F::HW * F::CH; i += 256) {
    const int c = i % F::CH, p = i / F::CH, h = h0 + p / F::HW, w = w0 + p % F::HW;
    const bool in = h >= 0 && h < G::H && w >= 0 && w < G::W;
    const kiln_bf16 *src = in ? x + (((long long)n * G::H + h) * G::W + w) * G::CI + c * 8 : x;
    kiln_cp16(buf + (p * F::PX + c) * 16, src, in);
  }
}

/* The 2x2 windows (stride 2) of a staged tile of TH x TW output pixels from (oh0, ow0) of image n,
 * max-pooled into y (N, OH / 2, OW / 2, CO): a window's 8-channel chunk a thread, its 32 windows
 * by the block's 256 threads, the rows and columns past the last whole window dropped. With at,
 * each value's window position p * 2 + q (its first maximum, NaN winning) as a byte indexed like
 * y, as window.cuh's kiln_max_pool_at writes them; by construction the same values (pool2.cuh). */
template <class G, int TH, int TW>
KILN__FN void kiln_few_pool(const unsigned char *stage, int n, int oh0, int ow0,
                            kiln_bf16 *__restrict__ y, unsigned char *__restrict__ at) {
  using F = kiln_few<G, TH, TW>;
  constexpr int POH = G::OH / 2, POW = G::OW / 2, CH = G::CO / 8;
  static_assert(TH % 2 == 0 && (TH / 2) * (TW / 2) * CH == 256, "a window's chunk a thread");
  const int q = threadIdx.x / CH, ch = threadIdx.x % CH;
  const int r = q / (TW / 2), c = q % (TW / 2), ph = oh0 / 2 + r, pw = ow0 / 2 + c;
  if (ph >= POH || pw >= POW) return;
  float best[8];
  int pos[8];
#pragma unroll
  for (int t = 0; t < 4; t++) {
    const int p = (2 * r + t / 2) * TW + 2 * c + t % 2;
    float v[8];
    kiln_load4((const kiln_bf16 *)(stage + p * F::ROW + ch * 16), v);
    kiln_load4((const kiln_bf16 *)(stage + p * F::ROW + ch * 16 + 8), v + 4);
    kiln_pool2_tap(t, v, best, pos);
  }
  kiln_pool2_store(y, at, (((long long)n * POH + ph) * POW + pw) * G::CO + ch * 8, best, pos);
}

/* Batch norm's statistics of the product (kiln_conv_few with MOM): thread t summed, over every
 * pixel it stored, the stored values of its eight channels less their shift (s[l]) and their
 * squares (s[8 + l]), channels 32 wn + 8 (lane % 4) + l (kiln_conv_few's store loop); the block's
 * sums, added through red (16 x 256 floats) in a fixed order, go into row blockIdx.x of the
 * moments node's partial sums out (P, 2, 64), zeros into its rows blockIdx.x + gridDim.x, ... (a
 * block a row, P >= gridDim.x): the sum over P is the image's. */
KILN__FN void kiln_few_moments(const float (&s)[16], float *red, float *__restrict__ out, int P) {
  __syncthreads(); /* red is free */
#pragma unroll
  for (int k = 0; k < 16; k++)
    red[k * 256 + threadIdx.x] = s[k];
  __syncthreads();
  const int t = threadIdx.x, which = t / 64 % 2, c = t % 64, wn = c / 32, ch = c % 32 / 8;
  if (t < 128) {
    float v = 0.f;
    for (int wm = 0; wm < 4; wm++)
      for (int j = 0; j < 8; j++)
        v += red[(which * 8 + c % 8) * 256 + (wm + 4 * wn) * 32 + ch + 4 * j];
    out[(blockIdx.x * 2 + which) * 64 + c] = v;
  }
  for (int r = blockIdx.x + gridDim.x; r < P && t < 128; r += gridDim.x)
    out[(r * 2 + which) * 64 + c] = 0.f;
}

/* With POOL, y is the 2x2 max pool of the product (kiln_few_pool, at its positions or NULL), the
 * product itself never written. With MOM, the block also sums batch norm's statistics of the
 * values it stores, shifted by kshift (64 floats), into the moments node's partial sums mom (P, 2,
 * 64: kiln_few_moments). */
template <class G, int TH, int TW, bool POOL = false, bool MOM = false>
KILN__FN void kiln_conv_few(const kiln_bf16 *__restrict__ x, const kiln_bf16 *__restrict__ wk,
                            kiln_bf16 *__restrict__ y, unsigned char *smem,
                            unsigned char *at = nullptr, const float *__restrict__ kshift = nullptr,
                            float *__restrict__ mom = nullptr, int P = 0) {
  using F = kiln_few<G, TH, TW>;
  unsigned char *filt = smem, *zero = smem + F::F_BYTES, *halo = zero + 16;
  unsigned char *stage = halo + 2 * F::HALO * 16;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int i = tid; i < G::CO * F::NCH; i += 256)
    kiln_cp16(filt + (i / F::NCH * F::FR + i % F::NCH) * 16, wk + (long long)i * 8, true);
  if (tid < 4) ((unsigned *)zero)[tid] = 0u;
  const int wm = warp & 3, wn = warp >> 2, hi = lane >> 4;
  /* A: lanes 0-15 give rows 0-15 of an m16 tile at the step's first chunk, 16-31 its second */
  int abase[2];
#pragma unroll
  for (int mt = 0; mt < 2; mt++) {
    const int p = wm * 32 + mt * 16 + (lane & 15);
    abase[mt] = (p / TW * F::HW + p % TW) * F::PX * 16;
  }
  /* B: lanes 0-7 n-tile 0 at the first chunk, 8-15 at the second, 16-31 n-tile 1 likewise */
  const int bco = wn * 32 + (lane & 7) + 8 * (lane >> 4), bsel = (lane >> 3) & 1;
  static_assert(!MOM || (!POOL && 128 * F::ROW >= 16 * 256 * 4), "kiln_few_moments' room");
  float ks[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, s[16] = {};
  (void)ks, (void)s;
  if constexpr (MOM) { /* the thread's eight channels of the store loop below */
    kiln_load4(kshift + wn * 32 + (lane & 3) * 8, ks);
    kiln_load4(kshift + wn * 32 + (lane & 3) * 8 + 4, ks + 4);
  }
  kiln_few_halo<G, TH, TW>(x, blockIdx.x, halo);
  kiln_cp_commit();
  int b = 0;
  for (int tile = blockIdx.x; tile < F::TILES; tile += gridDim.x, b ^= 1) {
    if (tile + (int)gridDim.x < F::TILES)
      kiln_few_halo<G, TH, TW>(x, tile + gridDim.x, halo + (b ^ 1) * F::HALO * 16);
    kiln_cp_commit();
    kiln_cp_wait<1>(); /* this tile's halo (and, the first time, the filters) landed */
    __syncthreads();
    const unsigned char *h = halo + b * F::HALO * 16;
    float c[2][4][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
      for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          c[mt][nt][e] = 0.f;
#pragma unroll
    for (int s = 0; s < F::KS; s++) {
      const int aoff = hi ? F::off(2 * s + 1) : F::off(2 * s);
      const bool avalid = 2 * s + hi < F::NCH;
      unsigned a[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; mt++)
        kiln_ldsm4(avalid ? h + abase[mt] + aoff : zero, a[mt]);
      const int q = 2 * s + bsel;
#pragma unroll
      for (int pr = 0; pr < 2; pr++) {
        unsigned bf[4];
        kiln_ldsm4(q < F::NCH ? filt + ((bco + 16 * pr) * F::FR + q) * 16 : zero, bf);
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
          kiln_mma_bf16(c[mt][2 * pr], a[mt], bf[0], bf[1]);
          kiln_mma_bf16(c[mt][2 * pr + 1], a[mt], bf[2], bf[3]);
        }
      }
    }
    /* the warp's 32 x 32 results into its part of the staged rows, then out 16 bytes a lane */
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
      for (int e2 = 0; e2 < 2; e2++) {
        const int p = wm * 32 + mt * 16 + (lane >> 2) + 8 * e2;
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
          *(unsigned *)(stage + p * F::ROW + (wn * 32 + nt * 8 + 2 * (lane & 3)) * 2) =
              kiln_bf16x2_bits(c[mt][nt][2 * e2], c[mt][nt][2 * e2 + 1]);
      }
    const int tw = tile % F::TILES_W, r = tile / F::TILES_W, n = r / F::TILES_H;
    const int oh0 = r % F::TILES_H * TH, ow0 = tw * TW;
    if constexpr (POOL) {
      __syncthreads(); /* a window's two rows were staged by two warps */
      kiln_few_pool<G, TH, TW>(stage, n, oh0, ow0, y, at);
      __syncthreads();
      continue;
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const int i = k * 32 + lane, p = wm * 32 + i / 4, ch = i % 4;
      const int oh = oh0 + p / TW, ow = ow0 + p % TW;
      if (oh >= G::OH || ow >= G::OW) continue;
      const unsigned char *v8 = stage + p * F::ROW + (wn * 32 + ch * 8) * 2;
      *(uint4 *)&y[(((long long)n * G::OH + oh) * G::OW + ow) * G::CO + wn * 32 + ch * 8] =
          *(const uint4 *)v8;
      if constexpr (MOM) {
        float v[8];
        kiln_load4((const kiln_bf16 *)v8, v);
        kiln_load4((const kiln_bf16 *)v8 + 4, v + 4);
#pragma unroll
        for (int l = 0; l < 8; l++) {
          const float e = v[l] - ks[l];
          s[l] += e;
          s[8 + l] += e * e;
        }
      }
    }
    __syncthreads(); /* every warp is done with this halo and its staged rows */
  }
  if constexpr (MOM) kiln_few_moments(s, (float *)stage, mom, P);
}

/* Blocks that add a slice each of a weight gradient's partial sums (kiln_conv_few_wgrad). */
#define KILN_FEW_SLICES 32

template <class G, int TH, int TW> struct kiln_few_w {
  using F = kiln_few<G, TH, TW>;
  static constexpr int KT = (F::NCH + 1) / 2; /* 16-row tiles of K */
  static_assert(KT <= 16, "conv_few.cuh: a weight gradient's K of at most 256 (4 tiles a warp)");
  static constexpr int KP = KT * 16; /* K padded: the rows of a partial dWt */
  static constexpr int DY_ROW = G::CO * 2 + 16;
  static constexpr int SMEM = 16 + 2 * F::HALO * 16 + 2 * 128 * DY_ROW;
};

/* dY read from memory (kiln_conv_few_wgrad's default) ... */
struct kiln_few_dy_read {
  static constexpr bool READ = true;
};
/* ... or computed where it is read: f(i0, c, gv) gives dY's four values from element i0 of the
 * dense (M, CO) dY, channel c (an elementwise prologue, render_window.c's kiln__emit_prologue) */
template <class F> struct kiln_few_dy_by {
  static constexpr bool READ = false;
  F f;
};

/* The weight gradient dW (CO, K) of x (N, H, W, CI) and dy (M, CO) into dw, bf16; part holds
 * gridDim.x partial dWt of kiln_few_w::KP x CO floats, cnt two counters, zero at the launch. With
 * pro a kiln_few_dy_by, dy is computed where the tile's rows are loaded (its four chunks a thread
 * computed, then stored to shared memory: the loads of all four in flight at once) and never
 * read. */
template <class G, int TH, int TW, class P = kiln_few_dy_read>
KILN__FN void kiln_conv_few_wgrad(const kiln_bf16 *__restrict__ x, const kiln_bf16 *__restrict__ dy,
                                  kiln_bf16 *__restrict__ dw, float *part, unsigned *cnt,
                                  unsigned char *smem, P pro = P{}) {
  using F = kiln_few<G, TH, TW>;
  using W = kiln_few_w<G, TH, TW>;
  unsigned char *zero = smem, *halo = smem + 16, *dys = halo + 2 * F::HALO * 16;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wk = warp & 3, wn = warp >> 2;
  if (tid < 4) ((unsigned *)zero)[tid] = 0u;
  /* the tile's dY rows into buf: row p is the tile's output pixel p, zeros past the image */
  auto load_dy = [&](int tile, unsigned char *buf) {
    const int tw = tile % F::TILES_W, r = tile / F::TILES_W, n = r / F::TILES_H;
    const int oh0 = r % F::TILES_H * TH, ow0 = tw * TW;
    constexpr int PER = 128 * (G::CO / 8) / 256; /* a thread's chunks */
    uint4 v[PER];
#pragma unroll
    for (int k = 0; k < PER; k++) {
      const int i = tid + 256 * k;
      const int p = i / (G::CO / 8), c = i % (G::CO / 8), oh = oh0 + p / TW, ow = ow0 + p % TW;
      const bool in = oh < G::OH && ow < G::OW;
      const long long o = (((long long)n * G::OH + oh) * G::OW + ow) * G::CO + c * 8;
      if constexpr (P::READ) {
        kiln_cp16(buf + p * W::DY_ROW + c * 16, in ? dy + o : dy, in);
      } else {
        float lo[4] = {0.f, 0.f, 0.f, 0.f}, hi[4] = {0.f, 0.f, 0.f, 0.f};
        if (in) {
          pro.f(o, c * 8, lo);
          pro.f(o + 4, c * 8 + 4, hi);
        }
        v[k] = make_uint4(kiln_bf16x2_bits(lo[0], lo[1]), kiln_bf16x2_bits(lo[2], lo[3]),
                          kiln_bf16x2_bits(hi[0], hi[1]), kiln_bf16x2_bits(hi[2], hi[3]));
      }
    }
    if constexpr (!P::READ) {
#pragma unroll
      for (int k = 0; k < PER; k++) {
        const int i = tid + 256 * k;
        *(uint4 *)(buf + i / (G::CO / 8) * W::DY_ROW + i % (G::CO / 8) * 16) = v[k];
      }
    }
  };
  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        acc[i][j][e] = 0.f;
  kiln_few_halo<G, TH, TW>(x, blockIdx.x, halo);
  load_dy(blockIdx.x, dys);
  kiln_cp_commit();
  /* A: lanes 0-7 pixels 0-7 of the step at the tile's first chunk, 8-15 at its second, 16-31
   * pixels 8-15 likewise; B: lanes 0-7 pixels 0-7 of n-tile 0, 8-15 pixels 8-15, 16-31 n-tile 1 */
  const int apx = (lane & 7) + 8 * (lane >> 4), asel = (lane >> 3) & 1;
  const int bpx = (lane & 7) + 8 * ((lane >> 3) & 1), bsel = lane >> 4;
  int b = 0;
  for (int tile = blockIdx.x; tile < F::TILES; tile += gridDim.x, b ^= 1) {
    if (tile + (int)gridDim.x < F::TILES) {
      kiln_few_halo<G, TH, TW>(x, tile + gridDim.x, halo + (b ^ 1) * F::HALO * 16);
      load_dy(tile + gridDim.x, dys + (b ^ 1) * 128 * W::DY_ROW);
    }
    kiln_cp_commit();
    kiln_cp_wait<1>();
    __syncthreads();
    const unsigned char *h = halo + b * F::HALO * 16, *d = dys + b * 128 * W::DY_ROW;
#pragma unroll 1
    for (int s = 0; s < 8; s++) {
      unsigned bf[2][4]; /* n-tiles 4 wn + 2 pr and the next: b0 and b1 of each */
#pragma unroll
      for (int pr = 0; pr < 2; pr++)
        kiln_ldsm4_trans(d + (16 * s + bpx) * W::DY_ROW + (4 * wn + 2 * pr + bsel) * 16, bf[pr]);
      const int p = 16 * s + apx, abase = (p / TW * F::HW + p % TW) * F::PX * 16;
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const int kt = wk + 4 * i;
        if (kt >= W::KT) break;
        const int q = 2 * kt + asel;
        unsigned a[4]; /* k 0-7 and 8-15 of pixels 0-7, then of pixels 8-15 */
        kiln_ldsm4_trans(q < F::NCH ? h + abase + F::off(q) : zero, a);
#pragma unroll
        for (int pr = 0; pr < 2; pr++) {
          kiln_mma_bf16(acc[i][2 * pr], a, bf[pr][0], bf[pr][1]);
          kiln_mma_bf16(acc[i][2 * pr + 1], a, bf[pr][2], bf[pr][3]);
        }
      }
    }
    __syncthreads(); /* every warp is done with this tile's buffers */
  }
  /* the block's partial dWt: row 16 kt + lane / 4 (+ 8), column 32 wn + 8 j + 2 (lane % 4) */
  float *mine = part + (long long)blockIdx.x * W::KP * G::CO;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const int kt = wk + 4 * i;
    if (kt >= W::KT) break;
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int e2 = 0; e2 < 2; e2++) {
        const int k = 16 * kt + (lane >> 2) + 8 * e2, co = 32 * wn + 8 * j + 2 * (lane & 3);
        *(float2 *)&mine[k * G::CO + co] = make_float2(acc[i][j][2 * e2], acc[i][j][2 * e2 + 1]);
      }
  }
  __threadfence();
  __syncthreads();
  __shared__ unsigned ticket;
  if (tid == 0) ticket = atomicAdd(&cnt[0], 1u);
  __syncthreads();
  const unsigned blocks = gridDim.x, slices = blocks < KILN_FEW_SLICES ? blocks : KILN_FEW_SLICES;
  if (ticket < blocks - slices) return;
  if (tid == 0) {
    while (*(volatile unsigned *)&cnt[0] < blocks)
      __nanosleep(256);
    __threadfence(); /* the partials the count stands for, before the block reads them */
  }
  __syncthreads();
  __threadfence();
  constexpr int TOTAL = G::K * G::CO;
  const int per = (TOTAL + (int)slices - 1) / (int)slices,
            slice = (int)(ticket - (blocks - slices));
  const int end = (slice + 1) * per < TOTAL ? (slice + 1) * per : TOTAL;
  for (int i = slice * per + tid; i < end; i += 256) {
    const int k = i / G::CO, co = i % G::CO;
    float sum = 0.f;
    for (unsigned z = 0; z < blocks; z++)
      sum += __ldcg(&part[(long long)z * W::KP * G::CO + k * G::CO + co]);
    dw[co * G::K + k] = kiln_bf16(sum);
  }
  __syncthreads();
  if (tid == 0 && atomicAdd(&cnt[1], 1u) == slices - 1) /* the last slice: counters to zero */
    cnt[0] = 0u, cnt[1] = 0u;
}

#endif
