// Layout: CUDA only (kernel instantiations).
// Attention kernels for bfloat16 (read as raw bits) queries, head dims 32..128, every bit-width
// pair.
#include "tq_entry.cuh"

namespace turboquant_mlx::cuda_kernels {

const void* attention_kernel_bf16_lo(int d, int kb, int vb) {
  return attention_kernel_for<ushort, 32, 128>(d, kb, vb);
}

} // namespace turboquant_mlx::cuda_kernels
