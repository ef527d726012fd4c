// probe.cu: does compute-sanitizer's initcheck count memory written by TMA stores, and by cuBLAS's
// Hopper GEMMs (which store their tiles that way), as initialized? Issue 24 saw initcheck report
// uninitialized 8-byte reads in the air step's bf16 max pool, whose input a cuBLAS product had
// written; reading kiln's pool kernels found no read past what they own. Three writers fill a
// buffer, a plain kernel reads every element of each; a clean run reports nothing.
//
//   nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o probe dev/initcheck/probe.cu -lcublas
//   ./probe                                         # prints the sums (a check that it ran)
//   compute-sanitizer --tool initcheck ./probe      # which readers does it flag?
//
// 1. plain stores (the control: nothing should be reported);
// 2. a TMA store (cp.async.bulk.tensor shared -> global) of a tile each block filled in shared memory;
// 3. cuBLAS's bf16 GEMM, 4096 x 4096 x 4096 (a shape Hopper's TMA kernels serve).
#include <cublas_v2.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cstdio>
#include <cstdlib>

#include "../conv_engine/lab_util.h" /* CK */

constexpr int N = 4096; /* every buffer is N x N bf16 */

__global__ void fill_plain(unsigned short *y) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (long long)N * N;
       i += (long long)gridDim.x * blockDim.x)
    y[i] = (unsigned short)(0x3f80 + (i & 7)); /* bf16 1.0 .. 1.05 */
}

/* A 64 x 64 tile a block, filled in shared memory and stored by one TMA copy. */
__global__ void fill_tma(const __grid_constant__ CUtensorMap map) {
  __shared__ __align__(128) unsigned short tile[64 * 64];
  for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x)
    tile[i] = (unsigned short)(0x3f80 + (i & 7));
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(tile);
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
                 "cp.async.bulk.commit_group;\n"
                 "cp.async.bulk.wait_group 0;\n" ::"l"((unsigned long long)&map),
                 "r"((int)blockIdx.x * 64), "r"((int)blockIdx.y * 64), "r"(s)
                 : "memory");
  }
}

__global__ void sum_all(const unsigned short *y, float *out) {
  float s = 0.f;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (long long)N * N;
       i += (long long)gridDim.x * blockDim.x) {
    unsigned u = (unsigned)y[i] << 16;
    s += __uint_as_float(u);
  }
  atomicAdd(out, s);
}

static float read_sum(const unsigned short *y, float *acc) {
  CK(cudaMemset(acc, 0, sizeof(float)));
  sum_all<<<264, 256>>>(y, acc);
  float h;
  CK(cudaMemcpy(&h, acc, sizeof h, cudaMemcpyDeviceToHost));
  return h;
}

int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0); /* each line at once, between the sanitizer's reports */
  unsigned short *a, *b, *y;
  float *acc;
  const size_t bytes = (size_t)N * N * 2;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMalloc(&y, bytes));
  CK(cudaMalloc(&acc, sizeof(float)));
  fill_plain<<<1024, 256>>>(a);
  fill_plain<<<1024, 256>>>(b);
  printf("1. plain stores: sum %.0f\n", read_sum(a, acc));

  void *fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  CUtensorMap map;
  const cuuint64_t dims[2] = {N, N}, strides[1] = {(cuuint64_t)N * 2};
  const cuuint32_t box[2] = {64, 64}, es[2] = {1, 1};
  CUresult r = ((PFN_cuTensorMapEncodeTiled_v12000)fn)(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, y, dims, strides, box, es,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    fprintf(stderr, "cuTensorMapEncodeTiled: %d\n", (int)r);
    return 1;
  }
  fill_tma<<<dim3(N / 64, N / 64), 128>>>(map);
  CK(cudaGetLastError());
  printf("2. TMA stores: sum %.0f\n", read_sum(y, acc));

  CK(cudaFree(y)); /* a fresh buffer: nothing written yet */
  CK(cudaMalloc(&y, bytes));
  cublasHandle_t h;
  cublasCreate(&h);
  const float one = 1.f, zero = 0.f;
  if (cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, N, N, N, &one, a, CUDA_R_16BF, N, b, CUDA_R_16BF,
                   N, &zero, y, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F,
                   CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
    fprintf(stderr, "cublasGemmEx failed\n");
    return 1;
  }
  printf("3. cuBLAS's product: sum %.0f\n", read_sum(y, acc));
  cublasDestroy(h);
  cudaFree(a), cudaFree(b), cudaFree(y), cudaFree(acc);
  return 0;
}
