/*
 * kargs.cuh: the one argument every generated kernel takes. This file is C (the host includes it
 * through fusion/fusion.h) and CUDA C++ (NVRTC compiles it into every kernel): one definition,
 * and KILN__KARGS_BYTES pins its size on both sides.
 */
#ifndef KILN_KARGS_CUH
#define KILN_KARGS_CUH

#define KILN__KMAX_PTR 24    /* operands of a generated kernel (each with strides) */
#define KILN__KMAX_UPDATE 24 /* pointers of a multi-tensor update (tensors x inputs) */
#define KILN__KMAX_F 16      /* float attributes a kernel reads */
#define KILN__KMAX_I 8       /* int attributes */
#define KILN__KMAX_U 4       /* 64-bit attributes */
#define KILN__KMAX_DIMS 6    /* = KILN_MAX_DIMS */

/* ptr: operands; n: elements in the iteration space; shape: its dims; st: each operand's strides
 * (elements) over those dims; rshape: the reduced dims of a reduction; nred: elements reduced into
 * each output; i: int attributes (structure: the same every step); fv, uv: where the kernel reads
 * its float and 64-bit attributes, the group's block of the step values on the device, written
 * before every run or replay (per-step values are never baked into a launch or a graph). */
/* The first bad value a kernel met (an out-of-range label or row index), written on the device
 * and read by the host at its next synchronisation (fusion/exec.c). code 0: none. */
typedef struct kiln__dev_error {
  int code; /* KILN__DEV_ERR_* */
  int pad;
  long long value, limit; /* the value, and the n of the range [0, n) it should lie in */
} kiln__dev_error;
#define KILN__DEV_ERR_LABEL 1    /* a label outside [0, classes) (kiln_cross_entropy) */
#define KILN__DEV_ERR_INDEX 2    /* a row index outside [0, rows) (kiln_index_select) */
#define KILN__DEV_ERR_OVERFLOW 3 /* an i32 sum outside the i32 range (kiln_sum) */

/* Anomaly mode's record (fusion/anomaly.c, device/anomaly.cuh): the trace index of the first
 * node whose written values a check found non-finite (-1: none), and the least (element << 2 |
 * what) among those values, what being 0 for NaN, 1 for +Inf, 2 for -Inf (all ones: none). */
typedef struct kiln__anomaly_rec {
  long long node;
  unsigned long long first;
} kiln__anomaly_rec;

typedef struct kiln__kargs {
  void *ptr[KILN__KMAX_UPDATE];
  long long n;
  long long nred;
  long long shape[KILN__KMAX_DIMS];
  long long st[KILN__KMAX_PTR][KILN__KMAX_DIMS];
  long long rshape[KILN__KMAX_DIMS];
  int i[KILN__KMAX_I];
  const float *fv;
  const unsigned long long *uv;
  kiln__dev_error *err; /* the context's error record */
} kiln__kargs;

/* A custom op's kernel (custom.cuh, fusion/render_custom.c) takes its tensors in ptr[0 .. nin]
 * (the output last), tensor q's shape in st[q] (1 past its dims), its dims and dtype in
 * st[KILN__CUSTOM_META + q / 6][q % 6] as ndim + 16 dtype, the call's parameters in
 * st[KILN__CUSTOM_PARAM], and nin in i[0]. */
#define KILN__CUSTOM_META 12
#define KILN__CUSTOM_PARAM 14

#define KILN__KARGS_BYTES 1512
#ifdef __cplusplus
static_assert(sizeof(kiln__kargs) == KILN__KARGS_BYTES, "kiln__kargs: host and device layouts");
#else
_Static_assert(sizeof(kiln__kargs) == KILN__KARGS_BYTES, "kiln__kargs: host and device layouts");
#endif

#endif
