// Layout: host code, every build.
// Which kernels this build runs on a device: one answer per backend (csrc/cpu/kernels.h,
// and gpu::kernel_support of csrc/cuda/, csrc/metal/ or csrc/gpu_none.cpp), asked by the
// op functions (ops.cpp) and by the Python layer (`_ext.kernel_support`: ops.py,
// selfcheck.py), so that no caller decides it from the backend's name.
#pragma once

#include <mlx/device.h>

namespace turboquant_mlx {

namespace mx = mlx::core;

struct KernelSupport {
  /// The primitives (quantize/append, the ring exchange, attention, dequantize) run as
  /// kernels; otherwise the Python ops take the plain-MLX fallback.
  bool kernels = false;
  /// The in-place token write (WriteTokens) has a kernel; otherwise the Python ops
  /// write with slice updates.
  bool write_tokens = false;
  /// Attention writes a float16 / bfloat16 `out` itself for queries of that dtype;
  /// otherwise float32 and a conversion node.
  bool out_in_query_dtype = false;
  /// ... and for queries of any dtype.
  bool out_in_any_dtype = false;
  /// The Python layer runs the kernels only once its first-use self-check passed
  /// (selfcheck.py; Metal, which has never run on Apple hardware).
  bool self_check = false;
};

namespace gpu {
/// The GPU backend compiled in (one per build).
KernelSupport kernel_support();
} // namespace gpu

/// The answer of `device`'s backend (ops.cpp).
KernelSupport kernel_support(const mx::Device& device);

} // namespace turboquant_mlx
