// Layout: host code shared by the GPU backends (CUDA and Metal).
// Host code shared by the GPU backends (csrc/cuda/eval_cuda.cu, csrc/metal/eval_metal.cpp):
// the kernels' argument blocks (metal/tq_params.h) filled from a primitive and its
// arrays, and the split of the keys over threadgroups. Backend-neutral C++: what
// differs per backend (which kernel, its rows per threadgroup, how many threadgroups
// fill the GPU) the callers pass in.
#pragma once

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "kernel_overrides.h"
#include "message.h"
#include "metal/tq_params.h"
#include "primitives.h"

namespace turboquant_mlx::gpu {

/// Refuses a head dim without compiled kernels (multiples of 32 from 32 to 256) in
/// `op` of the GPU backend `backend` ("CUDA", "Metal").
inline void check_kernel_head_dim(const char* op, const char* backend, int d) {
  if (d < 32 || d > 256 || d % 32 != 0) {
    throw std::invalid_argument(message(
        "[turboquant_mlx.",
        op,
        "] the ",
        backend,
        " kernels support head dims that are multiples of 32 in [32, 256], got ",
        d,
        "."));
  }
}

/// Arguments of an attention kernel over queries `q` (B, Hq, L, D) and the cache's
/// codes and scales as the kernel reads them, with the mask (nullptr: none) of
/// ap.has_mask. Leaves the launch shape to the caller: rows_per_tg, n_splits,
/// split_len and partials.
inline TQAttnParams attention_params(
    const AttentionParams& ap,
    const mx::array& q,
    const mx::array& kc,
    const mx::array& ks,
    const mx::array& vc,
    const mx::array& vs,
    int kv_heads,
    const mx::array* mask) {
  TQAttnParams p{};
  for (int a = 0; a < 3; ++a) {
    p.q_stride[a] = q.strides()[a];
    p.kc_stride[a] = kc.strides()[a];
    p.ks_stride[a] = ks.strides()[a];
    p.vc_stride[a] = vc.strides()[a];
    p.vs_stride[a] = vs.strides()[a];
  }
  p.batch = q.shape(0);
  p.q_heads = q.shape(1);
  p.kv_heads = kv_heads;
  p.q_len = q.shape(2);
  p.kv_len = ap.kv_len;
  p.gqa = p.q_heads / kv_heads;
  p.rows = p.gqa * p.q_len;
  p.scale_log2 = ap.scale * 1.4426950408889634f;
  p.causal = ap.causal ? 1 : 0;
  p.rot = kernel_rotation(ap.rotation, q.shape(3));
  if (mask != nullptr) {
    for (int a = 0; a < 4; ++a) {
      p.mask_stride[a] = mask->strides()[a];
    }
    switch (mask->dtype()) {
      case mx::bool_: p.mask_kind = 1; break;
      case mx::float32: p.mask_kind = 2; break;
      case mx::float16: p.mask_kind = 3; break;
      case mx::bfloat16: p.mask_kind = 4; break;
      default:
        throw std::invalid_argument(
            "[turboquant_mlx.compressed_attention] mask must be bool or floating point.");
    }
  }
  return p;
}

/// How many key splits the attention grid asks for, given `target` threadgroups over
/// `units` (batch x KV heads x row chunks).
enum class SplitRounding {
  down, // at most `target` threadgroups: one wave (CUDA: a second wave of a few blocks
        // would double the kernel's time)
  up, // at least `target` threadgroups (Metal)
};

struct KeySplits {
  int splits;
  int split_len; // keys per split, a multiple of `step`
};

/// Splits of `kv_len` keys for `units` of work aiming at `target` threadgroups
/// (splits_override() replaces the count), each split at least `min_split` keys
/// and a whole number of `step`-key iterations, at most TQ_MAX_SPLITS; the count is
/// then the fewest splits of that length.
inline KeySplits key_splits(
    int kv_len,
    int units,
    int target,
    int step,
    int min_split,
    SplitRounding rounding) {
  int splits = splits_override();
  if (splits <= 0) {
    splits = rounding == SplitRounding::down ? std::max(1, target / units)
                                             : (target + units - 1) / units;
  }
  const int max_splits = std::max(1, (kv_len + min_split - 1) / min_split);
  splits = std::max(1, std::min({splits, max_splits, TQ_MAX_SPLITS}));
  int split_len = (kv_len + splits - 1) / splits;
  split_len = std::max(step, (split_len + step - 1) / step * step);
  splits = std::max(1, (kv_len + split_len - 1) / split_len);
  return {splits, split_len};
}

/// Arguments of the split-K merge over the query rows of `q` (B, Hq, L, D) with
/// `splits` partials each, of the tail and the means when the attention op has them
/// (`tail`, `means`: those inputs as the merge reads them), with the op's rotation (the
/// merge writes R^T o for the compressed part when ap.rotate_output).
inline TQMergeParams merge_params(
    const mx::array& q,
    const AttentionParams& ap,
    const std::vector<mx::array>& tail,
    const std::vector<mx::array>& means,
    int kv_heads,
    int splits) {
  TQMergeParams mp{};
  mp.rows = q.shape(0) * q.shape(1) * q.shape(2);
  mp.n_splits = splits;
  mp.q_heads = q.shape(1);
  mp.q_len = q.shape(2);
  mp.gqa = q.shape(1) / kv_heads;
  mp.scale_log2 = ap.scale * 1.4426950408889634f;
  mp.rot = kernel_rotation(ap.rotation, q.shape(3));
  mp.unrotate_out = ap.rotate_output ? 1 : 0;
  for (int a = 0; a < 3; ++a) {
    mp.q_stride[a] = q.strides()[a];
  }
  if (ap.has_tail) {
    for (int a = 0; a < 3; ++a) {
      mp.tk_stride[a] = tail[0].strides()[a];
      mp.tv_stride[a] = tail[1].strides()[a];
    }
    mp.tail_len = tail[0].shape(2);
  }
  if (ap.centered) {
    // Both means are row-contiguous float32 (B, Hkv, 1, D) here (the evals copy one
    // that is not), so one pair of strides serves both.
    mp.mean_stride[0] = means[0].strides()[0];
    mp.mean_stride[1] = means[0].strides()[1];
    mp.centered = 1;
  }
  return mp;
}

/// Arguments of a quantize-and-append launch of one part: its vectors `x` as the
/// kernel reads them, the buffers it writes (nullptr: not written by this node) and
/// the part's mean (nullptr: not centered).
inline TQQuantParams quantize_params(
    const QuantizeAppend& prim,
    const AppendPart& part,
    const mx::array& x,
    const mx::array* codes,
    const mx::array* scales,
    const mx::array* mean) {
  TQQuantParams p{};
  for (int a = 0; a < 3; ++a) {
    p.x_stride[a] = x.strides()[a];
    p.c_stride[a] = codes ? codes->strides()[a] : 0;
    p.s_stride[a] = scales ? scales->strides()[a] : 0;
  }
  p.batch = x.shape(0);
  p.heads = x.shape(1);
  p.length = x.shape(2);
  p.offset = prim.offset();
  p.write = prim.write_flags();
  p.rot = kernel_rotation(part.rotation, x.shape(3));
  if (mean != nullptr) {
    p.mean_stride[0] = mean->strides()[0];
    p.mean_stride[1] = mean->strides()[1];
    p.centered = 1;
  }
  return p;
}

/// Arguments of a dequantize launch from `codes` and `scales` into `out`.
inline TQDequantParams dequantize_params(
    const Dequantize& prim,
    const mx::array& codes,
    const mx::array& scales,
    const mx::array& out) {
  TQDequantParams p{};
  for (int a = 0; a < 3; ++a) {
    p.c_stride[a] = codes.strides()[a];
    p.s_stride[a] = scales.strides()[a];
  }
  p.batch = out.shape(0);
  p.heads = out.shape(1);
  p.start = prim.start();
  p.length = prim.length();
  p.head_dim = out.shape(3);
  p.before = prim.before();
  p.out_tokens = out.shape(2);
  p.has_prefix = prim.prefix_input() >= 0;
  p.has_suffix = prim.suffix_input() >= 0;
  return p;
}

} // namespace turboquant_mlx::gpu
