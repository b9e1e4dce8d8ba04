// Layout: CUDA only (kernel instantiations).
// Simdgroup-matrix attention kernels for head dim 256 (see attention_simd.cuh).
#include "attention_simd.cuh"

namespace turboquant_mlx::cuda_kernels {

const void* attention_simd_kernel_d256(int kb, int vb, QType qt) {
  return attention_simd_kernel_for<256>(kb, vb, qt);
}

} // namespace turboquant_mlx::cuda_kernels
