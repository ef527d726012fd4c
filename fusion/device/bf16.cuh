/*
 * bf16.cuh: bfloat16 in generated kernels. A bf16 value is the upper 16 bits of an f32; kernels
 * compute in f32 registers and round to nearest (ties to even) where a bf16 value is stored.
 * kiln_bf16 is a 2-byte type that reads as a float and is made from one, so generated code loads
 * and stores every dtype with the same expressions ((const kiln_bf16 *)p)[i] and
 * ((kiln_bf16 *)p)[i] = (kiln_bf16)v. kiln_load4 / kiln_store4 move four neighbouring values as
 * floats, in one 16-byte (f32) or 8-byte (bf16) access.
 */
#ifndef KILN_BF16_CUH
#define KILN_BF16_CUH

#include "defs.cuh"

KILN__FN float kiln_bf16_to_float(unsigned short b) { return __uint_as_float((unsigned)b << 16); }

/* Two floats rounded to bf16 in one instruction, a in the low half. */
KILN__FN unsigned kiln_bf16x2_bits(float a, float b) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
  return r;
}

KILN__FN unsigned short kiln_bf16_bits(float f) {
  unsigned short r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

struct kiln_bf16 {
  unsigned short bits;
  kiln_bf16() = default;
  __device__ __forceinline__ kiln_bf16(float f) : bits(kiln_bf16_bits(f)) {}
  __device__ __forceinline__ operator float() const { return kiln_bf16_to_float(bits); }
};
static_assert(sizeof(kiln_bf16) == 2, "kiln_bf16 is two bytes");

/* kiln_load4 in two halves: kiln_fetch4 loads the four values as they are in memory (float4,
 * or uint2 for bf16), kiln_unpack4 widens them, so that a thread can have many loads in flight
 * before it waits on the first. */
KILN__FN void kiln_fetch4(const float *p, float4 &t) { t = *(const float4 *)p; }
KILN__FN void kiln_fetch4(const kiln_bf16 *p, uint2 &t) { t = *(const uint2 *)p; }
/* The type kiln_fetch4 loads four values of p's type into (unevaluated: decltype's). */
__device__ float4 kiln_raw4(const float *p);
__device__ uint2 kiln_raw4(const kiln_bf16 *p);
KILN__FN void kiln_unpack4(const float4 &t, float *v) {
  v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
}
KILN__FN void kiln_unpack4(const uint2 &t, float *v) {
  v[0] = __uint_as_float(t.x << 16), v[1] = __uint_as_float(t.x & 0xffff0000u);
  v[2] = __uint_as_float(t.y << 16), v[3] = __uint_as_float(t.y & 0xffff0000u);
}
KILN__FN void kiln_load4(const float *p, float *v) {
  float4 t;
  kiln_fetch4(p, t);
  kiln_unpack4(t, v);
}
KILN__FN void kiln_load4(const kiln_bf16 *p, float *v) {
  uint2 t;
  kiln_fetch4(p, t);
  kiln_unpack4(t, v);
}
KILN__FN void kiln_store4(float *p, const float *v) {
  *(float4 *)p = make_float4(v[0], v[1], v[2], v[3]);
}
KILN__FN void kiln_store4(kiln_bf16 *p, const float *v) {
  *(uint2 *)p = make_uint2(kiln_bf16x2_bits(v[0], v[1]), kiln_bf16x2_bits(v[2], v[3]));
}

#endif
