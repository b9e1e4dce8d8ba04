// Layout: shared by the kernels (Metal and CUDA) and the host code.
// Argument structs and compile-time shapes shared by the host code (csrc/cuda,
// csrc/metal) and the kernels (tq_kernels.h). Plain data only: counts are int32,
// strides are int64 and in elements, int64 fields come first so that Metal and C++
// lay the structs out identically.
#pragma once

#if !defined(__METAL_VERSION__)
#include <stdint.h>
#endif

/// Threads of an attention threadgroup (4 simdgroups of 32).
#define TQ_ATTN_SIMDGROUPS 4
#define TQ_ATTN_THREADS (TQ_ATTN_SIMDGROUPS * 32)
/// The simdgroup-matrix attention kernel (tq_attention_simd.h): query rows per
/// threadgroup (one 8x8 fragment's rows) and tokens per threadgroup step (a tile of 8 per
/// simdgroup); same threadgroup size as the portable kernel.
#define TQ_ATTN_SIMD_ROWS 8
#define TQ_ATTN_SIMD_TILE 8
#define TQ_ATTN_SIMD_STEP (TQ_ATTN_SIMDGROUPS * TQ_ATTN_SIMD_TILE)
/// Threads of the split-K merge, quantize, dequantize and copy threadgroups.
#define TQ_MERGE_THREADS 128
#define TQ_QUANT_SIMDGROUPS 4
#define TQ_QUANT_THREADS (TQ_QUANT_SIMDGROUPS * 32)
// TQQuantParams::write: the cache buffers a quantize launch writes.
#define TQ_WRITE_CODES 1
#define TQ_WRITE_SCALES 2
#define TQ_DEQUANT_THREADS 256
#define TQ_COPY_THREADS 256
/// Most key splits one attention call uses (the merge keeps one weight per split in
/// threadgroup memory).
#define TQ_MAX_SPLITS 1024
/// Most tail tokens (uncompressed keys/values every query sees, e.g. fp16 sinks and the
/// recent window) one attention call takes; the merge keeps their weights in
/// threadgroup memory.
#define TQ_MAX_TAIL 256
/// Tail values the merge stages in threadgroup memory (floats: 40 tokens at head dim
/// 128, fewer at larger ones; see tq_attention_merge_impl).
#define TQ_MERGE_TAIL_VALUES 5120
/// Threadgroup floats of the merge: split weights, tail weights, the query row,
/// reduction scratch, staged tail values (26.7 KB, within Metal's 32 KB).
#define TQ_MERGE_SMEM (TQ_MAX_SPLITS + TQ_MAX_TAIL + 256 + 16 + TQ_MERGE_TAIL_VALUES)

/// The per-layer rotation R = H diag(s) / sqrt(D) of a power-of-two head dim D (H the
/// Walsh-Hadamard matrix in Sylvester order), for kernels that apply it themselves
/// instead of reading inputs that were rotated before: bit d of sign_bits set means
/// s_d = -1. on == 0: no rotation to apply.
struct TQRotation {
  unsigned int sign_bits[8];
  float scale; // 1 / sqrt(D)
  int on;
};

/// How the attention kernel for head dim D lays out its work.
///   T  lanes share one token (each holds DL = D/T coordinates of q, k, v and o);
///   GS = 32/T tokens are read side by side by one simdgroup;
///   U  tokens per lane group per loop step (loads issued together);
///   RC query rows (query heads x query positions of one KV head) per threadgroup,
///      kept in registers: q[RC][DL] and o[RC][DL].
template <int D>
struct TQAttnConfig {
  static constexpr int kPow2 = ((D / 16) & (D / 16 - 1)) == 0 && D / 16 <= 16;
  static constexpr int T = kPow2 ? D / 16 : 8;
  static constexpr int DL = D / T;
  static constexpr int GS = 32 / T;
  static constexpr int U = 2;
  static constexpr int RC = 64 / DL > 8 ? 8 : (64 / DL < 1 ? 1 : 64 / DL);
  static constexpr int STEP = TQ_ATTN_SIMDGROUPS * GS * U; // tokens per threadgroup step
  // threadgroup floats: 2 codebooks (16 each), per-group (m, l) for RC rows, and one
  // o[RC][D] per simdgroup for the final reduction.
  static constexpr int SMEM = 32 + 2 * TQ_ATTN_SIMDGROUPS * GS * RC + TQ_ATTN_SIMDGROUPS * RC * D;
  static_assert(SMEM % 4 == 0, "Metal threadgroup memory comes in multiples of 16 bytes");
};

/// Shape of tq_attention_simd_impl for head dim D (64, 128 or 256).
template <int D>
struct TQAttnSimdConfig {
  static constexpr int ROWS = TQ_ATTN_SIMD_ROWS; // query rows per threadgroup
  static constexpr int TILE = TQ_ATTN_SIMD_TILE; // tokens per simdgroup and step
  static constexpr int NSG = TQ_ATTN_SIMDGROUPS;
  static constexpr int STEP = TQ_ATTN_SIMD_STEP; // tokens per threadgroup step
  static_assert(ROWS == 8 && TILE == 8 && STEP == NSG * TILE, "one 8x8 fragment per step");
  static constexpr int KBLK = D / 8; // 8-wide blocks of the head dim
  // threadgroup floats: the two codebooks as half (16 floats), the query rows as half,
  // one tile of TILE tokens x D halves per simdgroup (staging of the float query rows
  // before the loop and the merge of O after it reuse it), (m, l) per simdgroup and row
  static constexpr int TAB = 16;
  static constexpr int QH = ROWS * D / 2;
  static constexpr int TILES = NSG * TILE * D / 2;
  static constexpr int RED = 2 * NSG * ROWS + 2 * NSG;
  static constexpr int SMEM = TAB + QH + TILES + RED;
  static_assert(SMEM % 4 == 0, "Metal threadgroup memory comes in multiples of 16 bytes");
  static_assert(TILES >= ROWS * D, "the float query rows and O fit the tiles' memory");
  static_assert(D % 32 == 0 && D <= 256, "head dims 32..256, multiples of 32");
};

/// Threadgroup memory of each kernel, in floats ([[threadgroup(0)]], set by the host):
/// attention (portable / simdgroup matrices), merge, quantize and exchange, dequantize.
#define TQ_QUANT_SMEM(d) (32 + TQ_QUANT_SIMDGROUPS * 2 * (d))
#define TQ_DEQUANT_SMEM 16

/// Attention over the compressed cache, pass 1 (or the only pass when n_splits == 1).
struct TQAttnParams {
  int64_t q_stride[3]; // q: batch, head, position (elements; last axis contiguous)
  int64_t kc_stride[3]; // key codes: batch, head, token (32-bit words)
  int64_t ks_stride[3]; // key scales: batch, head, token
  int64_t vc_stride[3]; // value codes
  int64_t vs_stride[3]; // value scales
  int64_t mask_stride[4]; // mask: batch, q head, q position, key (0 on broadcast axes)
  int batch;
  int q_heads;
  int kv_heads;
  int q_len; // L, 1..8
  int kv_len; // keys 0..kv_len-1 are valid
  int gqa; // q_heads / kv_heads
  int rows; // gqa * q_len: query rows served by one KV head
  int rows_per_tg; // query rows per threadgroup (<= TQAttnConfig<D>::RC)
  int n_splits; // key splits (grid y)
  int partials; // 0: single pass writing out/lse directly (n_splits == 1); 1: write
                // o_part/ml_part for the merge (several splits, or a tail to add)
  int split_len; // keys per split, a multiple of TQAttnConfig<D>::STEP
  float scale_log2; // softmax scale * log2(e)
  int causal; // 1: query i sees keys j <= kv_len - q_len + i
  int mask_kind; // 0 none, 1 bool (keep where true), 2 float32, 3 float16, 4 bfloat16 (additive)
  TQRotation rot; // rot.on: q is in model space, the kernel rotates it
};
// Code rows must allow the kernel's vector loads: when a lane reads 2 or 4 whole words
// of a token, every (batch, head, token) row start is 8 / 16-byte aligned (the host
// copies a cache that is not, see vector_aligned in the backends).

/// Split-K merge (pass 2): rows = batch * q_heads * q_len, row = (b * q_heads + h) *
/// q_len + l. With tail_len > 0 it also attends to the tail: keys/values (batch,
/// kv_heads, tail_len, D) in the queries' type and space (model space when rot.on)
/// that every query row sees. With centered != 0 the compressed tokens were stored
/// minus the per-head means key_mean / value_mean (float32 (batch, kv_heads, D), in the
/// queries' space) and the tail was not: the merge adds the means back, so that out
/// and lse are those of the uncentered keys and values.
struct TQMergeParams {
  int64_t q_stride[3]; // q: batch, head, position (read with a tail or means)
  int64_t tk_stride[3]; // tail keys: batch, kv head, token (last axis contiguous)
  int64_t tv_stride[3]; // tail values
  int64_t mean_stride[2]; // key_mean / value_mean: batch, kv head (last axis contiguous)
  int rows;
  int n_splits;
  int q_heads;
  int q_len;
  int gqa; // q_heads / kv_heads
  int tail_len; // 0: no tail
  float scale_log2; // softmax scale * log2(e)
  int unrotate_out; // 1: write R^T o for the compressed tokens' part (their values are
                    // stored rotated, the caller wants the model's space)
  int centered; // 1: key_mean / value_mean are given (see above)
  TQRotation rot; // the R of unrotate_out
};

/// Quantize-and-append: x (batch, heads, length, D) float32, float16 or bfloat16.
struct TQQuantParams {
  int64_t x_stride[3]; // batch, head, position (last axis contiguous)
  int64_t c_stride[3]; // codes buffer: batch, head, token (words)
  int64_t s_stride[3]; // scales buffer: batch, head, token
  int64_t mean_stride[2]; // mean (float32, centered only): batch, head (last axis contiguous)
  int64_t in_stride[3]; // incoming tokens (a ring exchange only): batch, head, position
  int batch;
  int heads;
  int length;
  int offset; // first token slot written
  int write; // TQ_WRITE_CODES | TQ_WRITE_SCALES: the buffers written
  int centered; // 1: quantize x - mean (before the rotation)
  TQRotation rot; // rot.on: x is in model space, the kernel rotates it first
};

/// Dequantize tokens [start, start + length) into slots [before, before + length) of
/// out (batch, heads, out_tokens, D); the other slots are the prefix / suffix rows or zero.
struct TQDequantParams {
  int64_t c_stride[3]; // codes: batch, head, token (words)
  int64_t s_stride[3]; // scales: batch, head, token
  int batch;
  int heads;
  int start;
  int length;
  int head_dim;
  int before; // first output slot of the decoded tokens
  int out_tokens; // output slots per head: before + length + after
  int has_prefix; // 1: slots [0, before) copy prefix (batch, heads, before, D), else zeros
  int has_suffix; // 1: slots [before + length, out_tokens) copy suffix, else zeros
};

/// Strided gather of up to 4 axes into a row-contiguous buffer, or (dst_strided) into
/// a strided one (write_tokens: a block of tokens written into a cache buffer).
struct TQCopyParams {
  int64_t shape[4];
  int64_t stride[4]; // source strides in elements
  int64_t size; // total elements
  int64_t dst_stride[4]; // destination strides in elements, when dst_strided
  int dst_strided;
};
