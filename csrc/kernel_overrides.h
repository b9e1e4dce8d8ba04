// Layout: host code, every build.
// Test hooks on the GPU backends' kernel choices, set from Python with
// `_ext._set_kernel_override(name, value)` and read back with `_ext._kernel_overrides()`:
// the tests reach every attention kernel and the split-K merge paths with them, and
// bench/bench_gpu.py sweeps the split target. Not read from the environment: nothing
// here is for normal use. Each is read by every attention call, so a change applies to
// the next call.
#pragma once

#include <atomic>
#include <optional>
#include <stdexcept>
#include <string>

namespace turboquant_mlx {

/// The attention kernel where the backend would run its fast one.
enum class AttentionKernel : int {
  automatic = 0, // the backend's choice
  // the portable kernel (metal/tq_kernels.h), where CUDA's tensor-core kernel or Metal's
  // simdgroup-matrix kernel would run
  portable = 1,
  // CUDA: the simdgroup-matrix kernel (metal/tq_attention_simd.h) on the emulation of
  // simdgroup matrices, for float16 / bfloat16 queries at head dims 64, 128, 256 (any
  // bit widths), the portable kernel for the rest: how that kernel's body is tested on
  // NVIDIA GPUs (correct, slow). Metal: its own choice.
  simd = 2,
};

namespace override_detail {

struct Values {
  std::atomic<int> attention{0};
  std::atomic<int> splits{0};
  std::atomic<int> ctas{0};
  std::atomic<int> min_steps{0};
};

inline Values& values() {
  static Values v;
  return v;
}

} // namespace override_detail

inline AttentionKernel attention_kernel_override() {
  return static_cast<AttentionKernel>(override_detail::values().attention.load());
}

/// Split-K count of the attention (clamped to the keys' length and TQ_MAX_SPLITS);
/// 0: the heuristic's.
inline int splits_override() {
  return override_detail::values().splits.load();
}

/// Threadgroups the split heuristic aims at; 0: the backend's default.
inline int ctas_override() {
  return override_detail::values().ctas.load();
}

/// CUDA: least block iterations per split; 0: the kernel's default.
inline int min_steps_override() {
  return override_detail::values().min_steps.load();
}

/// Sets override `name` ("attention": "portable" / "simd"; "splits", "ctas",
/// "min_steps": a positive count) to `value`, or back to the backend's own choice
/// (nullopt).
inline void set_kernel_override(const std::string& name, const std::optional<std::string>& value) {
  auto& v = override_detail::values();
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument(
        "[turboquant_mlx._set_kernel_override] " + name + "=" + value.value_or("None") + ": " +
        why);
  };
  if (name == "attention") {
    if (!value) {
      v.attention = int(AttentionKernel::automatic);
    } else if (*value == "portable") {
      v.attention = int(AttentionKernel::portable);
    } else if (*value == "simd") {
      v.attention = int(AttentionKernel::simd);
    } else {
      fail("the attention kernel is 'portable', 'simd' or None.");
    }
    return;
  }
  std::atomic<int>* slot = name == "splits" ? &v.splits
      : name == "ctas"                      ? &v.ctas
      : name == "min_steps"                 ? &v.min_steps
                                            : nullptr;
  if (slot == nullptr) {
    fail("unknown override (attention, splits, ctas, min_steps).");
  }
  if (!value) {
    *slot = 0;
    return;
  }
  int n = 0;
  try {
    size_t used = 0;
    n = std::stoi(*value, &used);
    if (used != value->size()) {
      n = 0;
    }
  } catch (const std::exception&) {
    n = 0;
  }
  if (n < 1) {
    fail("a positive integer or None.");
  }
  *slot = n;
}

} // namespace turboquant_mlx
