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
