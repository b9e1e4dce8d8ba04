// Op functions of turboquant_mlx: validate inputs, then build the primitive.
// All ops work in rotated space; the Python layer applies the rotation.
// Errors are std::invalid_argument starting with "[turboquant_mlx.<op>]".
#pragma once

#include <optional>
#include <vector>

#include "mlx/ops.h"

namespace turboquant_mlx {

namespace mx = mlx::core;

/// 32-bit words one token of `head_dim` coordinates takes at `bits` per coordinate.
int words_per_token(int head_dim, int bits);

/// Quantizes `x_rot` (B, H, L, D) and writes it at token `offset` of the cache buffers
/// `codes` (B, H, capacity, W) uint32 and `scales` (B, H, capacity) float16.
/// Returns the updated {codes, scales}; they reuse the input buffers when the inputs
/// are donatable, so appending costs O(L), not O(capacity).
std::vector<mx::array> quantize_append(
    const mx::array& codes,
    const mx::array& scales,
    const mx::array& x_rot,
    const mx::array& centroids,
    int offset,
    int bits,
    mx::StreamOrDevice s = {});

/// Attention of q_rot (B, Hq, L<=8, D) over the first `kv_len` cached tokens and, when
/// given, the tail: up to 256 uncompressed keys/values (B, Hkv, T, D) in the same
/// rotated space that every query sees (fp16 sinks and the recent window of a cache),
/// in one softmax.
/// Returns {out (B, Hq, L, D) float32 in rotated space, lse (B, Hq, L) float32}.
std::vector<mx::array> compressed_attention(
    const mx::array& q_rot,
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
    mx::StreamOrDevice s = {});

/// Decodes tokens [start, start + length) into rotated-space float32 vectors
/// (B, H, length, D).
mx::array dequantize(
    const mx::array& codes,
    const mx::array& scales,
    const mx::array& centroids,
    int bits,
    int start,
    int length,
    mx::StreamOrDevice s = {});

} // namespace turboquant_mlx
