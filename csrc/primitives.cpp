#include "primitives.h"

#include "cpu/kernels.h"
#include "gpu.h"

namespace turboquant_mlx {

void QuantizeAppend::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  walk_parts([&](const AppendPart& part, size_t in, size_t out) {
    cpu::quantize_append_part(*this, part, stream(), &inputs[in], &outputs[out]);
  });
}

void QuantizeAppend::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  if (gpu::quantize_append_at_once(*this, stream(), inputs, outputs)) {
    return;
  }
  walk_parts([&](const AppendPart& part, size_t in, size_t out) {
    gpu::quantize_append_part(*this, part, stream(), &inputs[in], &outputs[out]);
  });
}

bool QuantizeAppend::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const QuantizeAppend&>(other);
  return offset_ == o.offset_ && target_ == o.target_ && parts_ == o.parts_ &&
      in_place_ == o.in_place_;
}

void WriteTokens::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  cpu::write_tokens(*this, stream(), inputs, outputs);
}

void WriteTokens::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  gpu::write_tokens(*this, stream(), inputs, outputs);
}

void CompressedAttention::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  cpu::attention(*this, stream(), inputs, outputs);
}

void CompressedAttention::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  gpu::attention(*this, stream(), inputs, outputs);
}

bool CompressedAttention::is_equivalent(const mx::Primitive& other) const {
  return params_ == static_cast<const CompressedAttention&>(other).params_;
}

std::vector<mx::Shape> CompressedAttention::output_shapes(
    const std::vector<mx::array>& inputs) {
  auto& q = inputs[0].shape();
  return {q, {q[0], q[1], q[2]}};
}

void Dequantize::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  cpu::dequantize(*this, stream(), inputs, outputs);
}

void Dequantize::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  gpu::dequantize(*this, stream(), inputs, outputs);
}

bool Dequantize::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const Dequantize&>(other);
  return bits_ == o.bits_ && start_ == o.start_ && length_ == o.length_;
}

std::vector<mx::Shape> Dequantize::output_shapes(const std::vector<mx::array>& inputs) {
  auto& c = inputs[0].shape();
  return {{c[0], c[1], length_, c[3] * 32 / bits_}};
}

} // namespace turboquant_mlx
