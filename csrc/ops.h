// Layout: host code, every build.
// Op functions of turboquant_mlx: validate inputs, then build the primitive.
// The ops work in rotated space; quantize_append and compressed_attention can also
// apply a power-of-two head dim's rotation themselves (rotation_signs).
// Errors are std::invalid_argument starting with "[turboquant_mlx.<op>]".
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include "mlx/ops.h"

namespace turboquant_mlx {

namespace mx = mlx::core;

/// The D signs s of a Hadamard rotation R = H diag(s) / sqrt(D) (power-of-two D), which
/// the ops apply in their kernels (their `rotation_signs`). A cache builds it once:
/// Python converts a sequence of floats on every call, a cost a decode step pays per
/// layer and op. The ops check the values against their head dim.
struct RotationSigns {
  std::vector<float> values;

  explicit RotationSigns(std::vector<float> v) : values(std::move(v)) {}
};

/// 32-bit words one token of `head_dim` coordinates takes at `bits` per coordinate.
int words_per_token(int head_dim, int bits);

/// Quantizes `x` (B, H, L, D) and writes it at token `offset` of the cache buffers
/// `codes` (B, H, capacity, W) uint32 and `scales` (B, H, capacity) float16.
/// `x` is in rotated space, or, when `rotation_signs` (the D signs s of the rotation
/// R = H diag(s) / sqrt(D), power-of-two D) is given, in model space: the kernels
/// rotate it. With `mean` (B, H, 1, D), in x's space, x - mean is quantized (a
/// mean-centered cache appends its tokens as they are).
/// Returns the updated {codes, scales}; they reuse the input buffers when the inputs
/// are donatable, so appending costs O(L), not O(capacity).
/// `in_place`: they reuse them even while other arrays reference the input buffers
/// (which then see the new tokens too): for a caller that owns the buffers and whose
/// other readers look only at slots before `offset` (see QuantizeAppend).
std::vector<mx::array> quantize_append(
    const mx::array& codes,
    const mx::array& scales,
    const mx::array& x,
    const mx::array& centroids,
    int offset,
    int bits,
    const std::optional<RotationSigns>& rotation_signs = std::nullopt,
    const std::optional<mx::array>& mean = std::nullopt,
    bool in_place = false,
    mx::StreamOrDevice s = {});

/// A layer's keys and values appended at `offset` as one graph node, always in place
/// (see quantize_append's in_place: for a cache that owns its buffers): the CUDA backend
/// writes both tensors' codes and scales with one kernel launch when they have the same
/// bits and shape, otherwise (and on Metal) one launch per tensor. Each tensor is checked as
/// quantize_append checks it; keys and values must bring the same number of tokens into
/// caches of the same capacity. Returns the key codes and scales, then the value codes
/// and scales.
std::vector<mx::array> quantize_append_kv(
    const mx::array& k_codes,
    const mx::array& k_scales,
    const mx::array& v_codes,
    const mx::array& v_scales,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& k_centroids,
    const mx::array& v_centroids,
    int offset,
    int key_bits,
    int value_bits,
    const std::optional<RotationSigns>& key_rotation_signs = std::nullopt,
    const std::optional<RotationSigns>& value_rotation_signs = std::nullopt,
    const std::optional<mx::array>& key_mean = std::nullopt,
    const std::optional<mx::array>& value_mean = std::nullopt,
    mx::StreamOrDevice s = {});

/// Writes x (B, H, L, D) into the dense cache buffer (B, H, capacity, D) of the same
/// floating-point dtype at token `offset`, in the buffer's own memory even while other
/// arrays reference it (they see the new tokens; see quantize_append's in_place). For
/// a caller that owns the buffer and whose other readers look only at tokens before
/// `offset`. CPU and CUDA streams.
mx::array write_tokens(
    const mx::array& buffer,
    const mx::array& x,
    int offset,
    mx::StreamOrDevice s = {});

/// write_tokens into a layer's key and value buffers as one node (same offset, same
/// checks per buffer). `after`: arrays the write must follow, earlier readers of the
/// slots it overwrites (a ring of tokens read by the previous step's attention): MLX
/// orders a node after its inputs' producers only, so they are passed as inputs.
std::vector<mx::array> write_tokens_kv(
    const mx::array& k_buffer,
    const mx::array& v_buffer,
    const mx::array& keys,
    const mx::array& values,
    int offset,
    const std::vector<mx::array>& after = {},
    mx::StreamOrDevice s = {});

/// A window ring's exchange as one node (RingAppend): the tokens in slots
/// [slot, slot + L) of the key and value rings (B, H, slots, D) -- those leaving a
/// cache's window -- are quantized into the caches at `offset` (as quantize_append_kv,
/// same arguments per tensor), then the new keys and values (B, H, L, D, in the
/// rings' dtype) are written into those slots (as write_tokens_kv, in place; `after`
/// as there). CPU and CUDA streams; on the CPU a leaving token that cannot be quantized
/// raises as quantize_append does, and the rings are then not written. Returns the key
/// codes and scales, the value codes and scales, then the key and value rings.
std::vector<mx::array> ring_append_kv(
    const mx::array& k_codes,
    const mx::array& k_scales,
    const mx::array& v_codes,
    const mx::array& v_scales,
    const mx::array& k_ring,
    const mx::array& v_ring,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& k_centroids,
    const mx::array& v_centroids,
    int offset,
    int slot,
    int key_bits,
    int value_bits,
    const std::optional<RotationSigns>& key_rotation_signs = std::nullopt,
    const std::optional<RotationSigns>& value_rotation_signs = std::nullopt,
    const std::optional<mx::array>& key_mean = std::nullopt,
    const std::optional<mx::array>& value_mean = std::nullopt,
    const std::vector<mx::array>& after = {},
    mx::StreamOrDevice s = {});

/// Attention of q (B, Hq, L<=8, D) over the first `kv_len` cached tokens and, when
/// given, the tail: up to 256 uncompressed keys/values (B, Hkv, T, D) in q's space
/// that every query sees (fp16 sinks and the recent window of a cache), in one
/// softmax.
/// q is in rotated space, or, with `rotation_signs` (see quantize_append), in model
/// space: the kernels rotate it, and with `rotate_output` return out in model space.
/// `key_mean` / `value_mean` (B, Hkv, 1, D), in q's space, say that the compressed
/// tokens were appended with those means (quantize_append's `mean`) and the tail was
/// not: out and lse are those of the uncentered keys and values.
/// Returns {out (B, Hq, L, D) float32, lse (B, Hq, L) float32}.
std::vector<mx::array> compressed_attention(
    const mx::array& q,
    const mx::array& k_codes,
    const mx::array& k_scales,
    const mx::array& v_codes,
    const mx::array& v_scales,
    const mx::array& k_centroids,
    const mx::array& v_centroids,
    int kv_len,
    float scale,
    int key_bits,
    int value_bits,
    bool causal,
    const std::optional<mx::array>& mask = std::nullopt,
    const std::optional<mx::array>& tail_k = std::nullopt,
    const std::optional<mx::array>& tail_v = std::nullopt,
    const std::optional<RotationSigns>& rotation_signs = std::nullopt,
    bool rotate_output = true,
    const std::optional<mx::array>& key_mean = std::nullopt,
    const std::optional<mx::array>& value_mean = std::nullopt,
    std::optional<mx::Dtype> out_dtype = std::nullopt,
    mx::StreamOrDevice s = {});

/// Decodes tokens [start, start + length) into rotated-space vectors of `dtype`
/// (float32, float16 or bfloat16), at slots [before, before + length) of a
/// (B, H, before + length + after, D) array whose other slots are zero, or the rows of
/// `prefix` (B, H, before, D) and `suffix` (B, H, after, D) where given (in `dtype`).
///
/// `into` (row-contiguous, `dtype`, at least as many elements as the result): the
/// result is written into its buffer and is a view of it, so that one temporary serves
/// every call (the prefill's keys and values, layer after layer). Every array sharing
/// that buffer sees the write: the caller orders the call after the last reader of
/// the previous contents (the prefill's next layer depends on the previous layer's
/// attention through its inputs).
mx::array dequantize(
    const mx::array& codes,
    const mx::array& scales,
    const mx::array& centroids,
    int bits,
    int start,
    int length,
    mx::Dtype dtype = mx::float32,
    int before = 0,
    int after = 0,
    const std::optional<mx::array>& prefix = std::nullopt,
    const std::optional<mx::array>& suffix = std::nullopt,
    const std::optional<mx::array>& into = std::nullopt,
    mx::StreamOrDevice s = {});

} // namespace turboquant_mlx
