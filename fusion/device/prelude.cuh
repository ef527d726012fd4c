/*
 * prelude.cuh: what every generated kernel includes first: the argument struct and the device
 * helpers. kiln embeds these files at build time and hands them to NVRTC by name, so a dumped
 * kernel (KILN_DUMP_KERNELS) compiles on its own with nvcc -I<dump folder>.
 */
#ifndef KILN_PRELUDE_CUH
#define KILN_PRELUDE_CUH

#include "bf16.cuh"
#include "defs.cuh"
#include "kargs.cuh"
#include "math.cuh"
#include "optim.cuh"
#include "philox.cuh"
#include "reduce.cuh"

/* Programmatic dependent launch (Hopper; KILN_PDL=1 launches kiln's kernels with the attribute
 * and puts this first in each): the kernel lets the next one in the stream launch now, its blocks
 * taking the SMs this one leaves while they wait, then waits until the kernel before it has
 * finished and its writes are visible. Nothing is read or written before the wait. Both are
 * no-ops in a kernel launched without the attribute. */
__device__ __forceinline__ void kiln_pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

#endif
