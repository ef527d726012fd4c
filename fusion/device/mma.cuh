/*
 * mma.cuh: the tensor-core building blocks the implicit-GEMM kernels share (igemm.cuh, conv.cuh),
 * sm_80 and newer: 16-byte asynchronous copies into shared memory (cp.async, zero-filling where
 * the source is outside the operand), ldmatrix fragment loads, and the mma.sync products (bf16
 * m16n8k16, TF32 m16n8k8) with f32 accumulators.
 */
#ifndef KILN_MMA_CUH
#define KILN_MMA_CUH

#include "bf16.cuh"
#include "defs.cuh"

/* 16 bytes from gmem to smem, asynchronously; sixteen zero bytes when !valid (gmem unread). */
KILN__FN void kiln_cp16(void *smem, const void *gmem, bool valid) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
KILN__FN void kiln_cp_commit() { asm volatile("cp.async.commit_group;\n"); }
/* Waits until at most N committed groups of this thread are still in flight. */
template <int N> KILN__FN void kiln_cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
/* kiln_cp_wait<n> for n known only at run time (an unrolled loop's makes it a constant): more
 * than 7 waits as 7 does, for more of the groups. */
KILN__FN void kiln_cp_wait_upto(int n) {
  switch (n < 0 ? 0 : n) {
  case 0: kiln_cp_wait<0>(); break;
  case 1: kiln_cp_wait<1>(); break;
  case 2: kiln_cp_wait<2>(); break;
  case 3: kiln_cp_wait<3>(); break;
  case 4: kiln_cp_wait<4>(); break;
  case 5: kiln_cp_wait<5>(); break;
  case 6: kiln_cp_wait<6>(); break;
  default: kiln_cp_wait<7>(); break;
  }
}

KILN__FN unsigned kiln_tf32(float f) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(f));
  return r;
}

/* Two bf16 values as one 32-bit register, a in the low half. */
KILN__FN unsigned kiln_pack2(kiln_bf16 a, kiln_bf16 b) {
  return (unsigned)a.bits | ((unsigned)b.bits << 16);
}

/* Four 8x8 matrices of 16-bit values from shared memory, lane l giving the address of row l % 8
 * of matrix l / 8; r[q] is this lane's pair of matrix q (row lane / 4, columns 2 (lane % 4) and
 * the next). trans: the matrices transposed (this lane's pair is column lane / 4, rows
 * 2 (lane % 4) and the next). */
KILN__FN void kiln_ldsm4(const void *smem, unsigned (&r)[4]) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
KILN__FN void kiln_ldsm4_trans(const void *smem, unsigned (&r)[4]) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

/* c += a b for one m16n8k16 tile in bf16 (a: four registers, b: two), f32 accumulators. */
KILN__FN void kiln_mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
               "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* c += a b for one m16n8k8 tile in TF32. */
KILN__FN void kiln_mma_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, "
               "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#endif
