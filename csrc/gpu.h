// GPU entry points. Exactly one backend provides them: csrc/cuda/ when MLX has CUDA,
// csrc/metal/ on macOS, csrc/gpu_none.cpp otherwise (where they throw; the Python
// layer routes GPU streams to plain-MLX fallbacks when gpu::available() is false).
#pragma once

#include <vector>

#include "metal/tq_params.h"
#include "primitives.h"

namespace turboquant_mlx::gpu {

/// True when this build carries GPU kernels for the default GPU device.
bool available();

/// Name of the GPU backend compiled in: "cuda", "metal" or "none".
const char* backend_name();

/// One QuantizeAppend node: writes prim.target() (codes or scales) into outputs[0].
void quantize_append(
    const QuantizeAppend& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    mx::array& output);

void attention(
    const CompressedAttention& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs);

void dequantize(
    const Dequantize& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs);

/// Arguments of the split-K merge over the query rows of `q` (B, Hq, L, D) with
/// `splits` partials each, and of the tail when the attention op has one (its last two
/// inputs, (B, Hkv, T, D)), with the op's rotation (the merge writes R^T out when
/// ap.rotate_output). Shared by the backends' `attention`.
inline TQMergeParams merge_params(
    const mx::array& q,
    const AttentionParams& ap,
    const std::vector<mx::array>& inputs,
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
  if (ap.has_tail) {
    const auto& tk = inputs[inputs.size() - 2];
    const auto& tv = inputs.back();
    for (int a = 0; a < 3; ++a) {
      mp.q_stride[a] = q.strides()[a];
      mp.tk_stride[a] = tk.strides()[a];
      mp.tv_stride[a] = tv.strides()[a];
    }
    mp.tail_len = tk.shape(2);
  }
  return mp;
}

} // namespace turboquant_mlx::gpu
