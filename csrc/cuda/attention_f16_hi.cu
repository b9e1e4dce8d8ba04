// Layout: CUDA only (kernel instantiations).
// Attention kernels for float16 queries, head dims 160..256, every bit-width pair.
#include "tq_entry.cuh"

namespace turboquant_mlx::cuda_kernels {

const void* attention_kernel_f16_hi(int d, int kb, int vb) {
  return attention_kernel_for<__half, 160, 256>(d, kb, vb);
}

} // namespace turboquant_mlx::cuda_kernels
