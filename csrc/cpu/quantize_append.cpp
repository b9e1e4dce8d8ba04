#include <stdexcept>

#include <cstring>

#include "mlx/backend/cpu/encoder.h"

#include "buffer_copies.h"
#include "message.h"
#include "cpu/codec.h"
#include "cpu/kernels.h"
#include "cpu/parallel.h"

namespace turboquant_mlx::cpu {

namespace {

// Largest finite float16: scales are stored in it.
constexpr float kMaxFloat16 = 65504.0f;

// Makes `out` hold the cache buffer: the input's own buffer when it can be donated or
// the caller asked for in_place (the O(new tokens) path), otherwise a copy.
void take_buffer(
    const char* op,
    const mx::array& in,
    mx::array& out,
    bool in_place,
    const mx::Stream& s) {
  if (in.flags().row_contiguous && (in_place || in.is_donatable())) {
    out.copy_shared_buffer(in);
    return;
  }
  count_buffer_copy(op, in);
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(s);
  encoder.set_input_array(in);
  encoder.set_output_array(out);
  encoder.dispatch([src = static_cast<const char*>(in.data<void>()),
                    dst = static_cast<char*>(out.data<void>()),
                    nbytes = out.nbytes(),
                    contiguous = in.flags().row_contiguous,
                    itemsize = in.itemsize(),
                    shape = in.shape(),
                    strides = in.strides()]() {
    if (contiguous) {
      std::memcpy(dst, src, nbytes);
      return;
    }
    // Strided source (a broadcast or sliced buffer): gather element by element.
    int64_t n = nbytes / itemsize;
    for (int64_t e = 0; e < n; ++e) {
      int64_t rem = e, at = 0;
      for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
        at += (rem % shape[d]) * strides[d];
        rem /= shape[d];
      }
      std::memcpy(dst + e * itemsize, src + at * itemsize, itemsize);
    }
  });
}

} // namespace

void quantize_append_part(
    const QuantizeAppend& prim,
    const AppendPart& part,
    const mx::Stream& s,
    const mx::array* in,
    mx::array* out,
    TaskCount done) {
  const int nb = prim.buffers();
  for (int i = 0; i < nb; ++i) {
    take_buffer("quantize_append", in[i], out[i], prim.in_place(), s);
  }
  auto& x = in[nb];
  auto& centroids = in[nb + 1];

  auto& encoder = mx::cpu::get_command_encoder(s);
  encoder.set_input_array(x);
  encoder.set_input_array(centroids);
  for (int i = 0; i < nb; ++i) {
    encoder.set_output_array(out[i]);
  }

  int batch = x.shape(0), heads = x.shape(1), length = x.shape(2), head_dim = x.shape(3);
  int capacity = out[0].shape(2);
  int words = prim.writes_codes() ? out[0].shape(3) : 0;
  TQRotation rot = kernel_rotation(part.rotation, head_dim);
  const float* mean_ptr = nullptr;
  if (part.centered) {
    encoder.set_input_array(in[nb + 2]);
    mean_ptr = in[nb + 2].data<float>();
  }
  encoder.dispatch([x_ptr = x.data<float>(),
                    mean_ptr,
                    rot,
                    c_ptr = centroids.data<float>(),
                    codes_ptr = prim.writes_codes() ? out[0].data<uint32_t>() : nullptr,
                    scales_ptr = prim.writes_scales() ? out[nb - 1].data<mx::float16_t>() : nullptr,
                    bits = part.bits,
                    offset = prim.offset(),
                    batch,
                    heads,
                    length,
                    head_dim,
                    capacity,
                    words,
                    done]() {
    int n_vectors = batch * heads * length;
    // Refuse non-finite input before writing anything, so a bad token never lands
    // in the cache.
    auto where = [&](int v) {
      return message(
          "token ", v % length, " of head ", (v / length) % heads, " (batch ",
          v / (length * heads), ")");
    };
    for (int v = 0; v < n_vectors; ++v) {
      const float* y = x_ptr + static_cast<int64_t>(v) * head_dim;
      for (int i = 0; i < head_dim; ++i) {
        if (!std::isfinite(y[i])) {
          throw std::invalid_argument(message(
              "[turboquant_mlx.quantize_append] ", where(v), " has a non-finite value ", y[i],
              " at coordinate ", i, "; nothing was written."));
        }
      }
    }
    const float* y_ptr = x_ptr;
    // A centered cache's tokens: minus their head's mean first, into scratch.
    std::vector<float> centered;
    if (mean_ptr) {
      centered.resize(static_cast<size_t>(n_vectors) * head_dim);
      for (int v = 0; v < n_vectors; ++v) {
        const float* m = mean_ptr + static_cast<int64_t>(v / length) * head_dim;
        for (int i = 0; i < head_dim; ++i) {
          const float c = x_ptr[static_cast<int64_t>(v) * head_dim + i] - m[i];
          if (!std::isfinite(c)) {
            throw std::invalid_argument(message(
                "[turboquant_mlx.quantize_append] mean has a non-finite value ", m[i],
                " at coordinate ", i, " of head ", (v / length) % heads, "; nothing was written."));
          }
          centered[static_cast<size_t>(v) * head_dim + i] = c;
        }
      }
      y_ptr = centered.data();
    }
    // Model-space tokens: rotate them first, into scratch.
    std::vector<float> rotated;
    if (rot.on) {
      rotated = rotated_rows(y_ptr, n_vectors, head_dim, rot.sign_bits, rot.scale);
      y_ptr = rotated.data();
    }
    // Quantize everything into scratch first, so that a token whose scale does not
    // fit float16 is refused before anything is written.
    auto bounds = boundaries(c_ptr, bits);
    std::vector<uint8_t> codes(static_cast<size_t>(n_vectors) * head_dim);
    std::vector<QuantizedVector> results(n_vectors);
    parallel_for(
        n_vectors,
        [&](int v) {
          results[v] = quantize_vector(
              y_ptr + static_cast<int64_t>(v) * head_dim,
              head_dim,
              c_ptr,
              bounds,
              codes.data() + static_cast<size_t>(v) * head_dim);
        },
        /* min_items = */ 256);
    for (int v = 0; v < n_vectors; ++v) {
      if (!(results[v].scale <= kMaxFloat16)) {
        throw std::invalid_argument(message(
            "[turboquant_mlx.quantize_append] ", where(v), " has norm ", results[v].norm,
            ": its scale ", results[v].scale, " exceeds the float16 range (", kMaxFloat16,
            "); nothing was written."));
      }
    }
    for (int v = 0; v < n_vectors; ++v) {
      int bh = v / length, t = offset + v % length;
      int64_t slot = static_cast<int64_t>(bh) * capacity + t;
      if (codes_ptr) {
        pack_codes(
            codes.data() + static_cast<size_t>(v) * head_dim,
            head_dim,
            bits,
            codes_ptr + slot * words);
      }
      if (scales_ptr) {
        scales_ptr[slot] = static_cast<mx::float16_t>(results[v].scale);
      }
    }
    if (done) {
      done->fetch_add(1);
    }
  });
}

mx::array ring_slots_f32(const mx::array& ring, int slot, int length, const mx::Stream& s) {
  mx::array x(
      mx::Shape{ring.shape(0), ring.shape(1), length, ring.shape(3)}, mx::float32, nullptr, {});
  x.set_data(mx::allocator::malloc(x.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(s);
  encoder.set_input_array(ring);
  encoder.set_output_array(x);
  encoder.dispatch([src = ring.data<char>(),
                    dst = x.data<float>(),
                    dtype = ring.dtype(),
                    itemsize = int64_t(ring.itemsize()),
                    shape = x.shape(),
                    rs = ring.strides(),
                    slot = int64_t(slot)]() {
    float* to = dst;
    for (int64_t b = 0; b < shape[0]; ++b) {
      for (int64_t h = 0; h < shape[1]; ++h) {
        for (int64_t l = 0; l < shape[2]; ++l) {
          for (int64_t d = 0; d < shape[3]; ++d) {
            const char* at = src + (b * rs[0] + h * rs[1] + (slot + l) * rs[2] + d * rs[3]) * itemsize;
            *to++ = dtype == mx::float16 ? static_cast<float>(*reinterpret_cast<const mx::float16_t*>(at))
                : dtype == mx::bfloat16  ? static_cast<float>(*reinterpret_cast<const mx::bfloat16_t*>(at))
                                         : *reinterpret_cast<const float*>(at);
          }
        }
      }
    }
  });
  encoder.add_temporary(x); // (until the node's tasks, which read it, have run)
  return x;
}

void write_tokens(
    const WriteTokens& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    TaskCount after,
    int needed) {
  // (the inputs after the tokens only order this node after earlier readers)
  const int n = prim.buffers();
  for (int i = 0; i < n; ++i) {
    take_buffer("write_tokens", inputs[i], outputs[i], true, s);
    const auto& x = inputs[n + i];
    auto& out = outputs[i];
    auto& encoder = mx::cpu::get_command_encoder(s);
    encoder.set_input_array(x);
    encoder.set_output_array(out);
    encoder.dispatch([src = x.data<char>(),
                      dst = out.data<char>(),
                      itemsize = int64_t(x.itemsize()),
                      shape = x.shape(),
                      xs = x.strides(),
                      os = out.strides(),
                      offset = int64_t(prim.offset()),
                      after,
                      needed]() {
      if (after && after->load() != needed) {
        return; // a task it follows failed (and raised): leave the buffer as it is
      }
      const int64_t D = shape[3];
      for (int64_t b = 0; b < shape[0]; ++b) {
        for (int64_t h = 0; h < shape[1]; ++h) {
          for (int64_t l = 0; l < shape[2]; ++l) {
            char* to = dst + (b * os[0] + h * os[1] + (offset + l) * os[2]) * itemsize;
            const char* from = src + (b * xs[0] + h * xs[1] + l * xs[2]) * itemsize;
            if (xs[3] == 1) {
              std::memcpy(to, from, D * itemsize);
            } else {
              for (int64_t d = 0; d < D; ++d) {
                std::memcpy(to + d * itemsize, from + d * xs[3] * itemsize, itemsize);
              }
            }
          }
        }
      }
    });
  }
}

} // namespace turboquant_mlx::cpu
