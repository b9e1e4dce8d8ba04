// Layout: Metal only (kernel instantiations).
// Every kernel of turboquant_mlx.metallib: the entry points of tq_entry.h instantiated
// under the names the host code (csrc/metal/eval_metal.cpp) builds:
//   tq_attention_<float32|float16|bfloat16>_d<D>_k<key bits>_v<value bits>
//   tq_attention_simd_<float16|bfloat16>_d<64|128|256>_k<key bits>_v<value bits>
//     (simdgroup matrices, tq_attention_simd.h: the fast path for half queries)
//   tq_attention_merge_<float32|float16|bfloat16>_d<D>
//   tq_quantize_<float32|float16|bfloat16>_d<D>_b<bits>
//   tq_exchange_<float32|float16|bfloat16>_d<D>_b<bits>   (a ring's exchange)
//   tq_dequantize_<float32|float16|bfloat16>_b<bits>
//   tq_copy_u32, tq_copy_u16
// D runs over the head dims the kernels support: multiples of 32 from 32 to 256.

#include "tq_entry.h"

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

#define TQ_EXCHANGE_X(xname, xtype, d)                                          \
  TQ_INSTANTIATE("tq_exchange_" #xname "_d" #d "_b2", tq_exchange, xtype, d, 2) \
  TQ_INSTANTIATE("tq_exchange_" #xname "_d" #d "_b3", tq_exchange, xtype, d, 3) \
  TQ_INSTANTIATE("tq_exchange_" #xname "_d" #d "_b4", tq_exchange, xtype, d, 4)

#define TQ_PER_DIM(d)              \
  TQ_ATTN_Q(d)                     \
  TQ_QUANT_X(float32, float, d)    \
  TQ_QUANT_X(float16, half, d)     \
  TQ_QUANT_X(bfloat16, ushort, d)  \
  TQ_EXCHANGE_X(float32, float, d) \
  TQ_EXCHANGE_X(float16, half, d)  \
  TQ_EXCHANGE_X(bfloat16, ushort, d)

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
