// Layout: CUDA only (kernel body).
// Attention over the compressed cache on NVIDIA tensor cores (mma.sync m16n8k16,
// float16 inputs, float32 accumulation): the CUDA fast path for float16 / bfloat16
// queries and head dims 64, 128, 256. Same contract, grid and split-K partials as
// tq_attention_impl (metal/tq_kernels.h), which stays the exact path (float32 queries,
// other head dims, or asked for by the tests) and the one the Metal build runs.
//
// Why tensor cores: decoding on CUDA cores spends ~8 FMAs per cached coordinate (GQA
// rows x keys and values) plus the code extraction, which made the SIMT kernel
// instruction-bound at ~15-20% of the H200's bandwidth. Here a 16-token tile costs,
// per warp, D/16 mma for the scores and D/16 for the values, and the codes are turned
// into float16 pairs by one shared-memory lookup per two coordinates.
//
// One warp, one 16-token tile, g = lane / 4, c = lane % 4 (mma fragment coordinates):
//
//   scores  S (16 tokens x 8 rows) = K (16 x D) . Q^T (D x 8)        [k = head dim]
//     A = K: thread holds tokens g and g+8 and, for k-block kb, head-dim slots
//     2c..2c+1 and 2c+8..2c+9. The head dim is permuted (a dot product does not care)
//     so that slot 2c+e <- dim c*D/4 + 4kb + e and slot 2c+8+e <- dim c*D/4 + 4kb+2+e:
//     each thread reads one contiguous D/4-coordinate slice of its two tokens, and
//     each pair of codes (2*KB bits) indexes a table of float16 centroid pairs.
//   values  O^T (D x 8 rows) += V^T (D x 16 tokens) . P^T (16 tokens x 8 rows)
//     A = V^T: thread holds dims g and g+8 of m-block mb for tokens 2c..2c+1 and
//     2c+8..2c+9; dim slot g <- dim g*D/8 + 2mb, slot g+8 <- g*D/8 + 2mb + 1, so each
//     thread reads a contiguous D/8 slice of four tokens, and the codes of the same
//     coordinate of two consecutive tokens index the same pair table.
//   P moves from the score layout (tokens on g) to the B layout (tokens on c) through
//   a 16 x rows float16 tile in shared memory; value scales are folded into P.
//
// The pair tables live in shared memory with one copy per lane (entry e of lane l at
// word e*32 + l), so that the 32 lanes' random lookups never share a bank.
//
// Loads: K4V4 at head dims <= 128 (the 16-warp shape, where registers are scarcest)
// copies each warp's next tile into a shared-memory ring with cp.async and reads it from
// there when it decodes it (TQMmaConfig::STAGED); the other shapes keep the next tiles'
// codes in registers. On an H200 the staging took 128k / 256k keys from 56.3 / 99.6 to
// 48.4 / 85.8 µs of device time.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "tq_kernels.h" // tq_mask_score, tq_neg_inf, TQAttnParams

// Knobs for tuning builds (-DTURBOQUANT_MMA_TUNE="TQ_MMA_TILES=2;..." in CMake,
// tools/mma_variants.sh); the defaults are what was measured and tested on an H200.
#ifndef TQ_MMA_TILES
#define TQ_MMA_TILES 1 // 16-token tiles per warp iteration
#endif
#ifndef TQ_MMA_WARPS_4BIT
#define TQ_MMA_WARPS_4BIT 16 // warps per block, K4V4, head dim <= 128, one row block
#endif
#ifndef TQ_MMA_CHAINS_4BIT
// independent score mma chains, K4V4 at head dims <= 128, one row block (divides D / 16;
// H200, 128k-256k keys, device time: 4 chains 2% faster than 2)
#define TQ_MMA_CHAINS_4BIT 4
#endif
#ifndef TQ_MMA_STAGES
// Warp iterations of codes and scales staged in shared memory by cp.async per warp
// (K4V4 at head dims <= 128), so that the loads hold no registers; 0 (and the other bit
// widths) loads them into registers one iteration ahead instead. H200, d128 K4V4, device
// time at 128k / 256k keys: 2 stages 48.4 / 85.8 µs, 3 stages 48.7 / 86.0, register
// loads 56.3 / 99.6. Two stages also keep the kernel within an A100's shared memory.
// Deeper in-flight reads through L2 instead (each warp issuing prefetch.global.L2 for
// the iterations 2 / 4 / 8 past its ring, one line per lane) were slower: 128k keys
// 49.1 / 50.6 / 64.6 µs against 47.3 without (kernel + merge, same H200 session).
#define TQ_MMA_STAGES 2
#endif
#ifndef TQ_MMA_PIPELINE
// Staged kernel only: 1 overlaps each tile's values with the next tile's scores in one
// block of code, 0 runs the phases of each tile one after another. H200, d128 K4V4,
// device time at 128k / 256k keys: 1 took 50.5 / 90.9 µs, 0 47.7 / 85.8 (the overlap
// needs registers that 16 warps of 128 do not leave); both pass the GPU tests.
#define TQ_MMA_PIPELINE 0
#endif

namespace turboquant_mlx::cuda_kernels {

/// Compile-time shape of the tensor-core kernel for head dim D and NRB blocks of 8 query
/// rows (1: up to 8 rows, e.g. decode with GQA <= 8; 2: up to 16).
template <int D, int KB, int VB, int NRB>
struct TQMmaConfig {
  static constexpr int KBLK = D / 16; // k-blocks of the score mma = m-blocks of the value mma
  static constexpr int MT = TQ_MMA_TILES; // 16-token tiles per warp iteration
  static constexpr int TILE = 16 * MT; // tokens per warp iteration
  // 4-bit keys: tables at a 64 KiB-aligned shared address (see tq_byte_addr), which
  // takes up to 128 KiB of shared memory: one block per SM, of 16 warps where 128
  // registers suffice (K4V4, head dims <= 128, one row block), 12 where 168 do (other
  // value bits), else 8. The kernel is latency-bound, so more warps in flight pay
  // (H200, d128 K4V4, 128k-256k keys, device time: 12 warps 15-17% faster than 8,
  // 16 warps 9-10% faster than 12; two tiles per warp iteration at 8 warps 4-5% faster
  // than 12 warps of one). Otherwise blocks of 4 warps, several per SM.
  static constexpr bool BYTE_ADDR = KB == 4;
  static constexpr int WARPS =
      BYTE_ADDR ? (D <= 128 && NRB == 1 ? (VB == 4 ? TQ_MMA_WARPS_4BIT : 12) : 8) : 4;
  static constexpr int THREADS = WARPS * 32;
  static constexpr int STEP = WARPS * TILE; // tokens per block iteration
  static constexpr int ROWS = 8 * NRB;
  // resident blocks per SM the registers are budgeted for (no spills at these limits)
  static constexpr int BLOCKS = BYTE_ADDR ? 1 : D <= 128 ? (NRB == 1 ? 3 : 2) : (NRB == 1 ? 2 : 1);
  // code words a thread reads per token: keys D/4 coordinates, values D/8
  static constexpr int KBITS = D / 4 * KB;
  static constexpr int VBITS = D / 8 * VB;
  static constexpr int KW = (KBITS + 31) / 32;
  // bytes per token of the codes (dense token axis, see tq_mma_load_tokens)
  static constexpr uint32_t KTOK = D * KB / 8;
  static constexpr uint32_t VTOK = D * VB / 8;
  static constexpr int VW = (VBITS + 31) / 32;
  // shared memory (bytes): the two pair tables and one P tile per warp; the final
  // merge reuses it for m, l and o of every warp.
  // Table entries are 128 bytes (32 lanes x one float16 pair), except with 4-bit keys:
  // 256 bytes, the key pair at +0 and (4-bit values) the value pair at +128, so that
  // one byte_perm turns a byte of codes into the lane's address (see tq_byte_addr).
  static constexpr int KSTRIDE = KB == 4 ? 256 : 128;
  static constexpr int VSTRIDE = VB == 4 ? 256 : 128;
  static constexpr int KTAB = (1 << (2 * KB)) * KSTRIDE;
  static constexpr int VOFF = VB == 4 ? 128 : KTAB; // value table offset
  static constexpr int VTAB = VB == 4 ? 0 : (1 << (2 * VB)) * VSTRIDE;
  // A warp's P tile: 16 tokens x ROWS float16 weights, token-major, so that a lane stores
  // its two rows of a token as one word and ldmatrix.trans reads the B fragments;
  // TSTRIDE halves per token (16 rows padded to 24: the stores and the ldmatrix rows
  // spread over the banks; 8 rows are conflict-free packed).
  static constexpr int TSTRIDE = ROWS == 8 ? 8 : ROWS + 8;
  static constexpr int PTILE = 16 * TSTRIDE * 2;
  static constexpr int TAB_ALIGN = BYTE_ADDR ? 65536 : 16; // of the tables' shared address
  // cp.async staging (see tq_mma_stage_copy): each warp owns a ring of STAGES stages,
  // each one warp iteration of codes and scales. Tokens are copied as they lie (a dense
  // token axis), except that the value rows are permuted and swizzled so that the
  // lanes' 8-byte reads of four tokens hit distinct banks. Scales are copied from the
  // 16-byte boundary below the iteration's first scale (SCH chunks per array).
  static constexpr bool STAGED = TQ_MMA_STAGES >= 2 && KB == 4 && VB == 4 && D <= 128;
  static constexpr int STAGES = STAGED ? TQ_MMA_STAGES : 0;
  // one tile's values overlapped with the next tile's scores (see the kernel's loop)
  static constexpr bool PIPELINED = STAGED && MT == 1 && TQ_MMA_PIPELINE;
  static constexpr int SCH = 2 * MT + 1;
  static constexpr int ST_V = TILE * KTOK; // stage offsets: keys at 0, then values,
  static constexpr int ST_KS = ST_V + TILE * VTOK; // key scales,
  static constexpr int ST_VS = ST_KS + 16 * SCH; // value scales
  static constexpr int STAGE_BYTES = ST_VS + 16 * SCH;
  static constexpr int RING = STAGES * STAGE_BYTES; // one warp's ring
  // The rings fill the gap below the aligned tables first and continue after the P
  // tiles: at most WARPS + 1 rings' worth beyond the tables and P tiles, or the gap.
  static constexpr int FIXED_SMEM = KTAB + VTAB + WARPS * PTILE;
  // warp 0's query fragments and their scale for the other warps, after the last ring
  static constexpr int QSHARE = NRB * KBLK * 2 * 32 * 4 + 16;
  static constexpr int LOOP_SMEM = FIXED_SMEM + QSHARE +
      (STAGED && (WARPS + 1) * RING > TAB_ALIGN - 16 ? (WARPS + 1) * RING : TAB_ALIGN - 16);
  // The final merge: a warp's accumulators as they lie in its registers, per (row block
  // nb, row parity e, m-block mb) a group of 64 floats, lane l's float2 (dims 2mb, 2mb+1
  // of its slice, row nb*8 + 2c + e) at 2l; groups 66 floats apart, so that the reads of
  // consecutive element pairs of a row (other groups, the same lanes) spread over the
  // banks. Then m and l of every warp, and the rows' maxima and sums.
  static constexpr int MERGE_GROUP = 66;
  static constexpr int MERGE_SLOTS = NRB * 2 * KBLK * MERGE_GROUP; // floats per warp
  static constexpr int MERGE_SMEM = (WARPS * (MERGE_SLOTS + 2 * ROWS) + 2 * ROWS) * 4;
  __host__ __device__ static constexpr int merge_slot(int nb, int e, int mb, int lane) {
    return ((nb * 2 + e) * KBLK + mb) * MERGE_GROUP + 2 * lane;
  }
  static constexpr int SMEM = LOOP_SMEM > MERGE_SMEM ? LOOP_SMEM : MERGE_SMEM;
};

__device__ __forceinline__ void tq_mma_16816(
    float (&d)[4],
    const uint32_t (&a)[4],
    uint32_t b0,
    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// 2^x (ex2.approx.ftz: relative error ~2^-22; -inf -> 0).
__device__ __forceinline__ float tq_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t tq_pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

/// Bits [pos, pos + n) of the little-endian bit stream a[] (pos, n known after
/// unrolling).
template <int N>
__device__ __forceinline__ uint32_t tq_bits_at(const uint32_t* a, int pos) {
  const int w = pos >> 5, o = pos & 31;
  uint32_t v = a[w] >> o;
  if (o + N > 32) {
    v |= a[w + 1] << (32 - o);
  }
  return v & ((1u << N) - 1u);
}

/// Loads the NBITS code bits of slice `j` (slices of NBITS bits each) of one token
/// into a[], shifted to start at bit 0. Whole-word slices use 16- or 8-byte loads
/// (the host guarantees the alignment, see vector_aligned in eval_cuda.cu).
template <int NBITS>
__device__ __forceinline__ void tq_load_slice(
    const uint32_t* __restrict__ tok,
    int j,
    uint32_t* a) {
  constexpr int NW = (NBITS + 31) / 32;
  if constexpr (NBITS % 32 == 0) {
    const uint32_t* p = tok + j * NW;
    if constexpr (NW % 4 == 0) {
#pragma unroll
      for (int i = 0; i < NW; i += 4) {
        uint4 v = __ldg(reinterpret_cast<const uint4*>(p + i));
        a[i] = v.x;
        a[i + 1] = v.y;
        a[i + 2] = v.z;
        a[i + 3] = v.w;
      }
    } else if constexpr (NW % 2 == 0) {
#pragma unroll
      for (int i = 0; i < NW; i += 2) {
        uint2 v = __ldg(reinterpret_cast<const uint2*>(p + i));
        a[i] = v.x;
        a[i + 1] = v.y;
      }
    } else {
#pragma unroll
      for (int i = 0; i < NW; ++i) {
        a[i] = __ldg(p + i);
      }
    }
  } else {
    // The slice starts mid-word: read one word more and funnel-shift. Reading past
    // the token's last word stays inside the buffer except for its very last token,
    // so the extra word is only read when the slice needs it.
    const int bit0 = j * NBITS;
    const int fw = bit0 >> 5;
    const uint32_t sh = uint32_t(bit0 & 31);
    uint32_t w[NW + 1];
#pragma unroll
    for (int i = 0; i <= NW; ++i) {
      const int last = (bit0 + NBITS - 1) >> 5;
      w[i] = fw + i <= last ? __ldg(tok + fw + i) : 0u;
    }
#pragma unroll
    for (int i = 0; i < NW; ++i) {
      a[i] = __funnelshift_r(w[i], w[i + 1], sh);
    }
  }
}

/// Codes and scales of one warp iteration (MT tiles of 16 tokens), held in registers
/// one iteration ahead of their use.
template <int D, int KB, int VB, int NRB>
struct TQMmaTile {
  typedef TQMmaConfig<D, KB, VB, NRB> C;
  uint32_t k[C::MT][2][C::KW]; // tokens g, g+8: key slice c
  uint32_t v[C::MT][4][C::VW]; // tokens 2c, 2c+1, 2c+8, 2c+9: value slice g
  // Scales of tokens g, g+8 as loaded (float16): converted where they are used, so that
  // the warp does not wait for the loads right after issuing them.
  __half ks[C::MT][2]; // keys
  __half vs[C::MT][2]; // values (folded into P)
};

/// One (batch, KV head) of the cache as this lane reads it: block-wide bases, and this
/// lane's slice kc_lane / vc_lane bytes into a token's codes when slices are whole words
/// (kj / vj = 0), else kj / vj is the slice index. A token's address is the base plus a
/// 32-bit offset (the host checks that every offset fits).
struct TQMmaCache {
  const unsigned char* kc;
  const unsigned char* ks;
  const unsigned char* vc;
  const unsigned char* vs;
  uint32_t kc_lane, vc_lane;
  int kj, vj;
};

/// Codes and scales of the warp iteration at tokens t0 .. t0 + TILE - 1 (CLAMP: tokens
/// past t_last re-read it). Tokens sit KTOK / VTOK / 2 bytes apart (the host makes the
/// token axis dense), so without CLAMP every token's address is one constant offset
/// from the lane's first.
template <int D, int KB, int VB, int NRB, bool CLAMP>
__device__ __forceinline__ void tq_mma_load_tokens(
    TQMmaTile<D, KB, VB, NRB>& tl,
    const TQMmaCache& c,
    int t0,
    int t_last,
    int g,
    int cc) {
  typedef TQMmaConfig<D, KB, VB, NRB> C;
  // Token t0 + i of this lane's first key (g) and value (2c) token, as byte pointers:
  // without CLAMP the lane's first token plus a constant (an immediate offset of the load).
  const uint32_t tk0 = uint32_t(t0 + g), tv0 = uint32_t(t0 + 2 * cc);
  const unsigned char* kc0 = c.kc + (tk0 * C::KTOK + c.kc_lane);
  const unsigned char* vc0 = c.vc + (tv0 * C::VTOK + c.vc_lane);
  const unsigned char* ks0 = c.ks + 2u * tk0;
  const unsigned char* vs0 = c.vs + 2u * tk0;
  auto at = [&](const unsigned char* first, uint32_t t_first, int i, uint32_t tok, uint32_t lane) {
    if constexpr (CLAMP) {
      const uint32_t t = uint32_t(min(int(t_first) + i, t_last));
      return (first - (t_first * tok + lane)) + (t * tok + lane);
    } else {
      return first + i * tok;
    }
  };
#pragma unroll
  for (int m = 0; m < C::MT; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = 16 * m + 8 * h;
      tq_load_slice<C::KBITS>(
          reinterpret_cast<const uint32_t*>(at(kc0, tk0, i, C::KTOK, c.kc_lane)), c.kj, tl.k[m][h]);
      tl.ks[m][h] = *reinterpret_cast<const __half*>(at(ks0, tk0, i, 2u, 0u));
      tl.vs[m][h] = *reinterpret_cast<const __half*>(at(vs0, tk0, i, 2u, 0u));
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = 16 * m + (j & 1) + 8 * (j >> 1);
      tq_load_slice<C::VBITS>(
          reinterpret_cast<const uint32_t*>(at(vc0, tv0, i, C::VTOK, c.vc_lane)), c.vj, tl.v[m][j]);
    }
  }
}

/// Loads the warp iteration at t0 (uniform within the warp) if it holds keys: the plain
/// addressing when it lies wholly before t_end, else clamped to the last key.
template <int D, int KB, int VB, int NRB>
__device__ __forceinline__ void tq_mma_load(
    TQMmaTile<D, KB, VB, NRB>& tl,
    const TQMmaCache& c,
    int t0,
    int t_end,
    int g,
    int cc) {
  typedef TQMmaConfig<D, KB, VB, NRB> C;
  if (t0 + C::TILE <= t_end) {
    tq_mma_load_tokens<D, KB, VB, NRB, false>(tl, c, t0, t_end - 1, g, cc);
  } else if (t0 < t_end) {
    tq_mma_load_tokens<D, KB, VB, NRB, true>(tl, c, t0, t_end - 1, g, cc);
  }
}

/// cp.async of 16 bytes from global `src` to shared address `dst`, of which the first
/// `src_bytes` (0..16) are read and the rest zero-filled (L2 only: read once).
__device__ __forceinline__ void tq_cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile(
      "cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
      : "memory");
}

__device__ __forceinline__ void tq_cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/// Waits until at most N of this thread's committed cp.async groups are pending.
template <int N>
__device__ __forceinline__ void tq_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/// Row of token t (of a 16-token tile) in a stage's values: tokens 4..7 and 12..15 swap
/// rows in pairs, so that tokens 2c (c = 0..3), read together, fall on two even and two
/// odd rows.
__device__ __forceinline__ uint32_t tq_stage_vrow(uint32_t t) {
  return t ^ ((t >> 2) & 1u);
}

/// Byte swizzle within a stage's value row of token t: rows of 64 bytes hold 16 banks,
/// so of the two even (odd) rows read together one is read with its 32-byte halves
/// swapped.
template <int VTOK>
__device__ __forceinline__ uint32_t tq_stage_vswz(uint32_t t) {
  return VTOK >= 64 ? ((t >> 1) & 1u) << 5 : 0u;
}

/// This lane's part of staging a warp iteration: 16-byte chunks lane + 32 r of the
/// iteration's keys and of its values, and their offsets in a stage (constant per lane).
template <int D, int KB, int VB, int NRB>
struct TQMmaStageLane {
  typedef TQMmaConfig<D, KB, VB, NRB> C;
  static constexpr int KCH = C::KTOK / 16, VCH = C::VTOK / 16; // chunks per token
  static constexpr int KR = C::TILE * KCH / 32, VR = C::TILE * VCH / 32; // chunks per lane
  static_assert(C::TILE * KCH % 32 == 0 && C::TILE * VCH % 32 == 0, "whole rounds of chunks");
  uint32_t vdst[VR]; // keys land at 16 * chunk: no table needed
  // Lanes 0 .. 2 SCH - 1: scale chunk s of the keys (lanes 0..SCH-1) or values. The
  // chunk of the iteration at t0 starts 2 t0 + soff bytes after sbase (the head's first
  // key or value scale; sc_k / sc_v: bytes from an iteration's first scale down to the
  // 16-byte boundary its chunks start at) and lands at sdst in a stage.
  const unsigned char* sbase;
  int soff;
  uint32_t sdst;

  __device__ __forceinline__ TQMmaStageLane(
      int lane,
      const unsigned char* ks,
      const unsigned char* vs,
      uint32_t sc_k,
      uint32_t sc_v) {
#pragma unroll
    for (int r = 0; r < VR; ++r) {
      const uint32_t j = uint32_t(lane + 32 * r), t = j / VCH, k = j % VCH;
      const uint32_t row = (t & ~15u) | tq_stage_vrow(t & 15u);
      vdst[r] = C::ST_V + row * C::VTOK + ((16u * k) ^ tq_stage_vswz<C::VTOK>(t & 15u));
    }
    const bool values = lane >= C::SCH;
    const int s = values ? lane - C::SCH : lane;
    sbase = values ? vs : ks;
    soff = 16 * s - int(values ? sc_v : sc_k);
    sdst = (values ? C::ST_VS : C::ST_KS) + 16u * s;
    asm volatile("" : "+l"(sbase), "+r"(soff), "+r"(sdst)); // (kept, not recomputed)
  }
};

/// Issues the cp.async copies of the warp iteration at t0 into the stage at shared
/// address `stage` (layout: TQMmaConfig::ST_*), tokens from t_end on zero-filled, and
/// commits them as one group (an empty group when t0 >= t_end, so that every iteration
/// commits one).
template <int D, int KB, int VB, int NRB>
__device__ __forceinline__ void tq_mma_stage_copy(
    uint32_t stage,
    const TQMmaCache& c,
    const TQMmaStageLane<D, KB, VB, NRB>& sl,
    int t0,
    int t_end,
    int lane) {
  typedef TQMmaConfig<D, KB, VB, NRB> C;
  typedef TQMmaStageLane<D, KB, VB, NRB> SL;
  if (t0 < t_end) {
    const unsigned char* kc = c.kc + (uint32_t(t0) * C::KTOK + 16u * lane);
    const unsigned char* vc = c.vc + (uint32_t(t0) * C::VTOK + 16u * lane);
    // The scale chunks reach at most 8 SCH tokens past t0 (whole tile and beyond): if
    // that is before the split's end, nothing is clipped (every tile but a split's last).
    if (t0 + 8 * C::SCH <= t_end) {
#pragma unroll
      for (int r = 0; r < SL::KR; ++r) {
        tq_cp_async16(stage + 16u * (lane + 32 * r), kc + 512 * r, 16u);
      }
#pragma unroll
      for (int r = 0; r < SL::VR; ++r) {
        tq_cp_async16(stage + sl.vdst[r], vc + 512 * r, 16u);
      }
      if (lane < 2 * C::SCH) {
        tq_cp_async16(stage + sl.sdst, sl.sbase + (2 * t0 + sl.soff), 16u);
      }
    } else {
#pragma unroll
      for (int r = 0; r < SL::KR; ++r) {
        const bool in = t0 + (lane + 32 * r) / SL::KCH < t_end;
        tq_cp_async16(stage + 16u * (lane + 32 * r), in ? kc + 512 * r : c.kc, in ? 16u : 0u);
      }
#pragma unroll
      for (int r = 0; r < SL::VR; ++r) {
        const bool in = t0 + (lane + 32 * r) / SL::VCH < t_end;
        tq_cp_async16(stage + sl.vdst[r], in ? vc + 512 * r : c.vc, in ? 16u : 0u);
      }
      if (lane < 2 * C::SCH) { // a scale chunk, clipped to the split's end
        const int off = 2 * t0 + sl.soff;
        const int n = min(16, max(0, 2 * t_end - off));
        tq_cp_async16(stage + sl.sdst, n > 0 ? sl.sbase + off : sl.sbase, uint32_t(n));
      }
    }
  }
  tq_cp_async_commit();
}

/// Keys and scales of one staged warp iteration, from shared memory into registers.
template <int D, int KB, int VB, int NRB>
__device__ __forceinline__ void tq_mma_stage_read_keys(
    TQMmaTile<D, KB, VB, NRB>& tl,
    const unsigned char* stage,
    int g,
    int cc,
    uint32_t sc_k,
    uint32_t sc_v) {
  typedef TQMmaConfig<D, KB, VB, NRB> C;
  static_assert(C::KW % 2 == 0, "staged key slices: 8 or 16 bytes");
#pragma unroll
  for (int m = 0; m < C::MT; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = 16 * m + g + 8 * h;
      const uint32_t* kp =
          reinterpret_cast<const uint32_t*>(stage + t * C::KTOK + cc * (C::KW * 4));
#pragma unroll
      for (int i = 0; i < C::KW; i += (C::KW % 4 == 0 ? 4 : 2)) {
        if constexpr (C::KW % 4 == 0) {
          const uint4 w = *reinterpret_cast<const uint4*>(kp + i);
          tl.k[m][h][i] = w.x;
          tl.k[m][h][i + 1] = w.y;
          tl.k[m][h][i + 2] = w.z;
          tl.k[m][h][i + 3] = w.w;
        } else {
          const uint2 w = *reinterpret_cast<const uint2*>(kp + i);
          tl.k[m][h][i] = w.x;
          tl.k[m][h][i + 1] = w.y;
        }
      }
      tl.ks[m][h] = *reinterpret_cast<const __half*>(stage + C::ST_KS + sc_k + 2 * t);
      tl.vs[m][h] = *reinterpret_cast<const __half*>(stage + C::ST_VS + sc_v + 2 * t);
    }
  }
}

/// This lane's value slices of tokens 2c, 2c+1, 2c+8, 2c+9 of tile m of a staged warp
/// iteration (rows and swizzle as tq_mma_stage_copy put them). The four share one
/// swizzle, and tokens 2c and 2c+1 sit in the two rows of a pair (which one is which
/// depends on c only), so the addresses are one base, that base with the row bit
/// flipped, and both 8 rows further: two registers and immediate offsets.
template <int D, int KB, int VB, int NRB>
__device__ __forceinline__ void tq_mma_stage_read_values(
    uint32_t (&v)[4][TQMmaConfig<D, KB, VB, NRB>::VW],
    const unsigned char* stage,
    int m,
    int g,
    int cc) {
  typedef TQMmaConfig<D, KB, VB, NRB> C;
  static_assert(C::VW == 1 || C::VW == 2, "staged value slices: 4 or 8 bytes");
  static_assert(
      (C::VTOK & (C::VTOK - 1)) == 0 && C::ST_V % (2 * C::VTOK) == 0,
      "a row pair's rows differ in one address bit");
  const uint32_t t0 = 2u * uint32_t(cc); // token 2c of the tile
  const uint32_t a0 = C::ST_V + (16u * m + tq_stage_vrow(t0)) * C::VTOK +
      ((uint32_t(g) * (C::VW * 4)) ^ tq_stage_vswz<C::VTOK>(t0));
  const uint32_t at[4] = {a0, a0 ^ C::VTOK, a0 + 8 * C::VTOK, (a0 ^ C::VTOK) + 8 * C::VTOK};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (C::VW == 2) {
      const uint2 w = *reinterpret_cast<const uint2*>(stage + at[j]);
      v[j][0] = w.x;
      v[j][1] = w.y;
    } else {
      v[j][0] = *reinterpret_cast<const uint32_t*>(stage + at[j]);
    }
  }
}

/// Codes and scales of one staged warp iteration, from shared memory into registers.
template <int D, int KB, int VB, int NRB>
__device__ __forceinline__ void tq_mma_stage_read(
    TQMmaTile<D, KB, VB, NRB>& tl,
    const unsigned char* stage,
    int g,
    int cc,
    uint32_t sc_k,
    uint32_t sc_v) {
  tq_mma_stage_read_keys<D, KB, VB, NRB>(tl, stage, g, cc, sc_k, sc_v);
#pragma unroll
  for (int m = 0; m < TQMmaConfig<D, KB, VB, NRB>::MT; ++m) {
    tq_mma_stage_read_values<D, KB, VB, NRB>(tl.v[m], stage, m, g, cc);
  }
}

/// Shared address of the entry that byte k of w indexes in a 256-byte-stride table, in
/// this lane's column: lane_base = table address (a multiple of 64 KiB) | 4 * lane, so
/// one byte_perm [lane_base.byte 0, w.byte k, lane_base.byte 2, lane_base.byte 3] forms
/// the whole address (k is a constant after unrolling: the selector is an immediate).
/// Without the alignment every lookup needs one more add: ptxas keeps the table base
/// in a register and adds it to each address when the loop holds warp-synchronous
/// operations (shuffles, __syncwarp), which the softmax and the P exchange need.
__device__ __forceinline__ uint32_t tq_byte_addr(uint32_t w, uint32_t lane_base, int k) {
  return __byte_perm(w, lane_base, 0x7604u | (uint32_t(k) << 4));
}

/// The word at shared-memory address `addr` (shared window, not generic).
__device__ __forceinline__ uint32_t tq_lds(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

/// Float16 centroid pair of table entry `idx` for this lane (tab: shared address of the
/// lane's column of the table, entries STRIDE bytes apart).
template <int STRIDE>
__device__ __forceinline__ uint32_t tq_pair(uint32_t tab, uint32_t idx) {
  return tq_lds(tab + idx * STRIDE);
}

/// Fills a pair table at shared pointer `tab` (entries STRIDE bytes apart, 32 lane
/// columns of 4 bytes each): entry e = float16 pair (cent[e % 2^B], cent[e / 2^B]), where
/// `mine` is lane l's cent[l % 2^B].
template <int B, int STRIDE>
__device__ __forceinline__ void tq_mma_pair_table(
    unsigned char* tab,
    float mine,
    int warp,
    int lane,
    int warps) {
  constexpr int ENTRIES = 1 << (2 * B), MASK = (1 << B) - 1;
  for (int e0 = 4 * warp; e0 < ENTRIES; e0 += 4 * warps) { // uniform within a warp
    const int e = e0 + (lane >> 3);
    const uint32_t pair = tq_pack_half2(
        __shfl_sync(0xffffffffu, mine, e & MASK), __shfl_sync(0xffffffffu, mine, e >> B));
    *reinterpret_cast<uint4*>(tab + e * STRIDE + 16 * (lane & 7)) =
        make_uint4(pair, pair, pair, pair);
  }
}

/// Online-softmax state of one thread: rows nb*8 + 2c + {0, 1} for each row block nb.
template <int D, int NRB>
struct TQMmaAcc {
  float o[NRB][D / 16][4]; // value-mma accumulators (dims g / g+8 of m-block mb)
  float m[NRB][2]; // running max (log2 units), shared by the 8 lanes of a row pair
  float l[NRB][2]; // this lane's partial sum of exp2(s - m)
};

/// Scores of one warp iteration (MT tiles of 16 tokens at t0), in log2 units:
/// s[m][nb][0..1] token g (rows 2c, 2c+1), [2..3] token g+8; CHECK: masked ones -inf.
template <int D, int KB, int VB, int NRB, bool CHECK>
__device__ __forceinline__ void tq_mma_scores(
    float (&s)[TQMmaConfig<D, KB, VB, NRB>::MT][NRB][4],
    const TQMmaTile<D, KB, VB, NRB>& tl,
    const uint32_t (&qf)[NRB][D / 16][2],
    uint32_t lane_base, // tables' shared address + 4 * lane
    int t0,
    int t_end,
    int row0,
    int b,
    int kvh,
    int g,
    int cc,
    const unsigned char* mask,
    const TQAttnParams& p,
    float score_up) { // 2^qexp: the scale the queries were divided by
  typedef TQMmaConfig<D, KB, VB, NRB> C;
  constexpr int KBLK = C::KBLK;
  const uint32_t ktab = lane_base; // this lane's column of the tables (see TQMmaConfig)

  // K-blocks kb mod NCH accumulate apart (NCH mma chains of 1/NCH the length) where the
  // registers allow it (head dims <= 128: 2, K4V4 with one row block: 4).
  constexpr int NCH = D > 128 ? 1 : (KB == 4 && VB == 4 && NRB == 1 ? TQ_MMA_CHAINS_4BIT : 2);
#pragma unroll
  for (int m = 0; m < C::MT; ++m) {
    float s2[NCH][NRB][4];
#pragma unroll
    for (int nb = 0; nb < NRB; ++nb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int ch = 0; ch < NCH; ++ch) {
          s2[ch][nb][i] = 0.0f;
        }
      }
    }
#pragma unroll
    for (int kb = 0; kb < KBLK; ++kb) {
      uint32_t a[4];
      if constexpr (KB == 4) {
        // k-block kb: bytes 2kb, 2kb+1 of the slice (word kb / 2)
        const uint32_t w0 = tl.k[m][0][kb >> 1], w1 = tl.k[m][1][kb >> 1];
        const int k0 = 2 * (kb & 1);
        a[0] = tq_lds(tq_byte_addr(w0, lane_base, k0));
        a[1] = tq_lds(tq_byte_addr(w1, lane_base, k0));
        a[2] = tq_lds(tq_byte_addr(w0, lane_base, k0 + 1));
        a[3] = tq_lds(tq_byte_addr(w1, lane_base, k0 + 1));
      } else {
        a[0] = tq_pair<C::KSTRIDE>(ktab, tq_bits_at<2 * KB>(tl.k[m][0], (4 * kb) * KB));
        a[1] = tq_pair<C::KSTRIDE>(ktab, tq_bits_at<2 * KB>(tl.k[m][1], (4 * kb) * KB));
        a[2] = tq_pair<C::KSTRIDE>(ktab, tq_bits_at<2 * KB>(tl.k[m][0], (4 * kb + 2) * KB));
        a[3] = tq_pair<C::KSTRIDE>(ktab, tq_bits_at<2 * KB>(tl.k[m][1], (4 * kb + 2) * KB));
      }
#pragma unroll
      for (int nb = 0; nb < NRB; ++nb) {
        tq_mma_16816(s2[kb % NCH][nb], a, qf[nb][kb][0], qf[nb][kb][1]);
      }
    }
#pragma unroll
    for (int nb = 0; nb < NRB; ++nb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float sum = s2[0][nb][i];
#pragma unroll
        for (int ch = 1; ch < NCH; ++ch) {
          sum += s2[ch][nb][i];
        }
        s[m][nb][i] = sum * (__half2float(tl.ks[m][i >> 1]) * score_up);
      }
    }
    if (CHECK) {
#pragma unroll
      for (int nb = 0; nb < NRB; ++nb) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int tok = t0 + 16 * m + g + 8 * (i >> 1);
          const int row = row0 + nb * 8 + 2 * cc + (i & 1);
          tq_mask_score(s[m][nb][i], mask, p, b, kvh, row, tok, t_end);
        }
      }
    }
  }
}

/// Online softmax of one warp iteration's scores: updates the running maxima and sums,
/// rescales the accumulators when a maximum grew, and turns s into the weights P, with
/// the value scales vs folded in.
template <int D, int NRB, int MT, bool CHECK>
__device__ __forceinline__ void tq_mma_softmax(
    TQMmaAcc<D, NRB>& acc,
    float (&s)[MT][NRB][4],
    const __half (&vs)[MT][2]) {
  constexpr int KBLK = D / 16;
  // Per row (rows 2c, 2c+1 of each row block; the 8 lanes g of a row pair reduce with
  // xor-shuffles over lane bits 2..4). The running maxima only change when some score
  // of the tile exceeds them, which after the first tiles is rare: one vote decides,
  // and the reduction (three dependent shuffles per row) and the rescale of the
  // accumulators run only then. The weights stay <= 1 either way. (Head dim 256
  // reduces and rescales every tile: the branch costs registers there.)
  bool grow = D > 128;
  if constexpr (D <= 128) {
#pragma unroll
    for (int nb = 0; nb < NRB; ++nb) {
#pragma unroll
      for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          grow = grow || s[m][nb][i] > acc.m[nb][i & 1];
        }
      }
    }
    grow = __any_sync(0xffffffffu, grow);
  }
  if (grow) {
#pragma unroll
    for (int nb = 0; nb < NRB; ++nb) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float mx = acc.m[nb][e];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mx = fmaxf(mx, fmaxf(s[m][nb][e], s[m][nb][e + 2]));
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        // mx == -inf: nothing visible yet for this row
        const float f = mx == tq_neg_inf() ? 1.0f : tq_ex2(acc.m[nb][e] - mx);
        acc.l[nb][e] *= f;
#pragma unroll
        for (int mb = 0; mb < KBLK; ++mb) {
          acc.o[nb][mb][e] *= f;
          acc.o[nb][mb][e + 2] *= f;
        }
        acc.m[nb][e] = mx;
      }
    }
  }
#pragma unroll
  for (int nb = 0; nb < NRB; ++nb) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float mx = acc.m[nb][e];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float sv = s[m][nb][e + 2 * h];
          // masked (CHECK) scores are -inf, and so is mx while a row saw none
          const float pv = (CHECK && sv == tq_neg_inf()) ? 0.0f : tq_ex2(sv - mx);
          acc.l[nb][e] += pv;
          s[m][nb][e + 2 * h] = pv * __half2float(vs[m][h]); // value scale folded into P
        }
      }
    }
  }
}

/// The weights of one 16-token tile (s: the score layout, tokens on g) as B fragments
/// of the value mma (tokens on c), through the warp's P tile: pb[nb][0] tokens 2c, 2c+1,
/// pb[nb][1] tokens 2c+8, 2c+9, of row nb*8 + g. Each lane stores rows 2c, 2c+1 of
/// tokens g and g+8 (a word each); one ldmatrix.trans per row block reads both
/// fragments (lanes 0-15 address tokens 0-15).
template <int D, int KB, int VB, int NRB>
__device__ __forceinline__ void tq_mma_p_fragments(
    uint32_t (&pb)[NRB][2],
    const float (&s)[NRB][4],
    __half* ptile,
    int g,
    int cc) {
  typedef TQMmaConfig<D, KB, VB, NRB> C;
  uint32_t* pw = reinterpret_cast<uint32_t*>(ptile);
  __syncwarp(); // the previous tile's fragments were read
#pragma unroll
  for (int nb = 0; nb < NRB; ++nb) {
    pw[(g * C::TSTRIDE + nb * 8) / 2 + cc] = tq_pack_half2(s[nb][0], s[nb][1]);
    pw[((g + 8) * C::TSTRIDE + nb * 8) / 2 + cc] = tq_pack_half2(s[nb][2], s[nb][3]);
  }
  __syncwarp();
  const uint32_t row =
      uint32_t(__cvta_generic_to_shared(ptile)) + 2u * uint32_t(((4 * g + cc) & 15) * C::TSTRIDE);
#pragma unroll
  for (int nb = 0; nb < NRB; ++nb) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(pb[nb][0]), "=r"(pb[nb][1])
                 : "r"(row + 16u * nb)
                 : "memory");
  }
}

/// Adds one 16-token tile's values, weighted by pb, to the accumulators. v: this lane's
/// value slices of tokens 2c, 2c+1, 2c+8, 2c+9.
template <int D, int KB, int VB, int NRB>
__device__ __forceinline__ void tq_mma_values(
    TQMmaAcc<D, NRB>& acc,
    const uint32_t (&v)[4][TQMmaConfig<D, KB, VB, NRB>::VW],
    const uint32_t (&pb)[NRB][2],
    uint32_t lane_base) {
  typedef TQMmaConfig<D, KB, VB, NRB> C;
  constexpr int KBLK = C::KBLK;
  const uint32_t vtab = C::VOFF + lane_base;
  if constexpr (VB == 4) {
    // Word j of a token's slice holds coordinates 8j..8j+7: m-blocks 4j..4j+3. The
    // codes of one coordinate of two tokens are interleaved into bytes: even
    // coordinates (slot g) and odd ones (slot g+8), for tokens 2c, 2c+1 and 2c+8, 2c+9.
#pragma unroll
    for (int j = 0; j < C::VW; ++j) {
      const uint32_t w0 = v[0][j], w1 = v[1][j];
      const uint32_t w2 = v[2][j], w3 = v[3][j];
      const uint32_t e01 = (w0 & 0x0F0F0F0Fu) | ((w1 << 4) & 0xF0F0F0F0u);
      const uint32_t o01 = ((w0 >> 4) & 0x0F0F0F0Fu) | (w1 & 0xF0F0F0F0u);
      const uint32_t e23 = (w2 & 0x0F0F0F0Fu) | ((w3 << 4) & 0xF0F0F0F0u);
      const uint32_t o23 = ((w2 >> 4) & 0x0F0F0F0Fu) | (w3 & 0xF0F0F0F0u);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        // byte k -> m-block 4j + k
        uint32_t a[4];
        a[0] = tq_lds(tq_byte_addr(e01, lane_base, k) + C::VOFF);
        a[1] = tq_lds(tq_byte_addr(o01, lane_base, k) + C::VOFF);
        a[2] = tq_lds(tq_byte_addr(e23, lane_base, k) + C::VOFF);
        a[3] = tq_lds(tq_byte_addr(o23, lane_base, k) + C::VOFF);
#pragma unroll
        for (int nb = 0; nb < NRB; ++nb) {
          tq_mma_16816(acc.o[nb][4 * j + k], a, pb[nb][0], pb[nb][1]);
        }
      }
    }
  } else {
#pragma unroll
    for (int mb = 0; mb < KBLK; ++mb) {
      // coordinate 2mb (dim slot g) and 2mb+1 (slot g+8) of this thread's value slice
      const uint32_t c00 = tq_bits_at<VB>(v[0], (2 * mb) * VB);
      const uint32_t c01 = tq_bits_at<VB>(v[1], (2 * mb) * VB);
      const uint32_t c02 = tq_bits_at<VB>(v[2], (2 * mb) * VB);
      const uint32_t c03 = tq_bits_at<VB>(v[3], (2 * mb) * VB);
      const uint32_t c10 = tq_bits_at<VB>(v[0], (2 * mb + 1) * VB);
      const uint32_t c11 = tq_bits_at<VB>(v[1], (2 * mb + 1) * VB);
      const uint32_t c12 = tq_bits_at<VB>(v[2], (2 * mb + 1) * VB);
      const uint32_t c13 = tq_bits_at<VB>(v[3], (2 * mb + 1) * VB);
      uint32_t a[4];
      a[0] = tq_pair<C::VSTRIDE>(vtab, c00 | (c01 << VB)); // dim slot g, tokens 2c, 2c+1
      a[1] = tq_pair<C::VSTRIDE>(vtab, c10 | (c11 << VB)); // slot g+8
      a[2] = tq_pair<C::VSTRIDE>(vtab, c02 | (c03 << VB)); // slot g, tokens 2c+8, 2c+9
      a[3] = tq_pair<C::VSTRIDE>(vtab, c12 | (c13 << VB));
#pragma unroll
      for (int nb = 0; nb < NRB; ++nb) {
        tq_mma_16816(acc.o[nb][mb], a, pb[nb][0], pb[nb][1]);
      }
    }
  }
}

/// One warp iteration: MT tiles of 16 tokens starting at t0, one phase after another.
template <int D, int KB, int VB, int NRB, bool CHECK>
__device__ __forceinline__ void tq_mma_step(
    TQMmaAcc<D, NRB>& acc,
    const TQMmaTile<D, KB, VB, NRB>& tl,
    const uint32_t (&qf)[NRB][D / 16][2],
    uint32_t lane_base,
    __half* ptile,
    int t0,
    int t_end,
    int row0,
    int b,
    int kvh,
    int g,
    int cc,
    const unsigned char* mask,
    const TQAttnParams& p,
    float score_up) {
  typedef TQMmaConfig<D, KB, VB, NRB> C;
  float s[C::MT][NRB][4];
  tq_mma_scores<D, KB, VB, NRB, CHECK>(
      s, tl, qf, lane_base, t0, t_end, row0, b, kvh, g, cc, mask, p, score_up);
  tq_mma_softmax<D, NRB, C::MT, CHECK>(acc, s, tl.vs);
#pragma unroll
  for (int m = 0; m < C::MT; ++m) {
    uint32_t pb[NRB][2];
    tq_mma_p_fragments<D, KB, VB, NRB>(pb, s[m], ptile, g, cc);
    tq_mma_values<D, KB, VB, NRB>(acc, tl.v[m], pb, lane_base);
  }
}

/// Grid: (row chunks of 8*NRB rows, n_splits, batch * kv_heads); TQMmaConfig::THREADS threads;
/// dynamic shared memory TQMmaConfig::SMEM bytes. Arguments as tq_attention_impl;
/// q is float16 or (q_bf16 != 0) bfloat16.
template <int D, int KB, int VB, int NRB>
__global__ void __launch_bounds__(
    TQMmaConfig<D, KB, VB, NRB>::THREADS,
    TQMmaConfig<D, KB, VB, NRB>::BLOCKS)
    tq_attention_mma_kernel(
        const void* __restrict__ q,
        const uint32_t* __restrict__ k_codes,
        const __half* __restrict__ k_scales,
        const uint32_t* __restrict__ v_codes,
        const __half* __restrict__ v_scales,
        const float* __restrict__ k_cent,
        const float* __restrict__ v_cent,
        const unsigned char* __restrict__ mask,
        float* __restrict__ out,
        float* __restrict__ lse,
        float* __restrict__ o_part,
        float* __restrict__ ml_part,
        const __grid_constant__ TQAttnParams p,
        int q_bf16) {
  typedef TQMmaConfig<D, KB, VB, NRB> C;
  constexpr int KBLK = C::KBLK, ROWS = C::ROWS;
  extern __shared__ __align__(16) unsigned char tq_mma_smem[];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, cc = lane & 3;
  const int chunk = blockIdx.x, split = blockIdx.y;
  const int b = blockIdx.z / p.kv_heads, kvh = blockIdx.z % p.kv_heads;
  const int row0 = chunk * ROWS;
  const int nr = min(ROWS, p.rows - row0);
  // tables from the first TAB_ALIGN-aligned shared address, then the warps' P tiles
  const uint32_t smem_addr = uint32_t(__cvta_generic_to_shared(tq_mma_smem));
  const uint32_t tab_off = (C::TAB_ALIGN - (smem_addr & (C::TAB_ALIGN - 1))) & (C::TAB_ALIGN - 1);
  unsigned char* tabs = tq_mma_smem + tab_off;
  __half* ptile = reinterpret_cast<__half*>(tabs + C::KTAB + C::VTAB) + warp * (C::PTILE / 2);

  // ---- every global load of the set-up first, so that their latencies overlap: the
  // lane's centroids (lanes past a codebook repeat it), its quarter of each query row
  // (D/2 bytes in 16-byte loads: the host makes the rows contiguous and 16-byte aligned;
  // element loads, 32 lanes on 8 rows, cost a wavefront each and took most of the set-up)
  // and the first copies of the keys.
  const float k_mine = k_cent[lane & ((1 << KB) - 1)];
  const float v_mine = v_cent[lane & ((1 << VB) - 1)];
  uint4 q_raw[NRB][D / 32]; // (warp 0's: it builds the query fragments of the block)
  if (warp == 0) {
#pragma unroll
    for (int nb = 0; nb < NRB; ++nb) {
      const int rr = min(row0 + nb * 8 + g, p.rows - 1);
      const int qh = kvh * p.gqa + rr / p.q_len;
      const int ql = rr % p.q_len;
      const int64_t base =
          b * p.q_stride[0] + qh * p.q_stride[1] + ql * p.q_stride[2] + cc * (D / 4);
      const uint4* qrow = reinterpret_cast<const uint4*>(reinterpret_cast<const __half*>(q) + base);
#pragma unroll
      for (int i = 0; i < D / 32; ++i) {
        q_raw[nb][i] = __ldg(qrow + i);
      }
    }
  }
  // this block's keys (split `split`) and, staged, their first copies
  TQMmaCache c;
  constexpr bool k_words = C::KBITS % 32 == 0, v_words = C::VBITS % 32 == 0;
  c.kc =
      reinterpret_cast<const unsigned char*>(k_codes + b * p.kc_stride[0] + kvh * p.kc_stride[1]);
  c.ks =
      reinterpret_cast<const unsigned char*>(k_scales + b * p.ks_stride[0] + kvh * p.ks_stride[1]);
  c.vc =
      reinterpret_cast<const unsigned char*>(v_codes + b * p.vc_stride[0] + kvh * p.vc_stride[1]);
  c.vs =
      reinterpret_cast<const unsigned char*>(v_scales + b * p.vs_stride[0] + kvh * p.vs_stride[1]);
  c.kc_lane = k_words ? uint32_t(cc * C::KW * 4) : 0u;
  c.vc_lane = v_words ? uint32_t(g * C::VW * 4) : 0u;
  c.kj = k_words ? 0 : cc;
  c.vj = v_words ? 0 : g;
  // opaque to the compiler: kept in registers instead of recomputed from the parameters
  asm volatile("" : "+l"(c.kc), "+l"(c.vc), "+l"(c.ks), "+l"(c.vs));
  const int t_begin = split * p.split_len;
  const int t_end = min(p.kv_len, t_begin + p.split_len);
  int t0 = t_begin + warp * C::TILE;
  // This warp's ring (staged shapes): in the gap below the tables while it has room,
  // else after the P tiles (see TQMmaConfig::LOOP_SMEM).
  const int in_gap = C::STAGED ? min(C::WARPS, int(tab_off) / max(C::RING, 1)) : 0;
  uint32_t ring_off = warp < in_gap ? uint32_t(warp * C::RING)
                                    : tab_off + C::FIXED_SMEM + uint32_t((warp - in_gap) * C::RING);
  asm volatile("" : "+r"(ring_off)); // (kept, not recomputed every iteration)
  [[maybe_unused]] const uint32_t ring = smem_addr + ring_off;
  [[maybe_unused]] const unsigned char* ring_ptr = tq_mma_smem + ring_off;
  // the split's scales start this many bytes past a 16-byte boundary (every
  // iteration's too: STEP is a multiple of 8 tokens)
  [[maybe_unused]] const uint32_t sc_k = uint32_t(reinterpret_cast<uintptr_t>(c.ks + 2 * t0) & 15u);
  [[maybe_unused]] const uint32_t sc_v = uint32_t(reinterpret_cast<uintptr_t>(c.vs + 2 * t0) & 15u);
  // (a placeholder for the shapes that load into registers)
  const std::conditional_t<C::STAGED, TQMmaStageLane<D, KB, VB, NRB>, int> sl = [&] {
    if constexpr (C::STAGED) {
      return TQMmaStageLane<D, KB, VB, NRB>(lane, c.ks, c.vs, sc_k, sc_v);
    } else {
      return 0;
    }
  }();
  if constexpr (C::STAGED) {
    // the overlap variant keeps STAGES iterations in flight ahead of the loop, the
    // plain loop STAGES - 1 (it issues the next one at the top of each iteration)
#pragma unroll
    for (int i = 0; i < (C::PIPELINED ? C::STAGES : C::STAGES - 1); ++i) {
      tq_mma_stage_copy<D, KB, VB, NRB>(
          ring + i * C::STAGE_BYTES, c, sl, t0 + i * C::STEP, t_end, lane);
    }
  }

  // ---- pair tables: entry e = (centroid[e & mask], centroid[e >> bits]), one column
  // per lane, gathered from the lanes' centroids by shuffles; a warp writes four entries
  // per 16-byte store, eight lanes per entry.
  tq_mma_pair_table<KB, C::KSTRIDE>(tabs, k_mine, warp, lane, C::WARPS);
  tq_mma_pair_table<VB, C::VSTRIDE>(tabs + C::VOFF, v_mine, warp, lane, C::WARPS);

  // ---- query fragments: row nb*8 + g, permuted dims (see the file comment), scaled by
  // scale * log2(e) and, against float16 overflow, by 2^-qexp (restored on the scores).
  // The block's warps share the query rows: warp 0 builds them and leaves them and
  // 2^qexp in shared memory (after the last ring, lane-interleaved 16-byte chunks), where
  // the others read them after the tables' barrier (take_queries below).
  uint32_t qf[NRB][KBLK][2];
  float sup = 1.0f;
  constexpr int QCH = NRB * KBLK / 2; // 16-byte chunks of a lane's fragments
  uint4* q_share = reinterpret_cast<uint4*>(
      tq_mma_smem + tab_off + C::FIXED_SMEM + uint32_t((C::WARPS - in_gap) * C::RING));
  if (warp == 0) {
    float qv[NRB][KBLK][4];
    float qmax = 0.0f;
#pragma unroll
    for (int nb = 0; nb < NRB; ++nb) {
      const int r = nb * 8 + g;
#pragma unroll
      for (int i = 0; i < D / 32; ++i) { // 8 elements: k-blocks 2i and 2i + 1
        const uint4 w = q_raw[nb][i];
        const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int h = 0; h < 4; ++h) { // elements 2h, 2h + 1 of the eight
          float lo, hi;
          if (q_bf16) {
            lo = __uint_as_float(u[h] << 16);
            hi = __uint_as_float(u[h] & 0xffff0000u);
          } else {
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&u[h]));
            lo = f.x;
            hi = f.y;
          }
          qv[nb][2 * i + h / 2][2 * (h % 2)] = lo;
          qv[nb][2 * i + h / 2][2 * (h % 2) + 1] = hi;
        }
      }
      // q in model space: R q, the 4 lanes of a row holding its quarters (uniform).
      if (p.rot.on != 0) {
        tq_rotate_blocked<D / 4, 4>(&qv[nb][0][0], p.rot, cc);
      }
#pragma unroll
      for (int kb = 0; kb < KBLK; ++kb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float x = r < nr ? qv[nb][kb][e] * p.scale_log2 : 0.0f;
          qv[nb][kb][e] = x;
          qmax = fmaxf(qmax, fabsf(x));
        }
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      qmax = fmaxf(qmax, __shfl_xor_sync(0xffffffffu, qmax, off));
    }
    // Largest |q| kept below 2^14: the products and their float32 sums cannot overflow.
    int qexp = 0;
    if (qmax > 16384.0f) {
      qexp = int(ceilf(log2f(qmax / 16384.0f)));
    }
    const float qdown = exp2f(float(-qexp));
    sup = exp2f(float(qexp));
#pragma unroll
    for (int nb = 0; nb < NRB; ++nb) {
#pragma unroll
      for (int kb = 0; kb < KBLK; ++kb) {
        qf[nb][kb][0] = tq_pack_half2(qv[nb][kb][0] * qdown, qv[nb][kb][1] * qdown);
        qf[nb][kb][1] = tq_pack_half2(qv[nb][kb][2] * qdown, qv[nb][kb][3] * qdown);
      }
    }
#pragma unroll
    for (int j = 0; j < QCH; ++j) {
      const uint32_t* w = &qf[0][0][0] + 4 * j;
      q_share[j * 32 + lane] = make_uint4(w[0], w[1], w[2], w[3]);
    }
    if (lane == 0) {
      *reinterpret_cast<float*>(q_share + QCH * 32) = sup;
    }
  }
  int lim_min = p.kv_len;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (p.causal && r < nr) {
      lim_min = min(lim_min, p.kv_len - p.q_len + (row0 + r) % p.q_len);
    }
  }

  TQMmaAcc<D, NRB> acc;
#pragma unroll
  for (int nb = 0; nb < NRB; ++nb) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      acc.m[nb][e] = tq_neg_inf();
      acc.l[nb][e] = 0.0f;
    }
#pragma unroll
    for (int mb = 0; mb < KBLK; ++mb) {
      acc.o[nb][mb][0] = acc.o[nb][mb][1] = acc.o[nb][mb][2] = acc.o[nb][mb][3] = 0.0f;
    }
  }

  const int t_fast = min(t_end, lim_min + 1);
  const uint32_t lane_base = smem_addr + tab_off + 4u * uint32_t(lane);
  // The query fragments and their scale, which warp 0 left in shared memory (called by
  // every loop variant right after the tables' barrier).
  auto take_queries = [&] {
    if (warp != 0) {
#pragma unroll
      for (int j = 0; j < QCH; ++j) {
        const uint4 w = q_share[j * 32 + lane];
        uint32_t* f = &qf[0][0][0] + 4 * j;
        f[0] = w.x;
        f[1] = w.y;
        f[2] = w.z;
        f[3] = w.w;
      }
      sup = *reinterpret_cast<const float*>(q_share + QCH * 32);
    }
  };
  auto run = [&](const TQMmaTile<D, KB, VB, NRB>& tl, int t) {
    if (p.mask_kind == 0 && t + C::TILE <= t_fast) {
      tq_mma_step<D, KB, VB, NRB, false>(
          acc, tl, qf, lane_base, ptile, t, t_end, row0, b, kvh, g, cc, mask, p, sup);
    } else {
      tq_mma_step<D, KB, VB, NRB, true>(
          acc, tl, qf, lane_base, ptile, t, t_end, row0, b, kvh, g, cc, mask, p, sup);
    }
  };
  if constexpr (C::STAGED) {
    if constexpr (C::PIPELINED) {
      // Tile i's values go with tile i+1's scores, two independent chains of lookups
      // and mma in one block of code: tile i+1's keys and scales, read from the stage
      // while tile i's value codes and weights wait in registers. The ring holds tiles
      // i+1 .. i+STAGES; tile i's stage is refilled once tile i+1 is read.
      __syncthreads(); // tables (and query fragments) ready
      take_queries();
      if (t0 < t_end) { // uniform within a warp
        tq_cp_async_wait<C::STAGES - 1>();
        __syncwarp();
        uint32_t vcur[4][C::VW]; // tile i: value slices
        uint32_t pb[NRB][2]; // and weights
        {
          TQMmaTile<D, KB, VB, NRB> tl;
          tq_mma_stage_read_keys<D, KB, VB, NRB>(tl, ring_ptr, g, cc, sc_k, sc_v);
          tq_mma_stage_read_values<D, KB, VB, NRB>(vcur, ring_ptr, 0, g, cc);
          float sn[1][NRB][4];
          auto first = [&](auto check) {
            constexpr bool CK = decltype(check)::value;
            tq_mma_scores<D, KB, VB, NRB, CK>(
                sn, tl, qf, lane_base, t0, t_end, row0, b, kvh, g, cc, mask, p, sup);
            tq_mma_softmax<D, NRB, 1, CK>(acc, sn, tl.vs);
          };
          if (p.mask_kind == 0 && t0 + C::TILE <= t_fast) {
            first(std::false_type{});
          } else {
            first(std::true_type{});
          }
          tq_mma_p_fragments<D, KB, VB, NRB>(pb, sn[0], ptile, g, cc);
        }
        int cur = 0; // stage of tile i
        for (;;) {
          const int t1 = t0 + C::STEP; // tile i+1
          if (t1 >= t_end) {
            tq_mma_values<D, KB, VB, NRB>(acc, vcur, pb, lane_base);
            break;
          }
          __syncwarp(); // every lane is done with tile i's stage
          tq_mma_stage_copy<D, KB, VB, NRB>(
              ring + cur * C::STAGE_BYTES, c, sl, t0 + C::STAGES * C::STEP, t_end, lane);
          cur = cur == C::STAGES - 1 ? 0 : cur + 1;
          tq_cp_async_wait<C::STAGES - 1>(); // this lane's copies of tile i+1 landed
          __syncwarp(); // and every lane's
          const unsigned char* st = ring_ptr + cur * C::STAGE_BYTES;
          TQMmaTile<D, KB, VB, NRB> tn;
          tq_mma_stage_read_keys<D, KB, VB, NRB>(tn, st, g, cc, sc_k, sc_v);
          float sn[1][NRB][4];
          auto next = [&](auto check) {
            constexpr bool CK = decltype(check)::value;
            tq_mma_values<D, KB, VB, NRB>(acc, vcur, pb, lane_base);
            tq_mma_scores<D, KB, VB, NRB, CK>(
                sn, tn, qf, lane_base, t1, t_end, row0, b, kvh, g, cc, mask, p, sup);
            tq_mma_stage_read_values<D, KB, VB, NRB>(vcur, st, 0, g, cc);
            tq_mma_softmax<D, NRB, 1, CK>(acc, sn, tn.vs);
          };
          if (p.mask_kind == 0 && t1 + C::TILE <= t_fast) {
            next(std::false_type{});
          } else {
            next(std::true_type{});
          }
          tq_mma_p_fragments<D, KB, VB, NRB>(pb, sn[0], ptile, g, cc);
          t0 = t1;
        }
      }
    } else {
      // Each iteration refills the stage read last, then waits for its own (issued
      // STAGES - 1 iterations before) and runs its phases one after another. Unrolled
      // over the ring, so that every stage address is a register plus an immediate.
      __syncthreads(); // tables (and query fragments) ready
      take_queries();
      while (t0 < t_end) { // uniform within a warp
#pragma unroll
        for (int cur = 0; cur < C::STAGES; ++cur) { // stage of iteration t0
          if (t0 >= t_end) {
            break;
          }
          // Every lane is done with the stage refilled next: it read it into registers
          // before the previous tile's P exchange, whose __syncwarp it has passed.
          const int fill = cur == 0 ? C::STAGES - 1 : cur - 1;
          tq_mma_stage_copy<D, KB, VB, NRB>(
              ring + fill * C::STAGE_BYTES, c, sl, t0 + (C::STAGES - 1) * C::STEP, t_end, lane);
          tq_cp_async_wait<C::STAGES - 1>(); // this lane's copies of iteration t0 landed
          __syncwarp(); // and every lane's
          TQMmaTile<D, KB, VB, NRB> tl;
          tq_mma_stage_read<D, KB, VB, NRB>(tl, ring_ptr + cur * C::STAGE_BYTES, g, cc, sc_k, sc_v);
          run(tl, t0);
          t0 += C::STEP;
        }
      }
    }
    tq_cp_async_wait<0>(); // (empty groups only; the merge below reuses the memory)
  } else {
    // Two tiles in flight per warp, used alternately (no register copies, so a tile's
    // loads are only waited for where it is decoded): tile a holds iteration 2i, tile b
    // iteration 2i + 1, each reloaded right after use. Iterations past the split's end
    // are not loaded (nor run); one that straddles it re-reads its last key.
    TQMmaTile<D, KB, VB, NRB> ta, tb;
    tq_mma_load<D, KB, VB, NRB>(ta, c, t0, t_end, g, cc);
    tq_mma_load<D, KB, VB, NRB>(tb, c, t0 + C::STEP, t_end, g, cc);
    __syncthreads(); // tables (and query fragments) ready
    take_queries();
    for (; t0 < t_end; t0 += 2 * C::STEP) { // uniform within a warp
      run(ta, t0);
      tq_mma_load<D, KB, VB, NRB>(ta, c, t0 + 2 * C::STEP, t_end, g, cc);
      if (t0 + C::STEP >= t_end) {
        break;
      }
      run(tb, t0 + C::STEP);
      tq_mma_load<D, KB, VB, NRB>(tb, c, t0 + 3 * C::STEP, t_end, g, cc);
    }
  }

  // ---- row sums over the 8 lanes of a row pair
#pragma unroll
  for (int nb = 0; nb < NRB; ++nb) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float l = acc.l[nb][e];
      l += __shfl_xor_sync(0xffffffffu, l, 4);
      l += __shfl_xor_sync(0xffffffffu, l, 8);
      l += __shfl_xor_sync(0xffffffffu, l, 16);
      acc.l[nb][e] = l;
    }
  }

  // ---- merge the warps through shared memory. The warps exchange their rows' maxima
  // and sums first, so that each rescales its own accumulators to the block's maximum;
  // then each stores them as they lie in its registers (per (nb, e, mb) one float2 per
  // lane, lane after lane: conflict-free; row-major stores were 16-way bank conflicts),
  // and each thread sums one element pair of a row over the warps and writes it.
  __syncthreads(); // every warp is done with the tables and its ring
  float* red_o = reinterpret_cast<float*>(tq_mma_smem); // [WARPS][MERGE_SLOTS]
  float* red_m = red_o + C::WARPS * C::MERGE_SLOTS; // [WARPS][ROWS] maxima
  float* red_l = red_m + C::WARPS * ROWS; // [WARPS][ROWS] sums
  float* red_ml = red_l + C::WARPS * ROWS; // [ROWS][2] the block's maxima and sums
#pragma unroll
  for (int nb = 0; nb < NRB; ++nb) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (g == 0) {
        red_m[warp * ROWS + nb * 8 + 2 * cc + e] = acc.m[nb][e];
        red_l[warp * ROWS + nb * 8 + 2 * cc + e] = acc.l[nb][e];
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int nb = 0; nb < NRB; ++nb) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = nb * 8 + 2 * cc + e;
      float mm = tq_neg_inf();
#pragma unroll
      for (int w = 0; w < C::WARPS; ++w) {
        mm = fmaxf(mm, red_m[w * ROWS + row]);
      }
      // a warp that saw no key of the row weighs nothing (and so does a row none saw)
      const float f = acc.m[nb][e] == tq_neg_inf() ? 0.0f : tq_ex2(acc.m[nb][e] - mm);
      if (warp == 0 && g == 0) { // the row's sum, once
        float ll = 0.0f;
#pragma unroll
        for (int w = 0; w < C::WARPS; ++w) {
          const float mw = red_m[w * ROWS + row];
          ll += mw == tq_neg_inf() ? 0.0f : red_l[w * ROWS + row] * tq_ex2(mw - mm);
        }
        red_ml[2 * row] = mm;
        red_ml[2 * row + 1] = ll;
      }
#pragma unroll
      for (int mb = 0; mb < KBLK; ++mb) {
        *reinterpret_cast<float2*>(red_o + warp * C::MERGE_SLOTS + C::merge_slot(nb, e, mb, lane)) =
            make_float2(acc.o[nb][mb][e] * f, acc.o[nb][mb][e + 2] * f);
      }
    }
  }
  __syncthreads();

  // row rr of this KV head's query rows: its row of out / lse (and of the merge's grid)
  auto out_row = [&](int rr) {
    return (b * p.q_heads + kvh * p.gqa + rr / p.q_len) * p.q_len + rr % p.q_len;
  };
  const bool single = p.partials == 0;
  for (int i = threadIdx.x; i < nr * (D / 2); i += C::THREADS) {
    // element pair (d, d + 1) of row r: lane 4 * (d / (D/8)) + (r % 8) / 2's float2 of
    // m-block (d % (D/8)) / 2
    const int r = i / (D / 2), d = 2 * (i % (D / 2));
    const int ln = 4 * (d / (D / 8)) + (r % 8) / 2;
    const int at = C::merge_slot(r / 8, r % 2, (d % (D / 8)) / 2, ln);
    float2 o = make_float2(0.0f, 0.0f);
#pragma unroll
    for (int w = 0; w < C::WARPS; ++w) {
      const float2 x = *reinterpret_cast<const float2*>(red_o + w * C::MERGE_SLOTS + at);
      o.x += x.x;
      o.y += x.y;
    }
    const float mm = red_ml[2 * r], ll = red_ml[2 * r + 1];
    const int rr = row0 + r;
    const int orow = out_row(rr);
    const int64_t prow = int64_t(orow) * p.n_splits + split;
    if (single) {
      const float inv = ll > 0.0f ? 1.0f / ll : 0.0f;
      *reinterpret_cast<float2*>(out + int64_t(orow) * D + d) = make_float2(o.x * inv, o.y * inv);
      if (d == 0) {
        lse[orow] = ll > 0.0f ? (mm + log2f(ll)) * 0.6931471805599453f : tq_neg_inf();
      }
    } else {
      *reinterpret_cast<float2*>(o_part + prow * D + d) = o;
      if (d == 0) {
        ml_part[prow * 2] = mm;
        ml_part[prow * 2 + 1] = ll;
      }
    }
  }
}

// Host-side lookup (attention_mma_d*.cu): the kernel's address for (kb, vb, nrb), or
// nullptr when that combination has no tensor-core instantiation.
const void* attention_mma_kernel_d64(int kb, int vb, int nrb);
const void* attention_mma_kernel_d128(int kb, int vb, int nrb);
const void* attention_mma_kernel_d256(int kb, int vb, int nrb);

/// Launch shape of the tensor-core kernel (host side).
struct TQMmaShape {
  int smem; // dynamic shared memory, bytes
  int step; // tokens per block iteration (split lengths are multiples of it)
  int threads; // per block
  int blocks_per_sm; // the kernel's __launch_bounds__ occupancy target
  bool staged; // copies codes by 16-byte cp.async: each head's rows 16-byte aligned
};

inline TQMmaShape attention_mma_shape(int d, int kb, int vb, int nrb) {
  TQMmaShape s{0, 0, 0, 0, false};
  auto set = [&](auto dd, auto kk, auto vv, auto nn) {
    typedef TQMmaConfig<
        decltype(dd)::value,
        decltype(kk)::value,
        decltype(vv)::value,
        decltype(nn)::value>
        C;
    s = {C::SMEM, C::STEP, C::THREADS, C::BLOCKS, C::STAGED};
  };
  auto with_n = [&](auto dd, auto kk, auto vv) {
    if (nrb == 1) {
      set(dd, kk, vv, std::integral_constant<int, 1>{});
    } else {
      set(dd, kk, vv, std::integral_constant<int, 2>{});
    }
  };
  auto with_v = [&](auto dd, auto kk) {
    switch (vb) {
      case 2: with_n(dd, kk, std::integral_constant<int, 2>{}); break;
      case 3: with_n(dd, kk, std::integral_constant<int, 3>{}); break;
      default: with_n(dd, kk, std::integral_constant<int, 4>{}); break;
    }
  };
  auto with_k = [&](auto dd) {
    switch (kb) {
      case 2: with_v(dd, std::integral_constant<int, 2>{}); break;
      case 3: with_v(dd, std::integral_constant<int, 3>{}); break;
      default: with_v(dd, std::integral_constant<int, 4>{}); break;
    }
  };
  switch (d) {
    case 64: with_k(std::integral_constant<int, 64>{}); break;
    case 128: with_k(std::integral_constant<int, 128>{}); break;
    case 256: with_k(std::integral_constant<int, 256>{}); break;
    default: break;
  }
  return s;
}

/// Instantiations of one head dim: key/value bit pairs with KB >= VB (keys carry the
/// softmax, presets never give values more bits), NRB 1 and (head dims <= 128) 2.
template <int D>
const void* attention_mma_kernel_for(int kb, int vb, int nrb) {
  const void* k = nullptr;
  auto pick = [&](auto kk, auto vv) {
    constexpr int KB = decltype(kk)::value, VB = decltype(vv)::value;
    if constexpr (KB >= VB) { // (16 rows at head dim 256 would spill: chunks of 8 there)
      if (nrb == 1) {
        k = reinterpret_cast<const void*>(&tq_attention_mma_kernel<D, KB, VB, 1>);
      } else if (nrb == 2) {
        if constexpr (D <= 128) {
          k = reinterpret_cast<const void*>(&tq_attention_mma_kernel<D, KB, VB, 2>);
        }
      }
    }
  };
  auto with_vb = [&](auto kk) {
    switch (vb) {
      case 2: pick(kk, std::integral_constant<int, 2>{}); break;
      case 3: pick(kk, std::integral_constant<int, 3>{}); break;
      case 4: pick(kk, std::integral_constant<int, 4>{}); break;
      default: break;
    }
  };
  switch (kb) {
    case 2: with_vb(std::integral_constant<int, 2>{}); break;
    case 3: with_vb(std::integral_constant<int, 3>{}); break;
    case 4: with_vb(std::integral_constant<int, 4>{}); break;
    default: break;
  }
  return k;
}

} // namespace turboquant_mlx::cuda_kernels
