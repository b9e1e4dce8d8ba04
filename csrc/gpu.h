// Layout: host code, every build (the GPU backends' interface).
// GPU entry points. Exactly one backend provides them: csrc/cuda/ when MLX has CUDA,
// csrc/metal/ on macOS, csrc/gpu_none.cpp otherwise (where they throw; the Python
// layer routes GPU streams to plain-MLX fallbacks where gpu::kernel_support says the
// build has no kernels, kernel_support.h).
#pragma once

#include <vector>

#include "kernel_support.h"
#include "metal/tq_params.h"
#include "primitives.h"

namespace turboquant_mlx::gpu {

/// Name of the GPU backend compiled in: "cuda", "metal" or "none".
const char* backend_name();

/// Device memory this backend allocates outside MLX's allocator (so outside
/// mx.get_active_memory / mx.get_peak_memory), in bytes: {in use, peak in use since
/// the last reset, held free for reuse}. With `reset_peak`, the peak restarts from what
/// is in use. All zero where the backend allocates through MLX (Metal, none).
std::vector<size_t> pool_memory(bool reset_peak);

/// One part (tensor) of a QuantizeAppend node, one kernel launch: writes the buffers
/// the node names (codes, scales or both) into `out`, its inputs from `in`.
void quantize_append_part(
    const QuantizeAppend& prim,
    const AppendPart& part,
    const mx::Stream& s,
    const mx::array* in,
    mx::array* out);

/// All parts of a QuantizeAppend node as one kernel launch, where the backend has one
/// for them (CUDA: a layer's keys and values of the same bits and shape); false leaves
/// the node to quantize_append_part, one launch per part.
bool quantize_append_at_once(
    const QuantizeAppend& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs);

/// One WriteTokens node (CUDA; the Metal backend raises: it has no kernel for it, and
/// the Python layer writes with slice updates there).
void write_tokens(
    const WriteTokens& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs);

/// One RingAppend node (CUDA: one launch of the quantize kernel that also writes the
/// incoming tokens; the Metal backend raises, as for write_tokens).
void ring_append(
    const RingAppend& prim,
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

/// A test of the CUDA emulation of Metal's simdgroup matrices (metal/tq_portable.h):
/// runs its operations on 8x8 row-major a, b, c (float32, 64 values each) in one warp
/// and returns what the lanes held and stored (csrc/cuda/simdgroup_matrix_check.cu
/// lists them). CUDA builds only: the other backends raise.
std::vector<float> simdgroup_matrix_check(
    const std::vector<float>& a,
    const std::vector<float>& b,
    const std::vector<float>& c);

} // namespace turboquant_mlx::gpu
