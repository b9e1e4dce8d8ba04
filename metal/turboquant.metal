// Layout: Metal only (kernel entry points and instantiations).
// Metal only: the [[kernel]] entry points of the turboquant_mlx kernels (thin wrappers
// over the shared bodies in tq_kernels.h and tq_attention_simd.h, as
// csrc/cuda/tq_entry.cuh is for CUDA) and their instantiations. Host code
// (csrc/metal/eval_metal.cpp) builds the same names:
//   tq_attention_<float32|float16|bfloat16>_d<D>_k<key bits>_v<value bits>
//   tq_attention_simd_<float16|bfloat16>_d<64|128|256>_k<key bits>_v<value bits>
//     (simdgroup matrices, tq_attention_simd.h: the fast path for half queries)
//   tq_attention_merge_<float32|float16|bfloat16>_d<D>
//   tq_quantize_<float32|float16|bfloat16>_d<D>_b<bits>
//   tq_dequantize_<float32|float16|bfloat16>_b<bits>
//   tq_copy_u32, tq_copy_u16
// D runs over the head dims the kernels support: multiples of 32 from 32 to 256.

#include "tq_attention_simd.h"
#include "tq_kernels.h"

// ============================================================================ entry points

template <typename QT, int D, int KB, int VB>
[[kernel]] void tq_attention(
    const device QT* q [[buffer(0)]],
    const device uint* k_codes [[buffer(1)]],
    const device half* k_scales [[buffer(2)]],
    const device uint* v_codes [[buffer(3)]],
    const device half* v_scales [[buffer(4)]],
    const device float* k_cent [[buffer(5)]],
    const device float* v_cent [[buffer(6)]],
    const device uchar* mask [[buffer(7)]],
    device float* out [[buffer(8)]],
    device float* lse [[buffer(9)]],
    device float* o_part [[buffer(10)]],
    device float* ml_part [[buffer(11)]],
    constant TQAttnParams& p [[buffer(12)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]]) {
  threadgroup float smem[TQAttnConfig<D>::SMEM];
  TQThread th = {tg.x, tg.y, tg.z, tid, lane, simd};
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
      th);
}

template <typename QT, int D>
[[kernel]] void tq_attention_merge(
    const device float* o_part [[buffer(0)]],
    const device float* ml_part [[buffer(1)]],
    const device QT* q [[buffer(2)]],
    const device QT* tail_k [[buffer(3)]],
    const device QT* tail_v [[buffer(4)]],
    const device float* key_mean [[buffer(5)]],
    const device float* value_mean [[buffer(6)]],
    device float* out [[buffer(7)]],
    device float* lse [[buffer(8)]],
    constant TQMergeParams& p [[buffer(9)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]]) {
  threadgroup float smem[TQ_MERGE_SMEM];
  TQThread th = {tg.x, tg.y, tg.z, tid, lane, simd};
  tq_attention_merge_impl<QT, D>(
      o_part, ml_part, q, tail_k, tail_v, key_mean, value_mean, out, lse, p, smem, th);
}

template <typename XT, int D, int B>
[[kernel]] void tq_quantize(
    const device XT* x [[buffer(0)]],
    const device float* cent [[buffer(1)]],
    const device float* mean [[buffer(2)]],
    device uint* codes [[buffer(3)]],
    device half* scales [[buffer(4)]],
    constant TQQuantParams& p [[buffer(5)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]]) {
  threadgroup float smem[32 + TQ_QUANT_SIMDGROUPS * 2 * D];
  TQThread th = {tg.x, tg.y, tg.z, tid, lane, simd};
  tq_quantize_impl<XT, D, B>(x, cent, mean, codes, scales, nullptr, nullptr, p, smem, th);
}

template <typename OT, int B>
[[kernel]] void tq_dequantize(
    const device uint* codes [[buffer(0)]],
    const device half* scales [[buffer(1)]],
    const device float* cent [[buffer(2)]],
    device OT* out [[buffer(3)]],
    constant TQDequantParams& p [[buffer(4)]],
    const device OT* prefix [[buffer(5)]],
    const device OT* suffix [[buffer(6)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]]) {
  threadgroup float smem[16];
  TQThread th = {tg.x, tg.y, tg.z, tid, lane, simd};
  tq_dequantize_impl<OT, B>(codes, scales, cent, prefix, suffix, out, p, smem, th);
}

template <typename T>
[[kernel]] void tq_copy(
    const device T* src [[buffer(0)]],
    device T* dst [[buffer(1)]],
    constant TQCopyParams& p [[buffer(2)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]]) {
  TQThread th = {tg.x, tg.y, tg.z, tid, lane, simd};
  tq_copy_impl<T>(src, dst, p, th);
}

template <typename QT, int D, int KB, int VB>
[[kernel]] void tq_attention_simd(
    const device QT* q [[buffer(0)]],
    const device uint* k_codes [[buffer(1)]],
    const device half* k_scales [[buffer(2)]],
    const device uint* v_codes [[buffer(3)]],
    const device half* v_scales [[buffer(4)]],
    const device float* k_cent [[buffer(5)]],
    const device float* v_cent [[buffer(6)]],
    const device uchar* mask [[buffer(7)]],
    device float* out [[buffer(8)]],
    device float* lse [[buffer(9)]],
    device float* o_part [[buffer(10)]],
    device float* ml_part [[buffer(11)]],
    constant TQAttnParams& p [[buffer(12)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]]) {
  threadgroup float smem[TQAttnSimdConfig<D>::SMEM];
  TQThread th = {tg.x, tg.y, tg.z, tid, lane, simd};
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
      th);
}

// ============================================================================ instantiations

#define TQ_INSTANTIATE(name, func, ...) \
  template [[host_name(name)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;

// bfloat16 queries travel as their raw bits (ushort), see tq_to_float.
#define TQ_ATTN_ONE(qname, qtype, d, kb, vb) \
  TQ_INSTANTIATE("tq_attention_" #qname "_d" #d "_k" #kb "_v" #vb, tq_attention, qtype, d, kb, vb)

#define TQ_ATTN_V(qname, qtype, d, kb) \
  TQ_ATTN_ONE(qname, qtype, d, kb, 2)  \
  TQ_ATTN_ONE(qname, qtype, d, kb, 3)  \
  TQ_ATTN_ONE(qname, qtype, d, kb, 4)

#define TQ_ATTN_K(qname, qtype, d) \
  TQ_ATTN_V(qname, qtype, d, 2)    \
  TQ_ATTN_V(qname, qtype, d, 3)    \
  TQ_ATTN_V(qname, qtype, d, 4)

#define TQ_MERGE_ONE(qname, qtype, d) \
  TQ_INSTANTIATE("tq_attention_merge_" #qname "_d" #d, tq_attention_merge, qtype, d)

#define TQ_ATTN_Q(d)              \
  TQ_ATTN_K(float32, float, d)    \
  TQ_ATTN_K(float16, half, d)     \
  TQ_ATTN_K(bfloat16, ushort, d)  \
  TQ_MERGE_ONE(float32, float, d) \
  TQ_MERGE_ONE(float16, half, d)  \
  TQ_MERGE_ONE(bfloat16, ushort, d)

#define TQ_QUANT_X(xname, xtype, d)                                             \
  TQ_INSTANTIATE("tq_quantize_" #xname "_d" #d "_b2", tq_quantize, xtype, d, 2) \
  TQ_INSTANTIATE("tq_quantize_" #xname "_d" #d "_b3", tq_quantize, xtype, d, 3) \
  TQ_INSTANTIATE("tq_quantize_" #xname "_d" #d "_b4", tq_quantize, xtype, d, 4)

#define TQ_PER_DIM(d)           \
  TQ_ATTN_Q(d)                  \
  TQ_QUANT_X(float32, float, d) \
  TQ_QUANT_X(float16, half, d)  \
  TQ_QUANT_X(bfloat16, ushort, d)

TQ_PER_DIM(32)
TQ_PER_DIM(64)
TQ_PER_DIM(96)
TQ_PER_DIM(128)
TQ_PER_DIM(160)
TQ_PER_DIM(192)
TQ_PER_DIM(224)
TQ_PER_DIM(256)

#define TQ_DEQUANT_O(oname, otype)                                       \
  TQ_INSTANTIATE("tq_dequantize_" #oname "_b2", tq_dequantize, otype, 2) \
  TQ_INSTANTIATE("tq_dequantize_" #oname "_b3", tq_dequantize, otype, 3) \
  TQ_INSTANTIATE("tq_dequantize_" #oname "_b4", tq_dequantize, otype, 4)

TQ_DEQUANT_O(float32, float)
TQ_DEQUANT_O(float16, half)
TQ_DEQUANT_O(bfloat16, ushort)
TQ_INSTANTIATE("tq_copy_u32", tq_copy, uint)
TQ_INSTANTIATE("tq_copy_u16", tq_copy, ushort)

// Simdgroup-matrix attention: float16 / bfloat16 queries, head dims 64, 128, 256.
#define TQ_SIMD_ONE(qname, qtype, d, kb, vb) \
  TQ_INSTANTIATE(                            \
      "tq_attention_simd_" #qname "_d" #d "_k" #kb "_v" #vb, tq_attention_simd, qtype, d, kb, vb)

#define TQ_SIMD_V(qname, qtype, d, kb) \
  TQ_SIMD_ONE(qname, qtype, d, kb, 2)  \
  TQ_SIMD_ONE(qname, qtype, d, kb, 3)  \
  TQ_SIMD_ONE(qname, qtype, d, kb, 4)

#define TQ_SIMD_K(qname, qtype, d) \
  TQ_SIMD_V(qname, qtype, d, 2)    \
  TQ_SIMD_V(qname, qtype, d, 3)    \
  TQ_SIMD_V(qname, qtype, d, 4)

#define TQ_SIMD_D(d)          \
  TQ_SIMD_K(float16, half, d) \
  TQ_SIMD_K(bfloat16, ushort, d)

TQ_SIMD_D(64)
TQ_SIMD_D(128)
TQ_SIMD_D(256)
