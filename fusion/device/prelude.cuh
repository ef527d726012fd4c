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

#endif
