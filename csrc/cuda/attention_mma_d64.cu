// Layout: CUDA only (kernel instantiations).
// Tensor-core attention kernels for head dim 64 (see attention_mma.cuh).
#include "attention_mma.cuh"

namespace turboquant_mlx::cuda_kernels {

const void* attention_mma_kernel_d64(int kb, int vb, int nrb) {
  return attention_mma_kernel_for<64>(kb, vb, nrb);
}

} // namespace turboquant_mlx::cuda_kernels
