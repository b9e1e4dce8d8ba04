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

namespace {

/// Tokens [slot, slot + length) of a ring (B, H, slots, D) as a view of its memory.
mx::array ring_slots_view(const mx::array& ring, int slot, int length) {
  mx::array view(
      mx::Shape{ring.shape(0), ring.shape(1), length, ring.shape(3)}, ring.dtype(), nullptr, {});
  const int64_t first = int64_t(slot) * ring.strides()[2];
  // Marked strided (the GPU kernels read x through its strides; nothing else reads it).
  auto flags = ring.flags();
  flags.contiguous = flags.row_contiguous = flags.col_contiguous = false;
  view.copy_shared_buffer(ring, ring.strides(), flags, ring.data_size() - first, first);
  return view;
}

} // namespace

void RingAppend::eval(
    bool on_gpu,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  const size_t v_in = append_.inputs_of(0), parts_end = v_in + append_.inputs_of(1);
  const mx::array& new_k = inputs[parts_end];
  const int length = new_k.shape(2);
  const int slot = write_.offset();
  // 1. The leaving tokens into the compressed caches, read where they are: a view of
  //    each ring (float32 row-major copies on the CPU, whose kernel reads those).
  std::vector<mx::array> append_in(inputs.begin(), inputs.begin() + parts_end);
  for (size_t ring : {size_t(2), v_in + 2}) {
    append_in[ring] = on_gpu ? ring_slots_view(inputs[ring], slot, length)
                             : cpu::ring_slots_f32(inputs[ring], slot, length, stream());
  }
  std::vector<mx::array> append_out(outputs.begin(), outputs.begin() + 4);
  // (CPU: the write runs only if both parts were written; a part that refuses its
  // tokens raises, and then the rings keep theirs)
  cpu::TaskCount appended = on_gpu ? nullptr : std::make_shared<std::atomic<int>>(0);
  if (on_gpu) {
    append_.eval_gpu(append_in, append_out);
  } else {
    append_.walk_parts([&](const AppendPart& part, size_t in, size_t out) {
      cpu::quantize_append_part(append_, part, stream(), &append_in[in], &append_out[out], appended);
    });
  }
  // 2. The new tokens into the slots. The write follows the append, which reads them
  //    (the CUDA graph orders a kernel after the writers of its inputs: the append's
  //    outputs), and the earlier readers given as inputs.
  std::vector<mx::array> write_in = {inputs[2], inputs[v_in + 2], new_k, inputs[parts_end + 1]};
  write_in.insert(write_in.end(), append_out.begin(), append_out.end());
  write_in.insert(write_in.end(), inputs.begin() + parts_end + 2, inputs.end());
  std::vector<mx::array> write_out = {outputs[4], outputs[5]};
  if (on_gpu) {
    write_.eval_gpu(write_in, write_out);
  } else {
    cpu::write_tokens(write_, stream(), write_in, write_out, appended, 2);
  }
}

void RingAppend::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  eval(false, inputs, outputs);
}

void RingAppend::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  eval(true, inputs, outputs);
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
  return bits_ == o.bits_ && start_ == o.start_ && length_ == o.length_ &&
      before_ == o.before_ && after_ == o.after_;
}

std::vector<mx::Shape> Dequantize::output_shapes(const std::vector<mx::array>& inputs) {
  auto& c = inputs[0].shape();
  return {{c[0], c[1], before_ + length_ + after_, c[3] * 32 / bits_}};
}

} // namespace turboquant_mlx
