// msl_exec.h: Metal Shading Language with its run-time meaning, for compiling the
// project's Metal kernels as C++ and running them on the CPU (tools/metal_emu).
//
// What it gives the kernel text (metal/turboquant.metal and its headers, as
// csrc/metal/embed_metal_source.py inlines them):
//   - address spaces (device, constant, threadgroup, thread) as plain C++ storage: the
//     executor binds each pointer to memory it staged for the dispatch;
//   - scalar and vector types (half = _Float16, uint2 / uint4 / ulong2 / float4 ... as
//     clang ext vectors with .x .y .z .w), as_type, the metal:: / fast:: / precise::
//     math the kernels call;
//   - the SIMD-group collectives (simd_shuffle_xor, simd_sum, simd_max, ...) and the
//     barriers, as rendezvous of the 32 lanes of a simdgroup / all threads of the
//     threadgroup, each thread a cooperative fiber (executor.h), so that a collective
//     with a wrong lane, a missing barrier or a divergent collective gives a wrong
//     result or an error rather than a right answer by luck;
//   - simdgroup_matrix<T, 8, 8> with Apple's lane-to-element layout (below), and
//     simdgroup_load / simdgroup_store / simdgroup_multiply_accumulate as simdgroup-wide
//     operations.
// What it cannot model: timing, memory ordering between threads beyond the barriers
// (a fiber runs alone until its next collective or barrier), hardware limits other than
// the few the executor checks (threads per threadgroup, threadgroup memory).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "executor.h" // (before the address-space macros below)

#ifndef __METAL_VERSION__
#define __METAL_VERSION__ 310
#endif

// ---- address spaces --------------------------------------------------------------
#define device
#define constant const
#define threadgroup
#define thread
#define kernel

// ---- scalar and vector types -----------------------------------------------------
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef _Float16 half;

#define TQ_EXEC_VEC(T, name)                                      \
  typedef T name##2 __attribute__((ext_vector_type(2)));          \
  typedef T name##3 __attribute__((ext_vector_type(3)));          \
  typedef T name##4 __attribute__((ext_vector_type(4)));          \
  typedef T packed_##name##2 __attribute__((ext_vector_type(2))); \
  typedef T packed_##name##4 __attribute__((ext_vector_type(4)));
TQ_EXEC_VEC(bool, bool)
TQ_EXEC_VEC(char, char)
TQ_EXEC_VEC(uchar, uchar)
TQ_EXEC_VEC(short, short)
TQ_EXEC_VEC(ushort, ushort)
TQ_EXEC_VEC(int, int)
TQ_EXEC_VEC(uint, uint)
TQ_EXEC_VEC(long, long)
TQ_EXEC_VEC(ulong, ulong)
TQ_EXEC_VEC(half, half)
TQ_EXEC_VEC(float, float)
#undef TQ_EXEC_VEC

namespace tq_exec {
template <class T>
struct vinfo {
  static constexpr int n = 1;
  using elem = T;
};
template <class T, int N>
struct vinfo<T __attribute__((ext_vector_type(N)))> {
  static constexpr int n = N;
  using elem = T;
};
template <class T, int N>
using vec = T __attribute__((ext_vector_type(N)));
template <class T, int N, class V>
void put(vec<T, N>& r, int& i, const V& v) {
  if constexpr (vinfo<V>::n > 1) {
    for (int k = 0; k < vinfo<V>::n; ++k) {
      r[i++] = static_cast<T>(v[k]);
    }
  } else {
    r[i++] = static_cast<T>(v);
  }
}
/// Metal's vector constructors: floatN(scalar) splats, otherwise the arguments' components.
template <class T, int N, class... A>
vec<T, N> make_vec(const A&... a) {
  if constexpr (sizeof...(A) == 1 && (vinfo<A>::n + ...) == 1) {
    return vec<T, N>(static_cast<T>((a, ...)));
  } else {
    static_assert((0 + ... + vinfo<A>::n) == N, "vector constructor: wrong number of components");
    vec<T, N> r{};
    int i = 0;
    (put<T, N>(r, i, a), ...);
    return r;
  }
}
} // namespace tq_exec

#define uint2(...) ::tq_exec::make_vec<uint, 2>(__VA_ARGS__)
#define uint3(...) ::tq_exec::make_vec<uint, 3>(__VA_ARGS__)
#define uint4(...) ::tq_exec::make_vec<uint, 4>(__VA_ARGS__)
#define int2(...) ::tq_exec::make_vec<int, 2>(__VA_ARGS__)
#define int4(...) ::tq_exec::make_vec<int, 4>(__VA_ARGS__)
#define ulong2(...) ::tq_exec::make_vec<ulong, 2>(__VA_ARGS__)
#define float2(...) ::tq_exec::make_vec<float, 2>(__VA_ARGS__)
#define float4(...) ::tq_exec::make_vec<float, 4>(__VA_ARGS__)
#define half2(...) ::tq_exec::make_vec<half, 2>(__VA_ARGS__)
#define half4(...) ::tq_exec::make_vec<half, 4>(__VA_ARGS__)

// ---- namespace metal ---------------------------------------------------------------
namespace metal {
template <class T, int N>
using vec = T __attribute__((ext_vector_type(N)));

template <class To, class From>
inline To as_type(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  return __builtin_bit_cast(To, x);
}

template <class T, class U>
inline auto min(T a, U b) -> decltype(a + b) {
  return a < b ? a : b;
}
template <class T, class U>
inline auto max(T a, U b) -> decltype(a + b) {
  return a > b ? a : b;
}
inline float fmax(float a, float b) {
  return std::fmax(a, b);
}
inline float fmin(float a, float b) {
  return std::fmin(a, b);
}
inline float abs(float x) {
  return std::fabs(x);
}
inline int abs(int x) {
  return x < 0 ? -x : x;
}
inline float fabs(float x) {
  return std::fabs(x);
}
inline float ceil(float x) {
  return std::ceil(x);
}
inline float floor(float x) {
  return std::floor(x);
}
inline float exp2(float x) {
  return std::exp2(x);
}
inline float log2(float x) {
  return std::log2(x);
}
inline float sqrt(float x) {
  return std::sqrt(x);
}
inline bool isnan(float x) {
  return std::isnan(x);
}
inline bool isinf(float x) {
  return std::isinf(x);
}
namespace fast {
inline float exp2(float x) {
  return std::exp2(x);
}
inline float log2(float x) {
  return std::log2(x);
}
inline float sqrt(float x) {
  return std::sqrt(x);
}
inline float divide(float a, float b) {
  return a / b;
}
} // namespace fast
namespace precise {
inline float exp2(float x) {
  return std::exp2(x);
}
inline float log2(float x) {
  return std::log2(x);
}
inline float sqrt(float x) {
  return std::sqrt(x);
}
inline float divide(float a, float b) {
  return a / b;
}
} // namespace precise

enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(uint(a) | uint(b));
}

inline void threadgroup_barrier(mem_flags) {
  tq_exec::threadgroup_rendezvous();
}
inline void simdgroup_barrier(mem_flags) {
  const int none = 0;
  tq_exec::simd_exchange(tq_exec::Collective::simd_barrier, &none, sizeof(none));
}

/// Lane l receives lane (l ^ mask)'s value.
template <class T>
T simd_shuffle_xor(T x, ushort mask) {
  const unsigned char* all =
      tq_exec::simd_exchange(tq_exec::Collective::shuffle_xor, &x, sizeof(T));
  return tq_exec::lane_value<T>(all, (tq_exec::lane_id() ^ mask) & 31u);
}
template <class T>
T simd_shuffle(T x, ushort lane) {
  const unsigned char* all = tq_exec::simd_exchange(tq_exec::Collective::shuffle, &x, sizeof(T));
  return tq_exec::lane_value<T>(all, lane & 31u);
}
template <class T>
T simd_broadcast(T x, ushort lane) {
  return simd_shuffle(x, lane);
}
/// Sums in lane order (Apple's order is unspecified; every order is a valid result).
template <class T>
T simd_sum(T x) {
  return tq_exec::exchange_reduce(tq_exec::Collective::sum, x);
}
template <class T>
T simd_max(T x) {
  return tq_exec::exchange_reduce(tq_exec::Collective::max, x);
}
template <class T>
T simd_min(T x) {
  return tq_exec::exchange_reduce(tq_exec::Collective::min, x);
}

// ---- simdgroup matrices ------------------------------------------------------------
// Apple's layout of an 8x8 simdgroup_matrix over the 32 lanes (the one MLX's steel
// kernels assume, mlx/backend/metal/kernels/steel/attn/mma.h): lane l holds row
// (l / 4 & 4) + (l / 2 % 4) and columns (l / 4 & 2) * 2 + (l % 2) * 2 and that + 1, as
// thread_elements()[0] and [1]. Written here from that description, independently of
// metal/tq_portable.h's CUDA emulation.
namespace detail {
inline int frag_row(unsigned l) {
  return int(((l / 4) & 4u) + ((l / 2) % 4u));
}
inline int frag_col(unsigned l) {
  return int(((l / 4) & 2u) * 2u + (l % 2u) * 2u);
}
} // namespace detail

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "8x8 simdgroup matrices only");
  vec<T, 2> e;
  simdgroup_matrix() = default;
  /// The diagonal matrix with `diag` on its diagonal.
  explicit simdgroup_matrix(T diag) {
    const unsigned l = tq_exec::lane_id();
    const int r = detail::frag_row(l), c = detail::frag_col(l);
    e[0] = r == c ? diag : T(0);
    e[1] = r == c + 1 ? diag : T(0);
  }
  thread vec<T, 2>& thread_elements() {
    return e;
  }
  thread const vec<T, 2>& thread_elements() const {
    return e;
  }
};

/// d = the 8x8 block at `origin` (x: column, y: row) of the row-major matrix at src
/// (`elements_per_row` per row), or its transpose. Simdgroup-wide: the lanes meet
/// before reading, so the block holds what every lane wrote before the call.
template <class T, class P, int C, int R>
void simdgroup_load(
    thread simdgroup_matrix<T, C, R>& d,
    P* src,
    ulong elements_per_row = C,
    vec<ulong, 2> origin = vec<ulong, 2>(0),
    bool transpose = false) {
  const int none = 0;
  tq_exec::simd_exchange(tq_exec::Collective::matrix, &none, sizeof(none));
  const unsigned l = tq_exec::lane_id();
  const int r = detail::frag_row(l), c = detail::frag_col(l);
  for (int i = 0; i < 2; ++i) {
    const ulong mr = transpose ? ulong(c + i) : ulong(r), mc = transpose ? ulong(r) : ulong(c + i);
    d.e[i] = T(src[(origin.y + mr) * elements_per_row + origin.x + mc]);
  }
}

template <class T, class P, int C, int R>
void simdgroup_store(
    thread const simdgroup_matrix<T, C, R>& a,
    P* dst,
    ulong elements_per_row = C,
    vec<ulong, 2> origin = vec<ulong, 2>(0),
    bool transpose = false) {
  const unsigned l = tq_exec::lane_id();
  const int r = detail::frag_row(l), c = detail::frag_col(l);
  for (int i = 0; i < 2; ++i) {
    const ulong mr = transpose ? ulong(c + i) : ulong(r), mc = transpose ? ulong(r) : ulong(c + i);
    dst[(origin.y + mr) * elements_per_row + origin.x + mc] = P(a.e[i]);
  }
  const int none = 0;
  tq_exec::simd_exchange(tq_exec::Collective::matrix, &none, sizeof(none));
}

/// d = a * b + c over the whole simdgroup: every lane's elements are gathered, each
/// lane computes its own two elements of d (products and sums in float).
template <class TD, class TA, class TB, class TC>
void simdgroup_multiply_accumulate(
    thread simdgroup_matrix<TD, 8, 8>& d,
    thread const simdgroup_matrix<TA, 8, 8>& a,
    thread const simdgroup_matrix<TB, 8, 8>& b,
    thread const simdgroup_matrix<TC, 8, 8>& c) {
  struct Elems {
    float a[2], b[2];
  } mine = {{float(a.e[0]), float(a.e[1])}, {float(b.e[0]), float(b.e[1])}};
  const unsigned char* all =
      tq_exec::simd_exchange(tq_exec::Collective::matrix, &mine, sizeof(mine));
  float A[8][8], B[8][8];
  for (unsigned l = 0; l < 32; ++l) {
    const Elems v = tq_exec::lane_value<Elems>(all, l);
    const int r = detail::frag_row(l), col = detail::frag_col(l);
    for (int i = 0; i < 2; ++i) {
      A[r][col + i] = v.a[i];
      B[r][col + i] = v.b[i];
    }
  }
  const unsigned l = tq_exec::lane_id();
  const int r = detail::frag_row(l), col = detail::frag_col(l);
  for (int i = 0; i < 2; ++i) {
    float acc = float(c.e[i]);
    for (int k = 0; k < 8; ++k) {
      acc += A[r][k] * B[k][col + i];
    }
    d.e[i] = TD(acc);
  }
}

} // namespace metal
