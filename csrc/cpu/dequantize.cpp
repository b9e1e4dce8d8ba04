// Layout: host code, every build (CPU kernels).
// Dequantize on the CPU.
#include <algorithm>
#include <vector>

#include "mlx/backend/cpu/encoder.h"

#include "cpu/codec.h"
#include "cpu/kernels.h"
#include "cpu/parallel.h"

namespace turboquant_mlx::cpu {

void dequantize(
    const Dequantize& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& codes = inputs[0];
  auto& scales = inputs[1];
  auto& centroids = inputs[2];
  auto& out = outputs[0];
  prim.place_output(
      inputs, out, [](mx::array& a) { a.set_data(mx::allocator::malloc(a.nbytes())); });
  const mx::array* prefix = prim.prefix_input() < 0 ? nullptr : &inputs[prim.prefix_input()];
  const mx::array* suffix = prim.suffix_input() < 0 ? nullptr : &inputs[prim.suffix_input()];

  auto& encoder = mx::cpu::get_command_encoder(s);
  encoder.set_input_array(codes);
  encoder.set_input_array(scales);
  encoder.set_input_array(centroids);
  for (auto* rows : {prefix, suffix}) {
    if (rows) {
      encoder.set_input_array(*rows);
    }
  }
  encoder.set_output_array(out);

  int bh_count = codes.shape(0) * codes.shape(1);
  int capacity = codes.shape(2), words = codes.shape(3);
  int slots = out.shape(2), head_dim = out.shape(3);
  auto run = [&]<typename OT>(OT* out_ptr) {
    encoder.dispatch([codes_ptr = codes.data<uint32_t>(),
                      prefix_ptr = prefix ? prefix->data<OT>() : nullptr,
                      suffix_ptr = suffix ? suffix->data<OT>() : nullptr,
                      scales_ptr = scales.data<mx::float16_t>(),
                      c_ptr = centroids.data<float>(),
                      out_ptr,
                      bits = prim.bits(),
                      start = prim.start(),
                      length = prim.length(),
                      before = prim.before(),
                      bh_count,
                      capacity,
                      words,
                      slots,
                      head_dim]() {
      dispatch_bits(bits, [&]<int BITS>() {
        Decoder<BITS> decoder(c_ptr);
        parallel_for(bh_count, [&](int bh) {
          OT* head = out_ptr + static_cast<int64_t>(bh) * slots * head_dim;
          // The slots around the decoded tokens: the prefix / suffix rows, else zeros.
          auto fill = [&](OT* dst, const OT* rows, int64_t n) {
            if (rows) {
              std::copy(
                  rows + static_cast<int64_t>(bh) * n,
                  rows + static_cast<int64_t>(bh + 1) * n,
                  dst);
            } else {
              std::fill(dst, dst + n, OT(0.0f));
            }
          };
          fill(head, prefix_ptr, static_cast<int64_t>(before) * head_dim);
          fill(
              head + static_cast<int64_t>(before + length) * head_dim,
              suffix_ptr,
              static_cast<int64_t>(slots - before - length) * head_dim);
          std::vector<float> row(head_dim);
          for (int t = 0; t < length; ++t) {
            int64_t slot = static_cast<int64_t>(bh) * capacity + start + t;
            decoder.decode(codes_ptr + slot * words, head_dim, row.data());
            float gamma = static_cast<float>(scales_ptr[slot]);
            OT* o = head + static_cast<int64_t>(before + t) * head_dim;
            for (int i = 0; i < head_dim; ++i) {
              o[i] = static_cast<OT>(row[i] * gamma);
            }
          }
        });
      });
    });
  };
  switch (out.dtype()) {
    case mx::float16: run(out.data<mx::float16_t>()); break;
    case mx::bfloat16: run(out.data<mx::bfloat16_t>()); break;
    default: run(out.data<float>()); break;
  }
}

} // namespace turboquant_mlx::cpu
