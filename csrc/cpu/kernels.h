// CPU backend of the primitives (eval_cpu).
#pragma once

#include <vector>

#include "primitives.h"

namespace turboquant_mlx::cpu {

/// One part (tensor) of a QuantizeAppend node: its inputs from `in`, its buffers'
/// outputs from `out`.
void quantize_append_part(
    const QuantizeAppend& prim,
    const AppendPart& part,
    const mx::Stream& s,
    const mx::array* in,
    mx::array* out);

/// Tokens [slot, slot + length) of a ring (B, H, slots, D; float32, float16 or
/// bfloat16) as a float32 row-major array (B, H, length, D), filled by a task of the
/// stream's encoder (RingAppend's leaving tokens, as the quantize kernel reads them).
mx::array ring_slots_f32(const mx::array& ring, int slot, int length, const mx::Stream& s);

void write_tokens(
    const WriteTokens& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs);

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

} // namespace turboquant_mlx::cpu
