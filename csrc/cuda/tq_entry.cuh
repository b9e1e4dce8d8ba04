// Layout: CUDA only (kernel entry points).
// CUDA entry points: thin __global__ wrappers over the shared kernel bodies in
// metal/tq_kernels.h (the same code the Metal build instantiates), plus the table
// through which the host code finds the instantiation it needs.
#pragma once

#include "tq_kernels.h"

namespace turboquant_mlx::cuda_kernels {

__device__ __forceinline__ TQThread tq_thread() {
  TQThread th;
  th.tg_x = blockIdx.x;
  th.tg_y = blockIdx.y;
  th.tg_z = blockIdx.z;
  th.tid = threadIdx.x;
  th.lane = threadIdx.x & 31u;
  th.simd = threadIdx.x >> 5;
  return th;
}

template <typename QT, int D, int KB, int VB>
__global__ void __launch_bounds__(TQ_ATTN_THREADS) tq_attention_kernel(
    const QT* __restrict__ q,
    const unsigned int* __restrict__ k_codes,
    const __half* __restrict__ k_scales,
    const unsigned int* __restrict__ v_codes,
    const __half* __restrict__ v_scales,
    const float* __restrict__ k_cent,
    const float* __restrict__ v_cent,
    const unsigned char* __restrict__ mask,
    float* __restrict__ out,
    float* __restrict__ lse,
    float* __restrict__ o_part,
    float* __restrict__ ml_part,
    const __grid_constant__ TQAttnParams p) {
  __shared__ float smem[TQAttnConfig<D>::SMEM];
  tq_attention_impl<QT, D, KB, VB>(
      q,
      k_codes,
      k_scales,
      v_codes,
      v_scales,
      k_cent,
      v_cent,
      mask,
      out,
      lse,
      o_part,
      ml_part,
      p,
      smem,
      tq_thread());
}

template <typename QT, int D, typename OT>
__global__ void __launch_bounds__(TQ_MERGE_THREADS, 1) tq_attention_merge_kernel(
    const float* __restrict__ o_part,
    const float* __restrict__ ml_part,
    const QT* __restrict__ q,
    const QT* __restrict__ tail_k,
    const QT* __restrict__ tail_v,
    const float* __restrict__ key_mean,
    const float* __restrict__ value_mean,
    OT* __restrict__ out,
    float* __restrict__ lse,
    const __grid_constant__ TQMergeParams p) {
  __shared__ float smem[TQ_MERGE_SMEM];
  tq_attention_merge_impl<QT, D, OT>(
      o_part, ml_part, q, tail_k, tail_v, key_mean, value_mean, out, lse, p, smem, tq_thread());
}

template <typename XT, int D, int B>
__global__ void __launch_bounds__(TQ_QUANT_THREADS) tq_quantize_kernel(
    const XT* __restrict__ x,
    const float* __restrict__ cent,
    const float* __restrict__ mean,
    unsigned int* __restrict__ codes,
    __half* __restrict__ scales,
    XT* x_slots,
    const XT* __restrict__ incoming,
    const __grid_constant__ TQQuantParams p) {
  __shared__ float smem[32 + TQ_QUANT_SIMDGROUPS * 2 * D];
  tq_quantize_impl<XT, D, B>(x, cent, mean, codes, scales, x_slots, incoming, p, smem, tq_thread());
}

template <typename OT, int B>
__global__ void __launch_bounds__(TQ_DEQUANT_THREADS) tq_dequantize_kernel(
    const unsigned int* __restrict__ codes,
    const __half* __restrict__ scales,
    const float* __restrict__ cent,
    const OT* __restrict__ prefix,
    const OT* __restrict__ suffix,
    OT* __restrict__ out,
    const __grid_constant__ TQDequantParams p) {
  __shared__ float smem[16];
  tq_dequantize_impl<OT, B>(codes, scales, cent, prefix, suffix, out, p, smem, tq_thread());
}

template <typename T>
__global__ void __launch_bounds__(TQ_COPY_THREADS) tq_copy_kernel(
    const T* __restrict__ src,
    T* __restrict__ dst,
    const __grid_constant__ TQCopyParams p) {
  tq_copy_impl<T>(src, dst, p, tq_thread());
}

// A layer's keys and values in one launch (blockIdx.y: 0 keys, 1 values), so that a
// decode step's append and ring write are one kernel node each on MLX's CUDA graph
// instead of two (host time per node; see eval_cuda.cu).

/// One tensor's quantize launch: the arguments of tq_quantize_kernel.
struct TQQuantArgs {
  const void* x;
  const float* cent;
  const float* mean;
  unsigned int* codes;
  __half* scales;
  void* x_slots; // a ring exchange: x's memory, and the tokens that take it
  const void* incoming;
  TQQuantParams p;
};

template <typename XT, int D, int B>
__global__ void __launch_bounds__(TQ_QUANT_THREADS) tq_quantize_pair_kernel(
    const __grid_constant__ TQQuantArgs keys,
    const __grid_constant__ TQQuantArgs values) {
  __shared__ float smem[32 + TQ_QUANT_SIMDGROUPS * 2 * D];
  const TQQuantArgs& a = blockIdx.y == 0 ? keys : values;
  tq_quantize_impl<XT, D, B>(
      static_cast<const XT*>(a.x),
      a.cent,
      a.mean,
      a.codes,
      a.scales,
      static_cast<XT*>(a.x_slots),
      static_cast<const XT*>(a.incoming),
      a.p,
      smem,
      tq_thread());
}

/// One buffer's copy: the arguments of tq_copy_kernel.
struct TQCopyArgs {
  const void* src;
  void* dst;
  TQCopyParams p;
};

template <typename T>
__global__ void __launch_bounds__(TQ_COPY_THREADS) tq_copy_pair_kernel(
    const __grid_constant__ TQCopyArgs keys,
    const __grid_constant__ TQCopyArgs values) {
  const TQCopyArgs& a = blockIdx.y == 0 ? keys : values;
  tq_copy_impl<T>(static_cast<const T*>(a.src), static_cast<T*>(a.dst), a.p, tq_thread());
}

// Query element types, as the kernels read them.
enum class QType { Float32 = 0, Float16 = 1, BFloat16 = 2 };

// Host-side lookup of instantiations, defined in separate .cu files (per query type
// and head-dim range) so that the many instantiations compile in parallel. Each returns
// the kernel's address (for cudaGetFuncBySymbol) or nullptr for an unsupported
// combination. "lo": head dims 32..128, "hi": 160..256.
const void* attention_kernel_f32_lo(int d, int kb, int vb);
const void* attention_kernel_f32_hi(int d, int kb, int vb);
const void* attention_kernel_f16_lo(int d, int kb, int vb);
const void* attention_kernel_f16_hi(int d, int kb, int vb);
const void* attention_kernel_bf16_lo(int d, int kb, int vb);
const void* attention_kernel_bf16_hi(int d, int kb, int vb);
/// The simdgroup-matrix attention kernel (metal/tq_attention_simd.h, see
/// attention_simd.cuh) for head dim 64 / 128 / 256, float16 or bfloat16 queries; nullptr
/// for other query types.
const void* attention_simd_kernel_d64(int kb, int vb, QType q);
const void* attention_simd_kernel_d128(int kb, int vb, QType q);
const void* attention_simd_kernel_d256(int kb, int vb, QType q);
/// The split-K merge for queries of type q, writing out as float32 or (out_in_q_type)
/// in q's type.
const void* attention_merge_kernel(int d, QType q, bool out_in_q_type = false);
/// The quantize kernel for head dim d, b bits, inputs of type x; with `pair`, the one
/// that writes a layer's keys and values in one launch (tq_quantize_pair_kernel).
const void* quantize_kernel(int d, int b, QType x, bool pair = false);
/// The dequantize kernel for b bits writing elements of type `out`.
const void* dequantize_kernel(int b, QType out);
/// The copy kernel for elements of `itemsize` bytes; with `pair`, the one that copies a
/// layer's keys and values in one launch (tq_copy_pair_kernel).
const void* copy_kernel(int itemsize, bool pair = false);

/// Calls f(std::integral_constant<int, D>{}) for a supported runtime head dim.
template <typename F>
bool dispatch_head_dim(int d, F&& f) {
  switch (d) {
    case 32: f(std::integral_constant<int, 32>{}); return true;
    case 64: f(std::integral_constant<int, 64>{}); return true;
    case 96: f(std::integral_constant<int, 96>{}); return true;
    case 128: f(std::integral_constant<int, 128>{}); return true;
    case 160: f(std::integral_constant<int, 160>{}); return true;
    case 192: f(std::integral_constant<int, 192>{}); return true;
    case 224: f(std::integral_constant<int, 224>{}); return true;
    case 256: f(std::integral_constant<int, 256>{}); return true;
    default: return false;
  }
}

/// Calls f(std::integral_constant<int, B>{}) for B in {2, 3, 4}.
template <typename F>
bool dispatch_bits(int b, F&& f) {
  switch (b) {
    case 2: f(std::integral_constant<int, 2>{}); return true;
    case 3: f(std::integral_constant<int, 3>{}); return true;
    case 4: f(std::integral_constant<int, 4>{}); return true;
    default: return false;
  }
}

/// The attention kernel for query type QT at runtime (d, kb, vb), for head dims in
/// [DLO, DHI] (others give nullptr without being instantiated).
template <typename QT, int DLO, int DHI>
const void* attention_kernel_for(int d, int kb, int vb) {
  const void* k = nullptr;
  dispatch_head_dim(d, [&](auto dd) {
    constexpr int D = decltype(dd)::value;
    if constexpr (D >= DLO && D <= DHI) {
      dispatch_bits(kb, [&](auto kk) {
        dispatch_bits(vb, [&](auto vv) {
          k = reinterpret_cast<const void*>(
              &tq_attention_kernel<QT, D, decltype(kk)::value, decltype(vv)::value>);
        });
      });
    }
  });
  return k;
}

} // namespace turboquant_mlx::cuda_kernels
