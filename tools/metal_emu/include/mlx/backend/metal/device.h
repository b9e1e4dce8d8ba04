// A fake of the slice of MLX's Metal backend API (mlx/backend/metal/device.h, with the
// metal-cpp types it hands out) that csrc/metal/eval_metal.cpp uses, so that the
// unchanged host code compiles on Linux against MLX's CPU build and its dispatches run
// the kernels on the CPU executor (tools/metal_emu/executor.h). Same names and
// signatures as MLX 0.32's; what each call does is in fake_device.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/device.h"
#include "mlx/stream.h"

namespace NS {
using UInteger = unsigned long;
} // namespace NS

namespace MTL {

struct Size {
  Size(NS::UInteger w, NS::UInteger h, NS::UInteger d) : width(w), height(h), depth(d) {}
  NS::UInteger width, height, depth;
};

/// A library: the source it was compiled from, or the metallib path.
class Library {
 public:
  std::string name;
  std::string source; // the run-time compile's text (empty for a metallib)
  std::string path;
};

class ComputePipelineState {
 public:
  std::string name;
  NS::UInteger maxTotalThreadsPerThreadgroup() const;
  NS::UInteger threadExecutionWidth() const {
    return 32;
  }
  NS::UInteger staticThreadgroupMemoryLength() const {
    return 0;
  }
};

} // namespace MTL

namespace mlx::core::metal {

class Device;

class CommandEncoder {
 public:
  void set_input_array(const array& a, int idx, int64_t offset = 0);
  void set_output_array(array& a, int idx, int64_t offset = 0);
  void add_temporary(array arr);
  void add_temporaries(std::vector<array> arrays);
  void dispatch_threadgroups(MTL::Size grid_dims, MTL::Size group_dims);
  void dispatch_threads(MTL::Size grid_dims, MTL::Size group_dims);
  void set_compute_pipeline_state(MTL::ComputePipelineState* kernel);
  void barrier();

  template <typename T>
  void set_bytes(const T* v, int n, int idx) {
    set_raw_bytes(v, size_t(n) * sizeof(T), idx);
  }
  template <typename T>
  void set_bytes(const T& v, int idx) {
    set_raw_bytes(&v, sizeof(T), idx);
  }
  void set_threadgroup_memory_length(size_t length, int idx);

  // ---- not MLX's: the fake's own ----
  void clear_temporaries() {
    temporaries_.clear();
  }
  void set_raw_bytes(const void* v, size_t bytes, int idx);
  struct Bound {
    enum Kind { none, input, output, bytes } kind = none;
    array arr{0.0f}; // input / output
    int64_t offset = 0; // bytes past the array's own offset
    std::vector<unsigned char> data; // bytes
  };

 private:
  void dispatch(MTL::Size grid, MTL::Size group, bool grid_is_threads);
  MTL::ComputePipelineState* kernel_ = nullptr;
  std::map<int, Bound> buffers_;
  std::map<int, size_t> tg_lengths_;
  std::vector<array> temporaries_;
};

class Device {
 public:
  MTL::Library* get_library(const std::string& name, const std::string& path = "");
  MTL::Library* get_library(
      const std::string& name,
      const std::function<std::string(void)>& builder);
  MTL::ComputePipelineState* get_kernel(const std::string& base_name, MTL::Library* mtl_lib);

 private:
  std::map<std::string, std::unique_ptr<MTL::Library>> libraries_;
  std::map<std::string, std::unique_ptr<MTL::ComputePipelineState>> kernels_;
};

Device& device(mlx::core::Device);
CommandEncoder& get_command_encoder(Stream s);

} // namespace mlx::core::metal
