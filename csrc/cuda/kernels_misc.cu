// Layout: CUDA only (kernel instantiations).
// Split-K merge, quantize, dequantize and copy kernels.
#include "tq_entry.cuh"

namespace turboquant_mlx::cuda_kernels {

const void* attention_merge_kernel(int d, QType q, bool out_in_q_type) {
  const void* k = nullptr;
  dispatch_head_dim(d, [&](auto dd) {
    constexpr int D = decltype(dd)::value;
    auto pick = [&](auto qt) {
      using QT = decltype(qt);
      k = out_in_q_type ? reinterpret_cast<const void*>(&tq_attention_merge_kernel<QT, D, QT>)
                        : reinterpret_cast<const void*>(&tq_attention_merge_kernel<QT, D, float>);
    };
    switch (q) {
      case QType::Float32: pick(0.0f); break;
      case QType::Float16: pick(__half{}); break;
      case QType::BFloat16: pick(static_cast<unsigned short>(0)); break;
    }
  });
  return k;
}

const void* quantize_kernel(int d, int b, QType x, bool pair) {
  const void* k = nullptr;
  dispatch_head_dim(d, [&](auto dd) {
    dispatch_bits(b, [&](auto bb) {
      constexpr int D = decltype(dd)::value, B = decltype(bb)::value;
      auto pick = [&](auto xt) {
        using XT = decltype(xt);
        k = pair ? reinterpret_cast<const void*>(&tq_quantize_pair_kernel<XT, D, B>)
                 : reinterpret_cast<const void*>(&tq_quantize_kernel<XT, D, B>);
      };
      switch (x) {
        case QType::Float32: pick(0.0f); break;
        case QType::Float16: pick(__half{}); break;
        case QType::BFloat16: pick(static_cast<unsigned short>(0)); break;
      }
    });
  });
  return k;
}

const void* dequantize_kernel(int b, QType out) {
  const void* k = nullptr;
  dispatch_bits(b, [&](auto bb) {
    constexpr int B = decltype(bb)::value;
    auto pick = [&](auto ot) {
      k = reinterpret_cast<const void*>(&tq_dequantize_kernel<decltype(ot), B>);
    };
    switch (out) {
      case QType::Float32: pick(0.0f); break;
      case QType::Float16: pick(__half{}); break;
      case QType::BFloat16: pick(static_cast<unsigned short>(0)); break;
    }
  });
  return k;
}

const void* copy_kernel(int itemsize, bool pair) {
  switch (itemsize) {
    case 4:
      return pair ? reinterpret_cast<const void*>(&tq_copy_pair_kernel<unsigned int>)
                  : reinterpret_cast<const void*>(&tq_copy_kernel<unsigned int>);
    case 2:
      return pair ? reinterpret_cast<const void*>(&tq_copy_pair_kernel<unsigned short>)
                  : reinterpret_cast<const void*>(&tq_copy_kernel<unsigned short>);
    default: return nullptr;
  }
}

} // namespace turboquant_mlx::cuda_kernels
