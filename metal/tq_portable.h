// Layout: shared kernel code, compiled as Metal and as CUDA.
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
#define TQ_NO_UNROLL _Pragma("clang loop unroll(disable)")

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
#define TQ_NO_UNROLL _Pragma("unroll 1")

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
/// A split-K partial result, read once by the merge: from L2 (ld.global.cg), not
/// through the read-only or L1 caches.
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

// ------------------------------------------------------------------ simdgroup matrices

// 8x8 matrices spread over the 32 lanes of a simdgroup (metal::simdgroup_matrix), for the
// kernels that multiply on them (tq_attention_simd.h). Metal provides the type and
// simdgroup_load / simdgroup_store / simdgroup_multiply_accumulate / thread_elements();
// the CUDA build emulates exactly those, with Metal's per-lane layout (the one MLX's
// steel kernels rely on, mlx/backend/metal/kernels/steel/attn/mma.h, get_coord): lane l
// holds row tq_frag_row(l), columns tq_frag_col(l) and tq_frag_col(l) + 1, as
// thread_elements()[0] and [1]. The emulation is correct, not fast (shuffles, one
// product per step). All of them are simdgroup-wide: uniform control flow only.
// TQ_ORIGIN0: the matrix origin argument (0, 0) of simdgroup_load / simdgroup_store.

/// Row of a lane's two elements of an 8x8 simdgroup matrix.
TQ_FN int tq_frag_row(tq_uint lane) {
  return int(((lane >> 4) & 1u) * 4u + ((lane >> 1) & 3u));
}
/// First of the two columns of a lane's elements (the other is this + 1).
TQ_FN int tq_frag_col(tq_uint lane) {
  return int(((lane >> 3) & 1u) * 4u + (lane & 1u) * 2u);
}

#if defined(TQ_METAL)

#define TQ_ORIGIN0 ulong2(0)

#else

#define TQ_ORIGIN0 make_ulong2(0, 0)

/// The lane that holds element (row, col) (the inverse of tq_frag_row / tq_frag_col).
TQ_FN unsigned int tq_frag_lane(int row, int col) {
  return unsigned(
      ((col >> 1) & 1) | ((row & 3) << 1) | (((col >> 2) & 1) << 3) | (((row >> 2) & 1) << 4));
}

TQ_FN unsigned int tq_lane_id() {
  unsigned int l;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(l));
  return l;
}

TQ_FN float tq_elem_to_float(float x) {
  return x;
}
TQ_FN float tq_elem_to_float(__half x) {
  return __half2float(x);
}
template <typename T>
TQ_FN T tq_elem_from_float(float x);
template <>
TQ_FN float tq_elem_from_float<float>(float x) {
  return x;
}
template <>
TQ_FN __half tq_elem_from_float<__half>(float x) {
  return __float2half_rn(x);
}

/// A lane's two elements (metal::vec<T, 2> as thread_elements() hands it out).
template <typename T>
struct tq_frag2 {
  T v[2];
  TQ_FN T& operator[](int i) {
    return v[i];
  }
  TQ_FN const T& operator[](int i) const {
    return v[i];
  }
};

/// metal::simdgroup_matrix<T, Cols, Rows> (8x8 only; T float or __half).
template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "8x8 simdgroup matrices only");
  tq_frag2<T> e;
  simdgroup_matrix() = default;
  /// The diagonal matrix with `diag` on its diagonal (Metal's scalar constructor).
  TQ_FN explicit simdgroup_matrix(T diag) {
    const unsigned int lane = tq_lane_id();
    const int r = tq_frag_row(lane), c = tq_frag_col(lane);
    e[0] = r == c ? diag : tq_elem_from_float<T>(0.0f);
    e[1] = r == c + 1 ? diag : tq_elem_from_float<T>(0.0f);
  }
  TQ_FN tq_frag2<T>& thread_elements() {
    return e;
  }
  TQ_FN const tq_frag2<T>& thread_elements() const {
    return e;
  }
};

/// d = the 8x8 block at `origin` (x: column, y: row) of the row-major matrix at src
/// with `elements_per_row` elements per row, or its transpose.
template <typename T, int C, int R>
TQ_FN void simdgroup_load(
    simdgroup_matrix<T, C, R>& d,
    const T* src,
    unsigned long elements_per_row = C,
    ulong2 origin = make_ulong2(0, 0),
    bool transpose = false) {
  __syncwarp(); // what the lanes wrote before is visible to the whole simdgroup
  const unsigned int lane = tq_lane_id();
  const int r = tq_frag_row(lane), c = tq_frag_col(lane);
  TQ_UNROLL
  for (int i = 0; i < 2; ++i) {
    const unsigned long mr = transpose ? c + i : r, mc = transpose ? r : c + i;
    d.e[i] = src[(origin.y + mr) * elements_per_row + origin.x + mc];
  }
}

/// Writes a (or its transpose) as the 8x8 block at `origin` of the row-major matrix at
/// dst with `elements_per_row` elements per row.
template <typename T, int C, int R>
TQ_FN void simdgroup_store(
    const simdgroup_matrix<T, C, R>& a,
    T* dst,
    unsigned long elements_per_row = C,
    ulong2 origin = make_ulong2(0, 0),
    bool transpose = false) {
  const unsigned int lane = tq_lane_id();
  const int r = tq_frag_row(lane), c = tq_frag_col(lane);
  TQ_UNROLL
  for (int i = 0; i < 2; ++i) {
    const unsigned long mr = transpose ? c + i : r, mc = transpose ? r : c + i;
    dst[(origin.y + mr) * elements_per_row + origin.x + mc] = a.e[i];
  }
  __syncwarp(); // the whole block is written before any lane reads it back
}

/// d = a * b + c, products and sums in float32 (d may be c).
template <typename TD, typename TA, typename TB, typename TC>
TQ_FN void simdgroup_multiply_accumulate(
    simdgroup_matrix<TD, 8, 8>& d,
    const simdgroup_matrix<TA, 8, 8>& a,
    const simdgroup_matrix<TB, 8, 8>& b,
    const simdgroup_matrix<TC, 8, 8>& c) {
  const unsigned int lane = tq_lane_id();
  const int r = tq_frag_row(lane), col = tq_frag_col(lane);
  const float a0 = tq_elem_to_float(a.e[0]), a1 = tq_elem_to_float(a.e[1]);
  float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll 1 // (a rolled loop: a kernel makes many of these products)
  for (int k = 0; k < 8; ++k) {
    // a[r][k] from the lane holding it (element k & 1, the same for every lane), and
    // b[k][col], b[k][col + 1] (elements 0 and 1 of one lane).
    const float ak = __shfl_sync(0xffffffffu, (k & 1) != 0 ? a1 : a0, tq_frag_lane(r, k));
    const unsigned int bl = tq_frag_lane(k, col);
    const float b0 = __shfl_sync(0xffffffffu, tq_elem_to_float(b.e[0]), bl);
    const float b1 = __shfl_sync(0xffffffffu, tq_elem_to_float(b.e[1]), bl);
    acc0 = fmaf(ak, b0, acc0);
    acc1 = fmaf(ak, b1, acc1);
  }
  const float c0 = tq_elem_to_float(c.e[0]), c1 = tq_elem_to_float(c.e[1]);
  d.e[0] = tq_elem_from_float<TD>(acc0 + c0);
  d.e[1] = tq_elem_from_float<TD>(acc1 + c1);
}

#endif
