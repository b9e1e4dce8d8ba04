// Layout: host code, every build.
// The primitives' evals (the CPU kernels or the GPU backend), equivalence and output shapes.
#include "primitives.h"

#include <stdexcept>

#include "cpu/kernels.h"
#include "gpu.h"
#include "message.h"

namespace turboquant_mlx {

void QuantizeAppend::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  cpu::quantize_append(*this, stream(), inputs, outputs);
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
      in_place_ == o.in_place_ && std::string_view(op_) == o.op_;
}

namespace {

/// Whether any element of x (B, H, L, D) lies in token slots [offset, offset + L) of
/// `buffer` (B, H, cap, D), which a write overwrites in place.
bool reads_written_slots(const mx::array& buffer, const mx::array& x, int offset) {
  if (!buffer.flags().row_contiguous || x.size() == 0 || buffer.size() == 0 ||
      buffer.buffer().ptr() != x.buffer().ptr()) {
    return false; // (a buffer that is not row-contiguous is copied before the write)
  }
  const int64_t item = buffer.itemsize(), xitem = x.itemsize();
  const int64_t D = buffer.shape(3), cap = buffer.shape(2), size = buffer.size();
  const int64_t first = offset, last = int64_t(offset) + x.shape(2);
  auto written = [&](int64_t byte) { // (from the buffer's first element)
    if (byte < 0 || byte >= size * item) {
      return false;
    }
    const int64_t t = (byte / item / D) % cap;
    return t >= first && t < last;
  };
  const auto& xs = x.strides();
  const int64_t base = x.offset() - buffer.offset();
  for (int64_t b = 0; b < x.shape(0); ++b) {
    for (int64_t h = 0; h < x.shape(1); ++h) {
      for (int64_t l = 0; l < x.shape(2); ++l) {
        for (int64_t d = 0; d < x.shape(3); ++d) {
          const int64_t at = base + (b * xs[0] + h * xs[1] + l * xs[2] + d * xs[3]) * xitem;
          if (written(at) || written(at + xitem - 1)) {
            return true;
          }
        }
      }
    }
  }
  return false;
}

/// Refuses, before anything is written, a write of tokens (inputs n..2n-1) into
/// buffers (inputs 0..n-1) at `offset` where some tokens are read from slots that the
/// write overwrites (a view of a buffer): a copy would read tokens it has already
/// overwritten, and GPU copies run in parallel.
void check_tokens_apart(
    const char* op,
    const char* const* buffer_names,
    const char* const* token_names,
    const std::vector<mx::array>& inputs,
    int n,
    int offset) {
  for (int j = 0; j < n; ++j) {
    const mx::array& x = inputs[n + j];
    for (int i = 0; i < n; ++i) {
      if (reads_written_slots(inputs[i], x, offset)) {
        throw std::invalid_argument(message(
            "[turboquant_mlx.",
            op,
            "] the ",
            token_names[j],
            " share memory with the slots [",
            offset,
            ", ",
            int64_t(offset) + x.shape(2),
            ") of the ",
            buffer_names[i],
            " that they are written to; pass a copy of them. Nothing was written."));
      }
    }
  }
}

void check_write(const WriteTokens& prim, const std::vector<mx::array>& inputs) {
  static const char* const one[] = {"buffer"};
  static const char* const one_tokens[] = {"tokens"};
  static const char* const kv[] = {"key buffer", "value buffer"};
  static const char* const kv_tokens[] = {"keys", "values"};
  const bool pair = prim.buffers() == 2;
  check_tokens_apart(
      pair ? "write_tokens_kv" : "write_tokens",
      pair ? kv : one,
      pair ? kv_tokens : one_tokens,
      inputs,
      prim.buffers(),
      prim.offset());
}

} // namespace

void WriteTokens::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  check_write(*this, inputs);
  cpu::write_tokens(*this, stream(), inputs, outputs);
}

void WriteTokens::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  check_write(*this, inputs);
  gpu::write_tokens(*this, stream(), inputs, outputs);
}

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

void RingAppend::check_tokens(const std::vector<mx::array>& inputs) const {
  static const char* const rings[] = {"key ring", "value ring"};
  static const char* const tokens[] = {"keys", "values"};
  const size_t v_in = append_.inputs_of(0), parts_end = v_in + append_.inputs_of(1);
  check_tokens_apart(
      "ring_append_kv",
      rings,
      tokens,
      {inputs[2], inputs[v_in + 2], inputs[parts_end], inputs[parts_end + 1]},
      2,
      slot());
}

void RingAppend::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  check_tokens(inputs);
  const size_t v_in = append_.inputs_of(0), parts_end = v_in + append_.inputs_of(1);
  const int length = inputs[parts_end].shape(2);
  // 1. The leaving tokens into the compressed caches, from float32 row-major copies of
  //    their slots (what the CPU kernel reads).
  std::vector<mx::array> append_in(inputs.begin(), inputs.begin() + parts_end);
  for (size_t ring : {size_t(2), v_in + 2}) {
    append_in[ring] = cpu::ring_slots_f32(inputs[ring], slot(), length, stream());
  }
  std::vector<mx::array> append_out(outputs.begin(), outputs.begin() + 4);
  // The write runs only if the append wrote both parts: an append that refuses a token
  // raises before writing either, and then the rings keep theirs too.
  cpu::TaskCount appended = std::make_shared<std::atomic<int>>(0);
  cpu::quantize_append(append_, stream(), append_in, append_out, appended, slot());
  // 2. The new tokens into the slots.
  std::vector<mx::array> write_in = {
      inputs[2], inputs[v_in + 2], inputs[parts_end], inputs[parts_end + 1]};
  write_in.insert(write_in.end(), append_out.begin(), append_out.end());
  write_in.insert(write_in.end(), inputs.begin() + parts_end + 2, inputs.end());
  std::vector<mx::array> write_out = {outputs[4], outputs[5]};
  cpu::write_tokens(write_, stream(), write_in, write_out, appended, 1);
}

void RingAppend::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  check_tokens(inputs);
  gpu::ring_append(*this, stream(), inputs, outputs);
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

std::vector<mx::Shape> CompressedAttention::output_shapes(const std::vector<mx::array>& inputs) {
  auto& q = inputs[0].shape();
  return {q, {q[0], q[1], q[2]}};
}

void Dequantize::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  cpu::dequantize(*this, stream(), inputs, outputs);
}

void Dequantize::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  gpu::dequantize(*this, stream(), inputs, outputs);
}

bool Dequantize::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const Dequantize&>(other);
  return bits_ == o.bits_ && start_ == o.start_ && length_ == o.length_ && before_ == o.before_ &&
      after_ == o.after_ && prefix_ == o.prefix_ && suffix_ == o.suffix_ && into_ == o.into_;
}

std::vector<mx::Shape> Dequantize::output_shapes(const std::vector<mx::array>& inputs) {
  auto& c = inputs[0].shape();
  return {{c[0], c[1], before_ + length_ + after_, c[3] * 32 / bits_}};
}

} // namespace turboquant_mlx
