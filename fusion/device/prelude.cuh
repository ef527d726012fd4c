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
 * and puts this first in each): the kernel waits until the kernel before it has finished and its
 * writes are visible (nothing is read or written before), then lets the next one in the stream
 * launch, its blocks taking the SMs this one leaves while they wait in turn. Waiting first keeps
 * one kernel at most waiting ahead: letting the next launch before the wait (2026-12-06, H100)
 * took steps 4-5.5% longer, a chain of waiting kernels holding the SMs. Both are no-ops in a
 * kernel launched without the attribute. */
__device__ __forceinline__ void kiln_pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#endif
