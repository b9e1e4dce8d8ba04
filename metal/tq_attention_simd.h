// Layout: shared kernel code, compiled as Metal and as CUDA (Metal's fast path).
// Attention over the compressed cache on 8x8 simdgroup matrices: the fast path for
// float16 / bfloat16 queries at head dims 64, 128 and 256 on Metal (Apple GPUs multiply
// simdgroup_matrix fragments in hardware), written once like the kernels of
// tq_kernels.h: the CUDA build compiles the same body against the emulation of
// simdgroup matrices in tq_portable.h (the tests' AttentionKernel::simd), so that it runs
// the GPU tests there too.
//
// The algorithm is that of the CUDA tensor-core kernel (csrc/cuda/attention_mma.cuh):
// codes turned into half-precision centroids in threadgroup memory, q.K and P.V as
// matrix products with float32 accumulation, the query rows of one KV head (GQA heads x
// query positions) together in one fragment's 8 rows, split-K partials for the shared
// merge (tq_attention_merge_impl). Same arguments, grid (row chunks, n_splits,
// batch * kv_heads), TQ_ATTN_THREADS threads and outputs as tq_attention_impl; the host
// chooses rows_per_tg <= 8 and split_len (any length; multiples of
// TQAttnSimdConfig<D>::STEP keep every simdgroup busy).
//
// Per simdgroup and step, one tile of 8 tokens:
//   each lane decodes a quarter (D/4 coordinates) of one token's key codes into the
//   simdgroup's tile, K (8 tokens x D) as half;
//   S (8 rows x 8 tokens) = sum over the D/8 blocks of Q (8 x 8 dims) . K^T (8 dims x 8
//   tokens), K^T read from the tile by a transposed simdgroup_load;
//   the values' codes replace the keys' in the tile while each lane works on its two
//   scores (row tq_frag_row, tokens tq_frag_col + 0/1): key scale, range, causal limit
//   and mask, then the online softmax of its row (the four lanes of a row exchange
//   their maxima), and P = exp2(s - m) * value scale as half;
//   O (8 rows x D) += P (8 x 8 tokens) . V (8 tokens x D), D/8 products; a lane's
//   elements of O lie in the row of its scores, so the softmax rescales them in place.
// The simdgroups' (m, l, O) are merged through threadgroup memory at the end.
//
// Precision: half queries (scaled by scale * log2 e, and by a power of two when they
// would overflow half), half centroids and half P, float32 products and sums: the class
// of the tensor-core kernel (~1e-3 of max |v|).
#pragma once

#include "tq_kernels.h"

// (TQAttnSimdConfig<D>, the shape of tq_attention_simd_impl: tq_params.h.)

/// Decodes the D/4 codes of quarter j of one token (B bits each, LSB-first from the
/// token's first word `tok`) into centroids from `tab`, as half, at dst[0 .. D/4).
/// Word loads only, so code rows need no alignment beyond their words'.
template <int B, int D>
TQ_FN void tq_simd_decode_quarter(
    const TQ_DEV tq_uint* tok,
    int j,
    const TQ_TG tq_half* tab,
    TQ_TG tq_half* dst) {
  constexpr int N = D / 4, NB = N * B, NA = (NB + 31) / 32, W = D * B / 32;
  const int bit0 = j * NB;
  const int fw = bit0 >> 5;
  const tq_uint sh = tq_uint(bit0 & 31);
  tq_uint w[NA + 1];
  TQ_UNROLL
  for (int i = 0; i <= NA; ++i) {
    w[i] = tok[min(fw + i, W - 1)]; // (a word past the token is never used)
  }
  tq_uint a[NA];
  TQ_UNROLL
  for (int i = 0; i < NA; ++i) {
    a[i] = tq_funnel_r(w[i], w[i + 1], sh);
  }
  TQ_UNROLL
  for (int i = 0; i < N; ++i) {
    const int bit = i * B;
    const int wi = bit >> 5;
    const int off = bit & 31;
    tq_uint c = a[wi] >> off;
    if (off + B > 32) {
      c |= a[wi + 1] << (32 - off);
    }
    dst[i] = tab[c & ((1u << B) - 1u)];
  }
}

/// The mask's term of a score (log2 units) at element `at`: -inf for a dropped key (a
/// false bool), else the additive value times log2(e) (0 for a kept bool).
TQ_FN float tq_simd_mask_term(const TQ_DEV uchar* mask, int kind, int64_t at) {
  if (kind == 1) {
    return mask[at] != 0 ? 0.0f : tq_neg_inf();
  }
  const float add = kind == 2 ? ((const TQ_DEV float*)mask)[at]
      : kind == 3             ? tq_to_float(((const TQ_DEV tq_half*)mask)[at])
                              : tq_to_float(((const TQ_DEV ushort*)mask)[at]);
  return add * 1.4426950408889634f;
}

/// Attention of up to 8 query rows of one KV head over one split of the keys on
/// simdgroup matrices; arguments, grid and outputs as tq_attention_impl (QT: half, or
/// bfloat16 bits as ushort; float works too but is not instantiated).
template <typename QT, int D, int KB, int VB>
TQ_FN void tq_attention_simd_impl(
    const TQ_DEV QT* TQ_RESTRICT q,
    const TQ_DEV tq_uint* TQ_RESTRICT k_codes,
    const TQ_DEV tq_half* TQ_RESTRICT k_scales,
    const TQ_DEV tq_uint* TQ_RESTRICT v_codes,
    const TQ_DEV tq_half* TQ_RESTRICT v_scales,
    const TQ_DEV float* TQ_RESTRICT k_cent,
    const TQ_DEV float* TQ_RESTRICT v_cent,
    const TQ_DEV uchar* TQ_RESTRICT mask,
    TQ_DEV float* TQ_RESTRICT out,
    TQ_DEV float* TQ_RESTRICT lse,
    TQ_DEV float* TQ_RESTRICT o_part,
    TQ_DEV float* TQ_RESTRICT ml_part,
    TQ_CONST TQAttnParams& p,
    TQ_TG float* smem,
    TQThread th) {
  typedef TQAttnSimdConfig<D> C;
  constexpr int ROWS = C::ROWS, TILE = C::TILE, NSG = C::NSG, KBLK = C::KBLK;
  constexpr int NT = TQ_ATTN_THREADS;

  TQ_TG tq_half* k_tab = reinterpret_cast<TQ_TG tq_half*>(smem);
  TQ_TG tq_half* v_tab = k_tab + 16;
  TQ_TG tq_half* qh = reinterpret_cast<TQ_TG tq_half*>(smem + C::TAB); // [ROWS][D]
  TQ_TG float* tiles = smem + C::TAB + C::QH;
  TQ_TG tq_half* tile = reinterpret_cast<TQ_TG tq_half*>(tiles) + int(th.simd) * TILE * D;
  TQ_TG float* red_m = tiles + C::TILES; // [NSG][ROWS]
  TQ_TG float* red_l = red_m + NSG * ROWS; // [NSG][ROWS]
  TQ_TG float* red_q = red_l + NSG * ROWS; // [NSG] (query maxima)

  const int lane = int(th.lane);
  const int tid = int(th.tid);
  const int chunk = int(th.tg_x);
  const int split = int(th.tg_y);
  const int b = int(th.tg_z) / p.kv_heads;
  const int kvh = int(th.tg_z) % p.kv_heads;
  const int row0 = chunk * p.rows_per_tg;
  const int nr = min(p.rows_per_tg, p.rows - row0); // uniform over the threadgroup

  if (tid < (1 << KB)) {
    k_tab[tid] = tq_to_half_rn(k_cent[tid]);
  }
  if (tid < (1 << VB)) {
    v_tab[tid] = tq_to_half_rn(v_cent[tid]);
  }

  // ---- query rows: float32 in the tiles' memory (rotated there when asked), scaled
  // by scale * log2(e), then as half; rows past nr are 0 and never written.
  TQ_TG float* qf = tiles; // [ROWS][D]
  const bool rotate = TQRotatable<D>::value && p.rot.on != 0; // uniform
  for (int e = tid; e < ROWS * D; e += NT) {
    const int r = e / D, d = e % D;
    float x = 0.0f;
    if (r < nr) {
      const int rr = row0 + r;
      const int qh_i = kvh * p.gqa + rr / p.q_len;
      const int ql = rr % p.q_len;
      x = tq_to_float(q[b * p.q_stride[0] + qh_i * p.q_stride[1] + ql * p.q_stride[2] + d]);
      if (rotate && tq_rot_negates(p.rot, d)) {
        x = -x;
      }
    }
    qf[e] = x;
  }
  if (rotate) {
    for (int r = 0; r < ROWS; ++r) { // (barriers inside: uniform)
      tq_fwht_threadgroup<D, NT>(qf + r * D, tid);
    }
  } else {
    tq_threadgroup_barrier();
  }
  const float qmul = (rotate ? p.rot.scale : 1.0f) * p.scale_log2;
  float amax = 0.0f;
  for (int e = tid; e < ROWS * D; e += NT) {
    const float x = qf[e] * qmul;
    qf[e] = x;
    amax = tq_fmax(amax, x < 0.0f ? -x : x);
  }
  amax = tq_simd_max(amax);
  if (lane == 0) {
    red_q[th.simd] = amax;
  }
  tq_threadgroup_barrier();
  amax = red_q[0];
  for (int k = 1; k < NSG; ++k) {
    amax = tq_fmax(amax, red_q[k]);
  }
  // Queries beyond half's range (bfloat16) are scaled down by a power of two, and the
  // scores back up by the same exact factor.
  float qdown = 1.0f;
  for (int i = 0; i < 128 && amax * qdown > 16384.0f; ++i) { // (bounded: amax may be inf)
    qdown *= 0.5f;
  }
  const float qup = 1.0f / qdown;
  for (int e = tid; e < ROWS * D; e += NT) {
    qh[e] = tq_to_half_rn(qf[e] * qdown);
  }
  tq_threadgroup_barrier(); // query rows and codebooks ready; qf is free again

  // ---- the keys of this split, one tile of TILE tokens per simdgroup and step
  const TQ_DEV tq_uint* kc = k_codes + b * p.kc_stride[0] + kvh * p.kc_stride[1];
  const TQ_DEV tq_half* ks = k_scales + b * p.ks_stride[0] + kvh * p.ks_stride[1];
  const TQ_DEV tq_uint* vc = v_codes + b * p.vc_stride[0] + kvh * p.vc_stride[1];
  const TQ_DEV tq_half* vs = v_scales + b * p.vs_stride[0] + kvh * p.vs_stride[1];
  // token strides (one head's rows: < 2^31 elements, as in tq_attention_impl)
  const int kc_tok = int(p.kc_stride[2]), ks_tok = int(p.ks_stride[2]);
  const int vc_tok = int(p.vc_stride[2]), vs_tok = int(p.vs_stride[2]);

  const int fr = tq_frag_row(th.lane); // this lane's row of S, P and O
  const int fc = tq_frag_col(th.lane); // its first token of S and P (columns fc, fc + 1)
  const int dtok = lane / 4; // the token whose codes this lane decodes
  const int dq = lane % 4; // and its quarter
  // this lane's row as the checks see it (rows past nr repeat the last one)
  const int crr = min(row0 + fr, p.rows - 1);
  const int cqh = kvh * p.gqa + crr / p.q_len;
  const int cql = crr % p.q_len;
  const int clim = p.causal ? p.kv_len - p.q_len + cql : p.kv_len;
  const int64_t mask_row = b * p.mask_stride[0] + cqh * p.mask_stride[1] + cql * p.mask_stride[2];

  simdgroup_matrix<float, 8, 8> o[KBLK];
  TQ_UNROLL
  for (int mb = 0; mb < KBLK; ++mb) {
    o[mb] = simdgroup_matrix<float, 8, 8>(0.0f);
  }
  float m = tq_neg_inf(); // running max of this lane's row (log2 units)
  float l = 0.0f; // this lane's share of the row's sum of exp2(s - m)

  const int t_begin = split * p.split_len;
  const int t_end = min(p.kv_len, t_begin + p.split_len);
  for (int t0 = t_begin + int(th.simd) * TILE; t0 < t_end; t0 += C::STEP) { // uniform per simdgroup
    const int td = min(t0 + dtok, t_end - 1); // spare slots decode a valid token
    tq_simd_decode_quarter<KB, D>(kc + td * kc_tok, dq, k_tab, tile + dtok * D + dq * (D / 4));
    tq_simdgroup_barrier();

    // S = Q . K^T
    simdgroup_matrix<float, 8, 8> s = simdgroup_matrix<float, 8, 8>(0.0f);
    TQ_NO_UNROLL // (s is the only accumulator: unrolled, the loop only holds more registers)
        for (int kb = 0; kb < KBLK; ++kb) {
      simdgroup_matrix<tq_half, 8, 8> qm;
      simdgroup_matrix<tq_half, 8, 8> km;
      simdgroup_load(qm, qh + kb * 8, D);
      simdgroup_load(km, tile + kb * 8, D, TQ_ORIGIN0, true);
      simdgroup_multiply_accumulate(s, qm, km, s);
    }
    tq_simdgroup_barrier(); // every lane has read the keys before the values replace them
    tq_simd_decode_quarter<VB, D>(vc + td * vc_tok, dq, v_tab, tile + dtok * D + dq * (D / 4));

    // this lane's two scores (range, causal limit and mask applied), their softmax
    // weights and P
    float sc[2], vsc[2];
    TQ_UNROLL
    for (int i = 0; i < 2; ++i) {
      const int tok = t0 + fc + i;
      const int tc = min(tok, t_end - 1);
      sc[i] = tq_to_float(s.thread_elements()[i]) * qup * tq_to_float(ks[tc * ks_tok]);
      vsc[i] = tq_to_float(vs[tc * vs_tok]);
      if (p.mask_kind != 0) { // uniform
        sc[i] += tq_simd_mask_term(mask, p.mask_kind, mask_row + int64_t(tc) * p.mask_stride[3]);
      }
      sc[i] = tok < t_end && tok <= clim ? sc[i] : tq_neg_inf();
    }
    float mx = tq_fmax(sc[0], sc[1]);
    mx = tq_fmax(mx, tq_shfl_xor(mx, 1)); // the four lanes of a row: lane bits 0 and 3
    mx = tq_fmax(mx, tq_shfl_xor(mx, 8));
    const float mn = tq_fmax(m, mx);
    const float f = m == tq_neg_inf() ? 0.0f : tq_exp2(m - mn);
    m = mn;
    simdgroup_matrix<tq_half, 8, 8> pm;
    float psum = 0.0f;
    TQ_UNROLL
    for (int i = 0; i < 2; ++i) {
      const float pw = sc[i] == tq_neg_inf() ? 0.0f : tq_exp2(sc[i] - mn);
      psum += pw;
      pm.thread_elements()[i] = tq_to_half_rn(pw * vsc[i]);
    }
    l = l * f + psum;
    TQ_UNROLL
    for (int mb = 0; mb < KBLK; ++mb) {
      o[mb].thread_elements()[0] *= f;
      o[mb].thread_elements()[1] *= f;
    }
    tq_simdgroup_barrier(); // the values are in the tile

    // O += P . V
    TQ_UNROLL
    for (int mb = 0; mb < KBLK; ++mb) {
      simdgroup_matrix<tq_half, 8, 8> vm;
      simdgroup_load(vm, tile + mb * 8, D);
      simdgroup_multiply_accumulate(o[mb], pm, vm, o[mb]);
    }
    tq_simdgroup_barrier(); // every lane has read the values before the next keys
  }

  // ---- merge the simdgroups: (m, l) per row, then O through threadgroup memory
  l += tq_shfl_xor(l, 1);
  l += tq_shfl_xor(l, 8);
  if ((lane & 9) == 0) { // one lane per row
    red_m[int(th.simd) * ROWS + fr] = m;
    red_l[int(th.simd) * ROWS + fr] = l;
  }
  tq_threadgroup_barrier(); // (also: every simdgroup is done with its tile)
  {
    float mt = tq_neg_inf();
    for (int k = 0; k < NSG; ++k) {
      mt = tq_fmax(mt, red_m[k * ROWS + fr]);
    }
    const float f = (mt == tq_neg_inf() || m == tq_neg_inf()) ? 0.0f : tq_exp2(m - mt);
    TQ_UNROLL
    for (int mb = 0; mb < KBLK; ++mb) {
      o[mb].thread_elements()[0] *= f;
      o[mb].thread_elements()[1] *= f;
    }
  }
  TQ_TG float* oacc = tiles; // [ROWS][D]
  for (int k = 0; k < NSG; ++k) { // one simdgroup after the other adds its O
    if (int(th.simd) == k) { // uniform per simdgroup
      TQ_UNROLL
      for (int mb = 0; mb < KBLK; ++mb) {
        if (k > 0) {
          simdgroup_matrix<float, 8, 8> prev;
          simdgroup_load(prev, oacc + mb * 8, D);
          o[mb].thread_elements()[0] += prev.thread_elements()[0];
          o[mb].thread_elements()[1] += prev.thread_elements()[1];
        }
        simdgroup_store(o[mb], oacc + mb * 8, D);
      }
    }
    tq_threadgroup_barrier();
  }

  // ---- write, as tq_attention_impl does
  const bool single = p.partials == 0;
  for (int r = 0; r < nr; ++r) {
    float mt = tq_neg_inf();
    for (int k = 0; k < NSG; ++k) {
      mt = tq_fmax(mt, red_m[k * ROWS + r]);
    }
    float lt = 0.0f;
    if (mt != tq_neg_inf()) {
      for (int k = 0; k < NSG; ++k) {
        const float mk = red_m[k * ROWS + r];
        lt += mk == tq_neg_inf() ? 0.0f : red_l[k * ROWS + r] * tq_exp2(mk - mt);
      }
    }
    const int rr = row0 + r;
    const int orow = (b * p.q_heads + kvh * p.gqa + rr / p.q_len) * p.q_len + rr % p.q_len;
    const int64_t prow = int64_t(orow) * p.n_splits + split;
    for (int d = tid; d < D; d += NT) {
      const float acc = oacc[r * D + d];
      if (single) {
        out[int64_t(orow) * D + d] = lt > 0.0f ? acc / lt : 0.0f;
      } else {
        o_part[prow * D + d] = acc;
      }
    }
    if (tid == 0) {
      if (single) {
        lse[orow] = lt > 0.0f ? (mt + tq_log2(lt)) * 0.6931471805599453f : tq_neg_inf();
      } else {
        ml_part[prow * 2] = mt;
        ml_part[prow * 2 + 1] = lt;
      }
    }
  }
}
