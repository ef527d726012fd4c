/*
 * defs.cuh: what every device file shares. KILN__FN declares a helper: a device function under
 * NVRTC or nvcc, a static inline C function on the host (philox.cuh is compiled both ways, so
 * that tests compute the same random numbers as the kernels).
 */
#ifndef KILN_DEFS_CUH
#define KILN_DEFS_CUH

#ifdef __CUDACC__
#define KILN__FN static __device__ __forceinline__
#else
#define KILN__FN static inline
#endif

#endif
