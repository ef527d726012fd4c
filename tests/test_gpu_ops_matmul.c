/*
 * test_gpu_ops_matmul.c: matrix products on the GPU with TF32 off: 2-D, batched and with a
 * broadcast batch, each operand contiguous or a transposed, row-sliced, column-sliced or expanded
 * view, against float64 references; gradients against central finite differences.
 * Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"

/* ---------------------------------------------------------------- matmul */

/* C = A B for (M,K) x (K,N), (B,M,K) x (B,K,N), (B,M,K) x (K,N), a batch of 1 broadcasting. */
static kiln_shape mm_ref(const double *a, kiln_shape as, const double *b, kiln_shape bs,
                         double *c) {
  int64_t m = as.d[as.ndim - 2], k = as.d[as.ndim - 1], n = bs.d[bs.ndim - 1];
  int64_t ba = as.ndim == 3 ? as.d[0] : 1, bb = bs.ndim == 3 ? bs.d[0] : 1;
  int64_t batch = ba > bb ? ba : bb;
  for (int64_t t = 0; t < batch; t++) {
    const double *pa = a + (ba == 1 ? 0 : t) * m * k, *pb = b + (bb == 1 ? 0 : t) * k * n;
    for (int64_t i = 0; i < m; i++)
      for (int64_t j = 0; j < n; j++) {
        double s = 0;
        for (int64_t q = 0; q < k; q++)
          s += pa[i * k + q] * pb[q * n + j];
        c[t * m * n + i * n + j] = s;
      }
  }
  if (as.ndim == 3 || bs.ndim == 3) return KILN_SHAPE(batch, m, n);
  return KILN_SHAPE(m, n);
}

static void check_mm(kiln_ctx *ctx, kiln_shape as, ref_layout la, kiln_shape bs, ref_layout lb,
                     uint64_t seed) {
  kiln_step_begin(ctx);
  ref_opnd A = ref_opnd_new(ctx, as, la, seed, &REF_GEN(-1, 1));
  ref_opnd B = ref_opnd_new(ctx, bs, lb, seed + 1, &REF_GEN(-1, 1));
  int64_t m = as.d[as.ndim - 2], n = bs.d[bs.ndim - 1];
  int64_t batch = (as.ndim == 3 ? as.d[0] : 1) > (bs.ndim == 3 ? bs.d[0] : 1)
                      ? (as.ndim == 3 ? as.d[0] : 1)
                      : (bs.ndim == 3 ? bs.d[0] : 1);
  double *want = ref_dalloc(batch * m * n);
  kiln_shape cs = mm_ref(A.v, as, B.v, bs, want);
  char what[1024], da[160], db[160];
  ref_opnd_desc(&A, la, da, sizeof da);
  ref_opnd_desc(&B, lb, db, sizeof db);
  snprintf(what, sizeof what, "matmul of %s x %s (TF32 off)", da, db);
  ref_expect_close(ctx, kiln_matmul(A.t, B.t), cs, want, 1e-4, 1e-4, what);
  free(want);
  ref_opnd_free(&A);
  ref_opnd_free(&B);
}

Test(gpu_ops, matmul_2d) {
  TH_GPU_CTX_EAGER(ctx);
  cr_assert_eq(kiln_tf32(ctx), 0, "TH_GPU_CTX must turn TF32 off");
  struct {
    kiln_shape a, b;
  } cases[] = {
      {.a = KILN_SHAPE(3, 5), .b = KILN_SHAPE(5, 4)},
      {.a = KILN_SHAPE(33, 70), .b = KILN_SHAPE(70, 17)},
      {.a = KILN_SHAPE(128, 784), .b = KILN_SHAPE(784, 16)},
      {.a = KILN_SHAPE(1, 5), .b = KILN_SHAPE(5, 4)},
      {.a = KILN_SHAPE(3, 5), .b = KILN_SHAPE(5, 1)},
  };
  ref_layout pairs[][2] = {{REF_PLAIN, REF_PLAIN}, {REF_TRANS, REF_PLAIN}, {REF_PLAIN, REF_TRANS},
                           {REF_TRANS, REF_TRANS}, {REF_ROWS, REF_PLAIN},  {REF_PLAIN, REF_ROWS},
                           {REF_SLICE, REF_PLAIN}, {REF_PLAIN, REF_SLICE}, {REF_EXPAND, REF_PLAIN}};
  uint64_t seed = 900;
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    for (size_t p = 0; p < sizeof pairs / sizeof *pairs; p++) {
      if (!ref_layout_fits(cases[i].a, pairs[p][0]) || !ref_layout_fits(cases[i].b, pairs[p][1]))
        continue;
      check_mm(ctx, cases[i].a, pairs[p][0], cases[i].b, pairs[p][1], seed);
      seed += 2;
    }
  th_ctx_free(ctx);
}

Test(gpu_ops, matmul_batched) {
  TH_GPU_CTX_EAGER(ctx);
  struct {
    kiln_shape a, b;
    ref_layout la, lb;
  } cases[] = {
      /* (B,M,K) x (B,K,N) */
      {.a = KILN_SHAPE(3, 7, 9), .b = KILN_SHAPE(3, 9, 5)},
      {.a = KILN_SHAPE(3, 7, 9), .b = KILN_SHAPE(3, 9, 5), .la = REF_TRANS},
      {.a = KILN_SHAPE(3, 7, 9), .b = KILN_SHAPE(3, 9, 5), .lb = REF_TRANS},
      {.a = KILN_SHAPE(3, 7, 9), .b = KILN_SHAPE(3, 9, 5), .la = REF_TRANS, .lb = REF_TRANS},
      {.a = KILN_SHAPE(3, 7, 9), .b = KILN_SHAPE(3, 9, 5), .la = REF_ROWS, .lb = REF_ROWS},
      {.a = KILN_SHAPE(3, 7, 9), .b = KILN_SHAPE(3, 9, 5), .la = REF_EXPAND},
      {.a = KILN_SHAPE(3, 7, 9), .b = KILN_SHAPE(3, 9, 5), .lb = REF_EXPAND},
      {.a = KILN_SHAPE(3, 7, 9), .b = KILN_SHAPE(3, 9, 5), .la = REF_SLICE, .lb = REF_SLICE},
      {.a = KILN_SHAPE(2, 40, 300), .b = KILN_SHAPE(2, 300, 24), .la = REF_TRANS},
      /* (B,M,K) x (K,N) */
      {.a = KILN_SHAPE(4, 6, 8), .b = KILN_SHAPE(8, 3)},
      {.a = KILN_SHAPE(4, 6, 8), .b = KILN_SHAPE(8, 3), .la = REF_TRANS, .lb = REF_TRANS},
      {.a = KILN_SHAPE(4, 6, 8), .b = KILN_SHAPE(8, 3), .la = REF_ROWS},
      {.a = KILN_SHAPE(4, 6, 8), .b = KILN_SHAPE(8, 3), .la = REF_EXPAND, .lb = REF_SLICE},
      /* a batch of 1 broadcasts */
      {.a = KILN_SHAPE(1, 5, 6), .b = KILN_SHAPE(3, 6, 4)},
      {.a = KILN_SHAPE(1, 5, 6), .b = KILN_SHAPE(3, 6, 4), .la = REF_TRANS, .lb = REF_TRANS},
      {.a = KILN_SHAPE(3, 5, 6), .b = KILN_SHAPE(1, 6, 4)},
      {.a = KILN_SHAPE(3, 5, 6), .b = KILN_SHAPE(1, 6, 4), .la = REF_TRANS, .lb = REF_TRANS},
  };
  uint64_t seed = 1000;
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    check_mm(ctx, cases[i].a, cases[i].la, cases[i].b, cases[i].lb, seed);
    seed += 2;
  }
  th_ctx_free(ctx);
}

typedef struct mm_gc {
  int ta, tb; /* the input is stored transposed and viewed back through kiln_transpose */
} mm_gc;

static kiln_tensor *gc_matmul(kiln_tensor *const *in, void *user) {
  const mm_gc *u = user;
  kiln_tensor *a = u->ta ? kiln_transpose(in[0], -1, -2) : in[0];
  kiln_tensor *b = u->tb ? kiln_transpose(in[1], -1, -2) : in[1];
  return kiln_matmul(a, b);
}

Test(gpu_ops, matmul_grad) {
  TH_GPU_CTX_EAGER(ctx);
  /* stored shapes: a transposed input is stored with its last two dims swapped */
  struct {
    kiln_shape a, b;
    int ta, tb;
    const char *desc;
  } cases[] = {
      {.a = KILN_SHAPE(3, 4), .b = KILN_SHAPE(4, 2), .desc = "[3,4] x [4,2]"},
      {.a = KILN_SHAPE(4, 3), .b = KILN_SHAPE(4, 2), .ta = 1, .desc = "[3,4]^T view x [4,2]"},
      {.a = KILN_SHAPE(3, 4), .b = KILN_SHAPE(2, 4), .tb = 1, .desc = "[3,4] x [4,2]^T view"},
      {.a = KILN_SHAPE(4, 3),
       .b = KILN_SHAPE(2, 4),
       .ta = 1,
       .tb = 1,
       .desc = "[3,4]^T view x [4,2]^T view"},
      {.a = KILN_SHAPE(2, 3, 4), .b = KILN_SHAPE(2, 4, 2), .desc = "[2,3,4] x [2,4,2]"},
      {.a = KILN_SHAPE(2, 4, 3),
       .b = KILN_SHAPE(2, 2, 4),
       .ta = 1,
       .tb = 1,
       .desc = "[2,3,4]^T view x [2,4,2]^T view"},
      {.a = KILN_SHAPE(2, 3, 4), .b = KILN_SHAPE(4, 2), .desc = "[2,3,4] x [4,2]"},
      {.a = KILN_SHAPE(2, 4, 3), .b = KILN_SHAPE(4, 2), .ta = 1, .desc = "[2,3,4]^T view x [4,2]"},
      {.a = KILN_SHAPE(1, 3, 4), .b = KILN_SHAPE(2, 4, 2), .desc = "[1,3,4] x [2,4,2]"},
      {.a = KILN_SHAPE(2, 3, 4), .b = KILN_SHAPE(1, 4, 2), .desc = "[2,3,4] x [1,4,2]"},
  };
  char what[1024];
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    kiln_tensor *in[2] = {ref_rand_tensor(ctx, cases[i].a, 1100 + i, &REF_GEN(-1, 1), 1, NULL),
                          ref_rand_tensor(ctx, cases[i].b, 1120 + i, &REF_GEN(-1, 1), 1, NULL)};
    mm_gc u = {.ta = cases[i].ta, .tb = cases[i].tb};
    snprintf(what, sizeof what, "matmul of %s", cases[i].desc);
    ref_expect_gradcheck(ctx, what, gc_matmul, 2, in, &u);
    kiln_tensor_free(in[0]);
    kiln_tensor_free(in[1]);
  }
  th_ctx_free(ctx);
}

/* KILN_DEBUG=initcheck (every product on cuBLAS zeroes its output first, for compute-sanitizer's
 * initcheck) changes no product: 2-D and batched, plain and transposed operands, against float64
 * as without it. */
Test(gpu_ops, matmul_outputs_zeroed_first_for_initcheck) {
  const char *was = getenv("KILN_DEBUG");
  char *saved = was ? strdup(was) : NULL;
  setenv("KILN_DEBUG", "initcheck,verify", 1); /* read when the context is made */
  TH_GPU_CTX_EAGER(ctx);
  if (saved)
    setenv("KILN_DEBUG", saved, 1);
  else
    unsetenv("KILN_DEBUG");
  free(saved);
  ref_layout pairs[][2] = {{REF_PLAIN, REF_PLAIN}, {REF_TRANS, REF_TRANS}};
  for (size_t p = 0; p < 2; p++) {
    check_mm(ctx, KILN_SHAPE(33, 70), pairs[p][0], KILN_SHAPE(70, 17), pairs[p][1], 990 + 2 * p);
    check_mm(ctx, KILN_SHAPE(3, 9, 70), pairs[p][0], KILN_SHAPE(3, 70, 17), pairs[p][1],
             994 + 2 * p);
  }
  th_ctx_free(ctx);
}
