/*
 * test_gpu_ops_movement.c: the ops that copy data into a new layout on the GPU: concat of 2 and 3
 * inputs along every axis, from contiguous and viewed inputs, with its gradient slices; and
 * index_select of f32 and i32 rows, repeated indices included (out-of-range indices are errors,
 * tested in test_gpu_hardening).
 * Without a GPU every test skips, saying why.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"

/* ---------------------------------------------------------------- concat */

static void check_concat(kiln_ctx *ctx, int n, const kiln_shape *shapes, const ref_layout *lays,
                         int axis, uint64_t seed) {
  kiln_step_begin(ctx);
  ref_opnd o[4];
  kiln_tensor *ts[4];
  char what[1024], d[160];
  int ax = ref_norm_axis(axis, shapes[0].ndim);
  kiln_shape os = shapes[0];
  os.d[ax] = 0;
  size_t k = (size_t)snprintf(what, sizeof what, "concat along axis %d of", axis);
  for (int i = 0; i < n; i++) {
    o[i] = ref_opnd_new(ctx, shapes[i], lays[i], seed + (uint64_t)i, &REF_GEN(-2, 2));
    ts[i] = o[i].t;
    os.d[ax] += shapes[i].d[ax];
    ref_opnd_desc(&o[i], lays[i], d, sizeof d);
    if (k < sizeof what) k += (size_t)snprintf(what + k, sizeof what - k, "%s %s", i ? "," : "", d);
  }
  int64_t total = ref_numel(os), co[KILN_MAX_DIMS];
  double *want = ref_dalloc(total);
  for (int64_t i = 0; i < total; i++) {
    ref_coords(os, i, co);
    int j = 0;
    while (co[ax] >= shapes[j].d[ax])
      co[ax] -= shapes[j++].d[ax];
    want[i] = o[j].v[ref_linear(shapes[j], co)];
  }
  ref_expect_close(ctx, kiln_concat(n, ts, axis), os, want, 0, 0, what);
  free(want);
  for (int i = 0; i < n; i++)
    ref_opnd_free(&o[i]);
}

typedef struct cat_gc {
  int axis;
  int transpose_last; /* the last input is stored transposed and viewed back */
} cat_gc;

static kiln_tensor *gc_concat(kiln_tensor *const *in, void *user) {
  const cat_gc *u = user;
  kiln_tensor *ts[4];
  int n = 0;
  for (; n < 4 && in[n]; n++)
    ts[n] = in[n];
  if (u->transpose_last) ts[n - 1] = kiln_transpose(ts[n - 1], 0, 1);
  return kiln_concat(n, ts, u->axis);
}

Test(gpu_ops, concat) {
  TH_GPU_CTX_EAGER(ctx);
  struct {
    int n, axis;
    kiln_shape s[3];
  } cases[] = {
      {.n = 2, .axis = 0, .s = {KILN_SHAPE(2, 3), KILN_SHAPE(4, 3)}},
      {.n = 3, .axis = 0, .s = {KILN_SHAPE(2, 3), KILN_SHAPE(1, 3), KILN_SHAPE(3, 3)}},
      {.n = 2, .axis = 1, .s = {KILN_SHAPE(2, 3), KILN_SHAPE(2, 5)}},
      {.n = 3, .axis = 1, .s = {KILN_SHAPE(2, 1), KILN_SHAPE(2, 3), KILN_SHAPE(2, 2)}},
      {.n = 2, .axis = -1, .s = {KILN_SHAPE(3, 2), KILN_SHAPE(3, 4)}},
      {.n = 2, .axis = 1, .s = {KILN_SHAPE(2, 3, 4), KILN_SHAPE(2, 1, 4)}},
      {.n = 3, .axis = 0, .s = {KILN_SHAPE(40, 33), KILN_SHAPE(7, 33), KILN_SHAPE(20, 33)}},
  };
  ref_layout mixes[][3] = {{REF_PLAIN, REF_PLAIN, REF_PLAIN},
                           {REF_TRANS, REF_SLICE, REF_EXPAND},
                           {REF_ROWS, REF_TRANS, REF_SLICE}};
  uint64_t seed = 1700;
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    for (size_t m = 0; m < sizeof mixes / sizeof *mixes; m++) {
      ref_layout l[3];
      for (int j = 0; j < 3; j++)
        l[j] =
            j < cases[i].n && ref_layout_fits(cases[i].s[j], mixes[m][j]) ? mixes[m][j] : REF_PLAIN;
      check_concat(ctx, cases[i].n, cases[i].s, l, cases[i].axis, seed);
      seed += 4;
    }
  /* gradients: each input gets its own slice of the output's gradient */
  struct {
    int n, axis, tlast;
    kiln_shape s[3]; /* stored shapes */
    const char *desc;
  } gcases[] = {
      {.n = 2, .axis = 0, .s = {KILN_SHAPE(2, 3), KILN_SHAPE(1, 3)}, .desc = "[2,3], [1,3]"},
      {.n = 3,
       .axis = 0,
       .s = {KILN_SHAPE(2, 3), KILN_SHAPE(1, 3), KILN_SHAPE(2, 3)},
       .desc = "[2,3], [1,3], [2,3]"},
      {.n = 2, .axis = 1, .s = {KILN_SHAPE(2, 3), KILN_SHAPE(2, 2)}, .desc = "[2,3], [2,2]"},
      {.n = 3,
       .axis = 1,
       .s = {KILN_SHAPE(2, 1), KILN_SHAPE(2, 3), KILN_SHAPE(2, 2)},
       .desc = "[2,1], [2,3], [2,2]"},
      {.n = 2,
       .axis = 1,
       .tlast = 1,
       .s = {KILN_SHAPE(3, 2), KILN_SHAPE(2, 3)},
       .desc = "[3,2], [3,2] (transposed view)"},
  };
  char what[1024];
  for (size_t i = 0; i < sizeof gcases / sizeof *gcases; i++) {
    kiln_tensor *in[4] = {NULL, NULL, NULL, NULL};
    for (int j = 0; j < gcases[i].n; j++)
      in[j] = ref_rand_tensor(ctx, gcases[i].s[j], 1800 + 4 * i + (uint64_t)j, &REF_GEN(-2, 2), 1,
                              NULL);
    cat_gc u = {.axis = gcases[i].axis, .transpose_last = gcases[i].tlast};
    snprintf(what, sizeof what, "concat along axis %d of %s", gcases[i].axis, gcases[i].desc);
    ref_expect_gradcheck(ctx, what, gc_concat, gcases[i].n, in, &u);
    for (int j = 0; j < gcases[i].n; j++)
      kiln_tensor_free(in[j]);
  }
  th_ctx_free(ctx);
}

/* ---------------------------------------------------------------- index_select */

static void check_index_select(kiln_ctx *ctx, kiln_shape s, ref_layout l, const int32_t *idx,
                               int64_t k, uint64_t seed) {
  kiln_step_begin(ctx);
  ref_opnd a = ref_opnd_new(ctx, s, l, seed, &REF_GEN(-2, 2));
  kiln_tensor *it = ref_upload_i32(ctx, KILN_SHAPE(k), idx);
  int64_t rows = s.d[0], row = rows ? ref_numel(s) / rows : 0;
  for (int64_t i = 0; i < k; i++)
    cr_assert(idx[i] >= 0 && idx[i] < rows, "index %lld of the test is out of range", (long long)i);
  kiln_shape os = s;
  os.d[0] = k;
  double *want = ref_dalloc(k * row);
  for (int64_t i = 0; i < k; i++)
    for (int64_t j = 0; j < row; j++)
      want[i * row + j] = a.v[idx[i] * row + j]; /* out-of-range rows: test_gpu_hardening */
  char what[1024], d[160];
  ref_opnd_desc(&a, l, d, sizeof d);
  snprintf(what, sizeof what, "index_select of %lld rows (with repeats) from %s", (long long)k, d);
  ref_expect_close(ctx, kiln_index_select(a.t, it), os, want, 0, 0, what);
  free(want);
  kiln_tensor_free(it);
  ref_opnd_free(&a);
}

Test(gpu_ops, index_select) {
  TH_GPU_CTX_EAGER(ctx);
  int32_t idx1[] = {4, 0, 0, 3, 1, 2};
  check_index_select(ctx, KILN_SHAPE(5, 3), REF_PLAIN, idx1, 6, 1900);
  check_index_select(ctx, KILN_SHAPE(5, 3), REF_TRANS, idx1, 6, 1901);
  check_index_select(ctx, KILN_SHAPE(5, 3), REF_SLICE, idx1, 6, 1902);
  int32_t idx2[] = {3, 1, 0, 3};
  check_index_select(ctx, KILN_SHAPE(4, 2, 3), REF_PLAIN, idx2, 4, 1903);
  int32_t idx3[] = {9, 0};
  check_index_select(ctx, KILN_SHAPE(10), REF_PLAIN, idx3, 2, 1904);
  /* an i32 table */
  kiln_step_begin(ctx);
  int32_t tab[] = {10, 11, 20, 21, 30, 31, 40, 41, 50, 51};
  int32_t pick[] = {2, 4, 0, 4};
  int32_t want[] = {30, 31, 50, 51, 10, 11, 50, 51};
  kiln_tensor *t = ref_upload_i32(ctx, KILN_SHAPE(5, 2), tab);
  kiln_tensor *p = ref_upload_i32(ctx, KILN_SHAPE(4), pick);
  ref_expect_i32(ctx, kiln_index_select(t, p), KILN_SHAPE(4, 2), want,
                 "index_select of rows {2,4,0,4} from an i32 [5,2] table");
  kiln_tensor_free(t);
  kiln_tensor_free(p);
  th_ctx_free(ctx);
}
