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
  out.set_data(mx::allocator::malloc(out.nbytes()));

  auto& encoder = mx::cpu::get_command_encoder(s);
  encoder.set_input_array(codes);
  encoder.set_input_array(scales);
  encoder.set_input_array(centroids);
  encoder.set_output_array(out);

  int bh_count = codes.shape(0) * codes.shape(1);
  int capacity = codes.shape(2), words = codes.shape(3), head_dim = out.shape(3);
  encoder.dispatch([codes_ptr = codes.data<uint32_t>(),
                    scales_ptr = scales.data<mx::float16_t>(),
                    c_ptr = centroids.data<float>(),
                    out_ptr = out.data<float>(),
                    bits = prim.bits(),
                    start = prim.start(),
                    length = prim.length(),
                    bh_count,
                    capacity,
                    words,
                    head_dim]() {
    dispatch_bits(bits, [&]<int BITS>() {
      Decoder<BITS> decoder(c_ptr);
      parallel_for(bh_count, [&](int bh) {
        for (int t = 0; t < length; ++t) {
          int64_t slot = static_cast<int64_t>(bh) * capacity + start + t;
          float* o = out_ptr + (static_cast<int64_t>(bh) * length + t) * head_dim;
          decoder.decode(codes_ptr + slot * words, head_dim, o);
          float gamma = static_cast<float>(scales_ptr[slot]);
          for (int i = 0; i < head_dim; ++i) {
            o[i] *= gamma;
          }
        }
      });
    });
  });
}

} // namespace turboquant_mlx::cpu
