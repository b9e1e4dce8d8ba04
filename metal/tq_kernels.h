// Layout: shared kernel code, compiled as Metal and as CUDA.
// Kernel bodies of turboquant_mlx, written once for Metal and CUDA (see tq_portable.h).
// Data layouts and op semantics: docs/ARCHITECTURE.md. Entry points: the Metal
// [[kernel]] wrappers in turboquant.metal and the CUDA __global__ wrappers in
// csrc/cuda/tq_entry.cuh.
#pragma once

#include "tq_params.h"
#include "tq_portable.h"

#if defined(TQ_CUDA)
#define TQ_RESTRICT __restrict__
#else
#define TQ_RESTRICT
#endif

// ============================================================================ codes

/// Packed-code geometry of one lane's DL coordinates at B bits each.
template <int B, int DL>
struct TQLaneBits {
  static constexpr int NB = DL * B; // bits a lane decodes per token
  static constexpr int NA = (NB + 31) / 32; // words once aligned to the lane's first bit
  static constexpr bool kAligned = NB % 32 == 0; // lanes start on word boundaries
};

/// Loads the packed codes of lane j (of the lanes sharing one token) into a[0..NA),
/// shifted so that the lane's first code starts at bit 0 of a[0].
///   tok: the token's first code word. When the lane's bits are word-aligned and span
///   2 or 4 words they are read with one vector load: code rows must then be aligned
///   to 8 / 16 bytes (the host guarantees it, see TQAttnParams).
template <int B, int D, int DL>
TQ_FN void tq_load_lane_codes(const TQ_DEV tq_uint* tok, int j, TQ_THR tq_uint* a) {
  typedef TQLaneBits<B, DL> LB;
  constexpr int W = D * B / 32;
  if constexpr (LB::kAligned) {
    const TQ_DEV tq_uint* p = tok + j * LB::NA;
    if constexpr (LB::NA == 2) {
      uint2 v = tq_load_u2(p);
      a[0] = v.x;
      a[1] = v.y;
    } else if constexpr (LB::NA == 4) {
      uint4 v = tq_load_u4(p);
      a[0] = v.x;
      a[1] = v.y;
      a[2] = v.z;
      a[3] = v.w;
    } else {
      TQ_UNROLL
      for (int i = 0; i < LB::NA; ++i) {
        a[i] = p[i];
      }
    }
  } else {
    // The lane's bits start mid-word: read one word more and funnel-shift.
    int bit0 = j * LB::NB;
    int fw = bit0 >> 5;
    tq_uint sh = tq_uint(bit0 & 31);
    tq_uint w[LB::NA + 1];
    TQ_UNROLL
    for (int i = 0; i <= LB::NA; ++i) {
      w[i] = fw + i < W ? tok[fw + i] : 0u;
    }
    TQ_UNROLL
    for (int i = 0; i < LB::NA; ++i) {
      a[i] = tq_funnel_r(w[i], w[i + 1], sh);
    }
  }
}

/// Expands DL codes of B bits (LSB-first in a[]) into centroid values.
template <int B, int DL>
TQ_FN void tq_decode_lane(TQ_THR const tq_uint* a, const TQ_TG float* table, TQ_THR float* out) {
  TQ_UNROLL
  for (int i = 0; i < DL; ++i) {
    const int bit = i * B;
    const int w = bit >> 5;
    const int off = bit & 31;
    tq_uint c = a[w] >> off;
    if (off + B > 32) {
      c |= a[w + 1] << (32 - off);
    }
    out[i] = table[c & ((1u << B) - 1u)];
  }
}

/// Value of the optional attention mask at element `at`: false in `keep` for a
/// dropped key, else the additive term (0 for bool masks).
TQ_FN float tq_mask_value(const TQ_DEV uchar* mask, int kind, int64_t at, TQ_THR bool& keep) {
  keep = true;
  if (kind == 1) {
    keep = mask[at] != 0;
    return 0.0f;
  } else if (kind == 2) {
    return ((const TQ_DEV float*)mask)[at];
  } else if (kind == 3) {
    return tq_to_float(((const TQ_DEV tq_half*)mask)[at]);
  } else if (kind == 4) {
    return tq_to_float(((const TQ_DEV ushort*)mask)[at]);
  }
  return 0.0f;
}

/// Applies the range, the causal limit and the mask to score `s` of query row `row`
/// (clamped to the last row) of KV head `kvh` in batch `b` at key `tok` of a split
/// ending at `t_end`: adds the mask's additive term (scaled by log2 e), or sets -inf
/// for a key the row does not see. The attention kernels (this file's and
/// csrc/cuda/attention_mma.cuh) call it on their checked steps only (CHECK).
TQ_FN void tq_mask_score(
    TQ_THR float& s,
    const TQ_DEV uchar* mask,
    TQ_CONST TQAttnParams& p,
    int b,
    int kvh,
    int row,
    int tok,
    int t_end) {
  const int rr = min(row, p.rows - 1);
  const int qh = kvh * p.gqa + rr / p.q_len;
  const int ql = rr % p.q_len;
  const int lim = p.causal ? p.kv_len - p.q_len + ql : p.kv_len;
  bool keep = tok < t_end && tok <= lim;
  if (p.mask_kind != 0) {
    bool mk;
    const int64_t at = b * p.mask_stride[0] + qh * p.mask_stride[1] + ql * p.mask_stride[2] +
        int64_t(min(tok, t_end - 1)) * p.mask_stride[3];
    const float add = tq_mask_value(mask, p.mask_kind, at, mk);
    keep = keep && mk;
    s += add * 1.4426950408889634f;
  }
  s = keep ? s : tq_neg_inf();
}

// ============================================================================ rotation

// R = H diag(s) / sqrt(D) applied in the kernels (TQRotation), so that a decode step
// does not need separate rotation kernels around the ops. Butterflies run in order of
// increasing stride, as the CPU backend's (csrc/cpu/codec.h): every pair is an exact
// a + b, a - b of the same operands, so the quantizer's codes match it bit for bit.

/// Whether kernels for head dim D carry the rotation code at all (the ops allow it for
/// powers of two only; for other D it would be dead code that still costs registers).
template <int D>
struct TQRotatable {
  static constexpr bool value = D > 0 && (D & (D - 1)) == 0;
};

TQ_FN bool tq_rot_negates(TQ_CONST TQRotation& r, int d) {
  return ((r.sign_bits[d >> 5] >> (d & 31)) & 1u) != 0u;
}

/// Butterflies over the register index of x[0..N) (stride 1, 2, ... N/2).
template <int N>
TQ_FN void tq_fwht_registers(TQ_THR float* x) {
  TQ_UNROLL
  for (int h = 1; h < N; h <<= 1) {
    TQ_UNROLL
    for (int i = 0; i < N; ++i) {
      if ((i & h) == 0 && i + h < N) { // the bound only matters for N not a power of 2
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
    }
  }
}

/// Butterflies over lane bits 1, 2, ... M/2 of `j` (the partner is lane ^ m).
/// Uniform control flow only.
template <int N, int M>
TQ_FN void tq_fwht_lanes(TQ_THR float* x, int j) {
  TQ_UNROLL
  for (int m = 1; m < M; m <<= 1) {
    TQ_UNROLL
    for (int i = 0; i < N; ++i) {
      const float o = tq_shfl_xor(x[i], m);
      x[i] = (j & m) != 0 ? o - x[i] : x[i] + o;
    }
  }
}

/// x <- R x for a vector held by T adjacent lanes (a power of two dividing 32), lane j
/// of them holding coordinates j*N .. j*N + N-1 in x[0..N). Uniform control flow only.
template <int N, int T>
TQ_FN void tq_rotate_blocked(TQ_THR float* x, TQ_CONST TQRotation& r, int j) {
  TQ_UNROLL
  for (int i = 0; i < N; ++i) {
    x[i] = tq_rot_negates(r, j * N + i) ? -x[i] : x[i];
  }
  tq_fwht_registers<N>(x);
  tq_fwht_lanes<N, T>(x, j);
  TQ_UNROLL
  for (int i = 0; i < N; ++i) {
    x[i] = tq_mul_rn(x[i], r.scale);
  }
}

/// x <- R x for a vector held by a simdgroup, lane l holding coordinates l + 32 i in
/// x[i] (D = 32 N). Uniform control flow only.
template <int N>
TQ_FN void tq_rotate_strided(TQ_THR float* x, TQ_CONST TQRotation& r, int lane) {
  TQ_UNROLL
  for (int i = 0; i < N; ++i) {
    x[i] = tq_rot_negates(r, lane + TQ_SIMD * i) ? -x[i] : x[i];
  }
  tq_fwht_lanes<N, TQ_SIMD>(x, lane);
  tq_fwht_registers<N>(x);
  TQ_UNROLL
  for (int i = 0; i < N; ++i) {
    x[i] = tq_mul_rn(x[i], r.scale);
  }
}

/// Unnormalized Walsh-Hadamard transform of v[0..D) in threadgroup memory by NT
/// threads (D a power of two). Starts and ends with a barrier: call it in uniform
/// control flow.
template <int D, int NT>
TQ_FN void tq_fwht_threadgroup(TQ_TG float* v, int tid) {
  TQ_UNROLL
  for (int h = 1; h < D; h <<= 1) {
    tq_threadgroup_barrier();
    for (int k = tid; k < D / 2; k += NT) {
      const int i = (k / h) * 2 * h + k % h;
      const float a = v[i], b = v[i + h];
      v[i] = a + b;
      v[i + h] = a - b;
    }
  }
  tq_threadgroup_barrier();
}

// ============================================================================ attention

/// Per-lane state of the attention kernel for head dim D: the query rows and the
/// online-softmax accumulators (registers), and the packed codes and scales of the
/// next U tokens of this lane's group, loaded one step ahead.
template <int D, int KB, int VB>
struct TQAttnState {
  float q[TQAttnConfig<D>::RC][TQAttnConfig<D>::DL]; // scale * log2(e) * q slice
  float o[TQAttnConfig<D>::RC][TQAttnConfig<D>::DL]; // unnormalised output slice
  float m[TQAttnConfig<D>::RC]; // running max (log2 units)
  float l[TQAttnConfig<D>::RC]; // running sum of exp2(s - m)
  tq_uint ka[TQAttnConfig<D>::U][TQLaneBits<KB, TQAttnConfig<D>::DL>::NA];
  tq_uint va[TQAttnConfig<D>::U][TQLaneBits<VB, TQAttnConfig<D>::DL>::NA];
  float ks[TQAttnConfig<D>::U];
  float vs[TQAttnConfig<D>::U];
};

/// Where one (batch, KV head) of the cache lives, and this lane's place in a step.
struct TQAttnCache {
  const TQ_DEV tq_uint* kc; // key codes of token 0
  const TQ_DEV tq_half* ks; // key scales of token 0
  const TQ_DEV tq_uint* vc;
  const TQ_DEV tq_half* vs;
  int kc_tok, ks_tok, vc_tok, vs_tok; // token strides (one head's rows: < 2^31 elements)
  int first; // this lane's first token offset within a step
  int j; // this lane's coordinate slice
};

/// Loads key codes + scale of token slot u of the step starting at t0.
template <int D, int KB, int VB>
TQ_FN void tq_attn_load_k(
    TQ_THR TQAttnState<D, KB, VB>& st,
    TQ_THR const TQAttnCache& c,
    int u,
    int t0,
    int t_end) {
  int t =
      min(t0 + c.first + u * TQAttnConfig<D>::GS, t_end - 1); // spare slots re-read a valid token
  tq_load_lane_codes<KB, D, TQAttnConfig<D>::DL>(c.kc + t * c.kc_tok, c.j, st.ka[u]);
  st.ks[u] = tq_to_float(c.ks[t * c.ks_tok]);
}

/// Loads value codes + scale of token slot u of the step starting at t0.
template <int D, int KB, int VB>
TQ_FN void tq_attn_load_v(
    TQ_THR TQAttnState<D, KB, VB>& st,
    TQ_THR const TQAttnCache& c,
    int u,
    int t0,
    int t_end) {
  int t = min(t0 + c.first + u * TQAttnConfig<D>::GS, t_end - 1);
  tq_load_lane_codes<VB, D, TQAttnConfig<D>::DL>(c.vc + t * c.vc_tok, c.j, st.va[u]);
  st.vs[u] = tq_to_float(c.vs[t * c.vs_tok]);
}

/// One step: the U tokens of this lane's group starting at t0 (codes already loaded).
/// CHECK = false is the hot path, for steps whose tokens are all valid and visible
/// to every row (no mask); CHECK = true applies the range, causal limit and mask.
/// The codes of step t0 + STEP are requested as soon as a token's codes are decoded
/// (past the end of the split they re-read its last token: no branch in the loop).
template <int D, int KB, int VB, bool CHECK>
TQ_FN void tq_attn_step(
    TQ_THR TQAttnState<D, KB, VB>& st,
    TQ_THR const TQAttnCache& c,
    int t0,
    int t_end,
    const TQ_TG float* k_tab,
    const TQ_TG float* v_tab,
    int row0,
    int b,
    int kvh,
    const TQ_DEV uchar* mask,
    TQ_CONST TQAttnParams& p) {
  typedef TQAttnConfig<D> C;
  constexpr int T = C::T, DL = C::DL, GS = C::GS, U = C::U, RC = C::RC;
  const int t1 = t0 + C::STEP;

  // Scores s[u][r] = scale * log2(e) * k_scale * q . C_K[codes].
  float s[U][RC];
  TQ_UNROLL
  for (int u = 0; u < U; ++u) {
    float kv[DL];
    tq_decode_lane<KB, DL>(st.ka[u], k_tab, kv);
    const float ksc = st.ks[u];
    tq_attn_load_k<D, KB, VB>(st, c, u, t1, t_end);
    TQ_UNROLL
    for (int r = 0; r < RC; ++r) {
      float acc = 0.0f;
      TQ_UNROLL
      for (int i = 0; i < DL; ++i) {
        acc += st.q[r][i] * kv[i];
      }
      s[u][r] = tq_group_sum<T>(acc) * ksc;
    }
    if (CHECK) {
      const int tok = t0 + c.first + u * GS;
      TQ_UNROLL
      for (int r = 0; r < RC; ++r) {
        tq_mask_score(s[u][r], mask, p, b, kvh, row0 + r, tok, t_end);
      }
    }
  }

  // Online softmax: rescale only when a row's maximum grows.
  float w[U][RC];
  TQ_UNROLL
  for (int r = 0; r < RC; ++r) {
    float mx = s[0][r];
    TQ_UNROLL
    for (int u = 1; u < U; ++u) {
      mx = tq_fmax(mx, s[u][r]);
    }
    if (mx > st.m[r]) {
      const float f = tq_exp2(st.m[r] - mx); // 0 while m is still -inf
      st.l[r] *= f;
      TQ_UNROLL
      for (int i = 0; i < DL; ++i) {
        st.o[r][i] *= f;
      }
      st.m[r] = mx;
    }
    TQ_UNROLL
    for (int u = 0; u < U; ++u) {
      // Without CHECK every score is finite and m >= s.
      const float pu = (CHECK && s[u][r] == tq_neg_inf()) ? 0.0f : tq_exp2(s[u][r] - st.m[r]);
      st.l[r] += pu;
      w[u][r] = pu * st.vs[u];
    }
  }

  // Values: o[r] += w[u][r] * C_V[codes of token u].
  TQ_UNROLL
  for (int u = 0; u < U; ++u) {
    float vv[DL];
    tq_decode_lane<VB, DL>(st.va[u], v_tab, vv);
    tq_attn_load_v<D, KB, VB>(st, c, u, t1, t_end);
    TQ_UNROLL
    for (int r = 0; r < RC; ++r) {
      TQ_UNROLL
      for (int i = 0; i < DL; ++i) {
        st.o[r][i] += w[u][r] * vv[i];
      }
    }
  }
}

/// Attention of the query rows of one KV head over one split of the keys.
///
/// Grid: (row chunks, n_splits, batch * kv_heads); TQ_ATTN_THREADS threads.
/// Each group of T lanes owns one token at a time and DL coordinates of it; the
/// GS groups of a simdgroup read GS consecutive tokens (coalesced), U of them per
/// step. A token's codes are read once and serve every query row of the KV head
/// (GQA heads x query positions) held in registers. Scores are in log2 units
/// (q pre-scaled by scale * log2 e); each group keeps an online softmax (m, l, o)
/// per row, merged across groups and simdgroups at the end. Without p.partials (one
/// split) the threadgroup writes out = o / l and lse; otherwise the unnormalised o and
/// (m, l) go to o_part / ml_part for tq_attention_merge_impl.
///
///   q        (B, Hq, L, D)            QT (float, half, or bfloat16 bits as ushort)
///   k_codes  (B, Hkv, cap, D*KB/32)   packed key codes;   k_scales (B, Hkv, cap) half
///   v_codes  (B, Hkv, cap, D*VB/32)   packed value codes; v_scales (B, Hkv, cap) half
///   k_cent   (2^KB) float, v_cent (2^VB) float: codebooks
///   mask     optional, interpreted by p.mask_kind, indexed through p.mask_stride
///   out      (B, Hq, L, D) float, lse (B, Hq, L) float       [!p.partials]
///   o_part   (B*Hq*L, n_splits, D) float, ml_part (B*Hq*L, n_splits, 2) float
template <typename QT, int D, int KB, int VB>
TQ_FN void tq_attention_impl(
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
  typedef TQAttnConfig<D> C;
  constexpr int T = C::T, DL = C::DL, GS = C::GS, U = C::U, RC = C::RC;
  constexpr int NSG = TQ_ATTN_SIMDGROUPS, NG = NSG * GS;

  TQ_TG float* k_tab = smem;
  TQ_TG float* v_tab = smem + 16;
  TQ_TG float* red_m = smem + 32; // [NG][RC]
  TQ_TG float* red_l = red_m + NG * RC; // [NG][RC]
  TQ_TG float* red_o = red_l + NG * RC; // [NSG][RC][D]

  const int j = int(th.lane) % T; // coordinate slice of this lane
  const int g = int(th.lane) / T; // token slot of this lane's group
  const int chunk = int(th.tg_x);
  const int split = int(th.tg_y);
  const int b = int(th.tg_z) / p.kv_heads;
  const int kvh = int(th.tg_z) % p.kv_heads;
  const int row0 = chunk * p.rows_per_tg;
  const int nr = min(p.rows_per_tg, p.rows - row0); // uniform over the threadgroup

  if (th.tid < (1u << KB)) {
    k_tab[th.tid] = k_cent[th.tid];
  }
  if (th.tid < (1u << VB)) {
    v_tab[th.tid] = v_cent[th.tid];
  }

  // Query rows: the scaled q slice per row. Rows past nr (a partial chunk) compute on
  // q = 0 and are never written. Row r is query head kvh * gqa + (row0 + r) / q_len at
  // position (row0 + r) % q_len.
  TQAttnState<D, KB, VB> st;
  int lim_min = p.kv_len; // smallest causal limit over the rows
  TQ_UNROLL
  for (int r = 0; r < RC; ++r) {
    const int rr = min(row0 + r, p.rows - 1);
    const int qh = kvh * p.gqa + rr / p.q_len;
    const int ql = rr % p.q_len;
    if (p.causal) {
      lim_min = min(lim_min, p.kv_len - p.q_len + ql);
    }
    const TQ_DEV QT* qp = q + b * p.q_stride[0] + qh * p.q_stride[1] + ql * p.q_stride[2];
    TQ_UNROLL
    for (int i = 0; i < DL; ++i) {
      st.q[r][i] = tq_to_float(qp[j * DL + i]);
      st.o[r][i] = 0.0f;
    }
    if (TQRotatable<D>::value && p.rot.on != 0) { // uniform
      tq_rotate_blocked<DL, T>(st.q[r], p.rot, j);
    }
    TQ_UNROLL
    for (int i = 0; i < DL; ++i) {
      st.q[r][i] = r < nr ? st.q[r][i] * p.scale_log2 : 0.0f;
    }
    st.m[r] = tq_neg_inf();
    st.l[r] = 0.0f;
  }

  TQAttnCache c;
  c.kc = k_codes + b * p.kc_stride[0] + kvh * p.kc_stride[1];
  c.ks = k_scales + b * p.ks_stride[0] + kvh * p.ks_stride[1];
  c.vc = v_codes + b * p.vc_stride[0] + kvh * p.vc_stride[1];
  c.vs = v_scales + b * p.vs_stride[0] + kvh * p.vs_stride[1];
  c.kc_tok = int(p.kc_stride[2]);
  c.ks_tok = int(p.ks_stride[2]);
  c.vc_tok = int(p.vc_stride[2]);
  c.vs_tok = int(p.vs_stride[2]);
  c.first = int(th.simd) * U * GS + g;
  c.j = j;

  const int t_begin = split * p.split_len;
  const int t_end = min(p.kv_len, t_begin + p.split_len);
  if (t_begin < t_end) { // uniform
    TQ_UNROLL
    for (int u = 0; u < U; ++u) {
      tq_attn_load_k<D, KB, VB>(st, c, u, t_begin, t_end);
      tq_attn_load_v<D, KB, VB>(st, c, u, t_begin, t_end);
    }
  }
  tq_threadgroup_barrier(); // codebooks ready

  // Steps whose tokens are all in range, causally visible to every row and unmasked
  // take the unchecked path.
  const int t_fast = min(t_end, lim_min + 1);
  for (int t0 = t_begin; t0 < t_end; t0 += C::STEP) {
    if (p.mask_kind == 0 && t0 + C::STEP <= t_fast) {
      tq_attn_step<D, KB, VB, false>(st, c, t0, t_end, k_tab, v_tab, row0, b, kvh, mask, p);
    } else {
      tq_attn_step<D, KB, VB, true>(st, c, t0, t_end, k_tab, v_tab, row0, b, kvh, mask, p);
    }
  }

  // ---- merge the NG groups of the threadgroup
  const int gid = int(th.simd) * GS + g;
  if (j == 0) {
    TQ_UNROLL
    for (int r = 0; r < RC; ++r) {
      red_m[gid * RC + r] = st.m[r];
      red_l[gid * RC + r] = st.l[r];
    }
  }
  tq_threadgroup_barrier();
  float mt[RC], lt[RC];
  TQ_UNROLL
  for (int r = 0; r < RC; ++r) {
    float mm = tq_neg_inf();
    for (int k = 0; k < NG; ++k) {
      mm = tq_fmax(mm, red_m[k * RC + r]);
    }
    float ll = 0.0f;
    if (mm != tq_neg_inf()) {
      for (int k = 0; k < NG; ++k) {
        ll += red_l[k * RC + r] * tq_exp2(red_m[k * RC + r] - mm);
      }
    }
    mt[r] = mm;
    lt[r] = ll;
    const float f = (mm == tq_neg_inf() || st.m[r] == tq_neg_inf()) ? 0.0f : tq_exp2(st.m[r] - mm);
    // Across the GS groups of the simdgroup (lanes j, j+T, ... hold the same slice).
    TQ_UNROLL
    for (int i = 0; i < DL; ++i) {
      float x = st.o[r][i] * f;
      TQ_UNROLL
      for (int off = T; off < TQ_SIMD; off <<= 1) {
        x += tq_shfl_xor(x, off);
      }
      st.o[r][i] = x;
    }
  }
  if (g == 0) {
    TQ_UNROLL
    for (int r = 0; r < RC; ++r) {
      TQ_UNROLL
      for (int i = 0; i < DL; ++i) {
        red_o[(int(th.simd) * RC + r) * D + j * DL + i] = st.o[r][i];
      }
    }
  }
  tq_threadgroup_barrier();

  // ---- across simdgroups, then write
  const bool single = p.partials == 0;
  TQ_UNROLL
  for (int r = 0; r < RC; ++r) {
    if (r < nr) {
      const int rr = row0 + r;
      const int orow = (b * p.q_heads + kvh * p.gqa + rr / p.q_len) * p.q_len + rr % p.q_len;
      const int64_t prow = int64_t(orow) * p.n_splits + split;
      for (int d = int(th.tid); d < D; d += TQ_ATTN_THREADS) {
        float acc = 0.0f;
        TQ_UNROLL
        for (int sg = 0; sg < NSG; ++sg) {
          acc += red_o[(sg * RC + r) * D + d];
        }
        if (single) {
          out[int64_t(orow) * D + d] = lt[r] > 0.0f ? acc / lt[r] : 0.0f;
        } else {
          o_part[prow * D + d] = acc;
        }
      }
      if (th.tid == 0) {
        if (single) {
          lse[orow] = lt[r] > 0.0f ? (mt[r] + tq_log2(lt[r])) * 0.6931471805599453f : tq_neg_inf();
        } else {
          ml_part[prow * 2] = mt[r];
          ml_part[prow * 2 + 1] = lt[r];
        }
      }
    }
  }
}

/// Split-K merge: one threadgroup per query row combines the n_splits partial
/// results by their log-sum-exp weights, and attends to the tail (keys and values that
/// every row sees: fp16 sinks and the recent window) in the same softmax, so that a
/// decode step's attention is this one call. The tail is in the queries' type and
/// space (model space when the op rotates), so it needs no transform of its own: with
/// unrotate_out only the compressed tokens' part is rotated back, and with `centered`
/// their means are added back (TQMergeParams).
///   o_part (rows, n_splits, D), ml_part (rows, n_splits, 2) -> out (rows, D), lse (rows)
///   q (B, Hq, L, D) QT [tail or centered]; tail_k / tail_v (B, Hkv, tail_len, D) QT
///   [tail_len > 0]; key_mean / value_mean (B, Hkv, D) float [centered]
/// Grid: rows threadgroups of TQ_MERGE_THREADS; smem: TQ_MERGE_SMEM floats.
/// OT: out's type (float, or the queries' type: the layer's output without a conversion
/// of its own).
template <typename QT, int D, typename OT = float>
TQ_FN void tq_attention_merge_impl(
    const TQ_DEV float* TQ_RESTRICT o_part,
    const TQ_DEV float* TQ_RESTRICT ml_part,
    const TQ_DEV QT* TQ_RESTRICT q,
    const TQ_DEV QT* TQ_RESTRICT tail_k,
    const TQ_DEV QT* TQ_RESTRICT tail_v,
    const TQ_DEV float* TQ_RESTRICT key_mean,
    const TQ_DEV float* TQ_RESTRICT value_mean,
    TQ_DEV OT* TQ_RESTRICT out,
    TQ_DEV float* TQ_RESTRICT lse,
    TQ_CONST TQMergeParams& p,
    TQ_TG float* smem,
    TQThread th) {
  constexpr int NT = TQ_MERGE_THREADS, NSG = TQ_MERGE_THREADS / TQ_SIMD;
  // The merge is a short chain of dependent steps, each of which would wait for global
  // memory: so everything it reads is loaded first, in registers, with one wait.
  //   PRE  partials per coordinate (the rest are read in the value sum)
  //   MSP  (m, l) pairs per thread: every split (NT * MSP = TQ_MAX_SPLITS)
  //   LPT  lanes per tail token in the scores (NG groups); TKP tokens per group
  //   TVP  tail tokens whose values are staged in threadgroup memory
  // (a window preset's 36-token tail fits TKP and TVP; longer tails read the rest later)
  constexpr int PRE = 16, DPT = (D + NT - 1) / NT;
  constexpr int MSP = TQ_MAX_SPLITS / NT;
  constexpr int LPT = 8, TPS = TQ_SIMD / LPT, NG = NSG * TPS, KPL = D / LPT;
  constexpr int TKP = D <= 128 ? 3 : 1;
  constexpr int TVP_MAX = 40;
  constexpr int TVP = TQ_MERGE_TAIL_VALUES / D < TVP_MAX ? TQ_MERGE_TAIL_VALUES / D : TVP_MAX;
  const int row = int(th.tg_x);
  const int S = p.n_splits, T = p.tail_len;
  const TQ_DEV float* ml = ml_part + int64_t(row) * S * 2;
  TQ_TG float* w = smem; // [S] split weights
  TQ_TG float* tw = smem + TQ_MAX_SPLITS; // [T] tail scores, then weights
  TQ_TG float* qs = tw + TQ_MAX_TAIL; // [D] the query row, later the output row
  TQ_TG float* red = qs + 256; // [3 * NSG]
  TQ_TG float* tvs = red + 16; // [TVP][D] the first tail values

  const int l = row % p.q_len, h = (row / p.q_len) % p.q_heads, b = row / (p.q_len * p.q_heads);
  const int kvh = h / p.gqa;
  const TQ_DEV QT* tk = tail_k + b * p.tk_stride[0] + kvh * p.tk_stride[1];
  const TQ_DEV QT* tv = tail_v + b * p.tv_stride[0] + kvh * p.tv_stride[1];
  const TQ_DEV float* mk = key_mean + b * p.mean_stride[0] + kvh * p.mean_stride[1];
  const TQ_DEV float* mv = value_mean + b * p.mean_stride[0] + kvh * p.mean_stride[1];
  const TQ_DEV QT* qr = q + b * p.q_stride[0] + h * p.q_stride[1] + l * p.q_stride[2];
  const bool centered = p.centered != 0, need_q = T > 0 || centered; // uniform
  const int64_t vstride = p.tv_stride[2];
  const int group = int(th.simd) * TPS + int(th.lane) / LPT, glane = int(th.lane) % LPT;

  // ---- loads
  const TQ_DEV float* op = o_part + int64_t(row) * S * D;
  float pre[DPT][PRE], qv[DPT], mkv[DPT], mvv[DPT];
  TQ_UNROLL
  for (int k = 0; k < DPT; ++k) {
    const int d = int(th.tid) + k * NT;
    const bool in = d < D;
    TQ_UNROLL
    for (int s = 0; s < PRE; ++s) {
      pre[k][s] = (in && s < S) ? tq_load_partial(op + s * D + d) : 0.0f;
    }
    if (in && T > 0) { // staged (read back by this thread only: no barrier needed)
      // Unpredicated loads (tokens past the tail re-read its last one), all issued
      // before the first is used.
      QT raw[TVP];
      TQ_UNROLL
      for (int j = 0; j < TVP; ++j) {
        raw[j] = tv[min(j, T - 1) * vstride + d];
      }
      TQ_UNROLL
      for (int j = 0; j < TVP; ++j) {
        tvs[j * D + d] = j < T ? tq_to_float(raw[j]) : 0.0f;
      }
    }
    qv[k] = (in && need_q) ? tq_to_float(qr[d]) : 0.0f;
    mkv[k] = (in && centered) ? mk[d] : 0.0f;
    mvv[k] = (in && centered) ? mv[d] : 0.0f;
  }
  float msv[MSP], lsv[MSP];
  TQ_UNROLL
  for (int i = 0; i < MSP; ++i) {
    const int s = int(th.tid) + i * NT;
    msv[i] = s < S ? tq_load_partial(ml + 2 * s) : tq_neg_inf();
    lsv[i] = s < S ? tq_load_partial(ml + 2 * s + 1) : 0.0f;
  }
  QT tkp[TKP][KPL]; // (unpredicated: tokens past the tail re-read its last one)
  if (T > 0) {
    TQ_UNROLL
    for (int i = 0; i < TKP; ++i) {
      const TQ_DEV QT* kr = tk + min(group + i * NG, T - 1) * p.tk_stride[2];
      TQ_UNROLL
      for (int c = 0; c < KPL; ++c) {
        tkp[i][c] = kr[glane + c * LPT];
      }
    }
  }

  // ---- the query row (log2 units) and q . key_mean: what centering took off every
  // compressed token's score
  float shift = 0.0f;
  if (need_q) {
    float part = 0.0f;
    TQ_UNROLL
    for (int k = 0; k < DPT; ++k) {
      const int d = int(th.tid) + k * NT;
      if (d < D) {
        const float x = qv[k] * p.scale_log2;
        qs[d] = x;
        part += x * mkv[k];
      }
    }
    part = tq_simd_sum(part);
    if (th.lane == 0) {
      red[2 * NSG + th.simd] = part;
    }
    tq_threadgroup_barrier();
    for (int k = 0; k < NSG; ++k) {
      shift += red[2 * NSG + k];
    }
  }
  // ---- tail scores in the compressed tokens' frame (minus the shift): groups of LPT
  // lanes per token (three shuffles per sum)
  if (T > 0) {
    TQ_UNROLL
    for (int i = 0; i < TKP; ++i) {
      const int j = group + i * NG;
      float dot = 0.0f;
      TQ_UNROLL
      for (int c = 0; c < KPL; ++c) {
        dot += qs[glane + c * LPT] * tq_to_float(tkp[i][c]);
      }
      dot = tq_group_sum<LPT>(dot);
      if (glane == 0 && j < T) {
        tw[j] = dot - shift;
      }
    }
    for (int j0 = TKP * NG + int(th.simd) * TPS; j0 < T; j0 += NG) { // longer tails
      const int j = min(j0 + int(th.lane) / LPT, T - 1);
      const TQ_DEV QT* kr = tk + j * p.tk_stride[2];
      float dot = 0.0f;
      TQ_UNROLL
      for (int c = 0; c < KPL; ++c) {
        dot += qs[glane + c * LPT] * tq_to_float(kr[glane + c * LPT]);
      }
      dot = tq_group_sum<LPT>(dot);
      if (glane == 0 && j0 + int(th.lane) / LPT < T) {
        tw[j] = dot - shift;
      }
    }
    tq_threadgroup_barrier();
  }

  // ---- softmax weights of the splits and the tail
  float mm = tq_neg_inf();
  TQ_UNROLL
  for (int i = 0; i < MSP; ++i) {
    mm = tq_fmax(mm, msv[i]);
  }
  for (int j = int(th.tid); j < T; j += NT) {
    mm = tq_fmax(mm, tw[j]);
  }
  mm = tq_simd_max(mm);
  if (th.lane == 0) {
    red[th.simd] = mm;
  }
  tq_threadgroup_barrier();
  mm = red[0];
  for (int k = 1; k < NSG; ++k) {
    mm = tq_fmax(mm, red[k]);
  }
  // lc: the compressed tokens' share of the softmax sum (their values get value_mean)
  float lc = 0.0f, lt = 0.0f;
  TQ_UNROLL
  for (int i = 0; i < MSP; ++i) {
    const int s = int(th.tid) + i * NT;
    const float ws = (mm == tq_neg_inf() || msv[i] == tq_neg_inf()) ? 0.0f : tq_exp2(msv[i] - mm);
    if (s < S) {
      w[s] = ws;
    }
    lc += lsv[i] * ws;
  }
  for (int j = int(th.tid); j < T; j += NT) {
    const float wj = tq_exp2(tw[j] - mm); // tail scores are finite: mm is too
    tw[j] = wj;
    lt += wj;
  }
  lc = tq_simd_sum(lc);
  lt = tq_simd_sum(lt);
  if (th.lane == 0) {
    red[NSG + th.simd] = lc;
    red[2 * NSG + th.simd] = lt; // (the shift's partial sums are read by now)
  }
  tq_threadgroup_barrier();
  lc = 0.0f;
  lt = 0.0f;
  for (int k = 0; k < NSG; ++k) {
    lc += red[NSG + k];
    lt += red[2 * NSG + k];
  }
  const float ll = lc + lt;

  // ---- weighted sums
  const bool unrotate = TQRotatable<D>::value && p.unrotate_out != 0; // uniform
  float tail_o[DPT];
  TQ_UNROLL
  for (int k = 0; k < DPT; ++k) {
    const int d = int(th.tid) + k * NT;
    tail_o[k] = 0.0f;
    if (d >= D) {
      break;
    }
    // Four independent sums keep several loads in flight.
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    TQ_UNROLL
    for (int s = 0; s < PRE; s += 4) { // weights past S are 0 (pre[k][s] too)
      a0 += pre[k][s] * (s < S ? w[s] : 0.0f);
      a1 += pre[k][s + 1] * (s + 1 < S ? w[s + 1] : 0.0f);
      a2 += pre[k][s + 2] * (s + 2 < S ? w[s + 2] : 0.0f);
      a3 += pre[k][s + 3] * (s + 3 < S ? w[s + 3] : 0.0f);
    }
    const TQ_DEV float* ps = op + PRE * D + d;
    int s = PRE;
    for (; s + 4 <= S; s += 4, ps += 4 * D) {
      a0 += tq_load_partial(ps) * w[s];
      a1 += tq_load_partial(ps + D) * w[s + 1];
      a2 += tq_load_partial(ps + 2 * D) * w[s + 2];
      a3 += tq_load_partial(ps + 3 * D) * w[s + 3];
    }
    for (; s < S; ++s, ps += D) {
      a0 += tq_load_partial(ps) * w[s];
    }
    const float oc = (a0 + a1) + (a2 + a3);
    float t0 = 0.0f, t1 = 0.0f;
    if (T > 0) { // (the staged values exist only then)
      TQ_UNROLL
      for (int j = 0; j + 1 < TVP; j += 2) { // staged values past T are 0
        t0 += tvs[j * D + d] * (j < T ? tw[j] : 0.0f);
        t1 += tvs[(j + 1) * D + d] * (j + 1 < T ? tw[j + 1] : 0.0f);
      }
      if (TVP % 2 != 0) {
        t0 += tvs[(TVP - 1) * D + d] * (TVP - 1 < T ? tw[TVP - 1] : 0.0f);
      }
      for (int j = TVP; j < T; ++j) { // longer tails
        t0 += tq_to_float(tv[j * vstride + d]) * tw[j];
      }
    }
    tail_o[k] = (t0 + t1) + lc * mvv[k];
    if (unrotate) {
      qs[d] = oc; // the tail scores are done with the query row
    } else {
      tq_store_out(out + int64_t(row) * D + d, ll > 0.0f ? (oc + tail_o[k]) / ll : 0.0f);
    }
  }
  if (unrotate) { // R^T o = s (H o) / sqrt(D), then the tail and means (model space)
    tq_fwht_threadgroup<D, NT>(qs, int(th.tid));
    TQ_UNROLL
    for (int k = 0; k < DPT; ++k) {
      const int d = int(th.tid) + k * NT;
      if (d >= D) {
        break;
      }
      const float y = qs[d] * p.rot.scale;
      const float oc = tq_rot_negates(p.rot, d) ? -y : y;
      tq_store_out(out + int64_t(row) * D + d, ll > 0.0f ? (oc + tail_o[k]) / ll : 0.0f);
    }
  }
  if (th.tid == 0) {
    lse[row] = ll > 0.0f ? (mm + tq_log2(ll) + shift) * 0.6931471805599453f : tq_neg_inf();
  }
}

// ============================================================================ quantize

/// Quantizes token vectors of x (rotated space, or model space rotated here when
/// p.rot.on; minus the head's mean first when p.centered) and writes their packed codes,
/// their scales or both (p.write) into the cache buffers at token slot offset +
/// position. One simdgroup per vector; the arithmetic follows docs/ARCHITECTURE.md in
/// the same order as the CPU backend (sequential float32 sums, never fused), so that
/// codes and scales match it bit for bit.
///   x (batch, heads, length, D) XT (float, half, bfloat16 bits); cent (2^B) float
///   codes (batch, heads, cap, D*B/32) uint [TQ_WRITE_CODES];
///   scales (batch, heads, cap) half [TQ_WRITE_SCALES]
///   mean (batch, heads, D) float [centered]
/// A ring exchange (incoming non-null): x is a window ring's slots, and once a vector is
/// read, the incoming token of its position takes its place (x_slots: x's memory,
/// writable), so that the tokens leaving a ring and those entering it are one launch.
///   incoming (batch, heads, length, D) XT [exchange], strides p.in_stride
/// Grid: ceil(batch*heads*length / TQ_QUANT_SIMDGROUPS) threadgroups of TQ_QUANT_THREADS;
/// smem: 32 + TQ_QUANT_SIMDGROUPS * 2 * D floats.
template <typename XT, int D, int B>
TQ_FN void tq_quantize_impl(
    const TQ_DEV XT* x, // (not restrict: an exchange writes it through x_slots)
    const TQ_DEV float* TQ_RESTRICT cent,
    const TQ_DEV float* TQ_RESTRICT mean,
    TQ_DEV tq_uint* TQ_RESTRICT codes,
    TQ_DEV tq_half* TQ_RESTRICT scales,
    TQ_DEV XT* x_slots,
    const TQ_DEV XT* TQ_RESTRICT incoming,
    TQ_CONST TQQuantParams& p,
    TQ_TG float* smem,
    TQThread th) {
  constexpr int NC = 1 << B, W = D * B / 32, PER = D / TQ_SIMD;
  TQ_TG float* tab = smem; // [16] centroids
  TQ_TG float* bnd = smem + 16; // [15] boundaries
  TQ_TG float* yv = smem + 32 + int(th.simd) * 2 * D; // [D] this vector
  TQ_TG float* cv = yv + D; // [D] its codes (small integers, exact in float)

  if (th.tid < uint(NC)) {
    tab[th.tid] = cent[th.tid];
  }
  if (th.tid < uint(NC - 1)) {
    bnd[th.tid] = tq_mul_rn(tq_add_rn(cent[th.tid], cent[th.tid + 1]), 0.5f);
  }
  tq_threadgroup_barrier();

  const int n = p.batch * p.heads * p.length;
  const int v = int(th.tg_x) * TQ_QUANT_SIMDGROUPS + int(th.simd);
  if (v >= n) { // uniform over the simdgroup
    return;
  }
  const int pos = v % p.length;
  const int h = (v / p.length) % p.heads;
  const int b = v / (p.length * p.heads);
  const TQ_DEV XT* xp = x + b * p.x_stride[0] + h * p.x_stride[1] + pos * p.x_stride[2];

  float xr[PER];
  TQ_UNROLL
  for (int k = 0; k < PER; ++k) {
    xr[k] = tq_to_float(xp[int(th.lane) + k * TQ_SIMD]);
  }
  if (p.centered != 0) { // uniform; one float32 subtraction, as on the CPU
    const TQ_DEV float* mp = mean + b * p.mean_stride[0] + h * p.mean_stride[1];
    TQ_UNROLL
    for (int k = 0; k < PER; ++k) {
      xr[k] = tq_add_rn(xr[k], -mp[int(th.lane) + k * TQ_SIMD]);
    }
  }
  if (TQRotatable<D>::value && p.rot.on != 0) { // uniform
    tq_rotate_strided<PER>(xr, p.rot, int(th.lane));
  }
  TQ_UNROLL
  for (int k = 0; k < PER; ++k) {
    yv[int(th.lane) + k * TQ_SIMD] = xr[k];
  }
  tq_simdgroup_barrier();

  // norm = sqrt(sum y_i^2), summed in coordinate order by every lane.
  float norm2 = 0.0f;
  for (int i = 0; i < D; ++i) {
    norm2 = tq_add_rn(norm2, tq_mul_rn(yv[i], yv[i]));
  }
  const float norm = tq_sqrt_rn(norm2);
  const float inv = norm > 0.0f ? tq_div_rn(1.0f, norm) : 0.0f;

  TQ_UNROLL
  for (int k = 0; k < PER; ++k) {
    const int i = int(th.lane) + k * TQ_SIMD;
    const float u = tq_mul_rn(yv[i], inv);
    int code = 0;
    for (int t = 0; t < NC - 1; ++t) {
      code += u > bnd[t] ? 1 : 0; // ties go to the lower code
    }
    cv[i] = float(code);
  }
  tq_simdgroup_barrier();

  if ((p.write & TQ_WRITE_CODES) != 0) { // uniform
    // Lane w assembles word w of the LSB-first bit stream.
    const int w = int(th.lane);
    if (w < W) {
      tq_uint word = 0u;
      const int first = (32 * w) / B;
      const int last = min(D - 1, (32 * w + 31) / B);
      for (int i = first; i <= last; ++i) {
        const int sh = i * B - 32 * w; // may be negative for a code straddling in
        const tq_uint c = tq_uint(cv[i]);
        word |= sh >= 0 ? (c << sh) : (c >> (-sh));
      }
      codes[b * p.c_stride[0] + h * p.c_stride[1] + (p.offset + pos) * p.c_stride[2] + w] = word;
    }
  }
  if ((p.write & TQ_WRITE_SCALES) != 0 && th.lane == 0) {
    float cn2 = 0.0f;
    for (int i = 0; i < D; ++i) {
      const float c = tab[int(cv[i])];
      cn2 = tq_add_rn(cn2, tq_mul_rn(c, c));
    }
    const float cn = tq_sqrt_rn(cn2);
    const float scale = cn > 0.0f ? tq_div_rn(norm, cn) : 0.0f;
    scales[b * p.s_stride[0] + h * p.s_stride[1] + (p.offset + pos) * p.s_stride[2]] =
        tq_to_half_rn(scale);
  }
  if (incoming != nullptr) { // uniform
    // Each lane overwrites the coordinates it read into xr above.
    TQ_DEV XT* dst = x_slots + (xp - x);
    const TQ_DEV XT* src =
        incoming + b * p.in_stride[0] + h * p.in_stride[1] + pos * p.in_stride[2];
    TQ_UNROLL
    for (int k = 0; k < PER; ++k) {
      dst[int(th.lane) + k * TQ_SIMD] = src[int(th.lane) + k * TQ_SIMD];
    }
  }
}

// ============================================================================ dequantize

/// Rotated-space vectors of tokens [start, start + length): out = scale * C[code], in
/// out's type (OT: float, half, or bfloat16 as raw ushort bits), written at slots
/// [before, before + length) of each head's out_tokens slots; the slots around them
/// copy the rows of prefix / suffix (the prefill's fp16 tokens, in OT) or are zeroed.
/// One thread per output element.
///   codes (batch, heads, cap, W) uint, scales (batch, heads, cap) half, cent (2^B) float
///   prefix (batch, heads, before, head_dim), suffix (batch, heads, after, head_dim):
///     row-contiguous, read only where p.has_prefix / p.has_suffix
///   out (batch, heads, out_tokens, head_dim), row-contiguous
/// Grid: ceil(total / TQ_DEQUANT_THREADS) threadgroups; smem: 16 floats.
template <typename OT, int B>
TQ_FN void tq_dequantize_impl(
    const TQ_DEV tq_uint* TQ_RESTRICT codes,
    const TQ_DEV tq_half* TQ_RESTRICT scales,
    const TQ_DEV float* TQ_RESTRICT cent,
    const TQ_DEV OT* TQ_RESTRICT prefix,
    const TQ_DEV OT* TQ_RESTRICT suffix,
    TQ_DEV OT* TQ_RESTRICT out,
    TQ_CONST TQDequantParams& p,
    TQ_TG float* smem,
    TQThread th) {
  if (th.tid < (1u << B)) {
    smem[th.tid] = cent[th.tid];
  }
  tq_threadgroup_barrier();
  const int64_t e = int64_t(th.tg_x) * TQ_DEQUANT_THREADS + th.tid;
  const int64_t total = int64_t(p.batch) * p.heads * p.out_tokens * p.head_dim;
  if (e >= total) {
    return;
  }
  const int d = int(e % p.head_dim);
  const int64_t tv = e / p.head_dim;
  const int t = int(tv % p.out_tokens) - p.before;
  const int64_t bh = tv / p.out_tokens; // b * heads + h
  if (t < 0) {
    if (p.has_prefix != 0) {
      out[e] = prefix[(bh * p.before + (t + p.before)) * p.head_dim + d];
    } else {
      tq_store_out(out + e, 0.0f);
    }
    return;
  }
  if (t >= p.length) {
    const int after = p.out_tokens - p.before - p.length;
    if (p.has_suffix != 0) {
      out[e] = suffix[(bh * after + (t - p.length)) * p.head_dim + d];
    } else {
      tq_store_out(out + e, 0.0f);
    }
    return;
  }
  const int h = int(bh % p.heads);
  const int b = int(bh / p.heads);
  const int64_t tok = int64_t(p.start) + t;
  const TQ_DEV tq_uint* cw = codes + b * p.c_stride[0] + h * p.c_stride[1] + tok * p.c_stride[2];
  const int bit = d * B;
  const int w = bit >> 5, off = bit & 31;
  tq_uint c = cw[w] >> off;
  if (off + B > 32) {
    c |= cw[w + 1] << (32 - off);
  }
  const float sc = tq_to_float(scales[b * p.s_stride[0] + h * p.s_stride[1] + tok * p.s_stride[2]]);
  tq_store_out(out + e, sc * smem[c & ((1u << B) - 1u)]);
}

// ============================================================================ copy

/// Row-contiguous copy of a strided array of 4-byte (T = uint) or 2-byte (T = ushort)
/// elements, used when a cache buffer cannot be updated in place.
template <typename T>
TQ_FN void tq_copy_impl(
    const TQ_DEV T* TQ_RESTRICT src,
    TQ_DEV T* TQ_RESTRICT dst,
    TQ_CONST TQCopyParams& p,
    TQThread th) {
  const int64_t e = int64_t(th.tg_x) * TQ_COPY_THREADS + th.tid;
  if (e >= p.size) {
    return;
  }
  int64_t rem = e, at = 0, to = 0;
  TQ_UNROLL
  for (int a = 3; a >= 0; --a) {
    const int64_t i = rem % p.shape[a];
    at += i * p.stride[a];
    to += i * p.dst_stride[a];
    rem /= p.shape[a];
  }
  dst[p.dst_strided != 0 ? to : e] = src[at];
}
