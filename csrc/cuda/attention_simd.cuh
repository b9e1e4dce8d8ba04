// Layout: CUDA only (kernel entry points).
// CUDA entry point of the simdgroup-matrix attention kernel (metal/tq_attention_simd.h,
// the Metal fast path): the very body Metal compiles, run here on the emulation of
// simdgroup matrices in metal/tq_portable.h, so that the GPU tests exercise it
// (AttentionKernel::simd, kernel_overrides.h). Correct, not fast: the tensor-core kernel
// (attention_mma.cuh) is CUDA's fast path.
#pragma once

#include "tq_attention_simd.h"
#include "tq_entry.cuh"

namespace turboquant_mlx::cuda_kernels {

template <typename QT, int D, int KB, int VB>
__global__ void __launch_bounds__(TQ_ATTN_THREADS, 1) tq_attention_simd_kernel(
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
  __shared__ float smem[TQAttnSimdConfig<D>::SMEM];
  tq_attention_simd_impl<QT, D, KB, VB>(
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

/// The simdgroup-matrix kernel for head dim D, runtime bits and query type (float16 or
/// bfloat16), or nullptr.
template <int D>
const void* attention_simd_kernel_for(int kb, int vb, QType qt) {
  const void* k = nullptr;
  dispatch_bits(kb, [&](auto kk) {
    dispatch_bits(vb, [&](auto vv) {
      constexpr int KB = decltype(kk)::value, VB = decltype(vv)::value;
      if (qt == QType::Float16) {
        k = reinterpret_cast<const void*>(&tq_attention_simd_kernel<__half, D, KB, VB>);
      } else if (qt == QType::BFloat16) {
        k = reinterpret_cast<const void*>(&tq_attention_simd_kernel<unsigned short, D, KB, VB>);
      }
    });
  });
  return k;
}

} // namespace turboquant_mlx::cuda_kernels
