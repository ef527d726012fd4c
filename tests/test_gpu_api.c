/*
 * test_gpu_api.c: what a new user of the public API runs into (issue 12), on the GPU: data sets
 * from host arrays (their values, batches, and kiln_dataset_from_mnist's equal), host copies into
 * persistent tensors that queue behind the device's work without waiting for it (a graph-mode
 * step stays whole, the caller's buffer is free at once, large and many copies arrive whole), and
 * the one-cycle schedule's momentum cycling against a float64 transcription of torch's rules.
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "helpers.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static kiln_exec_stats stats_of(kiln_ctx *ctx) {
  kiln_exec_stats s;
  kiln_stats(ctx, &s);
  return s;
}

/* ---------------------------------------------------------------- data sets from host arrays */

Test(gpu_api, dataset_from_host_values_and_batches) {
  TH_GPU_CTX(ctx);
  enum { N = 20, H = 3, W = 2, C = 3, F = H * W * C };
  uint8_t px[N * F];
  int32_t lab[N];
  th_rng r = {.s = 5};
  for (int i = 0; i < N * F; i++)
    px[i] = (uint8_t)th_rng_below(&r, 256);
  for (int i = 0; i < N; i++)
    lab[i] = (i * 7) % 10;
  float mean[C] = {0.5f, 0.25f, 0.75f}, std[C] = {0.2f, 0.3f, 0.4f};
  kiln_dataset *ds = kiln_dataset_from_host(
      ctx, KILN_HOST_U8, KILN_SHAPE(N, H, W, C), px, (kiln_host_labels){.i32 = lab, .classes = 10},
      &(kiln_normalize){.channels = C, .mean = mean, .std = std});
  cr_assert_not_null(ds, "%s", th_err(ctx));
  memset(px, 0, sizeof px); /* copied: the caller's arrays are free again */
  memset(lab, 0, sizeof lab);
  th_rng r2 = {.s = 5};
  double want[N * F];
  for (int i = 0; i < N * F; i++) {
    uint8_t p = (uint8_t)th_rng_below(&r2, 256);
    want[i] = ((double)p / 255.0 - mean[i % C]) / std[i % C];
  }
  float *got = th_read(kiln_dataset_images(ds));
  th_assert_close(got, want, N * F, 1e-5, 1e-6, "normalised images");
  int32_t *gl = th_read_i32(kiln_dataset_labels(ds));
  for (int i = 0; i < N; i++)
    cr_assert_eq(gl[i], (i * 7) % 10, "label %d", i);
  /* in order, the loader's batches are the rows, in the images' shape */
  kiln_loader *l = kiln_loader_new(ds, &(kiln_loader_options){.batch = 8});
  cr_assert_not_null(l, "%s", th_err(ctx));
  for (int b = 0; b < 3; b++) {
    kiln_step_begin(ctx);
    kiln_tensor *x, *y;
    cr_assert(kiln_loader_next(l, &x, &y), "batch %d: %s", b, th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    int rows = b < 2 ? 8 : N - 16;
    cr_assert_eq(kiln_tensor_dim(x, 0), rows);
    cr_assert_eq(kiln_tensor_ndim(x), 4);
    float *xb = th_read(x);
    int32_t *yb = th_read_i32(y);
    for (int k = 0; k < rows * F; k++)
      cr_assert_eq(xb[k], got[b * 8 * F + k], "batch %d value %d", b, k);
    for (int k = 0; k < rows; k++)
      cr_assert_eq(yb[k], gl[b * 8 + k]);
    free(xb);
    free(yb);
  }
  free(got);
  free(gl);
  kiln_loader_free(l);
  kiln_dataset_free(ds);
  th_ctx_free(ctx);
}

Test(gpu_api, dataset_from_host_equals_dataset_from_mnist) {
  TH_GPU_CTX(ctx);
  enum { N = 12, R = 4, CO = 5 };
  uint8_t img[N * R * CO], lab8[N];
  for (int i = 0; i < N * R * CO; i++)
    img[i] = (uint8_t)(i * 53 + 11);
  for (int i = 0; i < N; i++)
    lab8[i] = (uint8_t)((i * 7) % 10);
  kiln_mnist m = {.n = N, .rows = R, .cols = CO, .images = img, .labels = lab8};
  float mean = 0.1307f, std = 0.3081f;
  kiln_dataset *a = kiln_dataset_from_mnist(ctx, &m, mean, std);
  /* the same pixels and the reader's uint8 labels from host arrays, as they are */
  kiln_host_labels labels = {.u8 = lab8, .classes = 10};
  kiln_dataset *b =
      kiln_dataset_from_host(ctx, KILN_HOST_U8, KILN_SHAPE(N, R, CO, 1), img, labels,
                             &(kiln_normalize){.channels = 1, .mean = &mean, .std = &std});
  /* normalised by their own statistics: computed by the host route, and by kiln_dataset_from_mnist
   * given NAN */
  kiln_dataset *c = kiln_dataset_from_host(ctx, KILN_HOST_U8, KILN_SHAPE(N, R, CO, 1), img, labels,
                                           &(kiln_normalize){.channels = 1, .from_data = 1});
  kiln_dataset *c2 = kiln_dataset_from_mnist(ctx, &m, NAN, NAN);
  cr_assert(a && b && c && c2, "%s", th_err(ctx));
  cr_assert(kiln_tensor_ndim(kiln_dataset_images(a)) == 4 &&
                kiln_tensor_dim(kiln_dataset_images(a), 3) == 1,
            "image-shaped, (N, rows, cols, 1)");
  float *va = th_read(kiln_dataset_images(a)), *vb = th_read(kiln_dataset_images(b));
  cr_assert(memcmp(va, vb, sizeof(float) * N * R * CO) == 0, "not the same values");
  for (int i = 0; i < N * R * CO; i++) {
    double want = ((double)img[i] / 255.0 - mean) / std;
    cr_assert(fabs(va[i] - want) <= 1e-5 * fabs(want) + 1e-6, "value %d: %g, want %g", i, va[i],
              want);
  }
  int32_t *la = th_read_i32(kiln_dataset_labels(a)), *lb = th_read_i32(kiln_dataset_labels(b));
  for (int i = 0; i < N; i++)
    cr_assert(la[i] == lab8[i] && lb[i] == lab8[i], "label %d: %d and %d, want %d", i, la[i], lb[i],
              lab8[i]);
  /* normalised by its own statistics, the set has mean 0 and std 1 */
  float *vc = th_read(kiln_dataset_images(c)), *vc2 = th_read(kiln_dataset_images(c2));
  cr_assert(memcmp(vc, vc2, sizeof(float) * N * R * CO) == 0, "NAN and from_data differ");
  double s = 0, s2 = 0;
  for (int i = 0; i < N * R * CO; i++) {
    s += vc[i];
    s2 += (double)vc[i] * vc[i];
  }
  cr_assert_float_eq(s / (N * R * CO), 0.0, 1e-5);
  cr_assert_float_eq(sqrt(s2 / (N * R * CO)), 1.0, 1e-5);
  /* floats as they are */
  float f[N * 3];
  for (int i = 0; i < N * 3; i++)
    f[i] = (float)i * 0.5f - 4.f;
  kiln_dataset *d = kiln_dataset_from_host(ctx, KILN_HOST_F32, KILN_SHAPE(N, 3), f, labels, NULL);
  cr_assert_not_null(d, "%s", th_err(ctx));
  float *vd = th_read(kiln_dataset_images(d));
  cr_assert(memcmp(vd, f, sizeof f) == 0);
  free(va);
  free(vb);
  free(vc);
  free(vc2);
  free(vd);
  free(la);
  free(lb);
  kiln_dataset_free(a);
  kiln_dataset_free(b);
  kiln_dataset_free(c);
  kiln_dataset_free(c2);
  kiln_dataset_free(d);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- host copies */

Test(gpu_api, copies_into_an_input_keep_a_graph_step_whole) {
  TH_GPU_CTX(ctx);
  enum { B = 16, F = 24, STEPS = 6 };
  float *wh;
  kiln_tensor *w = th_rand(ctx, KILN_SHAPE(F), 3, -1.f, 1.f, &wh);
  kiln_tensor *x = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(B, F));
  cr_assert_not_null(x, "%s", th_err(ctx));
  float xs[B * F];
  kiln_exec_stats s0 = stats_of(ctx);
  for (int step = 0; step < STEPS; step++) {
    th_fill(xs, B * F, 100 + (uint64_t)step, -2.f, 2.f);
    double want = 0;
    for (int i = 0; i < B * F; i++)
      want += (double)xs[i] * wh[i % F];
    kiln_step_begin(ctx);
    cr_assert_eq(kiln_tensor_copy_from_host(x, xs, sizeof xs), KILN_OK, "%s", th_err(ctx));
    memset(xs, 0xff, sizeof xs); /* NaNs: the copy has its own copy of the data */
    kiln_tensor *y = kiln_sum(kiln_mul(x, w), KILN_ALL_AXES, 0);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "step %d: %s", step, th_err(ctx));
    cr_assert_float_eq(kiln_tensor_item(y), want, 1e-4 * (1 + fabs(want)), "step %d", step);
  }
  kiln_exec_stats s1 = stats_of(ctx);
  cr_assert_eq(s1.graph_captures - s0.graph_captures, 1, "one capture");
  cr_assert_eq(s1.graph_replays - s0.graph_replays, STEPS - 1, "every later step replayed");
  cr_assert_eq(s1.eager_steps - s0.eager_steps, 0, "the copies split no step");
  free(wh);
  kiln_tensor_free(w);
  kiln_tensor_free(x);
  th_ctx_free(ctx);
}

Test(gpu_api, a_copy_after_recorded_ops_comes_after_them) {
  for (int graphs = 0; graphs < 2; graphs++) {
    TH_GPU_CTX(ctx);
    kiln_set_graphs(ctx, graphs);
    float old[5] = {1, 2, 3, 4, 5}, neu[5] = {10, 20, 30, 40, 50};
    kiln_tensor *x = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(5), old);
    cr_assert_not_null(x, "%s", th_err(ctx));
    kiln_step_begin(ctx);
    kiln_tensor *y = kiln_mul_scalar(x, 2.f);
    cr_assert_eq(kiln_tensor_copy_from_host(x, neu, sizeof neu), KILN_OK, "%s", th_err(ctx));
    kiln_tensor *z = kiln_mul_scalar(x, 3.f);
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "%s", th_err(ctx));
    float *yv = th_read(y), *zv = th_read(z);
    for (int i = 0; i < 5; i++) {
      cr_assert_eq(yv[i], 2 * old[i], "graphs %d: y[%d] %g read the new x", graphs, i, yv[i]);
      cr_assert_eq(zv[i], 3 * neu[i], "graphs %d: z[%d] %g", graphs, i, zv[i]);
    }
    free(yv);
    free(zv);
    kiln_tensor_free(x);
    th_ctx_free(ctx);
  }
}

/* A gate a host function on the stream waits at (at most 5 s): the stream is blocked until the
 * test opens it. */
typedef struct gate {
  int open, left;
} gate;

static void CUDART_CB wait_at_gate(void *p) {
  gate *g = p;
  for (int i = 0; i < 5000 && !__atomic_load_n(&g->open, __ATOMIC_ACQUIRE); i++)
    usleep(1000);
  __atomic_store_n(&g->left, 1, __ATOMIC_RELEASE);
}

Test(gpu_api, a_copy_does_not_wait_for_the_device) {
  TH_GPU_CTX(ctx);
  enum { T = 4, M = 3000 };
  kiln_tensor *t[T];
  static float host[T][M];
  memset(host, 0, sizeof host);
  for (int k = 0; k < T; k++) {
    t[k] = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(M));
    cr_assert_not_null(t[k], "%s", th_err(ctx));
  }
  /* every staging buffer is made first: what is measured is the copy, not an allocation */
  for (int k = 0; k < 16; k++)
    cr_assert_eq(kiln_tensor_copy_from_host(t[k % T], host[0], sizeof host[0]), KILN_OK);
  cr_assert_eq(kiln_sync(ctx), KILN_OK, "%s", th_err(ctx));
  gate g = {0, 0};
  cr_assert_eq(cudaLaunchHostFunc((cudaStream_t)kiln_ctx_stream(ctx), wait_at_gate, &g),
               cudaSuccess);
  double t0 = now_s();
  for (int k = 0; k < T; k++) {
    th_fill(host[k], M, 7 + (uint64_t)k, -1.f, 1.f);
    cr_assert_eq(kiln_tensor_copy_from_host(t[k], host[k], sizeof host[k]), KILN_OK, "%s",
                 th_err(ctx));
  }
  double took = now_s() - t0;
  int left = __atomic_load_n(&g.left, __ATOMIC_ACQUIRE);
  __atomic_store_n(&g.open, 1, __ATOMIC_RELEASE);
  cr_assert_eq(left, 0, "the copies waited for the blocked stream (%.3f s)", took);
  cr_assert_lt(took, 2.0, "%d copies took %.3f s", T, took);
  for (int k = 0; k < T; k++) {
    float *v = th_read(t[k]);
    float want[M];
    th_fill(want, M, 7 + (uint64_t)k, -1.f, 1.f);
    cr_assert(memcmp(v, want, sizeof want) == 0, "tensor %d", k);
    free(v);
    kiln_tensor_free(t[k]);
  }
  th_ctx_free(ctx);
}

Test(gpu_api, large_and_many_copies_arrive_whole) {
  TH_GPU_CTX(ctx);
  /* 20 MiB: more than one staging chunk */
  const int64_t big = 5 << 20;
  float *h = malloc((size_t)big * sizeof *h);
  cr_assert_not_null(h);
  th_fill(h, big, 11, -3.f, 3.f);
  kiln_tensor *b = kiln_tensor_from_host(ctx, KILN_DTYPE_F32, KILN_SHAPE(big), h);
  cr_assert_not_null(b, "%s", th_err(ctx));
  /* many small copies round the ring of staging buffers, from one reused host buffer */
  enum { K = 40, M = 777 };
  kiln_tensor *s[K];
  float buf[M];
  for (int k = 0; k < K; k++) {
    s[k] = kiln_tensor_new(ctx, KILN_DTYPE_F32, KILN_SHAPE(M));
    cr_assert_not_null(s[k], "%s", th_err(ctx));
    th_fill(buf, M, 1000 + (uint64_t)k, 0.f, 1.f);
    cr_assert_eq(kiln_tensor_copy_from_host(s[k], buf, sizeof buf), KILN_OK, "%s", th_err(ctx));
  }
  float *got = th_read(b);
  cr_assert(memcmp(got, h, (size_t)big * sizeof *h) == 0, "the large copy");
  free(got);
  for (int k = 0; k < K; k++) {
    float *v = th_read(s[k]);
    th_fill(buf, M, 1000 + (uint64_t)k, 0.f, 1.f);
    cr_assert(memcmp(v, buf, sizeof buf) == 0, "small copy %d", k);
    free(v);
    kiln_tensor_free(s[k]);
  }
  free(h);
  kiln_tensor_free(b);
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- one-cycle momentum */

#define NP 29 /* parameter elements */

/* torch's OneCycleLR, two phases, cosine: the rate and the momentum of step t. */
static void torch_one_cycle(double max_lr, int total, int t, double *lr, double *mom) {
  double up = 0.3 * total - 1, last = total - 1, lo = max_lr / 25, end = lo / 1e4;
  double a0, a1, m0, m1, pct;
  if (t <= up) {
    pct = t / up, a0 = lo, a1 = max_lr, m0 = 0.95, m1 = 0.85;
  } else {
    pct = (t - up) / (last - up), a0 = max_lr, a1 = end, m0 = 0.85, m1 = 0.95;
  }
  *lr = a1 + (a0 - a1) / 2 * (cos(M_PI * pct) + 1);
  *mom = m1 + (m0 - m1) / 2 * (cos(M_PI * pct) + 1);
}

/* Ten steps of Adam (adam 1) or SGD with Nesterov momentum (adam 0) under a one-cycle schedule
 * that cycles beta1 or the momentum, against float64 transcriptions of torch's rules. The loss is
 * sum(p * w) + 0.5 sum(q p^2), whose gradient is w + q p. */
static void check_one_cycle(int adam) {
  TH_GPU_CTX(ctx);
  float *ph, *wh, *qh;
  kiln_tensor *p = th_rand(ctx, KILN_SHAPE(NP), 1, -1.f, 1.f, &ph);
  kiln_tensor *w = th_rand(ctx, KILN_SHAPE(NP), 2, -1.f, 1.f, &wh);
  kiln_tensor *q = th_rand(ctx, KILN_SHAPE(NP), 3, 0.1f, 1.f, &qh);
  kiln_params *params = kiln_params_new(ctx);
  cr_assert_eq(kiln_params_add(params, "p", p), KILN_OK);
  const int total = 10;
  const double max_lr = adam ? 0.05 : 0.1;
  kiln_optim *o = adam ? kiln_adam_new(params, &(kiln_adam_options){.beta2 = 0.99f})
                       : kiln_sgd_new(params, &(kiln_sgd_options){.momentum = 0.9f, .nesterov = 1});
  cr_assert_not_null(o, "%s", th_err(ctx));
  kiln_optim_set_schedule(o, &(kiln_schedule){.kind = KILN_SCHEDULE_ONE_CYCLE,
                                              .base_lr = (float)max_lr,
                                              .total_steps = total});
  th_assert_ok(ctx);
  double X[NP], M1[NP] = {0}, M2[NP] = {0};
  for (int i = 0; i < NP; i++)
    X[i] = ph[i];
  for (int t = 0; t < total; t++) {
    kiln_step_begin(ctx);
    kiln_optim_zero_grad(o);
    kiln_tensor *loss =
        kiln_add(kiln_sum(kiln_mul(p, w), KILN_ALL_AXES, 0),
                 kiln_mul_scalar(kiln_sum(kiln_mul(q, kiln_mul(p, p)), KILN_ALL_AXES, 0), 0.5f));
    cr_assert_eq(kiln_backward(loss), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_optim_step(o), KILN_OK, "%s", th_err(ctx));
    cr_assert_eq(kiln_step_end(ctx), KILN_OK, "step %d: %s", t, th_err(ctx));
    double lr, mom;
    torch_one_cycle(max_lr, total, t, &lr, &mom);
    cr_assert_float_eq(kiln_optim_lr(o), lr, 1e-6 * lr);
    for (int i = 0; i < NP; i++) {
      double g = wh[i] + qh[i] * X[i];
      if (adam) {
        M1[i] = mom * M1[i] + (1 - mom) * g;
        M2[i] = 0.99 * M2[i] + 0.01 * g * g;
        double bc1 = 1 - pow(mom, t + 1), bc2 = 1 - pow(0.99, t + 1);
        X[i] -= lr / bc1 * M1[i] / (sqrt(M2[i]) / sqrt(bc2) + 1e-8);
      } else {
        M1[i] = t == 0 ? g : mom * M1[i] + g;
        X[i] -= lr * (g + mom * M1[i]);
      }
    }
  }
  float *got = th_read(p);
  th_assert_close(got, X, NP, 1e-5, 1e-4,
                  adam ? "adam, one-cycle beta1" : "sgd, one-cycle momentum");
  free(got);
  free(ph);
  free(wh);
  free(qh);
  kiln_optim_free(o);
  kiln_params_free(params);
  kiln_tensor_free(w);
  kiln_tensor_free(q);
  th_ctx_free(ctx);
}

Test(gpu_api, one_cycle_cycles_adams_beta1_as_torch) { check_one_cycle(1); }
Test(gpu_api, one_cycle_cycles_sgds_momentum_as_torch) { check_one_cycle(0); }
