// Layout: host code, every build (CPU kernels).
// Quantize-and-append on the CPU.
#include <stdexcept>

#include <cstring>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/stream.h"

#include "buffer_copies.h"
#include "cpu/codec.h"
#include "cpu/kernels.h"
#include "cpu/parallel.h"
#include "message.h"

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

namespace {

/// One part of a QuantizeAppend node as its task reads and writes it.
struct PartJob {
  const float* x;
  const float* mean; // nullptr unless centered
  const float* centroids;
  uint32_t* codes; // nullptr unless the node writes codes
  mx::float16_t* scales; // nullptr unless the node writes scales
  TQRotation rot;
  int bits, batch, heads, length, head_dim, capacity, words;
  const char* what; // the part in messages: "" (one part), "key " or "value "
};

/// A part's tokens, checked and quantized, not yet written.
struct QuantizedPart {
  std::vector<uint8_t> codes; // one per coordinate
  std::vector<QuantizedVector> results; // one per token
};

} // namespace

void quantize_append(
    const QuantizeAppend& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    TaskCount done,
    int ring_slot) {
  const int nb = prim.buffers();
  const bool two = prim.parts().size() == 2;
  auto& encoder = mx::cpu::get_command_encoder(s);
  std::vector<PartJob> jobs;
  int index = 0;
  prim.walk_parts([&](const AppendPart& part, size_t in_at, size_t out_at) {
    const mx::array* in = &inputs[in_at];
    mx::array* out = &outputs[out_at];
    for (int i = 0; i < nb; ++i) {
      take_buffer("quantize_append", in[i], out[i], prim.in_place(), s);
    }
    auto& x = in[nb];
    encoder.set_input_array(x);
    encoder.set_input_array(in[nb + 1]);
    if (part.centered) {
      encoder.set_input_array(in[nb + 2]);
    }
    for (int i = 0; i < nb; ++i) {
      encoder.set_output_array(out[i]);
    }
    const int head_dim = x.shape(3);
    jobs.push_back(PartJob{
        x.data<float>(),
        part.centered ? in[nb + 2].data<float>() : nullptr,
        in[nb + 1].data<float>(),
        prim.writes_codes() ? out[0].data<uint32_t>() : nullptr,
        prim.writes_scales() ? out[nb - 1].data<mx::float16_t>() : nullptr,
        kernel_rotation(part.rotation, head_dim),
        part.bits,
        x.shape(0),
        x.shape(1),
        x.shape(2),
        head_dim,
        out[0].shape(2),
        prim.writes_codes() ? out[0].shape(3) : 0,
        two ? (index == 0 ? "key " : "value ") : ""});
    ++index;
  });
  auto task = [jobs = std::move(jobs), op = prim.op(), offset = prim.offset(), ring_slot, done]() {
    // Every part's tokens are checked and quantized into scratch first; a refusal
    // raises before any buffer is written.
    auto refuse = [op](const auto&... args) {
      throw std::invalid_argument(
          message("[turboquant_mlx.", op, "] ", args..., "; nothing was written."));
    };
    std::vector<QuantizedPart> quantized(jobs.size());
    for (size_t j = 0; j < jobs.size(); ++j) {
      const PartJob& job = jobs[j];
      const int length = job.length, heads = job.heads, head_dim = job.head_dim;
      const int n_vectors = job.batch * heads * length;
      auto where = [&](int v) {
        return message(
            job.what,
            ring_slot >= 0 ? "ring slot " : "token ",
            (ring_slot >= 0 ? ring_slot : 0) + v % length,
            " of head ",
            (v / length) % heads,
            " (batch ",
            v / (length * heads),
            ")");
      };
      for (int v = 0; v < n_vectors; ++v) {
        const float* y = job.x + static_cast<int64_t>(v) * head_dim;
        for (int i = 0; i < head_dim; ++i) {
          if (!std::isfinite(y[i])) {
            refuse(where(v), " has a non-finite value ", y[i], " at coordinate ", i);
          }
        }
      }
      const float* y_ptr = job.x;
      // A centered cache's tokens: minus their head's mean first, into scratch.
      std::vector<float> centered;
      if (job.mean) {
        centered.resize(static_cast<size_t>(n_vectors) * head_dim);
        for (int v = 0; v < n_vectors; ++v) {
          const float* m = job.mean + static_cast<int64_t>(v / length) * head_dim;
          for (int i = 0; i < head_dim; ++i) {
            const float c = job.x[static_cast<int64_t>(v) * head_dim + i] - m[i];
            if (!std::isfinite(m[i])) {
              refuse(
                  job.what,
                  "mean has a non-finite value ",
                  m[i],
                  " at coordinate ",
                  i,
                  " of head ",
                  (v / length) % heads);
            }
            if (!std::isfinite(c)) {
              refuse(where(v), " minus the mean overflows at coordinate ", i);
            }
            centered[static_cast<size_t>(v) * head_dim + i] = c;
          }
        }
        y_ptr = centered.data();
      }
      // Model-space tokens: rotate them first, into scratch.
      std::vector<float> rotated;
      if (job.rot.on) {
        rotated = rotated_rows(y_ptr, n_vectors, head_dim, job.rot.sign_bits, job.rot.scale);
        y_ptr = rotated.data();
      }
      // A token whose scale does not fit float16 is refused too.
      auto bounds = boundaries(job.centroids, job.bits);
      QuantizedPart& q = quantized[j];
      q.codes.resize(static_cast<size_t>(n_vectors) * head_dim);
      q.results.resize(n_vectors);
      parallel_for(
          n_vectors,
          [&](int v) {
            q.results[v] = quantize_vector(
                y_ptr + static_cast<int64_t>(v) * head_dim,
                head_dim,
                job.centroids,
                bounds,
                q.codes.data() + static_cast<size_t>(v) * head_dim);
          },
          /* min_items = */ 256);
      for (int v = 0; v < n_vectors; ++v) {
        if (!(q.results[v].scale <= kMaxFloat16)) {
          refuse(
              where(v),
              " has norm ",
              q.results[v].norm,
              ": its scale ",
              q.results[v].scale,
              " exceeds the float16 range (",
              kMaxFloat16,
              ")");
        }
      }
    }
    // Every part passed: write them all.
    for (size_t j = 0; j < jobs.size(); ++j) {
      const PartJob& job = jobs[j];
      const QuantizedPart& q = quantized[j];
      const int n_vectors = job.batch * job.heads * job.length;
      for (int v = 0; v < n_vectors; ++v) {
        int bh = v / job.length, t = offset + v % job.length;
        int64_t slot = static_cast<int64_t>(bh) * job.capacity + t;
        if (job.codes) {
          pack_codes(
              q.codes.data() + static_cast<size_t>(v) * job.head_dim,
              job.head_dim,
              job.bits,
              job.codes + slot * job.words);
        }
        if (job.scales) {
          job.scales[slot] = static_cast<mx::float16_t>(q.results[v].scale);
        }
      }
    }
    if (done) {
      done->fetch_add(1);
    }
  };
  // The task may refuse its tokens. MLX 0.32's CPU scheduler keeps an error thrown on
  // its stream thread and rethrows it at a later enqueue, between the two halves of a
  // command encoder's dispatch, which leaves a task counted as active forever; a few
  // such leaks and every later eval waits on them. So the stream is drained (the
  // inputs are then computed and no earlier task reads the buffers) and the task runs
  // here, where a refusal raises out of eval like any argument check.
  mx::synchronize(s);
  task();
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
            const char* at =
                src + (b * rs[0] + h * rs[1] + (slot + l) * rs[2] + d * rs[3]) * itemsize;
            *to++ = dtype == mx::float16
                ? static_cast<float>(*reinterpret_cast<const mx::float16_t*>(at))
                : dtype == mx::bfloat16
                ? static_cast<float>(*reinterpret_cast<const mx::bfloat16_t*>(at))
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
