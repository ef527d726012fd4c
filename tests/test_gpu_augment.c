/*
 * test_gpu_augment.c: image augmentation (kiln_augment) on the GPU. Every output value against a
 * host reference that pads the (flipped) image and crops it where the same Philox draws say
 * (philox.cuh compiled as C), in every mode: zero and reflected borders, every flip mode, 1, 3, 4
 * and 6 channels (a thread moves a channel, a pixel or 16 bytes), unaligned and non-contiguous
 * inputs. Properties without the reference: two full flips and pad 0 without a flip are the
 * identity, translated crops stay inside the image (or bring in zeros), the same seed repeats a
 * batch and two calls differ, random flips take half of the images and translations are uniform,
 * and the alternating flip takes exactly the complement set on the next epoch. Loader batches
 * augmented over two epochs (with the loader's indices) are bitwise the same unfused, fused and
 * replayed as a step graph, fresh every step and equal to the reference. Without a GPU every test
 * skips, saying why.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fusion/device/philox.cuh"
#include "ref.h"

/* ---------------------------------------------------------------- the reference */

/* What image n of a call drew: its translation and whether it is flipped. */
typedef struct draw {
  int dy, dx, flip;
} draw;

/* Image n's draws for a call with Philox (seed, offset), as kiln.h documents them. */
static draw draw_of(uint64_t seed, uint64_t offset, const kiln_augment_options *o, int64_t n,
                    const int32_t *idx) {
  unsigned w[4];
  kiln_philox4(seed, offset, (unsigned long long)n, w);
  uint64_t m = 2 * (uint64_t)o->pad + 1; /* values of dy and of dx */
  draw d = {(int)(((uint64_t)w[0] * m) >> 32) - o->pad, (int)(((uint64_t)w[1] * m) >> 32) - o->pad,
            0};
  switch (o->flip) {
  case KILN_AUGMENT_FLIP_NONE: break;
  case KILN_AUGMENT_FLIP_RANDOM: d.flip = (int)(w[2] >> 31); break;
  case KILN_AUGMENT_FLIP_ALL: d.flip = 1; break;
  case KILN_AUGMENT_FLIP_ALTERNATE: {
    unsigned bit = kiln_philox(seed, 0xFFFFFFFFFFFFFFFFull, (uint32_t)idx[n]) >> 31;
    d.flip = (int)(bit ^ (unsigned)(o->epoch & 1));
    break;
  }
  }
  return d;
}

/* PyTorch's reflection of coordinate i into [0, n): -1 is 1, n is n - 2 (|i| < 2n - 1). */
static int64_t reflect(int64_t i, int64_t n) { return i < 0 ? -i : (i >= n ? 2 * (n - 1) - i : i); }

/* kiln_augment of x (N, H, W, C) into y as airbench does it: each image flipped (or not), padded
 * by pad on every side (zeros or reflection), and cropped back to H x W at (pad + dy, pad + dx).
 * draws (if given) gets each image's draws. */
static void ref_augment(const float *x, float *y, kiln_shape s, uint64_t seed, uint64_t offset,
                        const kiln_augment_options *o, const int32_t *idx, draw *draws) {
  int64_t N = s.d[0], H = s.d[1], W = s.d[2], C = s.d[3], p = o->pad;
  int64_t PH = H + 2 * p, PW = W + 2 * p;
  float *padded = ref_falloc(PH * PW * C);
  for (int64_t n = 0; n < N; n++) {
    draw d = draw_of(seed, offset, o, n, idx);
    if (draws) draws[n] = d;
    const float *img = x + n * H * W * C;
    for (int64_t i = 0; i < PH; i++)
      for (int64_t j = 0; j < PW; j++) {
        int64_t h = i - p, w = j - p;
        bool inside = h >= 0 && h < H && w >= 0 && w < W;
        if (o->border == KILN_AUGMENT_BORDER_REFLECT) {
          h = reflect(h, H);
          w = reflect(w, W);
          inside = true;
        }
        if (d.flip) w = W - 1 - w; /* the flipped image's column w */
        for (int64_t c = 0; c < C; c++)
          padded[(i * PW + j) * C + c] = inside ? img[(h * W + w) * C + c] : 0.f;
      }
    for (int64_t h = 0; h < H; h++)
      for (int64_t w = 0; w < W; w++)
        for (int64_t c = 0; c < C; c++)
          y[((n * H + h) * W + w) * C + c] = padded[((h + p + d.dy) * PW + (w + p + d.dx)) * C + c];
  }
  free(padded);
}

static const char *flip_name(int f) {
  static const char *const names[] = {"none", "random", "all", "alternate"};
  return f >= 0 && f < 4 ? names[f] : "?";
}

/* Asserts got == want everywhere (a copy: bitwise), naming the first difference. */
static void expect_same(const float *got, const float *want, kiln_shape s, const draw *draws,
                        const char *what) {
  int64_t H = s.d[1], W = s.d[2], C = s.d[3], total = ref_numel(s);
  for (int64_t i = 0; i < total; i++) {
    if (memcmp(&got[i], &want[i], sizeof got[i]) == 0) continue;
    int64_t c = i % C, w = i / C % W, h = i / C / W % H, n = i / C / W / H;
    cr_assert_fail("%s: image %lld pixel (%lld, %lld) channel %lld is %.9g, want %.9g (dy %d, "
                   "dx %d, flip %d)",
                   what, (long long)n, (long long)h, (long long)w, (long long)c, (double)got[i],
                   (double)want[i], draws ? draws[n].dy : 0, draws ? draws[n].dx : 0,
                   draws ? draws[n].flip : 0);
  }
}

/* Distinct values 1 .. n in a scrambled order: nothing is 0 (the zero border's fill). */
static void distinct_fill(float *p, int64_t n, uint64_t seed) {
  int64_t step = 7919; /* a prime: coprime with n unless it divides n */
  while (n % step == 0)
    step += 2;
  for (int64_t i = 0; i < n; i++)
    p[i] = (float)(1 + (i * step + (int64_t)seed) % n);
}

/* One call of kiln_augment in a step of its own after kiln_manual_seed(seed): its output. */
static float *augment_once(kiln_ctx *ctx, kiln_tensor *x, const kiln_augment_options *o,
                           uint64_t seed, const char *what) {
  kiln_manual_seed(ctx, seed);
  kiln_step_begin(ctx);
  float *y = ref_read_f32(ctx, kiln_augment(x, o), what);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", what, th_err(ctx));
  return y;
}

/* ---------------------------------------------------------------- against the reference */

Test(gpu_augment, every_mode_matches_the_reference) {
  TH_GPU_CTX_EAGER(ctx);
  const int64_t chans[4] = {1, 3, 4, 6};
  th_rng r = {41};
  int32_t idx[13];
  for (int i = 0; i < 13; i++) /* any i32 is a data-set index: large and negative ones too */
    idx[i] = i == 0 ? 2147483647 : (i == 1 ? -5 : (int32_t)(th_rng_next(&r) % 100000));
  kiln_tensor *it = ref_upload_i32(ctx, KILN_SHAPE(13), idx);
  int cases = 0;
  for (int ci = 0; ci < 4; ci++) {
    kiln_shape s = KILN_SHAPE(13, 9, 11, chans[ci]);
    float *hx;
    kiln_tensor *x =
        ref_rand_tensor(ctx, s, 4100 + (uint64_t)ci, &REF_GEN(0.5f, 1.5f), 0, &hx); /* non-zero */
    float *want = ref_falloc(ref_numel(s));
    draw draws[13];
    for (int pad = 0; pad <= 3; pad++)
      for (int border = 0; border < 2; border++)
        for (int flip = 0; flip < 5; flip++) { /* 4: alternating, odd epoch */
          kiln_augment_options o = {.pad = pad,
                                    .border = (kiln_augment_border)border,
                                    .flip = (kiln_augment_flip)(flip < 4 ? flip : 3)};
          if (o.flip == KILN_AUGMENT_FLIP_ALTERNATE) {
            o.idx = it;
            o.epoch = flip == 4 ? 7 : 10;
          }
          char what[160];
          snprintf(what, sizeof what, "augment of [13,9,11,%lld], pad %d, %s border, flip %s%s",
                   (long long)chans[ci], pad, border ? "reflected" : "zero", flip_name(o.flip),
                   flip == 4 ? " (odd epoch)" : "");
          uint64_t seed = 100 + (uint64_t)cases++;
          float *got = augment_once(ctx, x, &o, seed, what);
          ref_augment(hx, want, s, seed, 0, &o, idx, draws);
          expect_same(got, want, s, draws, what);
          free(got);
        }
    kiln_tensor_free(x);
    free(hx);
    free(want);
  }
  cr_log_info("%d modes checked against the reference", cases);

  /* four channels at an offset that is not 16-byte aligned, and a transposed view */
  kiln_shape s = KILN_SHAPE(6, 5, 7, 4);
  int64_t total = ref_numel(s);
  float *hf;
  kiln_tensor *flat =
      ref_rand_tensor(ctx, KILN_SHAPE(1 + total), 4200, &REF_GEN(-2.f, -1.f), 0, &hf);
  kiln_augment_options o = {
      .pad = 2, .border = KILN_AUGMENT_BORDER_REFLECT, .flip = KILN_AUGMENT_FLIP_RANDOM};
  kiln_manual_seed(ctx, 77);
  kiln_step_begin(ctx);
  kiln_tensor *odd = kiln_reshape(kiln_slice(flat, 0, 1, 1 + total, 1), s);
  float *got = ref_read_f32(ctx, kiln_augment(odd, &o), "augment of an unaligned [6,5,7,4]");
  float *t = ref_read_f32(ctx, kiln_augment(kiln_transpose(odd, 1, 2), &o),
                          "augment of a transposed view [6,7,5,4]");
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  float *want = ref_falloc(total), *ht = ref_falloc(total);
  ref_augment(hf + 1, want, s, 77, 0, &o, NULL, NULL);
  expect_same(got, want, s, NULL, "augment of an unaligned [6,5,7,4]");
  kiln_shape st = KILN_SHAPE(6, 7, 5, 4);
  for (int64_t n = 0; n < 6; n++)
    for (int64_t h = 0; h < 7; h++)
      for (int64_t w = 0; w < 5; w++)
        for (int64_t c = 0; c < 4; c++)
          ht[((n * 7 + h) * 5 + w) * 4 + c] = hf[1 + ((n * 5 + w) * 7 + h) * 4 + c];
  ref_augment(ht, want, st, 77, 1, &o, NULL, NULL); /* the second call: offset 1 */
  expect_same(t, want, st, NULL, "augment of a transposed view [6,7,5,4]");
  free(got);
  free(t);
  free(want);
  free(ht);
  free(hf);
  kiln_tensor_free(flat);
  kiln_tensor_free(it);
  th_assert_ok(ctx);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- properties */

Test(gpu_augment, identities) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_shape s = KILN_SHAPE(16, 8, 10, 3);
  int64_t total = ref_numel(s);
  float *hx;
  kiln_tensor *x = ref_rand_tensor(ctx, s, 4300, &REF_GEN(0.5f, 1.5f), 0, &hx);
  kiln_augment_options all = {.flip = KILN_AUGMENT_FLIP_ALL}, none = {0};
  kiln_step_begin(ctx);
  kiln_tensor *once = kiln_augment(x, &all);
  float *twice = ref_read_f32(ctx, kiln_augment(once, &all), "two full flips");
  float *flipped = ref_read_f32(ctx, once, "one full flip");
  float *copy = ref_read_f32(ctx, kiln_augment(x, &none), "pad 0, no flip");
  float *null = ref_read_f32(ctx, kiln_augment(x, NULL), "NULL options");
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  cr_assert(memcmp(twice, hx, (size_t)total * 4) == 0, "two full flips are not the identity");
  cr_assert(memcmp(copy, hx, (size_t)total * 4) == 0, "pad 0 without a flip is not the identity");
  cr_assert(memcmp(null, hx, (size_t)total * 4) == 0, "NULL options are not the identity");
  for (int64_t n = 0; n < 16; n++) /* one flip mirrors every row */
    for (int64_t h = 0; h < 8; h++)
      for (int64_t w = 0; w < 10; w++)
        for (int64_t c = 0; c < 3; c++)
          cr_assert_eq(
              flipped[((n * 8 + h) * 10 + w) * 3 + c], hx[((n * 8 + h) * 10 + (9 - w)) * 3 + c],
              "full flip: image %lld pixel (%lld, %lld)", (long long)n, (long long)h, (long long)w);
  free(twice);
  free(flipped);
  free(copy);
  free(null);
  free(hx);
  kiln_tensor_free(x);
  th_ctx_free(ctx);
}

/* Fixed shifts (test-time augmentation's translated views), zero or reflected borders, with and
 * without the flip, on f32 images and on bf16 ones (the same values, in bf16), against the
 * definition: output (h, w) is pixel (h + dy, w + dx) of the image flipped or not. */
Test(gpu_augment, fixed_shifts_on_f32_and_bf16_images) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_shape s = KILN_SHAPE(3, 7, 9, 4);
  int64_t H = 7, W = 9, C = 4, total = ref_numel(s);
  float *hx;
  kiln_tensor *x = ref_rand_tensor(ctx, s, 4400, &REF_GEN(-2.f, 2.f), 0, &hx);
  int shifts[][2] = {{-1, -1}, {1, 1}, {2, -3}, {0, 4}};
  for (int b = 0; b < 2; b++)
    for (int k = 0; k < 4; k++)
      for (int f = 0; f < 2; f++)
        for (int bf = 0; bf < 2; bf++) {
          kiln_augment_options o = {.border = b ? KILN_AUGMENT_BORDER_REFLECT : 0,
                                    .flip = f ? KILN_AUGMENT_FLIP_ALL : KILN_AUGMENT_FLIP_NONE,
                                    .shift_h = shifts[k][0],
                                    .shift_w = shifts[k][1]};
          kiln_step_begin(ctx);
          kiln_tensor *in = bf ? kiln_cast(x, KILN_DTYPE_BF16) : x;
          kiln_tensor *y = kiln_cast(kiln_augment(in, &o), KILN_DTYPE_F32);
          cr_assert_not_null(y, "%s", th_err(ctx));
          float *got = ref_read_f32(ctx, y, "a shifted batch");
          cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
          for (int64_t i = 0; i < total; i++) {
            int64_t c = i % C, w = (i / C) % W, h = (i / (C * W)) % H, n = i / (C * W * H);
            int64_t sh = h + o.shift_h, sw = w + o.shift_w;
            bool inside = sh >= 0 && sh < H && sw >= 0 && sw < W;
            if (b) {
              sh = reflect(sh, H);
              sw = reflect(sw, W);
              inside = true;
            }
            if (f) sw = W - 1 - sw;
            float v = inside ? hx[((n * H + sh) * W + sw) * C + c] : 0.f;
            if (bf) v = kiln_bf16_to_f32(kiln_bf16_from_f32(v));
            cr_assert_eq(got[i], v,
                         "shift (%d, %d) border %d flip %d %s: image %lld pixel (%lld, %lld) "
                         "channel %lld is %g, not %g",
                         o.shift_h, o.shift_w, b, f, bf ? "bf16" : "f32", (long long)n,
                         (long long)h, (long long)w, (long long)c, (double)got[i], (double)v);
          }
          free(got);
        }
  const kiln_augment_options bad[2] = {{.pad = 1, .shift_h = 1}, {.shift_w = -9}};
  const char *why[2] = {"shift (1, 0) with pad 1", "shift (0, -9)"};
  for (int k = 0; k < 2; k++) {
    cr_assert_null(kiln_augment(x, &bad[k]));
    cr_assert_eq(kiln_ctx_status(ctx), KILN_ERR_INVALID);
    cr_assert(strstr(kiln_ctx_error(ctx), "kiln_augment") && strstr(kiln_ctx_error(ctx), why[k]),
              "%s", th_err(ctx));
    kiln_ctx_clear_error(ctx);
  }
  free(hx);
  kiln_tensor_free(x);
  th_ctx_free(ctx);
}

/* Where value v lies in image n of x (N, H, W, C): *h, *w, *c; false when it is nowhere. */
static bool find(const float *x, kiln_shape s, int64_t n, float v, int64_t *h, int64_t *w,
                 int64_t *c) {
  int64_t H = s.d[1], W = s.d[2], C = s.d[3];
  const float *img = x + n * H * W * C;
  for (int64_t i = 0; i < H * W * C; i++)
    if (img[i] == v) {
      *c = i % C;
      *w = i / C % W;
      *h = i / C / W;
      return true;
    }
  return false;
}

/* Recovers image n's translation and flip from its output alone (distinct non-zero inputs):
 * every pixel read from inside the image must agree on one (dy, dx, flip) within the pad, and
 * every other pixel is 0 (zero border) or a reflection. Returns the draws it found. */
static draw recover(const float *x, const float *y, kiln_shape s, int64_t n, int pad, bool reflect,
                    const char *what) {
  int64_t H = s.d[1], W = s.d[2], C = s.d[3];
  draw d = {0, 0, 0};
  /* the centre pixel's source is inside the image for any pad below half the size */
  int64_t h0 = H / 2, w0 = W / 2, hs, ws, cs;
  float v0 = y[((n * H + h0) * W + w0) * C];
  cr_assert(find(x, s, n, v0, &hs, &ws, &cs) && cs == 0,
            "%s: image %lld's centre (value %g) comes from no pixel of the image", what,
            (long long)n, (double)v0);
  d.dy = (int)(hs - h0);
  /* flipped or not: the column relation that holds for the neighbour too */
  int64_t hs1, ws1, cs1;
  float v1 = y[((n * H + h0) * W + w0 + 1) * C];
  cr_assert(find(x, s, n, v1, &hs1, &ws1, &cs1));
  d.flip = ws1 == ws - 1;
  d.dx = d.flip ? (int)((W - 1 - ws) - w0) : (int)(ws - w0);
  cr_assert(abs(d.dy) <= pad && abs(d.dx) <= pad, "%s: image %lld moved by (%d, %d), pad %d", what,
            (long long)n, d.dy, d.dx, pad);
  for (int64_t h = 0; h < H; h++)
    for (int64_t w = 0; w < W; w++)
      for (int64_t c = 0; c < C; c++) {
        float v = y[((n * H + h) * W + w) * C + c];
        int64_t sh = h + d.dy, sw = w + d.dx;
        bool inside = sh >= 0 && sh < H && sw >= 0 && sw < W;
        if (!inside && !reflect) {
          cr_assert_eq(v, 0.f, "%s: image %lld pixel (%lld, %lld) reads from outside: %g, want 0",
                       what, (long long)n, (long long)h, (long long)w, (double)v);
          continue;
        }
        int64_t fh, fw, fc;
        cr_assert(find(x, s, n, v, &fh, &fw, &fc) && fc == c,
                  "%s: image %lld pixel (%lld, %lld) channel %lld holds %g, from no pixel of its "
                  "image and channel",
                  what, (long long)n, (long long)h, (long long)w, (long long)c, (double)v);
        if (reflect) { /* inside the image: the crop never leaves the reflected padding */
          sh = sh < 0 ? -sh : (sh >= H ? 2 * (H - 1) - sh : sh);
          sw = sw < 0 ? -sw : (sw >= W ? 2 * (W - 1) - sw : sw);
        }
        if (d.flip) sw = W - 1 - sw;
        cr_assert(fh == sh && fw == sw,
                  "%s: image %lld pixel (%lld, %lld) comes from (%lld, %lld), not (%lld, %lld) "
                  "as its centre says (dy %d, dx %d, flip %d)",
                  what, (long long)n, (long long)h, (long long)w, (long long)fh, (long long)fw,
                  (long long)sh, (long long)sw, d.dy, d.dx, d.flip);
      }
  return d;
}

Test(gpu_augment, crops_stay_in_bounds_and_draws_are_fresh_and_reproducible) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_shape s = KILN_SHAPE(64, 8, 9, 2);
  int64_t total = ref_numel(s);
  float *hx = ref_falloc(total);
  distinct_fill(hx, total, 5);
  kiln_tensor *x = ref_upload(ctx, s, hx);
  for (int border = 0; border < 2; border++) {
    kiln_augment_options o = {
        .pad = 3, .border = (kiln_augment_border)border, .flip = KILN_AUGMENT_FLIP_RANDOM};
    char what[96];
    snprintf(what, sizeof what, "augment of [64,8,9,2], pad 3, %s border",
             border ? "reflected" : "zero");
    float *a = augment_once(ctx, x, &o, 9, what), *b = augment_once(ctx, x, &o, 9, what);
    cr_assert(memcmp(a, b, (size_t)total * 4) == 0, "%s: the same seed gave another batch", what);
    int moved = 0, flips = 0;
    for (int64_t n = 0; n < 64; n++) {
      draw d = recover(hx, a, s, n, 3, border, what), w = draw_of(9, 0, &o, n, NULL);
      cr_assert(d.dy == w.dy && d.dx == w.dx && d.flip == w.flip,
                "%s: image %lld drew (%d, %d, flip %d), Philox says (%d, %d, flip %d)", what,
                (long long)n, d.dy, d.dx, d.flip, w.dy, w.dx, w.flip);
      moved += d.dy != 0 || d.dx != 0;
      flips += d.flip;
    }
    cr_assert(moved > 48 && flips > 16 && flips < 48, "%s: %d of 64 moved, %d flipped", what, moved,
              flips);
    /* two calls in a row: different offsets, different batches */
    kiln_manual_seed(ctx, 9);
    kiln_step_begin(ctx);
    kiln_tensor *t1 = kiln_augment(x, &o), *t2 = kiln_augment(x, &o);
    float *c1 = ref_read_f32(ctx, t1, what), *c2 = ref_read_f32(ctx, t2, what);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    cr_assert(memcmp(c1, a, (size_t)total * 4) == 0, "%s: the first call after the seed differs",
              what);
    int differ = 0;
    for (int64_t n = 0; n < 64; n++)
      differ += memcmp(c1 + n * 144, c2 + n * 144, 144 * 4) != 0;
    cr_assert_gt(differ, 48, "%s: two calls in a row agree on %d of 64 images", what, 64 - differ);
    /* another seed, another batch */
    float *e = augment_once(ctx, x, &o, 10, what);
    cr_assert(memcmp(e, a, (size_t)total * 4) != 0, "%s: seeds 9 and 10 gave the same batch", what);
    free(a);
    free(b);
    free(c1);
    free(c2);
    free(e);
  }
  free(hx);
  kiln_tensor_free(x);
  th_ctx_free(ctx);
}

Test(gpu_augment, random_flips_take_half_and_translations_are_uniform) {
  TH_GPU_CTX_EAGER(ctx);
  const int64_t N = 4000;
  /* rows of 4 distinct values: flipped exactly when reversed */
  kiln_shape s = KILN_SHAPE(N, 1, 4, 1);
  float *hx = ref_falloc(N * 4);
  distinct_fill(hx, N * 4, 3);
  kiln_tensor *x = ref_upload(ctx, s, hx);
  kiln_augment_options o = {.flip = KILN_AUGMENT_FLIP_RANDOM};
  float *y = augment_once(ctx, x, &o, 21, "random flips of [4000,1,4,1]");
  int flipped = 0;
  for (int64_t n = 0; n < N; n++) {
    bool same = true, rev = true;
    for (int w = 0; w < 4; w++) {
      same = same && y[n * 4 + w] == hx[n * 4 + w];
      rev = rev && y[n * 4 + w] == hx[n * 4 + 3 - w];
    }
    cr_assert(same != rev, "image %lld is neither itself nor its mirror", (long long)n);
    flipped += rev;
  }
  cr_assert(flipped > 1850 && flipped < 2150, "random flips took %d of 4000 images", flipped);
  free(y);
  kiln_tensor_free(x);
  free(hx);

  /* translations by pad 2 of 5 x 5 images: the centre's source gives (dy, dx) */
  kiln_shape t = KILN_SHAPE(N, 5, 5, 1);
  hx = ref_falloc(N * 25);
  distinct_fill(hx, N * 25, 4);
  x = ref_upload(ctx, t, hx);
  o = (kiln_augment_options){.pad = 2};
  y = augment_once(ctx, x, &o, 22, "translations of [4000,5,5,1] by up to 2");
  int hist[2][5] = {{0}};
  for (int64_t n = 0; n < N; n++) {
    int64_t h, w, c;
    cr_assert(find(hx, t, n, y[n * 25 + 12], &h, &w, &c));
    hist[0][h]++; /* dy + 2 */
    hist[1][w]++;
  }
  for (int k = 0; k < 2; k++)
    for (int v = 0; v < 5; v++)
      cr_assert(hist[k][v] > 680 && hist[k][v] < 920, "%s = %d in %d of 4000 images",
                k ? "dx" : "dy", v - 2, hist[k][v]);
  free(y);
  kiln_tensor_free(x);
  free(hx);
  th_ctx_free(ctx);
}

/* Which images the alternating flip takes (rows of 4 distinct values, pad 0), after seed 5 and
 * skip other random calls (its offset). */
static void alternate_set(kiln_ctx *ctx, kiln_tensor *x, const float *hx, kiln_tensor *idx,
                          int64_t epoch, int skip, int64_t N, bool *set) {
  kiln_augment_options o = {.flip = KILN_AUGMENT_FLIP_ALTERNATE, .idx = idx, .epoch = epoch};
  char what[96];
  snprintf(what, sizeof what, "alternating flip of [%lld,1,4,1], epoch %lld, offset %d",
           (long long)N, (long long)epoch, skip);
  kiln_manual_seed(ctx, 5);
  kiln_step_begin(ctx);
  for (int k = 0; k < skip; k++)
    cr_assert_not_null(kiln_rand(ctx, KILN_SHAPE(1)));
  float *y = ref_read_f32(ctx, kiln_augment(x, &o), what);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s: %s", what, th_err(ctx));
  for (int64_t n = 0; n < N; n++) {
    set[n] = y[n * 4] == hx[n * 4 + 3];
    cr_assert(set[n] ? y[n * 4 + 3] == hx[n * 4] : y[n * 4] == hx[n * 4], "%s: image %lld", what,
              (long long)n);
  }
  free(y);
}

Test(gpu_augment, alternating_flips_take_the_complement_on_the_next_epoch) {
  TH_GPU_CTX_EAGER(ctx);
  const int64_t N = 1000;
  float *hx = ref_falloc(N * 4);
  distinct_fill(hx, N * 4, 8);
  kiln_tensor *x = ref_upload(ctx, KILN_SHAPE(N, 1, 4, 1), hx);
  int32_t *ids = malloc((size_t)N * sizeof *ids), *rev = malloc((size_t)N * sizeof *rev);
  for (int64_t n = 0; n < N; n++)
    ids[n] = (int32_t)(n * 37 + 11) - 500; /* some negative */
  kiln_tensor *idx = ref_upload_i32(ctx, KILN_SHAPE(N), ids);
  static bool e0[1000], e1[1000], e2[1000], e3[1000], other[1000];
  alternate_set(ctx, x, hx, idx, 0, 0, N, e0);
  alternate_set(ctx, x, hx, idx, 1, 0, N, e1);
  alternate_set(ctx, x, hx, idx, 2, 3, N, e2); /* the call's offset does not matter */
  alternate_set(ctx, x, hx, idx, -1, 1, N, e3);
  int count = 0;
  for (int64_t n = 0; n < N; n++) {
    cr_assert_neq(e0[n], e1[n], "image %lld (index %d): flipped %d on epoch 0 and %d on epoch 1",
                  (long long)n, ids[n], e0[n], e1[n]);
    cr_assert_eq(e0[n], e2[n], "image %lld: epochs 0 and 2 differ", (long long)n);
    cr_assert_eq(e1[n], e3[n], "image %lld: epochs 1 and -1 differ", (long long)n);
    kiln_augment_options o = {.flip = KILN_AUGMENT_FLIP_ALTERNATE, .epoch = 0};
    cr_assert_eq(e0[n], draw_of(5, 0, &o, n, ids).flip, "image %lld: not Philox's bit",
                 (long long)n);
    count += e0[n];
  }
  cr_assert(count > 420 && count < 580, "the alternating flip took %d of 1000 on epoch 0", count);
  /* the bit belongs to the sample: the batch in another order flips the same samples */
  for (int64_t n = 0; n < N; n++)
    rev[n] = ids[N - 1 - n];
  float *hr = ref_falloc(N * 4);
  for (int64_t n = 0; n < N; n++)
    memcpy(hr + n * 4, hx + (N - 1 - n) * 4, 4 * sizeof *hr);
  kiln_tensor *xr = ref_upload(ctx, KILN_SHAPE(N, 1, 4, 1), hr);
  kiln_tensor *ir = ref_upload_i32(ctx, KILN_SHAPE(N), rev);
  alternate_set(ctx, xr, hr, ir, 0, 0, N, other);
  for (int64_t n = 0; n < N; n++)
    cr_assert_eq(other[n], e0[N - 1 - n], "sample %d flips by its position", ids[N - 1 - n]);
  free(hr);
  free(hx);
  free(ids);
  free(rev);
  kiln_tensor_free(x);
  kiln_tensor_free(xr);
  kiln_tensor_free(idx);
  kiln_tensor_free(ir);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- loader batches, three modes */

#define LN 64 /* samples */
#define LB 16 /* batch */
#define LSTEPS 8
#define LIMG (6 * 7 * 3)

typedef struct loader_run {
  float a[LSTEPS][LB * LIMG], b[LSTEPS][LB * LIMG];
  int32_t ids[LSTEPS][LB];
  kiln_exec_stats stats;
} loader_run;

static const kiln_augment_options la = {
    .pad = 2, .border = KILN_AUGMENT_BORDER_REFLECT, .flip = KILN_AUGMENT_FLIP_RANDOM};

/* Two epochs of 4 batches: a = augment(x) (random flips, reflected translations), b = 2 augment(x
 * + 1) (the alternating flip by the loader's indices, zero border), read after each step; labels
 * are the samples' indices. mode 0: unfused, 1: fused, 2: fused with step graphs. */
static void loader_steps(int mode, const float *data, loader_run *out) {
  TH_GPU_CTX(ctx);
  kiln_set_fusion(ctx, mode > 0);
  kiln_set_graphs(ctx, mode == 2);
  int32_t labels[LN];
  for (int i = 0; i < LN; i++)
    labels[i] = i;
  kiln_dataset *ds = kiln_dataset_from_host(ctx, KILN_HOST_F32, KILN_SHAPE(LN, 6, 7, 3), data,
                                            (kiln_host_labels){.i32 = labels}, NULL);
  kiln_loader *l = kiln_loader_new(
      ds, &(kiln_loader_options){.batch = LB, .shuffle = 1, .seed = 13, .drop_last = 1});
  cr_assert_not_null(l, "%s", th_err(ctx));
  kiln_manual_seed(ctx, 31);
  int s = 0;
  for (int epoch = 0; epoch < 2; epoch++) {
    kiln_loader_start(l, epoch);
    for (;;) {
      kiln_step_begin(ctx);
      kiln_tensor *x, *y;
      if (!kiln_loader_next(l, &x, &y)) break;
      cr_assert_lt(s, LSTEPS);
      kiln_augment_options alt = {.pad = 1,
                                  .flip = KILN_AUGMENT_FLIP_ALTERNATE,
                                  .idx = kiln_loader_indices(l),
                                  .epoch = epoch};
      kiln_tensor *a = kiln_augment(x, &la);
      kiln_tensor *b = kiln_mul_scalar(kiln_augment(kiln_add_scalar(x, 1.f), &alt), 2.f);
      cr_assert(a && b, "%s", th_err(ctx));
      cr_assert_eq(kiln_step_end(ctx), KILN_OK, "mode %d step %d: %s", mode, s, th_err(ctx));
      cr_assert_eq(kiln_tensor_to_host(a, out->a[s], sizeof out->a[s]), KILN_OK, "%s", th_err(ctx));
      cr_assert_eq(kiln_tensor_to_host(b, out->b[s], sizeof out->b[s]), KILN_OK, "%s", th_err(ctx));
      cr_assert_eq(kiln_tensor_to_host(y, out->ids[s], sizeof out->ids[s]), KILN_OK, "%s",
                   th_err(ctx));
      s++;
    }
    kiln_step_end(ctx); /* the step the epoch's end opened */
  }
  cr_assert_eq(s, LSTEPS);
  kiln_stats(ctx, &out->stats);
  kiln_loader_free(l);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}

Test(gpu_augment, loader_batches_in_three_modes_and_graph_replay, .timeout = 600) {
  static float data[LN * LIMG];
  th_fill(data, LN * LIMG, 4400, 0.5f, 1.5f);
  static loader_run run[3];
  for (int mode = 0; mode < 3; mode++)
    loader_steps(mode, data, &run[mode]);
  cr_assert_eq(run[2].stats.graph_captures, 1, "one signature for every batch and epoch: %llu",
               (unsigned long long)run[2].stats.graph_captures);
  cr_assert_eq(run[2].stats.graph_replays, LSTEPS - 1);
  cr_assert_eq(run[0].stats.graph_captures + run[1].stats.graph_captures, 0);
  for (int mode = 0; mode < 2; mode++) {
    cr_assert(memcmp(run[mode].ids, run[2].ids, sizeof run[2].ids) == 0, "mode %d: other batches",
              mode);
    for (int s = 0; s < LSTEPS; s++) {
      cr_assert(memcmp(run[mode].a[s], run[2].a[s], sizeof run[2].a[s]) == 0,
                "step %d: a differs between mode %d and graph replay", s, mode);
      cr_assert(memcmp(run[mode].b[s], run[2].b[s], sizeof run[2].b[s]) == 0,
                "step %d: b differs between mode %d and graph replay", s, mode);
    }
  }
  /* every step against the reference: offsets 2 s and 2 s + 1 of seed 31 */
  kiln_shape s4 = KILN_SHAPE(LB, 6, 7, 3);
  static float batch[LB * LIMG], plus[LB * LIMG], want[LB * LIMG];
  for (int s = 0; s < LSTEPS; s++) {
    const int32_t *ids = run[2].ids[s];
    for (int k = 0; k < LB; k++) {
      cr_assert(ids[k] >= 0 && ids[k] < LN);
      memcpy(batch + k * LIMG, data + ids[k] * LIMG, LIMG * sizeof *batch);
    }
    for (int i = 0; i < LB * LIMG; i++)
      plus[i] = batch[i] + 1.f;
    char what[64];
    snprintf(what, sizeof what, "graph step %d, a", s);
    ref_augment(batch, want, s4, 31, 2 * (uint64_t)s, &la, NULL, NULL);
    expect_same(run[2].a[s], want, s4, NULL, what);
    kiln_augment_options alt = {.pad = 1, .flip = KILN_AUGMENT_FLIP_ALTERNATE, .epoch = s / 4};
    ref_augment(plus, want, s4, 31, 2 * (uint64_t)s + 1, &alt, ids, NULL);
    for (int i = 0; i < LB * LIMG; i++)
      want[i] *= 2.f;
    snprintf(what, sizeof what, "graph step %d, b", s);
    expect_same(run[2].b[s], want, s4, NULL, what);
    if (s > 0) /* fresh numbers every replayed step (the batches differ too: same samples kept) */
      cr_assert(memcmp(run[2].a[s], run[2].a[s - 1], sizeof run[2].a[s]) != 0,
                "steps %d and %d augmented alike", s - 1, s);
  }
}
