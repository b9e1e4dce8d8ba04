// GPU entry points. Exactly one backend provides them: csrc/cuda/ when MLX has CUDA,
// csrc/metal/ on macOS, csrc/gpu_none.cpp otherwise (where they throw; the Python
// layer routes GPU streams to plain-MLX fallbacks when gpu::available() is false).
#pragma once

#include <vector>

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

} // namespace turboquant_mlx::gpu
