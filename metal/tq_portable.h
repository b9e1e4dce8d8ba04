// Portability layer: the few GPU facilities the kernel bodies in tq_kernels.h use,
// spelled once for Metal (compiled by Apple's compiler into turboquant_mlx.metallib)
// and once for CUDA (compiled by nvcc from csrc/cuda/*.cu). The kernel bodies use
// only what is defined here, so the same lines of kernel logic run on both.
//
// Conventions for kernel bodies:
//   - address spaces: TQ_DEV (device memory), TQ_TG (threadgroup / shared memory),
//     TQ_THR (a thread's own arrays), TQ_CONST (kernel parameters passed by reference);
//   - thread indices arrive in a TQThread, filled by each backend's entry point;
//   - a "simdgroup" is 32 lanes (a CUDA warp; Apple GPUs run 32-wide simdgroups);
//   - collectives (tq_shfl_xor, tq_simd_sum, ...) are called in uniform control
//     flow only: Metal's simd_* act on the active lanes, CUDA's full-mask shuffles
//     need every lane of the warp;
//   - arithmetic is float32; tq_mul_rn / tq_add_rn / tq_div_rn / tq_sqrt_rn are the
//     correctly rounded, never-fused operations the quantizer needs to reproduce the
//     CPU backend bit for bit.
#pragma once

#if defined(__METAL_VERSION__)

#include <metal_stdlib>
using namespace metal;

#define TQ_METAL 1
#define TQ_DEV device
#define TQ_TG threadgroup
#define TQ_CONST constant
#define TQ_THR thread
#define TQ_FN inline __attribute__((always_inline))
#define TQ_UNROLL _Pragma("clang loop unroll(full)")

typedef half tq_half;
typedef uint tq_uint;

#else // CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define TQ_CUDA 1
#define TQ_DEV
#define TQ_TG
#define TQ_CONST const
#define TQ_THR
#define TQ_FN __device__ __forceinline__
#define TQ_UNROLL _Pragma("unroll")

typedef __half tq_half;
typedef unsigned int tq_uint;
typedef unsigned short ushort;
typedef unsigned char uchar;

#endif

/// Thread coordinates of one kernel invocation, filled by the backend entry point.
struct TQThread {
  tq_uint tg_x, tg_y, tg_z; // threadgroup (block) index in the grid
  tq_uint tid; // thread index in the threadgroup (1-D threadgroups only)
  tq_uint lane; // index in the simdgroup, 0..31
  tq_uint simd; // simdgroup index in the threadgroup
};

#define TQ_SIMD 32

// ------------------------------------------------------------------ conversions

#if defined(TQ_METAL)

TQ_FN float tq_to_float(float x) {
  return x;
}
TQ_FN float tq_to_float(half x) {
  return float(x);
}
/// bfloat16 travels as its raw 16 bits (ushort): exact widening, any Metal version.
TQ_FN float tq_to_float(ushort bits) {
  return as_type<float>(uint(bits) << 16);
}
TQ_FN tq_half tq_to_half_rn(float x) {
  return half(x); // Metal rounds float -> half to nearest even
}
TQ_FN float tq_bits_to_float(uint x) {
  return as_type<float>(x);
}
TQ_FN uint tq_float_to_bits(float x) {
  return as_type<uint>(x);
}
TQ_FN void tq_store_out(TQ_DEV half* p, float x) {
  *p = half(x);
}

#else

TQ_FN float tq_to_float(float x) {
  return x;
}
TQ_FN float tq_to_float(__half x) {
  return __half2float(x);
}
TQ_FN float tq_to_float(ushort bits) {
  return __uint_as_float(static_cast<unsigned int>(bits) << 16);
}
TQ_FN tq_half tq_to_half_rn(float x) {
  return __float2half_rn(x);
}
TQ_FN float tq_bits_to_float(unsigned int x) {
  return __uint_as_float(x);
}
TQ_FN unsigned int tq_float_to_bits(float x) {
  return __float_as_uint(x);
}
TQ_FN void tq_store_out(TQ_DEV __half* p, float x) {
  *p = __float2half_rn(x);
}

#endif

/// An output element in the output's type: float as it is; half / bfloat16 (raw bits)
/// rounded to nearest even, as MLX's astype rounds.
TQ_FN void tq_store_out(TQ_DEV float* p, float x) {
  *p = x;
}
TQ_FN void tq_store_out(TQ_DEV ushort* p, float x) {
  const tq_uint u = tq_float_to_bits(x);
  *p = (u & 0x7fffffffu) > 0x7f800000u ? ushort((u >> 16) | 0x40u) // NaN stays NaN
                                       : ushort((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// ------------------------------------------------------------------ arithmetic

#if defined(TQ_METAL)

TQ_FN float tq_exp2(float x) {
  return fast::exp2(x);
}
TQ_FN float tq_log2(float x) {
  return precise::log2(x);
}
// Metal is built with -fno-fast-math; the precise:: forms make the intent explicit.
// Products and sums are separate statements so that no a*b+c contraction can occur.
TQ_FN float tq_mul_rn(float a, float b) {
#pragma clang fp contract(off)
  return a * b;
}
TQ_FN float tq_add_rn(float a, float b) {
#pragma clang fp contract(off)
  return a + b;
}
TQ_FN float tq_div_rn(float a, float b) {
  return precise::divide(a, b);
}
TQ_FN float tq_sqrt_rn(float a) {
  return precise::sqrt(a);
}
TQ_FN float tq_fmax(float a, float b) {
  return metal::fmax(a, b);
}

#else

TQ_FN float tq_exp2(float x) {
  return exp2f(x);
}
TQ_FN float tq_log2(float x) {
  return log2f(x);
}
TQ_FN float tq_mul_rn(float a, float b) {
  return __fmul_rn(a, b);
}
TQ_FN float tq_add_rn(float a, float b) {
  return __fadd_rn(a, b);
}
TQ_FN float tq_div_rn(float a, float b) {
  return __fdiv_rn(a, b);
}
TQ_FN float tq_sqrt_rn(float a) {
  return __fsqrt_rn(a);
}
TQ_FN float tq_fmax(float a, float b) {
  return fmaxf(a, b);
}

#endif

TQ_FN float tq_neg_inf() {
  return tq_bits_to_float(0xff800000u);
}

/// Bits [sh, sh + 32) of the 64-bit value hi:lo, for 0 <= sh < 32.
TQ_FN tq_uint tq_funnel_r(tq_uint lo, tq_uint hi, tq_uint sh) {
#if defined(TQ_METAL)
  return uint(((ulong(hi) << 32) | ulong(lo)) >> sh);
#else
  return __funnelshift_r(lo, hi, sh);
#endif
}

// ------------------------------------------------------------------ simdgroup collectives

#if defined(TQ_METAL)

TQ_FN float tq_shfl_xor(float x, int mask) {
  return simd_shuffle_xor(x, ushort(mask));
}
TQ_FN float tq_simd_sum(float x) {
  return simd_sum(x);
}
TQ_FN float tq_simd_max(float x) {
  return simd_max(x);
}
TQ_FN void tq_threadgroup_barrier() {
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
TQ_FN void tq_simdgroup_barrier() {
  simdgroup_barrier(mem_flags::mem_threadgroup);
}
/// A split-K partial result (see tq_attention_merge_impl).
TQ_FN float tq_load_partial(const TQ_DEV float* p) {
  return *p;
}

#else

TQ_FN float tq_shfl_xor(float x, int mask) {
  return __shfl_xor_sync(0xffffffffu, x, mask);
}
TQ_FN float tq_simd_sum(float x) {
  TQ_UNROLL
  for (int m = 16; m > 0; m >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, m);
  }
  return x;
}
TQ_FN float tq_simd_max(float x) {
  TQ_UNROLL
  for (int m = 16; m > 0; m >>= 1) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
  }
  return x;
}
TQ_FN void tq_threadgroup_barrier() {
  __syncthreads();
}
TQ_FN void tq_simdgroup_barrier() {
  __syncwarp();
}
/// A split-K partial result: from L2 (ld.global.cg), never through the read-only or L1
/// caches, so that a block of the attention kernel that merges its splits (the
/// tensor-core kernel's fused merge) sees what the other blocks wrote.
TQ_FN float tq_load_partial(const TQ_DEV float* p) {
  return __ldcg(p);
}

#endif

/// Sum over aligned groups of N consecutive lanes (N a power of two, N <= 32); every
/// lane of a group ends with the group's sum. Uniform control flow only.
template <int N>
TQ_FN float tq_group_sum(float x) {
  TQ_UNROLL
  for (int m = 1; m < N; m <<= 1) {
    x += tq_shfl_xor(x, m);
  }
  return x;
}

// ------------------------------------------------------------------ wide loads

/// Two / four consecutive 32-bit words from p, which must be 8 / 16-byte aligned.
TQ_FN uint2 tq_load_u2(const TQ_DEV tq_uint* p) {
#if defined(TQ_METAL)
  return *((const device uint2*)p);
#else
  return *reinterpret_cast<const uint2*>(p);
#endif
}
TQ_FN uint4 tq_load_u4(const TQ_DEV tq_uint* p) {
#if defined(TQ_METAL)
  return *((const device uint4*)p);
#else
  return *reinterpret_cast<const uint4*>(p);
#endif
}
