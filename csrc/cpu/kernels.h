// CPU backend of the primitives (eval_cpu).
#pragma once

#include <vector>

#include "primitives.h"

namespace turboquant_mlx::cpu {

void quantize_append(
    const QuantizeAppend& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs);

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
