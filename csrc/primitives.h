// Layout: host code, every build.
// Primitives of turboquant_mlx. Each holds only its settings; the work is done by
// eval_cpu (csrc/cpu/) and eval_gpu (csrc/cuda/ or csrc/metal/, see gpu.h).
// Data layouts: docs/ARCHITECTURE.md.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <vector>

#include "metal/tq_params.h"
#include "mlx/primitives.h"

namespace turboquant_mlx {

namespace mx = mlx::core;

/// The per-layer rotation R = H diag(s) / sqrt(D) of a power-of-two head dim, applied
/// by a primitive itself (so that a decode step needs no rotation kernels around it):
/// bit d of sign_bits set means s_d = -1.
struct SignedHadamard {
  std::array<uint32_t, 8> sign_bits{};

  bool operator==(const SignedHadamard& o) const {
    return sign_bits == o.sign_bits;
  }
};

/// The rotation as the GPU kernels take it (on = 0 when there is none).
inline TQRotation kernel_rotation(const std::optional<SignedHadamard>& r, int head_dim) {
  TQRotation k{};
  if (r) {
    for (int w = 0; w < 8; ++w) {
      k.sign_bits[w] = r->sign_bits[w];
    }
    k.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
    k.on = 1;
  }
  return k;
}

/// Which cache buffers a QuantizeAppend node writes.
enum class AppendTarget { Codes, Scales, Both };

/// One tensor a QuantizeAppend node appends (a layer's keys, or its values).
struct AppendPart {
  int bits;
  /// Set: x is in model space and is rotated before quantizing.
  std::optional<SignedHadamard> rotation;
  /// Set: a per-head mean (the part's last input) is subtracted from x first.
  bool centered = false;

  bool operator==(const AppendPart& o) const {
    return bits == o.bits && rotation == o.rotation && centered == o.centered;
  }
};

/// Quantizes rotated tokens (or model-space tokens it rotates itself, when a part holds
/// a rotation) and writes their packed codes, their scales, or both into the cache
/// buffers at `offset`, for one tensor or two (a layer's keys and values: parts).
///
/// Without in_place the op builds one node per buffer (Codes, Scales): a node with
/// several outputs can never reuse (donate) its inputs' buffers in MLX, because every
/// output holds a reference to the inputs; single-output nodes can, which makes an
/// append O(new tokens). Each node re-derives the codes of the few new tokens, which is
/// cheap. With in_place no donation is needed, and one node (Both) writes both buffers
/// of each of its parts, one kernel launch per part: a layer's decode-step append is
/// one node instead of four.
///
/// inputs, per part: the buffers written (codes (B,H,cap,W) u32 and/or scales (B,H,cap)
///          f16, in that order), x (B,H,L,D) float (float32 on the CPU; GPUs also read
///          float16/bfloat16), centroids (2^b) f32 [, mean (B,H,1,D) f32 when
///          centered: x - mean is quantized]
/// outputs, per part: the buffers (each shares its input buffer when donatable or
///          in_place, else a copy)
///
/// Refusals: on the CPU the node checks the tokens of all its parts (finite, and a
/// scale that fits float16) and quantizes them into scratch before it writes any
/// buffer, so a node that refuses them raises (naming op()) and leaves every buffer as
/// it was. GPU kernels cannot raise without the host waiting for the device: they store
/// such a token (a non-finite scale for NaN/Inf input, an overflowing one rounded to
/// float16).
///
/// in_place: the node writes into the input buffers even while other arrays still
/// reference them. MLX keeps every op input alive until the GPU has run the op, so
/// under pipelined decoding (the next step's graph evaluated while the GPU still runs
/// the current one) a cache buffer is never donatable and each append would copy all
/// of it. A cache that owns its buffers asks for in_place: the append writes only the
/// slots [offset, offset + L), which no earlier reader of the cache looks at.
class QuantizeAppend : public mx::Primitive {
 public:
  QuantizeAppend(
      mx::Stream stream,
      int offset,
      AppendTarget target,
      std::vector<AppendPart> parts,
      bool in_place = false,
      const char* op = "quantize_append")
      : mx::Primitive(stream),
        offset_(offset),
        target_(target),
        parts_(std::move(parts)),
        in_place_(in_place),
        op_(op) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return parts_.size() == 2             ? "QuantizeAppendKV"
        : target_ == AppendTarget::Codes  ? "QuantizeAppendCodes"
        : target_ == AppendTarget::Scales ? "QuantizeAppendScales"
                                          : "QuantizeAppend";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes;
    walk_parts([&](const AppendPart&, size_t in, size_t) {
      for (int b = 0; b < buffers(); ++b) {
        shapes.push_back(inputs[in + b].shape());
      }
    });
    return shapes;
  }

  const std::vector<AppendPart>& parts() const {
    return parts_;
  }
  /// Buffers written per part: its first inputs and its outputs, in the same order;
  /// its x follows them.
  int buffers() const {
    return target_ == AppendTarget::Both ? 2 : 1;
  }
  /// Inputs of part i (buffers, x, centroids, the mean when centered).
  int inputs_of(size_t i) const {
    return buffers() + 2 + (parts_[i].centered ? 1 : 0);
  }
  /// Calls f(part, index of its first input, index of its first output) for each part
  /// in turn.
  template <typename F>
  void walk_parts(F&& f) const {
    size_t in = 0, out = 0;
    for (size_t i = 0; i < parts_.size(); ++i) {
      f(parts_[i], in, out);
      in += inputs_of(i);
      out += buffers();
    }
  }
  bool writes_codes() const {
    return target_ != AppendTarget::Scales;
  }
  bool writes_scales() const {
    return target_ != AppendTarget::Codes;
  }
  /// Kernel flags (TQ_WRITE_CODES | TQ_WRITE_SCALES) of the buffers written.
  int write_flags() const {
    return (writes_codes() ? TQ_WRITE_CODES : 0) | (writes_scales() ? TQ_WRITE_SCALES : 0);
  }
  int offset() const {
    return offset_;
  }
  /// Set: the input buffers are written in place even when referenced elsewhere.
  bool in_place() const {
    return in_place_;
  }
  /// The public op that built the node (quantize_append, quantize_append_kv,
  /// ring_append_kv), which its errors name.
  const char* op() const {
    return op_;
  }

 private:
  int offset_;
  AppendTarget target_;
  std::vector<AppendPart> parts_;
  bool in_place_;
  const char* op_; // a string literal
};

/// Writes tokens x (B,H,L,D) into dense cache buffers (B,H,cap,D) of the same dtype at
/// token `offset`, in the buffers' own memory even when other arrays reference them
/// (see QuantizeAppend's in_place; a buffer that is not row-contiguous is copied
/// first): one buffer, or a layer's keys and values in one node. For a cache that owns
/// its buffers: the window ring of a compressed cache, the benchmarks' fp16 cache that
/// does not copy itself.
/// inputs: the `buffers` buffers, their tokens in the same order, then arrays the write
/// must follow (earlier readers of the slots it overwrites: ordering only, not read);
/// outputs: the buffers
class WriteTokens : public mx::Primitive {
 public:
  WriteTokens(mx::Stream stream, int offset, int buffers)
      : mx::Primitive(stream), offset_(offset), buffers_(buffers) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return buffers_ == 2 ? "WriteTokensKV" : "WriteTokens";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const WriteTokens&>(other);
    return offset_ == o.offset_ && buffers_ == o.buffers_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes;
    for (int i = 0; i < buffers_; ++i) {
      shapes.push_back(inputs[i].shape());
    }
    return shapes;
  }

  int offset() const {
    return offset_;
  }
  /// Buffers written (inputs 0..buffers-1; their tokens follow).
  int buffers() const {
    return buffers_;
  }

 private:
  int offset_;
  int buffers_;
};

/// Tokens [slot, slot + length) of a ring (B, H, slots, D) as a view of its memory,
/// marked strided.
mx::array ring_slots_view(const mx::array& ring, int slot, int length);

/// A window ring's exchange, for a cache whose recent tokens sit unquantized in a ring
/// (sinks, then one slot per window position): the tokens in slots [slot, slot + L) of
/// the key and value rings, the ones leaving the window, are appended to the compressed
/// caches at `offset` (as QuantizeAppend with in_place, both buffers), and the new
/// tokens are written into those slots (as WriteTokens). One node instead of two for a
/// decode step's window update, and the leaving tokens need no array of their own; on
/// CUDA one launch, whose quantize kernel writes the new tokens over the slots it read.
/// inputs: per part (keys, values) codes, scales, the ring (B,H,slots,D), centroids
///         [, mean]; then the new keys and values (B,H,L,D) in the rings' dtype; then
///         arrays the write must follow (earlier readers of the slots; ordering only)
/// outputs: k_codes, k_scales, v_codes, v_scales, the key ring, the value ring
class RingAppend : public mx::Primitive {
 public:
  RingAppend(mx::Stream stream, int offset, int slot, std::vector<AppendPart> parts)
      : mx::Primitive(stream),
        append_(
            stream,
            offset,
            AppendTarget::Both,
            std::move(parts),
            /* in_place = */ true,
            "ring_append_kv"),
        write_(stream, slot, 2) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "RingAppendKV";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RingAppend&>(other);
    return append_.is_equivalent(o.append_) && write_.is_equivalent(o.write_);
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const size_t v = append_.inputs_of(0);
    return {
        inputs[0].shape(),
        inputs[1].shape(),
        inputs[v].shape(),
        inputs[v + 1].shape(),
        inputs[2].shape(),
        inputs[v + 2].shape()};
  }

  /// The append it makes (its inputs are laid out as this node's, up to the new
  /// tokens), and the ring slot of the exchange.
  const QuantizeAppend& append() const {
    return append_;
  }
  int slot() const {
    return write_.offset();
  }

 private:
  // Refuses new tokens that share memory with the slots they are written to.
  void check_tokens(const std::vector<mx::array>& inputs) const;

  // The two nodes it stands for: their inputs are laid out as QuantizeAppend's (the
  // ring where x stands) and WriteTokens' (slot = the write's offset).
  QuantizeAppend append_;
  WriteTokens write_;
};

/// Settings of one attention call over the compressed cache.
struct AttentionParams {
  int kv_len; // valid keys 0..kv_len-1
  float scale; // softmax scale applied to q·k
  int key_bits;
  int value_bits;
  bool causal; // query i sees keys j <= kv_len - L + i
  bool has_mask; // inputs[7] is a mask
  bool mask_is_bool; // true: keep where mask; false: additive
  bool has_tail; // the last two inputs are the tail's keys and values
  // Set: q is in model space (the kernels rotate it); with rotate_output the output
  // is returned in model space too (R^T out: values are stored rotated).
  std::optional<SignedHadamard> rotation;
  bool rotate_output;
  // The compressed tokens were stored minus per-head means (the last two inputs) and
  // the tail was not: the op adds them back, so out and lse are the uncentered ones.
  bool centered;
  // out's dtype: float32, or the queries' float16 / bfloat16 (a decode step's layer
  // output, then without a conversion node of its own). lse is float32.
  mx::Dtype out_dtype = mx::float32;

  bool operator==(const AttentionParams& o) const {
    return kv_len == o.kv_len && scale == o.scale && key_bits == o.key_bits &&
        value_bits == o.value_bits && causal == o.causal && has_mask == o.has_mask &&
        mask_is_bool == o.mask_is_bool && has_tail == o.has_tail && rotation == o.rotation &&
        rotate_output == o.rotate_output && centered == o.centered && out_dtype == o.out_dtype;
  }
  // Positions of the optional inputs (see CompressedAttention).
  int tail_input() const {
    return 7 + (has_mask ? 1 : 0);
  }
  int mean_input() const {
    return tail_input() + (has_tail ? 2 : 0);
  }
};

/// Attention of a few queries over the compressed cache, in rotated space (or in model
/// space, see AttentionParams::rotation).
/// inputs:  q (B,Hq,L,D) float, k_codes, k_scales, v_codes, v_scales,
///          k_centroids, v_centroids [, mask (B,Hq,L,kv_len) bool/float, broadcast allowed]
///          [, tail_k, tail_v (B,Hkv,T,D): keys every query sees, unmasked, in q's
///          type (float32 on the CPU) and space (the model's when `rotation` is set)]
///          [, key_mean, value_mean (B,Hkv,1,D) f32 when `centered`]
/// outputs: out (B,Hq,L,D) f32 or the queries' type (params().out_dtype), lse (B,Hq,L) f32
class CompressedAttention : public mx::Primitive {
 public:
  CompressedAttention(mx::Stream stream, AttentionParams params)
      : mx::Primitive(stream), params_(params) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "CompressedAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

  const AttentionParams& params() const {
    return params_;
  }

 private:
  AttentionParams params_;
};

/// Decodes tokens start..start+length-1 of one cache buffer into rotated-space vectors,
/// at slots [before, before + length) of an output with `after` more slots. The slots
/// around them take the rows of `prefix` / `suffix` where given (the prefill's fp16
/// tokens), else zeros.
/// inputs:  codes (B,H,cap,W) u32, scales (B,H,cap) f16, centroids (2^b) f32,
///          then, where the flags say so: prefix (B,H,before,D), suffix (B,H,after,D)
///          (row-contiguous, the output's dtype), into (row-contiguous, the output's
///          dtype, >= the output's size)
/// outputs: (B,H,before+length+after,D) f32, f16 or bf16; with `into` a view of its
///          buffer (written in place: a reused temporary, see ops.h)
class Dequantize : public mx::Primitive {
 public:
  Dequantize(
      mx::Stream stream,
      int bits,
      int start,
      int length,
      int before,
      int after,
      bool prefix = false,
      bool suffix = false,
      bool into = false)
      : mx::Primitive(stream),
        bits_(bits),
        start_(start),
        length_(length),
        before_(before),
        after_(after),
        prefix_(prefix),
        suffix_(suffix),
        into_(into) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "Dequantize";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

  int bits() const {
    return bits_;
  }
  int start() const {
    return start_;
  }
  int length() const {
    return length_;
  }
  int before() const {
    return before_;
  }
  /// Input index of prefix / suffix / into, or -1 where absent.
  int prefix_input() const {
    return prefix_ ? 3 : -1;
  }
  int suffix_input() const {
    return suffix_ ? 3 + prefix_ : -1;
  }
  int into_input() const {
    return into_ ? 3 + prefix_ + suffix_ : -1;
  }

  /// Gives `out` its buffer: a view of the `into` input's where there is one (the
  /// reused temporary), else a new allocation from `alloc`.
  template <typename Alloc>
  void place_output(const std::vector<mx::array>& inputs, mx::array& out, Alloc&& alloc) const {
    if (into_) {
      if (!inputs[into_input()].flags().row_contiguous) {
        throw std::invalid_argument("[turboquant_mlx.dequantize] into must be row-contiguous.");
      }
      mx::Strides strides(out.ndim(), 1);
      for (int a = out.ndim() - 2; a >= 0; --a) {
        strides[a] = strides[a + 1] * out.shape(a + 1);
      }
      mx::array::Flags flags{};
      flags.contiguous = flags.row_contiguous = true;
      out.copy_shared_buffer(inputs[into_input()], strides, flags, out.size(), 0);
    } else {
      alloc(out);
    }
  }

 private:
  int bits_;
  int start_;
  int length_;
  int before_;
  int after_;
  bool prefix_;
  bool suffix_;
  bool into_;
};

} // namespace turboquant_mlx
