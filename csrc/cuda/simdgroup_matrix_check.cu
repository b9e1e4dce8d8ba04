// Layout: CUDA only (a test kernel and its host code).
// A test of the CUDA emulation of Metal's simdgroup matrices (metal/tq_portable.h)
// against plain inputs: one warp runs each operation the simdgroup-matrix kernels use
// and hands back what every lane holds and what was stored, for tests/test_gpu.py to
// compare with Metal's documented lane layout and with NumPy. Not used by the ops.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "gpu.h"
#include "message.h"
#include "tq_portable.h"

namespace turboquant_mlx::cuda_kernels {

/// Results, 64 floats each, in this order (lane elements are [lane][2], stores 8x8
/// row-major):
///   0 lane elements of simdgroup_load(a) (float)
///   1 lane elements of simdgroup_load(a, transposed)
///   2 lane elements of simdgroup_load(a as half)
///   3 lane elements of simdgroup_load of the 8x8 block at origin (8, 0) of the 8x16
///     row-major [a | b] (elements_per_row 16): b
///   4 store of a * b + c (float fragments)
///   5 store of a * b + c (half a and b, float c and d)
///   6 transposed store of a * b + c (float)
///   7 store of simdgroup_matrix<float, 8, 8>(2.5) (a diagonal matrix)
constexpr int kChecks = 8;

__global__ void __launch_bounds__(32) simdgroup_matrix_check_kernel(
    const float* __restrict__ a,
    const float* __restrict__ b,
    const float* __restrict__ c,
    float* __restrict__ out) {
  __shared__ float fa[64], fb[64], fc[64], wide[128], st[64];
  __shared__ __half ha[64], hb[64];
  const int lane = int(threadIdx.x);
  for (int i = lane; i < 64; i += 32) {
    fa[i] = a[i];
    fb[i] = b[i];
    fc[i] = c[i];
    ha[i] = __float2half_rn(a[i]);
    hb[i] = __float2half_rn(b[i]);
    wide[(i / 8) * 16 + i % 8] = a[i];
    wide[(i / 8) * 16 + 8 + i % 8] = b[i];
  }
  __syncwarp();
  auto lanes = [&](int k, float e0, float e1) {
    out[k * 64 + 2 * lane] = e0;
    out[k * 64 + 2 * lane + 1] = e1;
  };
  auto stored = [&](int k) {
    __syncwarp();
    for (int i = lane; i < 64; i += 32) {
      out[k * 64 + i] = st[i];
    }
    __syncwarp();
  };
  simdgroup_matrix<float, 8, 8> ma, mat, mb, mc, mw;
  simdgroup_matrix<__half, 8, 8> mha, mhb;
  simdgroup_load(ma, fa, 8);
  lanes(0, ma.thread_elements()[0], ma.thread_elements()[1]);
  simdgroup_load(mat, fa, 8, TQ_ORIGIN0, true);
  lanes(1, mat.thread_elements()[0], mat.thread_elements()[1]);
  simdgroup_load(mha, ha, 8);
  lanes(2, __half2float(mha.thread_elements()[0]), __half2float(mha.thread_elements()[1]));
  simdgroup_load(mw, wide, 16, make_ulong2(8, 0));
  lanes(3, mw.thread_elements()[0], mw.thread_elements()[1]);

  simdgroup_load(mb, fb, 8);
  simdgroup_load(mc, fc, 8);
  simdgroup_matrix<float, 8, 8> d;
  simdgroup_multiply_accumulate(d, ma, mb, mc);
  simdgroup_store(d, st, 8);
  stored(4);
  simdgroup_load(mhb, hb, 8);
  simdgroup_matrix<float, 8, 8> dh = mc;
  simdgroup_multiply_accumulate(dh, mha, mhb, dh); // (d is c: the kernels accumulate so)
  simdgroup_store(dh, st, 8);
  stored(5);
  simdgroup_store(d, st, 8, TQ_ORIGIN0, true);
  stored(6);
  simdgroup_store(simdgroup_matrix<float, 8, 8>(2.5f), st, 8);
  stored(7);
}

} // namespace turboquant_mlx::cuda_kernels

namespace turboquant_mlx::gpu {

std::vector<float> simdgroup_matrix_check(
    const std::vector<float>& a,
    const std::vector<float>& b,
    const std::vector<float>& c) {
  if (a.size() != 64 || b.size() != 64 || c.size() != 64) {
    throw std::invalid_argument(message(
        "[turboquant_mlx._simdgroup_matrix_check] a, b and c must hold 64 values (8x8), "
        "got ",
        a.size(),
        ", ",
        b.size(),
        " and ",
        c.size(),
        "."));
  }
  auto check = [](cudaError_t err, const char* what) {
    if (err != cudaSuccess) {
      throw std::runtime_error(message(
          "[turboquant_mlx._simdgroup_matrix_check] CUDA error in ",
          what,
          ": ",
          cudaGetErrorString(err)));
    }
  };
  constexpr int n_out = cuda_kernels::kChecks * 64;
  float* dev = nullptr;
  check(cudaMalloc(&dev, (3 * 64 + n_out) * sizeof(float)), "cudaMalloc");
  std::vector<float> out(n_out);
  try {
    check(cudaMemcpy(dev, a.data(), 64 * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
    check(cudaMemcpy(dev + 64, b.data(), 64 * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
    check(
        cudaMemcpy(dev + 128, c.data(), 64 * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
    check(cudaMemset(dev + 192, 0xff, n_out * sizeof(float)), "cudaMemset"); // NaN: unwritten
    cuda_kernels::simdgroup_matrix_check_kernel<<<1, 32>>>(dev, dev + 64, dev + 128, dev + 192);
    check(cudaGetLastError(), "launch");
    check(
        cudaMemcpy(out.data(), dev + 192, n_out * sizeof(float), cudaMemcpyDeviceToHost),
        "cudaMemcpy");
  } catch (...) {
    cudaFree(dev);
    throw;
  }
  check(cudaFree(dev), "cudaFree");
  return out;
}

} // namespace turboquant_mlx::gpu
