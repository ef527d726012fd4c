/*
 * test_gpu_ops_index.c: on the GPU, what indices and integers do: index_select's gradient (rows
 * picked twice get both gradients) against a float64 reference and finite differences, the
 * embedding layer (its init, forward and one SGD step that moves only the rows used, a bad index
 * found on the device), i32 comparisons and exact i32 sums (rows, columns, all, fused after a
 * cast, and a total past the i32 range reported as an error), and kiln_rand / kiln_randn against
 * Philox's own draws, fresh every replayed step and bitwise the same with and without graphs.
 * Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fusion/device/philox.cuh"
#include "ref.h"

/* Ends the open step, in which t was recorded, expecting the error a kernel found on the device,
 * whose message holds both words. */
static void expect_device_error(kiln_ctx *ctx, kiln_tensor *t, const char *what, const char *w1,
                                const char *w2) {
  cr_assert_not_null(t, "%s: %s", what, th_err(ctx));
  kiln_status st = kiln_step_end(ctx);
  if (st == KILN_OK) st = kiln_sync(ctx);
  cr_assert_neq(st, KILN_OK, "%s ran clean", what);
  cr_assert(strstr(th_err(ctx), w1) && strstr(th_err(ctx), w2),
            "%s: the error names '%s' and '%s': %s", what, w1, w2, th_err(ctx));
}

/* ---------------------------------------------------------------- index_select's gradient */

static kiln_tensor *gc_index_select(kiln_tensor *const *in, void *user) {
  return kiln_index_select(in[0], (kiln_tensor *)user);
}

Test(gpu_index, index_select_gradient_sums_repeated_rows) {
  TH_GPU_CTX_EAGER(ctx);
  const int V = 6, D = 5, K = 9;
  int32_t rows[9] = {4, 1, 4, 0, 5, 4, 1, 3, 0}; /* row 2 never picked, row 4 three times */
  kiln_tensor *idx = ref_upload_i32(ctx, KILN_SHAPE(K), rows);
  float *ha, *hw;
  kiln_tensor *a = ref_rand_tensor(ctx, KILN_SHAPE(V, D), 3100, &REF_GEN(-1.f, 1.f), 1, &ha);
  kiln_tensor *w = ref_rand_tensor(ctx, KILN_SHAPE(K, D), 3101, &REF_GEN(-1.f, 1.f), 0, &hw);
  kiln_step_begin(ctx);
  kiln_tensor *y = kiln_index_select(a, idx);
  double fwd[9 * 5], grad[6 * 5] = {0};
  for (int k = 0; k < K; k++)
    for (int j = 0; j < D; j++) {
      fwd[k * D + j] = ha[rows[k] * D + j];
      grad[rows[k] * D + j] += hw[k * D + j];
    }
  ref_expect_close(ctx, y, KILN_SHAPE(K, D), fwd, 0, 0, "index_select of [6,5] by 9 rows");
  cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(y, w), KILN_ALL_AXES, 0)), KILN_OK, "%s",
               th_err(ctx));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  ref_expect_close(ctx, kiln_tensor_grad(a), KILN_SHAPE(V, D), grad, 1e-6, 1e-6,
                   "gradient of sum(w * index_select(a, idx)) in a (row 2 zero, row 4 three "
                   "rows' sum)");
  kiln_tensor_zero_grad(a);
  ref_expect_gradcheck(ctx, "index_select with repeated rows", gc_index_select, 1, &a, idx);
  kiln_tensor_free(a);
  kiln_tensor_free(w);
  kiln_tensor_free(idx);
  free(ha);
  free(hw);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- embedding */

Test(gpu_index, embedding_init_forward_and_a_step_that_moves_only_used_rows) {
  TH_GPU_CTX_EAGER(ctx);
  kiln_manual_seed(ctx, 5);
  kiln_params *p = kiln_params_new(ctx);
  kiln_embedding e;
  const int V = 1000, D = 64;
  cr_assert_eq(kiln_embedding_init(
                   &e, p, &(kiln_embedding_options){.name = "emb", .num_embeddings = V, .dim = D}),
               KILN_OK, "%s", th_err(ctx));
  cr_assert_str_eq(kiln_params_name(p, 0), "emb.weight");
  cr_assert(kiln_tensor_requires_grad(e.weight));
  float *w0 = ref_read_f32(ctx, e.weight, "the embedding's weight");
  double s = 0, s2 = 0;
  for (int i = 0; i < V * D; i++) {
    s += w0[i];
    s2 += (double)w0[i] * w0[i];
  }
  double mean = s / (V * D), sd = sqrt(s2 / (V * D) - mean * mean);
  cr_assert(fabs(mean) < 0.01 && fabs(sd - 1.0) < 0.01,
            "embedding init: mean %.4f and std %.4f of 64000 values, want N(0, 1)", mean, sd);

  /* indices (2, 3): the output is (2, 3, 64), each the weight's row; loss = sum(out * c) */
  int32_t ids[6] = {7, 999, 7, 0, 42, 7};
  kiln_tensor *idx = ref_upload_i32(ctx, KILN_SHAPE(2, 3), ids);
  float *hc;
  kiln_tensor *c = ref_rand_tensor(ctx, KILN_SHAPE(2, 3, D), 3200, &REF_GEN(-1.f, 1.f), 0, &hc);
  kiln_optim *opt = kiln_sgd_new(p, &(kiln_sgd_options){.lr = 0.5f});
  kiln_step_begin(ctx);
  kiln_tensor *out = kiln_embedding_forward(&e, idx);
  double want[6 * 64];
  for (int k = 0; k < 6; k++)
    for (int j = 0; j < D; j++)
      want[k * D + j] = w0[ids[k] * D + j];
  ref_expect_close(ctx, out, KILN_SHAPE(2, 3, D), want, 0, 0, "embedding of (2, 3) indices");
  cr_assert_eq(kiln_backward(kiln_sum(kiln_mul(out, c), KILN_ALL_AXES, 0)), KILN_OK, "%s",
               th_err(ctx));
  cr_assert_eq(kiln_optim_step(opt), KILN_OK, "%s", th_err(ctx));
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  float *w1 = ref_read_f32(ctx, e.weight, "the embedding's weight after a step");
  for (int r = 0; r < V; r++)
    for (int j = 0; j < D; j++) {
      double g = 0;
      for (int k = 0; k < 6; k++)
        if (ids[k] == r) g += hc[k * D + j];
      double wantw = (double)w0[r * D + j] - 0.5 * g;
      float got = w1[r * D + j];
      if (g == 0)
        cr_assert(got == w0[r * D + j], "row %d (unused) changed at %d: %.9g to %.9g", r, j,
                  (double)w0[r * D + j], (double)got);
      else
        cr_assert(fabs(got - wantw) <= 1e-5, "row %d, column %d: %.9g, want %.9g", r, j,
                  (double)got, wantw);
    }

  /* an index outside [0, 1000) is found on the device and names the range */
  int32_t bad[2] = {3, 1000};
  kiln_tensor *bidx = ref_upload_i32(ctx, KILN_SHAPE(2), bad);
  kiln_step_begin(ctx);
  expect_device_error(ctx, kiln_embedding_forward(&e, bidx), "an embedding index of 1000", "1000",
                      "[0, 1000)");
  free(w0);
  free(w1);
  free(hc);
  kiln_optim_free(opt);
  kiln_tensor_free(bidx);
  kiln_tensor_free(idx);
  kiln_tensor_free(c);
  kiln_params_free(p);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- i32 comparisons and sums */

Test(gpu_index, accuracy_as_sum_of_eq_of_argmax_and_labels) {
  TH_GPU_CTX_EAGER(ctx);
  const int N = 777, C = 10;
  float *hl;
  kiln_tensor *logits = ref_rand_tensor(ctx, KILN_SHAPE(N, C), 3300, &REF_GEN(-3.f, 3.f), 0, &hl);
  int32_t *lab = ref_malloc(N * sizeof *lab);
  int right = 0;
  th_rng r = {77};
  for (int i = 0; i < N; i++) {
    int best = 0;
    for (int j = 1; j < C; j++)
      if (hl[i * C + j] > hl[i * C + best]) best = j;
    lab[i] = th_rng_chance(&r, 0.6) ? best : th_rng_below(&r, C);
    right += lab[i] == best;
  }
  kiln_tensor *labels = ref_upload_i32(ctx, KILN_SHAPE(N), lab);
  kiln_step_begin(ctx);
  kiln_tensor *hits = kiln_eq(kiln_argmax(logits, 1, 0), labels);
  cr_assert_eq(kiln_tensor_dtype(hits), KILN_DTYPE_F32);
  float correct = kiln_tensor_item(kiln_sum(hits, KILN_ALL_AXES, 0));
  cr_assert_eq(correct, (float)right, "sum(eq(argmax, labels)) is %g, want %d", (double)correct,
               right);
  /* an i32 against an f32 compares as floats: argmax > 4.5 */
  float *gt = ref_read_f32(
      ctx, kiln_gt(kiln_argmax(logits, 1, 0), kiln_full(ctx, KILN_SHAPE(1), 4.5f)), "argmax > 4.5");
  for (int i = 0; i < N; i++) {
    int best = 0;
    for (int j = 1; j < C; j++)
      if (hl[i * C + j] > hl[i * C + best]) best = j;
    cr_assert_eq(gt[i], best > 4 ? 1.f : 0.f, "row %d: argmax %d > 4.5 gave %g", i, best,
                 (double)gt[i]);
  }
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  free(gt);
  free(lab);
  free(hl);
  kiln_tensor_free(labels);
  kiln_tensor_free(logits);
  th_ctx_free(ctx);
}

Test(gpu_index, i32_sums_are_exact) {
  TH_GPU_CTX_EAGER(ctx);
  /* values up to 1e6 in magnitude over 300 x 7: the totals pass 2^24, where f32 stops counting */
  const int R = 300, C = 7;
  int32_t *h = ref_malloc(R * C * sizeof *h);
  th_rng r = {91};
  for (int i = 0; i < R * C; i++)
    h[i] = th_rng_below(&r, 2000001) - 1000000 + (i % 3 == 0 ? 999999 : 0);
  kiln_tensor *x = ref_upload_i32(ctx, KILN_SHAPE(R, C), h);
  int32_t *rows = ref_malloc(R * sizeof *rows), cols[7] = {0}, all;
  long long tot = 0;
  for (int i = 0; i < R; i++) {
    long long s = 0;
    for (int j = 0; j < C; j++) {
      s += h[i * C + j];
      cols[j] += h[i * C + j];
    }
    rows[i] = (int32_t)s;
    tot += s;
  }
  all = (int32_t)tot;
  cr_assert(llabs(tot) < 2147483647ll && llabs(tot) > (1 << 24), "the test's total %lld", tot);
  kiln_step_begin(ctx);
  ref_expect_i32(ctx, kiln_sum(x, KILN_AXES(1), 0), KILN_SHAPE(R), rows, "i32 sum of rows");
  ref_expect_i32(ctx, kiln_sum(x, KILN_AXES(0), 0), KILN_SHAPE(C), cols, "i32 sum of columns");
  ref_expect_i32(ctx, kiln_sum(x, KILN_ALL_AXES, 1), KILN_SHAPE(1, 1), &all, "i32 sum of all");
  ref_expect_i32(ctx, kiln_sum(kiln_transpose(x, 0, 1), KILN_AXES(0), 0), KILN_SHAPE(R), rows,
                 "i32 sum over a transposed view");
  /* fused after a cast from f32 (truncation towards zero) */
  float *hf;
  kiln_tensor *f = ref_rand_tensor(ctx, KILN_SHAPE(64, 50), 3400, &REF_GEN(-900.f, 900.f), 0, &hf);
  int32_t fs[64];
  for (int i = 0; i < 64; i++) {
    fs[i] = 0;
    for (int j = 0; j < 50; j++)
      fs[i] += (int32_t)hf[i * 50 + j];
  }
  ref_expect_i32(ctx, kiln_sum(kiln_cast(f, KILN_DTYPE_I32), KILN_AXES(1), 0), KILN_SHAPE(64), fs,
                 "i32 sum of a cast");
  float item = kiln_tensor_item(kiln_sum(kiln_slice(x, 0, 0, 1, 1), KILN_ALL_AXES, 0));
  cr_assert_eq(item, (float)rows[0], "item of an i32 sum: %g, want %d", (double)item, rows[0]);
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));

  /* four values of 2^30: a total of 2^32 is an error naming kiln_sum and the value */
  int32_t big[4] = {1 << 30, 1 << 30, 1 << 30, 1 << 30};
  kiln_tensor *b = ref_upload_i32(ctx, KILN_SHAPE(4), big);
  kiln_step_begin(ctx);
  expect_device_error(ctx, kiln_sum(b, KILN_ALL_AXES, 0), "an i32 sum of 2^32", "kiln_sum",
                      "4294967296");
  free(hf);
  free(rows);
  free(h);
  kiln_tensor_free(f);
  kiln_tensor_free(b);
  kiln_tensor_free(x);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- random tensors */

Test(gpu_index, rand_and_randn_are_philox_draws) {
  TH_GPU_CTX_EAGER(ctx);
  const int64_t n = 1 << 20;
  kiln_manual_seed(ctx, 9);
  kiln_step_begin(ctx);
  float *u = ref_read_f32(ctx, kiln_rand(ctx, KILN_SHAPE(n)), "rand of [1048576]");
  float *z = ref_read_f32(ctx, kiln_randn(ctx, KILN_SHAPE(1024, 1024)), "randn of [1024,1024]");
  cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
  double su = 0, sz = 0, sz2 = 0;
  for (int64_t i = 0; i < n; i++) {
    float wu = kiln_philox_uniform(9, 0, (unsigned long long)i);
    cr_assert_eq(u[i], wu, "rand element %lld: %.9g, Philox(9, 0) gives %.9g", (long long)i,
                 (double)u[i], (double)wu);
    cr_assert(u[i] >= 0.f && u[i] < 1.f);
    float wz = kiln_philox_normal(9, 1, (unsigned long long)i);
    cr_assert(fabsf(z[i] - wz) <= 1e-5f * (1.f + fabsf(wz)),
              "randn element %lld: %.9g, Philox(9, 1) gives %.9g", (long long)i, (double)z[i],
              (double)wz);
    su += u[i];
    sz += z[i];
    sz2 += (double)z[i] * z[i];
  }
  double mu = su / n, mz = sz / n, vz = sz2 / n - mz * mz;
  cr_assert(fabs(mu - 0.5) < 0.002, "rand's mean %.5f", mu);
  cr_assert(fabs(mz) < 0.005 && fabs(vz - 1.0) < 0.005, "randn's mean %.5f and variance %.5f", mz,
            vz);
  free(u);
  free(z);
  th_ctx_free(ctx);
}

/* Four steps of grad(p) = randn: the values each step drew, graphs on or off. */
static void randn_steps(int graphs, float out[4][500], uint64_t *replays) {
  TH_GPU_CTX(ctx);
  kiln_set_graphs(ctx, graphs);
  kiln_manual_seed(ctx, 21);
  float *hp;
  kiln_tensor *p = ref_rand_tensor(ctx, KILN_SHAPE(500), 3500, &REF_GEN(-1.f, 1.f), 1, &hp);
  for (int s = 0; s < 4; s++) {
    kiln_step_begin(ctx);
    kiln_tensor *loss = kiln_sum(kiln_mul(p, kiln_randn(ctx, KILN_SHAPE(500))), KILN_ALL_AXES, 0);
    cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_tensor_to_host(kiln_tensor_grad(p), out[s], 500 * sizeof(float)), KILN_OK,
                 "%s", th_err(ctx));
    kiln_tensor_zero_grad(p);
  }
  kiln_exec_stats st;
  kiln_stats(ctx, &st);
  *replays = st.graph_replays;
  kiln_tensor_free(p);
  free(hp);
  th_ctx_free(ctx);
}

Test(gpu_index, randn_in_replayed_steps_is_fresh_and_graph_free) {
  static float g[4][500], e[4][500];
  uint64_t rg, re;
  randn_steps(1, g, &rg);
  randn_steps(0, e, &re);
  cr_assert(rg >= 2, "graph mode replayed %llu steps", (unsigned long long)rg);
  cr_assert_eq(re, 0);
  cr_assert(memcmp(g, e, sizeof g) == 0, "randn with graphs differs from randn without");
  for (int s = 0; s < 4; s++)
    for (int i = 0; i < 500; i++) {
      float w = kiln_philox_normal(21, (unsigned long long)s, (unsigned long long)i);
      cr_assert(fabsf(g[s][i] - w) <= 1e-5f * (1.f + fabsf(w)),
                "step %d element %d: %.9g, Philox(21, %d) gives %.9g", s, i, (double)g[s][i], s,
                (double)w);
    }
  cr_assert(memcmp(g[0], g[1], sizeof g[0]) != 0, "two replayed steps drew the same numbers");
}
