/*
 * ref.h: the float64 host references the GPU tests check kiln against, built independently of
 * kiln: row-major shapes and index maps, NumPy broadcasting, the shapes and output indices of
 * reductions, a map of what each element of a chain of views (transpose, permute, slice, expand,
 * reshape) reads, op operands laid out as such views, random fills that are never all zeros, and
 * the upload, read-back, compare and gradient-check steps every op test takes.
 */
#ifndef KILN_TEST_REF_H
#define KILN_TEST_REF_H

#include "helpers.h"

/* ---------------------------------------------------------------- host memory */

/* malloc that asserts (n may be 0); float and double buffers of n elements. */
void *ref_malloc(size_t n);
float *ref_falloc(int64_t n);
double *ref_dalloc(int64_t n);

/* ---------------------------------------------------------------- shapes and indices */

int64_t ref_numel(kiln_shape s);
bool ref_shape_eq(kiln_shape a, kiln_shape b);
/* A negative axis counted from the end of ndim. */
int ref_norm_axis(int axis, int ndim);
/* Row-major coordinates c of linear index lin in s, and back. */
void ref_coords(kiln_shape s, int64_t lin, int64_t *c);
int64_t ref_linear(kiln_shape s, const int64_t *c);

/* NumPy broadcasting of n shapes into *out; false when they do not broadcast. */
bool ref_broadcast(int n, const kiln_shape *in, kiln_shape *out);
/* The linear index into a dense tensor of shape in that the output coordinate co reads. */
int64_t ref_broadcast_src(kiln_shape out, const int64_t *co, kiln_shape in);

/* ---------------------------------------------------------------- reductions */

/* The bit mask of the axes ax of an ndim tensor (none given: all of them). */
unsigned ref_axes_mask(kiln_axes ax, int ndim);
kiln_shape ref_reduced_shape(kiln_shape s, unsigned mask, int keepdim);
/* The output element (row-major over the kept axes) that input coordinate c reduces into. */
int64_t ref_reduced_index(kiln_shape s, unsigned mask, const int64_t *c);
/* "{0,2}" or "{all}", for messages. */
void ref_axes_str(kiln_axes ax, char *buf, size_t n);

/* ---------------------------------------------------------------- random inputs */

/* Uniform in [lo, hi); quant > 0 rounds to qoff + k * quant (ties between inputs); values are
 * kept at least margin away from each kink (so finite differences do not straddle it). */
typedef struct ref_gen {
  float lo, hi;
  float quant, qoff;
  int nkinks;
  float kinks[2];
  float margin;
} ref_gen;
#define REF_GEN(l, h) ((ref_gen){.lo = (l), .hi = (h)})

void ref_gen_fill(float *p, int64_t n, uint64_t seed, const ref_gen *g);
/* Distinct values 0.1 apart in a scrambled order (no ties, even after a 1e-2 perturbation). */
void ref_distinct_fill(float *p, int64_t n, uint64_t seed);

/* ---------------------------------------------------------------- device tensors */

/* Persistent tensors of the given values (asserted). */
kiln_tensor *ref_upload(kiln_ctx *ctx, kiln_shape s, const float *h);
kiln_tensor *ref_upload_i32(kiln_ctx *ctx, kiln_shape s, const int32_t *h);
void ref_set_grad(kiln_ctx *ctx, kiln_tensor *t);
/* A persistent f32 tensor of values from g; grad: it requires grad; host: a malloc'd copy. */
kiln_tensor *ref_rand_tensor(kiln_ctx *ctx, kiln_shape s, uint64_t seed, const ref_gen *g, int grad,
                             float **host);

/* The values of t (asserted f32 or i32), malloc'd; what names it in failure messages. */
float *ref_read_f32(kiln_ctx *ctx, kiln_tensor *t, const char *what);
int32_t *ref_read_i32(kiln_ctx *ctx, kiln_tensor *t, const char *what);
/* Asserts t is not NULL and has shape want. */
void ref_expect_shape(kiln_ctx *ctx, kiln_tensor *t, kiln_shape want, const char *what);
/* Asserts t has shape ws and f32 values within atol + rtol * |want| of want. */
void ref_expect_close(kiln_ctx *ctx, kiln_tensor *t, kiln_shape ws, const double *want, double atol,
                      double rtol, const char *what);
/* Asserts t has shape ws and exactly the i32 values want. */
void ref_expect_i32(kiln_ctx *ctx, kiln_tensor *t, kiln_shape ws, const int32_t *want,
                    const char *what);
/* Runs kiln_gradcheck with its defaults (eps 1e-2, atol 1e-2, rtol 1e-2) and asserts it passed. */
void ref_expect_gradcheck(kiln_ctx *ctx, const char *what, kiln_gradcheck_fn fn, int n,
                          kiln_tensor *const *in, void *user);

/* ---------------------------------------------------------------- chains of views */

typedef enum ref_vkind {
  REF_V_T,
  REF_V_PERMUTE,
  REF_V_SLICE,
  REF_V_EXPAND,
  REF_V_RESHAPE,
  REF_V_CONTIG
} ref_vkind;

/* One view step: REF_V_T (axis, axis1), REF_V_PERMUTE (order), REF_V_SLICE (axis, start, end,
 * step), REF_V_EXPAND / REF_V_RESHAPE (shape, -1 allowed), REF_V_CONTIG (kiln_contiguous). */
typedef struct ref_vstep {
  ref_vkind k;
  int axis, axis1;
  int64_t start, end, step;
  kiln_axes order;
  kiln_shape shape;
} ref_vstep;

#define REF_MAX_STEPS 3
typedef struct ref_vchain {
  int n;
  ref_vstep st[REF_MAX_STEPS];
} ref_vchain;

/* The chain applied to x with kiln's view ops (NULL stays NULL). */
kiln_tensor *ref_chain_apply(kiln_tensor *x, const ref_vchain *c);

/* The host side: idx[i] is the element of the base tensor that element i (row-major) of the
 * view of shape s reads. */
typedef struct ref_hmap {
  kiln_shape s;
  int64_t *idx; /* malloc'd */
} ref_hmap;
ref_hmap ref_chain_map(kiln_shape base, const ref_vchain *c);

/* ---------------------------------------------------------------- operands in several layouts */

typedef enum ref_layout { REF_PLAIN, REF_TRANS, REF_SLICE, REF_ROWS, REF_EXPAND } ref_layout;
/* "contiguous", "transposed", "sliced (last axis, step 2)", "sliced (rows, step 2)",
 * "expanded (axis 0)" */
const char *ref_layout_name(ref_layout l);
/* Whether a tensor of shape s can be laid out as l. */
int ref_layout_fits(kiln_shape s, ref_layout l);

/* An op input: a persistent base tensor, the view of it the op reads, and the view's values. */
typedef struct ref_opnd {
  kiln_tensor *base;
  float *host; /* the base's values */
  kiln_tensor *t;
  double *v; /* the view's values, row-major */
  kiln_shape s;
} ref_opnd;

/* An operand of shape s laid out as l, with values from g. */
ref_opnd ref_opnd_new(kiln_ctx *ctx, kiln_shape s, ref_layout l, uint64_t seed, const ref_gen *g);
void ref_opnd_free(ref_opnd *o);
/* "[4,3] transposed", for messages. */
void ref_opnd_desc(const ref_opnd *o, ref_layout l, char *buf, size_t n);

/* The forward check every elementwise unary op's test takes: fn(a, p) against ref(x, p) in float64
 * over inputs of several shapes and layouts (plain, transposed, sliced, row views, expanded),
 * values from fwd, seeds from seed on; atol and rtol 0 mean 1e-5. Each input in its own step. */
typedef kiln_tensor *(*ref_unary_fn)(kiln_tensor *a, const float *p);
typedef double (*ref_scalar_fn)(double x, const float *p);
void ref_check_unary_forward(kiln_ctx *ctx, const char *name, ref_unary_fn fn, ref_scalar_fn ref,
                             const float *p, const ref_gen *fwd, uint64_t seed, double atol,
                             double rtol);

#endif
