/*
 * kargs.h: the one argument every generated kernel takes, written once as a macro so that the
 * host C code and the generated CUDA C (through the prelude's string) see the same layout.
 */
#ifndef KILN_KARGS_H
#define KILN_KARGS_H

#define KILN__KMAX_PTR 16    /* operands of a generated kernel (each with strides) */
#define KILN__KMAX_UPDATE 24 /* pointers of a multi-tensor update (tensors x inputs) */
#define KILN__KMAX_F 16
#define KILN__KMAX_I 8
#define KILN__KMAX_U 4

/* ptr: operands; n: elements in the iteration space; shape: its dims; st: each operand's strides
 * (elements) over those dims; rshape/rst: the reduced dims of a reduction and the input's strides
 * over them; nred: elements reduced into each output; f, i, u: node attributes; fv, uv: where the
 * kernel reads the float and 64-bit ones, the group's block of the step values on the device
 * (f and u are the host's copy: per-step values are never baked into a launch or a graph). */
#define KILN__KARGS_FIELDS                                                                         \
  void *ptr[24];                                                                                   \
  long long n;                                                                                     \
  long long nred;                                                                                  \
  long long shape[6];                                                                              \
  long long st[16][6];                                                                             \
  long long rshape[6];                                                                             \
  long long rst[6];                                                                                \
  float f[16];                                                                                     \
  int i[8];                                                                                        \
  unsigned long long u[4];                                                                         \
  const float *fv;                                                                                 \
  const unsigned long long *uv;

typedef struct kiln__kargs {
  KILN__KARGS_FIELDS
} kiln__kargs;

#define KILN__STR_(...) #__VA_ARGS__
#define KILN__STR(...) KILN__STR_(__VA_ARGS__)

#endif
