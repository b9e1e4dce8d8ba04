// Layout: host code, every build.
// Op functions: validate the inputs, then build the primitive (ops.h).
#include "ops.h"
#include <limits>

#include <cstdlib>
#include <stdexcept>

#include "cpu/kernels.h"
#include "gpu.h"
#include "message.h"
#include "metal/tq_params.h"
#include "primitives.h"

namespace turboquant_mlx {

KernelSupport kernel_support(const mx::Device& device) {
  return device.type == mx::Device::cpu ? cpu::kernel_support() : gpu::kernel_support();
}

namespace {

// Throws std::invalid_argument("[turboquant_mlx.<op>] ...") built from the arguments.
template <typename... Args>
[[noreturn]] void fail(const char* op, Args&&... args) {
  throw std::invalid_argument(message("[turboquant_mlx.", op, "] ", args...));
}

// Names of dtypes for messages. MLX's own dtype_to_string is not exported by its
// CUDA build's libmlx, and its ostream operator is what message.h avoids.
const char* dtype_str(mx::Dtype t) {
  switch (t) {
    case mx::bool_: return "bool";
    case mx::uint8: return "uint8";
    case mx::uint16: return "uint16";
    case mx::uint32: return "uint32";
    case mx::uint64: return "uint64";
    case mx::int8: return "int8";
    case mx::int16: return "int16";
    case mx::int32: return "int32";
    case mx::int64: return "int64";
    case mx::float16: return "float16";
    case mx::bfloat16: return "bfloat16";
    case mx::float32: return "float32";
    case mx::float64: return "float64";
    case mx::complex64: return "complex64";
    default: return "an unsupported dtype";
  }
}

std::string shape_str(const mx::Shape& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    s += message(i ? ", " : "", shape[i]);
  }
  s += shape.size() == 1 ? ",)" : ")";
  return s;
}

void check_bits(const char* op, const char* what, int bits) {
  if (bits != 2 && bits != 3 && bits != 4) {
    fail(op, what, " bits must be 2, 3 or 4, got ", bits, ".");
  }
}

void check_head_dim(const char* op, int head_dim) {
  if (head_dim < 32 || head_dim > 256 || head_dim % 32 != 0) {
    fail(op, "head dim must be a multiple of 32 in [32, 256], got ", head_dim, ".");
  }
}

void check_float(const char* op, const char* what, const mx::array& a) {
  if (a.dtype() != mx::float32 && a.dtype() != mx::float16 && a.dtype() != mx::bfloat16) {
    fail(op, what, " must be float32, float16 or bfloat16, got ", dtype_str(a.dtype()), ".");
  }
}

// Checks one cache buffer pair (codes, scales) and returns its capacity.
int check_cache(
    const char* op,
    const char* what,
    const mx::array& codes,
    const mx::array& scales,
    const mx::array& centroids,
    int bits) {
  check_bits(op, what, bits);
  if (codes.dtype() != mx::uint32 || codes.ndim() != 4) {
    fail(
        op,
        what,
        " codes must be uint32 of shape (B, H, capacity, words), got ",
        dtype_str(codes.dtype()),
        " ",
        shape_str(codes.shape()),
        ".");
  }
  int words = codes.shape(3);
  if ((words * 32) % bits != 0) {
    fail(op, what, " codes have ", words, " words per token, not a multiple of bits.");
  }
  check_head_dim(op, words * 32 / bits);
  auto expect = mx::Shape{codes.shape(0), codes.shape(1), codes.shape(2)};
  if (scales.dtype() != mx::float16 || scales.shape() != expect) {
    fail(
        op,
        what,
        " scales must be float16 of shape ",
        shape_str(expect),
        ", got ",
        dtype_str(scales.dtype()),
        " ",
        shape_str(scales.shape()),
        ".");
  }
  if (centroids.ndim() != 1 || centroids.shape(0) != (1 << bits)) {
    fail(
        op,
        what,
        " centroids must have shape (",
        1 << bits,
        ",) for ",
        bits,
        " bits, got ",
        shape_str(centroids.shape()),
        ".");
  }
  check_float(op, "centroids", centroids);
  return codes.shape(2);
}

// The rotation of `rotation_signs` (D values, each +1 or -1) for x's head dim.
std::optional<SignedHadamard> signed_hadamard(
    const char* op,
    const std::optional<RotationSigns>& rotation_signs,
    int head_dim) {
  if (!rotation_signs) {
    return std::nullopt;
  }
  if ((head_dim & (head_dim - 1)) != 0) {
    fail(
        op,
        "rotation_signs need a power-of-two head dim (a Hadamard rotation), got head dim ",
        head_dim,
        "; rotate the inputs before the op instead.");
  }
  const std::vector<float>& signs = rotation_signs->values;
  if (static_cast<int>(signs.size()) != head_dim) {
    fail(
        op,
        "rotation_signs must hold one sign per coordinate (",
        head_dim,
        "), got ",
        signs.size(),
        ".");
  }
  SignedHadamard r;
  for (int d = 0; d < head_dim; ++d) {
    float v = signs[d];
    if (v != 1.0f && v != -1.0f) {
      fail(op, "rotation_signs must be +1 or -1, got ", v, " at coordinate ", d, ".");
    }
    if (v < 0.0f) {
      r.sign_bits[d >> 5] |= 1u << (d & 31);
    }
  }
  return r;
}

// Token slots [offset, offset + length) of a buffer of `capacity` tokens, which an op
// is `doing` (appending, writing) to: they must exist.
void check_token_slots(const char* op, const char* doing, int offset, int length, int capacity) {
  if (offset < 0) {
    fail(op, "offset must be >= 0, got ", offset, ".");
  }
  if (static_cast<int64_t>(offset) + length > capacity) {
    fail(
        op,
        "capacity overflow: ",
        doing,
        " ",
        length,
        " tokens at offset ",
        offset,
        " exceeds the capacity ",
        capacity,
        ".");
  }
}

// An input as the backend's kernels read it. The CPU kernels read row-major float32;
// the GPU backends take any layout (their eval copies what their kernels cannot read
// through strides) and float16/bfloat16 as they are, so a decode step gets no
// conversion or Contiguous nodes in front of the ops (each is host time per layer).
mx::array kernel_input(const mx::array& a, const mx::Stream& stream, bool to_float32) {
  if (stream.device == mx::Device::gpu) {
    return to_float32 && a.dtype() != mx::float16 && a.dtype() != mx::bfloat16
        ? mx::astype(a, mx::float32, stream)
        : a;
  }
  return mx::contiguous(to_float32 ? mx::astype(a, mx::float32, stream) : a, false, stream);
}

// Checks a per-head mean (B, H, 1, D) for tokens of `batch`, `heads`, `head_dim` and
// returns it as the kernels read it: float32 (row-major on the CPU; GPU evals copy
// one whose last axis is strided).
mx::array mean_input(
    const char* op,
    const char* what,
    const mx::array& mean,
    int batch,
    int heads,
    int head_dim,
    const mx::Stream& stream) {
  check_float(op, what, mean);
  auto want = mx::Shape{batch, heads, 1, head_dim};
  if (mean.shape() != want) {
    fail(op, what, " must have shape ", shape_str(want), ", got ", shape_str(mean.shape()), ".");
  }
  auto m = mx::astype(mean, mx::float32, stream);
  return stream.device == mx::Device::gpu ? m : mx::contiguous(m, false, stream);
}

} // namespace

int words_per_token(int head_dim, int bits) {
  check_bits("words_per_token", "requested", bits);
  check_head_dim("words_per_token", head_dim);
  return head_dim * bits / 32;
}

namespace {

/// One tensor's append, checked and with its inputs as the kernels read them (see
/// QuantizeAppend): the part, and the inputs after its buffers.
struct PreparedAppend {
  AppendPart part;
  std::vector<mx::array> rest; // x (unless the node reads its tokens elsewhere), centroids [, mean]
};

PreparedAppend prepare_append(
    const char* op,
    const char* what,
    const mx::array& codes,
    const mx::array& scales,
    const mx::array& x,
    const mx::array& centroids,
    int offset,
    int bits,
    const std::optional<RotationSigns>& rotation_signs,
    const std::optional<mx::array>& mean,
    const mx::Stream& stream,
    bool x_is_input = true) {
  int capacity = check_cache(op, what, codes, scales, centroids, bits);
  check_float(op, "x", x);
  if (x.ndim() != 4) {
    fail(op, "x must have shape (B, H, L, D), got ", shape_str(x.shape()), ".");
  }
  int head_dim = x.shape(3);
  check_head_dim(op, head_dim);
  if (head_dim * bits / 32 != codes.shape(3)) {
    fail(
        op,
        "x has head dim ",
        head_dim,
        " but the codes hold ",
        codes.shape(3) * 32 / bits,
        " coordinates per token at ",
        bits,
        " bits.");
  }
  if (x.shape(0) != codes.shape(0) || x.shape(1) != codes.shape(1)) {
    fail(
        op,
        "x has batch/heads ",
        shape_str(x.shape()),
        " but the cache has ",
        shape_str(codes.shape()),
        ".");
  }
  check_token_slots(op, "appending", offset, x.shape(2), capacity);
  PreparedAppend a{{bits, signed_hadamard(op, rotation_signs, head_dim), mean.has_value()}, {}};
  // The kernels read plain row-major buffers; these are no-ops for the usual inputs.
  // (Without x_is_input, x stands for tokens the node reads from elsewhere.)
  if (x_is_input) {
    a.rest.push_back(kernel_input(x, stream, true));
  }
  a.rest.push_back(mx::astype(centroids, mx::float32, stream));
  if (mean) {
    a.rest.push_back(mean_input(op, "mean", *mean, x.shape(0), x.shape(1), head_dim, stream));
  }
  return a;
}

/// The nodes of appends with the same offset: one node for all buffers (in_place), or,
/// without in_place (donation needs single-output nodes), one node per buffer. Outputs:
/// codes, scales of each tensor in turn. (A node refuses bad tokens without writing any
/// of its buffers, so an in-place call is all-or-nothing.)
std::vector<mx::array> append_nodes(
    const char* op,
    const std::vector<std::pair<mx::array, mx::array>>& buffers,
    const std::vector<PreparedAppend>& appends,
    int offset,
    bool in_place,
    const mx::Stream& stream) {
  if (in_place) {
    // Every buffer in one node (no donation needed; see QuantizeAppend).
    std::vector<AppendPart> parts;
    std::vector<mx::array> inputs;
    std::vector<mx::Shape> shapes;
    std::vector<mx::Dtype> dtypes;
    for (size_t i = 0; i < appends.size(); ++i) {
      parts.push_back(appends[i].part);
      for (const auto& b : {buffers[i].first, buffers[i].second}) {
        inputs.push_back(b);
        shapes.push_back(b.shape());
        dtypes.push_back(b.dtype());
      }
      inputs.insert(inputs.end(), appends[i].rest.begin(), appends[i].rest.end());
    }
    return mx::array::make_arrays(
        std::move(shapes),
        std::move(dtypes),
        std::make_shared<QuantizeAppend>(
            stream, offset, AppendTarget::Both, std::move(parts), in_place, op),
        std::move(inputs));
  }
  std::vector<mx::array> outputs;
  // One node per buffer, which can then donate it; a node copies its buffer only if it
  // is not row-contiguous or (without in_place) referenced elsewhere.
  for (size_t i = 0; i < appends.size(); ++i) {
    auto node = [&](const mx::array& buffer, AppendTarget target) {
      std::vector<mx::array> inputs = {buffer};
      inputs.insert(inputs.end(), appends[i].rest.begin(), appends[i].rest.end());
      return mx::array(
          buffer.shape(),
          buffer.dtype(),
          std::make_shared<QuantizeAppend>(
              stream, offset, target, std::vector<AppendPart>{appends[i].part}, in_place, op),
          std::move(inputs));
    };
    outputs.push_back(node(buffers[i].first, AppendTarget::Codes));
    outputs.push_back(node(buffers[i].second, AppendTarget::Scales));
  }
  return outputs;
}

/// Both tensors' appends of a layer (quantize_append_kv, ring_append_kv), each checked
/// as quantize_append checks it; keys and values must bring the same number of tokens
/// into caches of the same capacity. `tokens_are_inputs`: see prepare_append's
/// x_is_input.
std::vector<PreparedAppend> prepare_kv_appends(
    const char* op,
    const mx::array& k_codes,
    const mx::array& k_scales,
    const mx::array& v_codes,
    const mx::array& v_scales,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& k_centroids,
    const mx::array& v_centroids,
    int offset,
    int key_bits,
    int value_bits,
    const std::optional<RotationSigns>& key_rotation_signs,
    const std::optional<RotationSigns>& value_rotation_signs,
    const std::optional<mx::array>& key_mean,
    const std::optional<mx::array>& value_mean,
    const mx::Stream& stream,
    bool tokens_are_inputs = true) {
  std::vector<PreparedAppend> appends;
  appends.push_back(prepare_append(
      op,
      "key cache",
      k_codes,
      k_scales,
      keys,
      k_centroids,
      offset,
      key_bits,
      key_rotation_signs,
      key_mean,
      stream,
      tokens_are_inputs));
  appends.push_back(prepare_append(
      op,
      "value cache",
      v_codes,
      v_scales,
      values,
      v_centroids,
      offset,
      value_bits,
      value_rotation_signs,
      value_mean,
      stream,
      tokens_are_inputs));
  if (keys.shape(2) != values.shape(2) || k_codes.shape(2) != v_codes.shape(2)) {
    fail(
        op,
        "keys ",
        shape_str(keys.shape()),
        " and values ",
        shape_str(values.shape()),
        " must bring the same tokens into caches of the same capacity (key cache ",
        shape_str(k_codes.shape()),
        ", value cache ",
        shape_str(v_codes.shape()),
        ").");
  }
  return appends;
}

} // namespace

std::vector<mx::array> quantize_append(
    const mx::array& codes,
    const mx::array& scales,
    const mx::array& x,
    const mx::array& centroids,
    int offset,
    int bits,
    const std::optional<RotationSigns>& rotation_signs,
    const std::optional<mx::array>& mean,
    bool in_place,
    mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  auto a = prepare_append(
      "quantize_append",
      "cache",
      codes,
      scales,
      x,
      centroids,
      offset,
      bits,
      rotation_signs,
      mean,
      stream);
  return append_nodes(
      "quantize_append", {{codes, scales}}, {std::move(a)}, offset, in_place, stream);
}

std::vector<mx::array> quantize_append_kv(
    const mx::array& k_codes,
    const mx::array& k_scales,
    const mx::array& v_codes,
    const mx::array& v_scales,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& k_centroids,
    const mx::array& v_centroids,
    int offset,
    int key_bits,
    int value_bits,
    const std::optional<RotationSigns>& key_rotation_signs,
    const std::optional<RotationSigns>& value_rotation_signs,
    const std::optional<mx::array>& key_mean,
    const std::optional<mx::array>& value_mean,
    mx::StreamOrDevice s) {
  constexpr const char* op = "quantize_append_kv";
  auto stream = mx::to_stream(s);
  auto appends = prepare_kv_appends(
      op,
      k_codes,
      k_scales,
      v_codes,
      v_scales,
      keys,
      values,
      k_centroids,
      v_centroids,
      offset,
      key_bits,
      value_bits,
      key_rotation_signs,
      value_rotation_signs,
      key_mean,
      value_mean,
      stream);
  return append_nodes(
      op,
      {{k_codes, k_scales}, {v_codes, v_scales}},
      appends,
      offset,
      /* in_place = */ true,
      stream);
}

namespace {

/// Checks one buffer's write for write_tokens(_kv) (`what`: which buffer).
void check_token_write(
    const char* op,
    const char* what,
    const mx::array& buffer,
    const mx::array& x,
    int offset) {
  if (buffer.ndim() != 4 || x.ndim() != 4) {
    fail(
        op,
        what,
        " and its tokens must be (B, H, capacity, D) and (B, H, L, D), got ",
        shape_str(buffer.shape()),
        " and ",
        shape_str(x.shape()),
        ".");
  }
  check_float(op, what, buffer);
  if (x.dtype() != buffer.dtype()) {
    fail(
        op,
        "the tokens have dtype ",
        dtype_str(x.dtype()),
        " but the ",
        what,
        " ",
        dtype_str(buffer.dtype()),
        ".");
  }
  if (x.shape(0) != buffer.shape(0) || x.shape(1) != buffer.shape(1) ||
      x.shape(3) != buffer.shape(3)) {
    fail(
        op,
        "tokens ",
        shape_str(x.shape()),
        " do not match the ",
        what,
        " ",
        shape_str(buffer.shape()),
        " in batch, heads or head dim.");
  }
  check_token_slots(op, "writing", offset, x.shape(2), buffer.shape(2));
}

} // namespace

mx::array write_tokens(
    const mx::array& buffer,
    const mx::array& x,
    int offset,
    mx::StreamOrDevice s) {
  check_token_write("write_tokens", "buffer", buffer, x, offset);
  auto stream = mx::to_stream(s);
  return mx::array(
      buffer.shape(),
      buffer.dtype(),
      std::make_shared<WriteTokens>(stream, offset, 1),
      {buffer, x});
}

std::vector<mx::array> write_tokens_kv(
    const mx::array& k_buffer,
    const mx::array& v_buffer,
    const mx::array& keys,
    const mx::array& values,
    int offset,
    const std::vector<mx::array>& after,
    mx::StreamOrDevice s) {
  constexpr const char* op = "write_tokens_kv";
  check_token_write(op, "key buffer", k_buffer, keys, offset);
  check_token_write(op, "value buffer", v_buffer, values, offset);
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {k_buffer, v_buffer, keys, values};
  inputs.insert(inputs.end(), after.begin(), after.end());
  return mx::array::make_arrays(
      {k_buffer.shape(), v_buffer.shape()},
      {k_buffer.dtype(), v_buffer.dtype()},
      std::make_shared<WriteTokens>(stream, offset, 2),
      std::move(inputs));
}

std::vector<mx::array> ring_append_kv(
    const mx::array& k_codes,
    const mx::array& k_scales,
    const mx::array& v_codes,
    const mx::array& v_scales,
    const mx::array& k_ring,
    const mx::array& v_ring,
    const mx::array& keys,
    const mx::array& values,
    const mx::array& k_centroids,
    const mx::array& v_centroids,
    int offset,
    int slot,
    int key_bits,
    int value_bits,
    const std::optional<RotationSigns>& key_rotation_signs,
    const std::optional<RotationSigns>& value_rotation_signs,
    const std::optional<mx::array>& key_mean,
    const std::optional<mx::array>& value_mean,
    const std::vector<mx::array>& after,
    mx::StreamOrDevice s) {
  constexpr const char* op = "ring_append_kv";
  // The write's checks: the rings hold the new tokens' slots, in their dtype.
  check_token_write(op, "key ring", k_ring, keys, slot);
  check_token_write(op, "value ring", v_ring, values, slot);
  auto stream = mx::to_stream(s);
  // The append's checks, on the leaving tokens (the new tokens' shape and dtype);
  // its x is then the ring itself, whose slots the node reads.
  auto appends = prepare_kv_appends(
      op,
      k_codes,
      k_scales,
      v_codes,
      v_scales,
      keys,
      values,
      k_centroids,
      v_centroids,
      offset,
      key_bits,
      value_bits,
      key_rotation_signs,
      value_rotation_signs,
      key_mean,
      value_mean,
      stream,
      /* tokens_are_inputs = */ false);
  std::vector<mx::array> inputs;
  std::vector<AppendPart> parts;
  const std::pair<mx::array, mx::array> buffers[2] = {{k_codes, k_scales}, {v_codes, v_scales}};
  const mx::array* rings[2] = {&k_ring, &v_ring};
  for (int i = 0; i < 2; ++i) {
    parts.push_back(appends[i].part);
    inputs.push_back(buffers[i].first);
    inputs.push_back(buffers[i].second);
    inputs.push_back(*rings[i]);
    inputs.insert(inputs.end(), appends[i].rest.begin(), appends[i].rest.end());
  }
  inputs.push_back(keys);
  inputs.push_back(values);
  inputs.insert(inputs.end(), after.begin(), after.end());
  return mx::array::make_arrays(
      {k_codes.shape(),
       k_scales.shape(),
       v_codes.shape(),
       v_scales.shape(),
       k_ring.shape(),
       v_ring.shape()},
      {k_codes.dtype(),
       k_scales.dtype(),
       v_codes.dtype(),
       v_scales.dtype(),
       k_ring.dtype(),
       v_ring.dtype()},
      std::make_shared<RingAppend>(stream, offset, slot, std::move(parts)),
      std::move(inputs));
}

std::vector<mx::array> compressed_attention(
    const mx::array& q,
    const mx::array& k_codes,
    const mx::array& k_scales,
    const mx::array& v_codes,
    const mx::array& v_scales,
    const mx::array& k_centroids,
    const mx::array& v_centroids,
    int kv_len,
    float scale,
    int key_bits,
    int value_bits,
    bool causal,
    const std::optional<mx::array>& mask,
    const std::optional<mx::array>& tail_k,
    const std::optional<mx::array>& tail_v,
    const std::optional<RotationSigns>& rotation_signs,
    bool rotate_output,
    const std::optional<mx::array>& key_mean,
    const std::optional<mx::array>& value_mean,
    std::optional<mx::Dtype> out_dtype,
    mx::StreamOrDevice s) {
  constexpr const char* op = "compressed_attention";
  int k_cap = check_cache(op, "key", k_codes, k_scales, k_centroids, key_bits);
  int v_cap = check_cache(op, "value", v_codes, v_scales, v_centroids, value_bits);
  check_float(op, "queries", q);
  if (q.ndim() != 4) {
    fail(op, "queries must have shape (B, Hq, L, D), got ", shape_str(q.shape()), ".");
  }
  int batch = q.shape(0), n_q_heads = q.shape(1), q_len = q.shape(2), head_dim = q.shape(3);
  check_head_dim(op, head_dim);
  if (q_len < 1 || q_len > 8) {
    fail(
        op,
        "query length must be in [1, 8] (use dequantize + scaled_dot_product_attention "
        "for prefill), got ",
        q_len,
        ".");
  }
  for (auto* codes : {&k_codes, &v_codes}) {
    if (codes->shape(0) != batch) {
      fail(op, "queries have batch ", batch, " but the cache has ", codes->shape(0), ".");
    }
  }
  if (k_codes.shape(1) != v_codes.shape(1)) {
    fail(
        op,
        "key and value caches have different head counts: ",
        k_codes.shape(1),
        " vs ",
        v_codes.shape(1),
        ".");
  }
  int n_kv_heads = k_codes.shape(1);
  if (n_q_heads % n_kv_heads != 0) {
    fail(
        op, "query heads (", n_q_heads, ") must be a multiple of the KV heads (", n_kv_heads, ").");
  }
  if (k_codes.shape(3) * 32 / key_bits != head_dim ||
      v_codes.shape(3) * 32 / value_bits != head_dim) {
    fail(
        op,
        "queries have head dim ",
        head_dim,
        " but the key/value caches hold ",
        k_codes.shape(3) * 32 / key_bits,
        "/",
        v_codes.shape(3) * 32 / value_bits,
        " coordinates per token.");
  }
  if (kv_len < q_len || kv_len > std::min(k_cap, v_cap)) {
    fail(
        op,
        "kv_len must be in [query length ",
        q_len,
        ", capacity ",
        std::min(k_cap, v_cap),
        "], got ",
        kv_len,
        ".");
  }
  if (!(scale > 0.0f) || !std::isfinite(scale)) {
    fail(op, "scale must be a positive finite number, got ", scale, ".");
  }

  auto stream = mx::to_stream(s);
  // The GPU kernels read float16 / bfloat16 queries as they are (CUDA runs them on
  // tensor cores); the CPU kernel reads float32.
  std::vector<mx::array> inputs = {
      kernel_input(q, stream, true),
      kernel_input(k_codes, stream, false),
      kernel_input(k_scales, stream, false),
      kernel_input(v_codes, stream, false),
      kernel_input(v_scales, stream, false),
      mx::astype(k_centroids, mx::float32, stream),
      mx::astype(v_centroids, mx::float32, stream)};
  if (tail_k.has_value() != tail_v.has_value()) {
    fail(op, "tail_k and tail_v must be given together.");
  }
  if (tail_k) {
    auto want = mx::Shape{batch, n_kv_heads, tail_k->ndim() == 4 ? tail_k->shape(2) : -1, head_dim};
    for (auto* t : {&*tail_k, &*tail_v}) {
      check_float(op, "tail", *t);
      if (t->shape() != want) {
        fail(
            op,
            "tail keys and values must have shape (B, Hkv, T, D) = ",
            shape_str(want),
            ", got ",
            shape_str(tail_k->shape()),
            " and ",
            shape_str(tail_v->shape()),
            ".");
      }
    }
    if (want[2] > TQ_MAX_TAIL) {
      fail(op, "the tail holds at most ", TQ_MAX_TAIL, " tokens, got ", want[2], ".");
    }
  }
  const bool has_tail = tail_k && tail_k->shape(2) > 0; // an empty tail is no tail
  auto rotation = signed_hadamard(op, rotation_signs, head_dim);
  AttentionParams params{
      kv_len,
      scale,
      key_bits,
      value_bits,
      causal,
      mask.has_value(),
      false,
      has_tail,
      rotation,
      rotation.has_value() && rotate_output,
      key_mean.has_value()};
  if (key_mean.has_value() != value_mean.has_value()) {
    fail(op, "key_mean and value_mean must be given together.");
  }
  if (mask) {
    auto target = mx::Shape{batch, n_q_heads, q_len, kv_len};
    if (mask->ndim() > 4) {
      fail(op, "mask must have at most 4 dims, got ", shape_str(mask->shape()), ".");
    }
    // Right-align and check broadcastability against (B, Hq, L, kv_len).
    for (int i = 0; i < mask->ndim(); ++i) {
      int m = mask->shape(mask->ndim() - 1 - i), t = target[3 - i];
      if (m != 1 && m != t) {
        fail(
            op,
            "mask of shape ",
            shape_str(mask->shape()),
            " does not broadcast to (B, Hq, L, kv_len) = ",
            shape_str(target),
            ".");
      }
    }
    params.mask_is_bool = mask->dtype() == mx::bool_;
    if (!params.mask_is_bool) {
      check_float(op, "mask", *mask);
    }
    // A broadcast view: kernels index it through its strides (0 on broadcast axes).
    auto m = params.mask_is_bool ? *mask : mx::astype(*mask, mx::float32, stream);
    inputs.push_back(mx::broadcast_to(m, target, stream));
  }
  if (has_tail) {
    // The tail in the kernels' query type (a no-op for a cache's window, which has
    // the model's dtype): float32 row-major on the CPU, q's type in any layout on GPUs.
    for (auto* t : {&*tail_k, &*tail_v}) {
      inputs.push_back(
          stream.device == mx::Device::gpu
              ? mx::astype(*t, inputs[0].dtype(), stream)
              : mx::contiguous(mx::astype(*t, mx::float32, stream), false, stream));
    }
  }
  if (key_mean) {
    inputs.push_back(mean_input(op, "key_mean", *key_mean, batch, n_kv_heads, head_dim, stream));
    inputs.push_back(
        mean_input(op, "value_mean", *value_mean, batch, n_kv_heads, head_dim, stream));
  }
  const mx::Dtype want = out_dtype.value_or(mx::float32);
  if (want != mx::float32 && want != mx::float16 && want != mx::bfloat16) {
    fail(op, "out_dtype must be float32, float16 or bfloat16, got ", dtype_str(want), ".");
  }
  // What the backend's kernels write themselves (kernel_support.h); otherwise a node of
  // its own converts out.
  const KernelSupport support = kernel_support(stream.device);
  const bool direct = want == mx::float32 || support.out_in_any_dtype ||
      (support.out_in_query_dtype && want == inputs[0].dtype());
  params.out_dtype = direct ? want : mx::float32;
  auto outs = mx::array::make_arrays(
      {{batch, n_q_heads, q_len, head_dim}, {batch, n_q_heads, q_len}},
      {params.out_dtype, mx::float32},
      std::make_shared<CompressedAttention>(stream, params),
      std::move(inputs));
  if (params.out_dtype != want) {
    outs[0] = mx::astype(outs[0], want, stream);
  }
  return outs;
}

mx::array dequantize(
    const mx::array& codes,
    const mx::array& scales,
    const mx::array& centroids,
    int bits,
    int start,
    int length,
    mx::Dtype dtype,
    int before,
    int after,
    const std::optional<mx::array>& prefix,
    const std::optional<mx::array>& suffix,
    const std::optional<mx::array>& into,
    mx::StreamOrDevice s) {
  constexpr const char* op = "dequantize";
  int capacity = check_cache(op, "cache", codes, scales, centroids, bits);
  if (start < 0 || length < 0 || static_cast<int64_t>(start) + length > capacity) {
    fail(
        op,
        "tokens [",
        start,
        ", ",
        static_cast<int64_t>(start) + length,
        ") are outside the capacity ",
        capacity,
        ".");
  }
  if (dtype != mx::float32 && dtype != mx::float16 && dtype != mx::bfloat16) {
    fail(op, "dtype must be float32, float16 or bfloat16, got ", dtype_str(dtype), ".");
  }
  const int head_dim = codes.shape(3) * 32 / bits;
  // prefix / suffix give the slots around the decoded tokens their rows (and their count).
  auto check_rows = [&](const char* what, const std::optional<mx::array>& rows, int& slots) {
    if (!rows) {
      return;
    }
    const mx::Shape want{
        codes.shape(0), codes.shape(1), rows->ndim() == 4 ? rows->shape(2) : 0, head_dim};
    if (rows->shape() != want) {
      fail(
          op,
          what,
          " must have shape (",
          want[0],
          ", ",
          want[1],
          ", n, ",
          head_dim,
          ") to match the cache, got ",
          shape_str(rows->shape()),
          ".");
    }
    if (rows->dtype() != dtype) {
      fail(
          op,
          what,
          " must have the output's dtype ",
          dtype_str(dtype),
          ", got ",
          dtype_str(rows->dtype()),
          ".");
    }
    if (slots != 0 && slots != rows->shape(2)) {
      fail(op, what, " has ", rows->shape(2), " tokens but ", slots, " slots were asked for.");
    }
    slots = rows->shape(2);
  };
  check_rows("prefix", prefix, before);
  check_rows("suffix", suffix, after);
  const int64_t slots = static_cast<int64_t>(before) + length + after;
  if (before < 0 || after < 0 || slots > std::numeric_limits<int>::max()) {
    fail(
        op,
        "before and after must be >= 0 with before + length + after < 2^31, got before ",
        before,
        ", after ",
        after,
        " for ",
        length,
        " tokens.");
  }
  auto stream = mx::to_stream(s);
  const mx::Shape shape{codes.shape(0), codes.shape(1), static_cast<int>(slots), head_dim};
  std::vector<mx::array> inputs{
      mx::contiguous(codes, false, stream),
      mx::contiguous(scales, false, stream),
      mx::astype(centroids, mx::float32, stream)};
  if (prefix) {
    inputs.push_back(mx::contiguous(*prefix, false, stream));
  }
  if (suffix) {
    inputs.push_back(mx::contiguous(*suffix, false, stream));
  }
  if (into) {
    const int64_t need = static_cast<int64_t>(shape[0]) * shape[1] * shape[2] * shape[3];
    if (into->dtype() != dtype || static_cast<int64_t>(into->size()) < need) {
      fail(
          op,
          "into must be a ",
          dtype_str(dtype),
          " array of at least ",
          need,
          " elements, got ",
          dtype_str(into->dtype()),
          " with ",
          into->size(),
          ".");
    }
    // (a copy would defeat the reuse: the buffer itself is written)
    if (into->is_available() && !into->flags().row_contiguous) {
      fail(op, "into must be row-contiguous.");
    }
    inputs.push_back(*into);
  }
  return mx::array(
      shape,
      dtype,
      std::make_shared<Dequantize>(
          stream,
          bits,
          start,
          length,
          before,
          after,
          prefix.has_value(),
          suffix.has_value(),
          into.has_value()),
      std::move(inputs));
}

} // namespace turboquant_mlx
