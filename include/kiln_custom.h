/*
 * kiln_custom.h: kernels you write yourself, called like any op (kiln.h includes this header at
 * its end). You give the CUDA C++ of a device function, how the output's shape and the launch
 * follow from the inputs, and optionally a backward; kiln compiles the source with NVRTC through
 * its kernel cache when the op is made (a compile error comes back then, with NVRTC's log), and
 * every call records one node: it is planned like kiln's own kernels, its output gets memory
 * from the step's memory plan, it is captured in the step graph, and kiln_backward calls your
 * backward for it (torch.autograd.Function's forward and backward, with the forward a kernel).
 *
 * The device side. Your source defines
 *     __device__ void ENTRY(const kiln_custom_args &a)
 * which every thread of the launch runs, with blockIdx, threadIdx and shared memory as in any
 * kernel (kiln wraps it in the __global__ function it launches). a.in[0 .. a.nin) are the
 * inputs, read-only; a.out the output, which the kernel must write in full (its memory is not
 * cleared, unless the op asks for zero_output). Each is a kiln_custom_tensor: data (its first
 * element; contiguous, C order, 16-byte aligned), ndim, shape[], numel and dtype (KILN_CUSTOM_F32,
 * KILN_CUSTOM_BF16, KILN_CUSTOM_I32). a.param[0..3] are the call's integer parameters. The
 * prelude gives kiln_bf16 (converts to and from float) and the usual CUDA math functions; kiln's
 * own device helpers are named kiln_* and kiln__*, so leave those prefixes to kiln.
 *
 *   static const char *src =
 *       "__device__ void scale_rows(const kiln_custom_args &a) {\n"
 *       "  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n"
 *       "  if (i >= a.out.numel) return;\n"
 *       "  const float *x = (const float *)a.in[0].data, *s = (const float *)a.in[1].data;\n"
 *       "  ((float *)a.out.data)[i] = x[i] * s[i / a.in[0].shape[1]];\n"
 *       "}\n";
 *   kiln_custom_op *op = kiln_custom_op_new(ctx, &(kiln_custom_op_options){
 *       .name = "scale_rows", .source = src, .entry = "scale_rows", .nin = 2,
 *       .output = same_as_first});
 *   kiln_tensor *y = kiln_custom(op, (kiln_tensor *[]){x, s}, NULL);
 *
 * examples/custom_kernel.c writes matmul + bias + ReLU this way, forward and backward, and
 * checks it against kiln's own fused path.
 */
#ifndef KILN_CUSTOM_H
#define KILN_CUSTOM_H

#ifdef __cplusplus
extern "C" {
#endif

#define KILN_CUSTOM_MAX_IN 8 /* inputs of a custom op */
#define KILN_CUSTOM_PARAMS 4 /* integer parameters of a call */

typedef struct kiln_custom_op kiln_custom_op;

/* One call of an op, as its callbacks see it: the inputs (in .output and .launch as kiln_custom
 * received them; in .backward as the kernel read them, views that were not contiguous copied),
 * the output (NULL in .output and .launch, which run before it exists), the call's parameters
 * (zeros where it gave none) and the op's user pointer. */
typedef struct kiln_custom_call {
  const kiln_custom_op *op;
  int nin;
  kiln_tensor *const *in;
  kiln_tensor *out;
  const int64_t *param; /* KILN_CUSTOM_PARAMS values */
  void *user;
} kiln_custom_call;

/* A launch: grid[0] blocks along x (1 .. 2^31 - 1), grid[1] and grid[2] along y and z (0 means
 * 1; at most 65535), block threads a block (one-dimensional: 1 .. the op's max_block), smem bytes
 * of dynamic shared memory (extern __shared__; up to what the device allows a block, 227 KiB on
 * an H100 or H200, less the kernel's own static __shared__ arrays). */
typedef struct kiln_custom_launch {
  uint32_t grid[3];
  uint32_t block;
  uint32_t smem;
} kiln_custom_launch;

typedef struct kiln_custom_op_options {
  const char *name;   /* an identifier of at most 40 characters: traces, errors, kernel names */
  const char *source; /* CUDA C++ that defines the entry (and anything it calls) */
  const char *entry;  /* the name of its __device__ void ENTRY(const kiln_custom_args &a) */
  int nin;            /* inputs every call gives: 1 .. KILN_CUSTOM_MAX_IN */
  int max_block;      /* threads a block may have: the kernel's __launch_bounds__; 0: 256 */
  int zero_output;    /* 1: the output is zeroed before every launch (a kernel that adds into it) */
  /* The output's shape and dtype (f32, bf16 or i32) for the call's inputs and parameters;
   * required. A status other than KILN_OK refuses the call (kiln_custom's error names the op, the
   * status and the inputs). */
  kiln_status (*output)(const kiln_custom_call *c, kiln_shape *shape, kiln_dtype *dtype);
  /* The launch for the call, whose output has shape out (l arrives zeroed). NULL: one thread per
   * output element, max_block threads a block, as many blocks as that takes. An empty output
   * launches nothing (and asks for no launch). */
  kiln_status (*launch)(const kiln_custom_call *c, const kiln_shape *out, kiln_custom_launch *l);
  /* The gradients: given grad_out (the output's shape, f32 for an f32 output), set grad_in[k] for
   * every input k that requires grad (kiln_tensor_requires_grad(c->in[k])) to its gradient, of
   * its shape, recorded with kiln's ops (kiln_custom among them: a backward kernel is another
   * custom op); c->out is the forward's output. It runs inside kiln_backward, with gradients
   * off. NULL: the op has no gradient, and a call with an input that requires grad (gradients
   * on) is an error. A status other than KILN_OK, or a missing or misshapen gradient, fails
   * kiln_backward with an error naming the op. */
  kiln_status (*backward)(const kiln_custom_call *c, kiln_tensor *grad_out, kiln_tensor **grad_in);
  void *user; /* handed to every callback */
} kiln_custom_op_options;

/* Makes an op of o (its strings copied) and compiles its kernel now, for this context's device
 * (on a context without a GPU too: NVRTC runs on the host). NULL with the context's error set
 * when an option is out of range or the source does not compile (the error holds NVRTC's log,
 * with line numbers of your source). The op lives as long as the context. */
kiln_custom_op *kiln_custom_op_new(kiln_ctx *ctx, const kiln_custom_op_options *o);
const char *kiln_custom_op_name(const kiln_custom_op *op);
/* Records one call of op on in[0 .. nin) (any dtype kiln has; a view that is not contiguous is
 * copied first) with parameters param (NULL: zeros; else KILN_CUSTOM_PARAMS values, part of the
 * step's structure: a new value is a new step graph). Gives the output, or NULL with the error
 * set, nothing recorded: a bad or foreign tensor, an output or launch the callbacks refuse or
 * that is out of range, an input that requires grad when the op has no backward. */
kiln_tensor *kiln_custom(kiln_custom_op *op, kiln_tensor *const *in, const int64_t *param);

#ifdef __cplusplus
}
#endif
#endif
