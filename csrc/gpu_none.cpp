// Layout: host code, builds without GPU kernels.
// Builds without GPU kernels (Linux CPU wheels): the Python layer sends GPU streams
// to the plain-MLX fallbacks, so reaching these is a routing bug, reported as such.
#include <stdexcept>

#include "gpu.h"

namespace turboquant_mlx::gpu {

KernelSupport kernel_support() {
  return {}; // no kernels: the Python layer takes the fallbacks
}

const char* backend_name() {
  return "none";
}

std::vector<size_t> pool_memory(bool) {
  return {0, 0, 0};
}

namespace {
[[noreturn]] void no_kernels(const char* op) {
  throw std::runtime_error(
      std::string("[turboquant_mlx.") + op +
      "] this build has no GPU kernels; use the CPU stream or the plain-MLX fallback.");
}
} // namespace

void quantize_append_part(
    const QuantizeAppend&,
    const AppendPart&,
    const mx::Stream&,
    const mx::array*,
    mx::array*) {
  no_kernels("quantize_append");
}

bool quantize_append_at_once(
    const QuantizeAppend&,
    const mx::Stream&,
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  return false; // (quantize_append_part raises)
}

void write_tokens(
    const WriteTokens&,
    const mx::Stream&,
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  no_kernels("write_tokens");
}

void ring_append(
    const RingAppend&,
    const mx::Stream&,
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  no_kernels("ring_append_kv");
}

void attention(
    const CompressedAttention&,
    const mx::Stream&,
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  no_kernels("compressed_attention");
}

void dequantize(
    const Dequantize&,
    const mx::Stream&,
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  no_kernels("dequantize");
}

std::vector<float> simdgroup_matrix_check(
    const std::vector<float>&,
    const std::vector<float>&,
    const std::vector<float>&) {
  throw std::runtime_error(
      "[turboquant_mlx._simdgroup_matrix_check] tests the CUDA build's emulation of "
      "simdgroup matrices; this build has no CUDA kernels.");
}

} // namespace turboquant_mlx::gpu
