// fake_device.cpp: MLX's Metal device and command encoder as eval_metal.cpp uses them,
// dispatching into the CPU executor.
//
//   Device::get_library(name, builder): calls the builder, as MLX's run-time compile
//     does, and checks that the text is the one the executor's kernels were compiled
//     from (tools/metal_emu/msl_to_cpp.py records its hash) followed by exactly one
//     TQ_INSTANTIATE line naming a kernel that the executor has, with the same
//     function and template arguments;
//   Device::get_kernel(name, lib): a pipeline for a kernel that library defines;
//   CommandEncoder: records bindings by index and runs each dispatch at once. Every
//     array's memory is staged for the dispatch with guard bytes around it (one stage
//     per allocation, so aliased bindings stay aliased): a write outside the allocation
//     is an error naming the buffer index. Bindings do not outlive their dispatch (a
//     stricter rule than Metal's, so that a buffer the host forgot to bind is an error
//     and not a stale one).
#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "executor.h"
#include "fake_device.h"
#include "mlx/backend/metal/device.h"

namespace mlx::core::metal {

namespace {

constexpr size_t kGuard = 256;
constexpr unsigned char kGuardByte = 0xa5;

std::string trim(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c != ' ' && c != '\n' && c != '\t') {
      out += c;
    }
  }
  return out;
}

[[noreturn]] void fail(const std::string& what) {
  throw std::runtime_error("[metal_emu] " + what);
}

} // namespace

} // namespace mlx::core::metal

namespace MTL {
NS::UInteger ComputePipelineState::maxTotalThreadsPerThreadgroup() const {
  return tq_exec::kMaxThreadsPerThreadgroup;
}
} // namespace MTL

namespace metal_emu {

EmulatorState& state() {
  static EmulatorState s;
  return s;
}

uint64_t fnv1a(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h = (h ^ c) * 1099511628211ull;
  }
  return h;
}

} // namespace metal_emu

namespace mlx::core::metal {

MTL::Library* Device::get_library(const std::string& name, const std::string& path) {
  // (The metallib build: every kernel of turboquant.metal is in it.)
  auto& lib = libraries_[name];
  if (!lib) {
    lib = std::make_unique<MTL::Library>();
    lib->name = name;
    lib->path = path;
  }
  return lib.get();
}

MTL::Library* Device::get_library(
    const std::string& name,
    const std::function<std::string(void)>& builder) {
  auto& lib = libraries_[name];
  if (lib) {
    return lib.get(); // MLX caches libraries by name: the builder runs once
  }
  const std::string text = builder();
  // The text = the embedded source + one instantiation line.
  const size_t line = text.rfind("TQ_INSTANTIATE(");
  if (line == std::string::npos) {
    fail("library " + name + ": its source has no TQ_INSTANTIATE line");
  }
  const std::string body = text.substr(0, line);
  if (metal_emu::fnv1a(body) != metal_emu::compiled_source_hash()) {
    fail(
        "library " + name +
        ": its source is not the text the executor's kernels were compiled from (rebuild "
        "tools/metal_emu)");
  }
  // TQ_INSTANTIATE("name", func, args)
  const std::string inst = text.substr(line + 15);
  const size_t q1 = inst.find('"'), q2 = inst.find('"', q1 + 1);
  const size_t c1 = inst.find(',', q2), c2 = inst.find(',', c1 + 1);
  const size_t close = inst.rfind(')');
  if (q1 != 0 || q2 == std::string::npos || c1 == std::string::npos || c2 == std::string::npos ||
      close == std::string::npos || trim(inst.substr(close + 1)) != "") {
    fail("library " + name + ": malformed instantiation line: " + inst);
  }
  const std::string kname = inst.substr(1, q2 - 1);
  const std::string func = trim(inst.substr(c1 + 1, c2 - c1 - 1));
  const std::string args = trim(inst.substr(c2 + 1, close - c2 - 1));
  const tq_exec::KernelInfo* k = tq_exec::find_kernel(kname);
  if (k == nullptr) {
    fail("library " + name + " instantiates " + kname + ", which turboquant.metal does not define");
  }
  if (trim(k->func) != func || trim(k->args) != args) {
    fail(
        "library " + name + " instantiates " + kname + " as " + func + "<" + args +
        ">; turboquant.metal's kernel of that name is " + k->func + "<" + k->args + ">");
  }
  lib = std::make_unique<MTL::Library>();
  lib->name = name;
  lib->source = kname;
  metal_emu::state().libraries_compiled.push_back(name);
  return lib.get();
}

MTL::ComputePipelineState* Device::get_kernel(const std::string& base_name, MTL::Library* lib) {
  if (lib == nullptr) {
    fail("get_kernel(" + base_name + ") without a library");
  }
  if (!lib->source.empty() && lib->source != base_name) {
    fail("library " + lib->name + " has no function " + base_name);
  }
  if (tq_exec::find_kernel(base_name) == nullptr) {
    fail("no function " + base_name + " in library " + lib->name);
  }
  auto& k = kernels_[base_name];
  if (!k) {
    k = std::make_unique<MTL::ComputePipelineState>();
    k->name = base_name;
  }
  return k.get();
}

Device& device(mlx::core::Device) {
  static Device d;
  return d;
}

CommandEncoder& get_command_encoder(Stream s) {
  static std::map<int, CommandEncoder> encoders;
  return encoders[s.index];
}

void CommandEncoder::set_input_array(const array& a, int idx, int64_t offset) {
  Bound b;
  b.kind = Bound::input;
  b.arr = a;
  b.offset = offset;
  buffers_[idx] = std::move(b);
}

void CommandEncoder::set_output_array(array& a, int idx, int64_t offset) {
  Bound b;
  b.kind = Bound::output;
  b.arr = a;
  b.offset = offset;
  buffers_[idx] = std::move(b);
}

void CommandEncoder::set_raw_bytes(const void* v, size_t bytes, int idx) {
  Bound b;
  b.kind = Bound::bytes;
  b.data.assign(static_cast<const unsigned char*>(v), static_cast<const unsigned char*>(v) + bytes);
  buffers_[idx] = std::move(b);
}

void CommandEncoder::set_threadgroup_memory_length(size_t length, int idx) {
  tg_lengths_[idx] = length;
}

void CommandEncoder::add_temporary(array arr) {
  temporaries_.push_back(std::move(arr));
}

void CommandEncoder::add_temporaries(std::vector<array> arrays) {
  for (auto& a : arrays) {
    temporaries_.push_back(std::move(a));
  }
}

void CommandEncoder::set_compute_pipeline_state(MTL::ComputePipelineState* kernel) {
  kernel_ = kernel;
}

void CommandEncoder::barrier() {
  metal_emu::state().log.push_back({"(barrier)", {}, {}, {}, {}});
}

void CommandEncoder::dispatch_threadgroups(MTL::Size grid, MTL::Size group) {
  dispatch(grid, group, false);
}

void CommandEncoder::dispatch_threads(MTL::Size grid, MTL::Size group) {
  dispatch(grid, group, true);
}

void CommandEncoder::dispatch(MTL::Size grid, MTL::Size group, bool grid_is_threads) {
  if (kernel_ == nullptr) {
    fail("dispatch without a compute pipeline state");
  }
  const std::string kernel = kernel_->name;
  // One stage per allocation: [lowest bound start, allocation end) with guards.
  struct Stage {
    unsigned char* base; // the allocation's first byte
    size_t size; // the allocation's bytes
    size_t lo = ~size_t(0); // first staged byte (from base)
    std::vector<unsigned char> copy; // guard | staged bytes | guard
    std::vector<int> indices;
  };
  std::map<const void*, Stage> stages;
  int max_index = -1;
  for (auto& [idx, b] : buffers_) {
    max_index = std::max(max_index, idx);
    if (b.kind != Bound::input && b.kind != Bound::output) {
      continue;
    }
    const array& a = b.arr;
    auto* raw = static_cast<unsigned char*>(const_cast<void*>(a.buffer().raw_ptr()));
    if (raw == nullptr) {
      fail(kernel + ": buffer(" + std::to_string(idx) + ") is an array without memory");
    }
    Stage& s = stages.try_emplace(a.buffer().ptr(), Stage{raw, a.buffer_size()}).first->second;
    const size_t start = size_t(a.offset() + b.offset);
    if (start > s.size) {
      fail(kernel + ": buffer(" + std::to_string(idx) + ") starts past its allocation");
    }
    s.lo = std::min(s.lo, start);
    s.indices.push_back(idx);
  }
  for (auto& [_, s] : stages) {
    s.copy.assign(kGuard + (s.size - s.lo) + kGuard, kGuardByte);
    std::memcpy(s.copy.data() + kGuard, s.base + s.lo, s.size - s.lo);
  }
  std::vector<tq_exec::Binding> bindings(size_t(max_index + 1));
  std::vector<std::vector<unsigned char>> bytes_stages;
  for (auto& [idx, b] : buffers_) {
    if (b.kind == Bound::bytes) {
      bytes_stages.emplace_back(b.data.size() + kGuard, kGuardByte);
      std::memcpy(bytes_stages.back().data(), b.data.data(), b.data.size());
      bindings[idx] = {bytes_stages.back().data(), b.data.size()};
    } else if (b.kind != Bound::none) {
      Stage& s = stages.at(b.arr.buffer().ptr());
      const size_t start = size_t(b.arr.offset() + b.offset);
      bindings[idx] = {s.copy.data() + kGuard + (start - s.lo), s.size - start};
    }
  }
  std::vector<size_t> tg;
  for (auto& [idx, len] : tg_lengths_) {
    if (tg.size() <= size_t(idx)) {
      tg.resize(idx + 1, 0);
    }
    tg[idx] = len;
  }
  auto& log = metal_emu::state().log;
  log.push_back(
      {kernel,
       {grid.width, grid.height, grid.depth},
       {group.width, group.height, group.depth},
       tg,
       {}});
  for (auto& [idx, b] : buffers_) {
    log.back().bindings.push_back(
        idx * 4 +
        (b.kind == Bound::input        ? 0
             : b.kind == Bound::output ? 1
                                       : 2));
  }
  // Clear the bindings before running: an error leaves none behind.
  auto buffers = std::move(buffers_);
  buffers_.clear();
  tg_lengths_.clear();
  tq_exec::run(
      kernel,
      bindings,
      tg,
      {grid.width, grid.height, grid.depth},
      {group.width, group.height, group.depth},
      grid_is_threads);
  // Guards intact, then the staged bytes back (inputs too: the kernel may not have
  // written them, and then they are unchanged).
  for (auto& [_, s] : stages) {
    const size_t n = s.size - s.lo;
    for (size_t i = 0; i < kGuard; ++i) {
      if (s.copy[i] != kGuardByte || s.copy[kGuard + n + i] != kGuardByte) {
        std::ostringstream idx;
        for (int k : s.indices) {
          idx << (idx.tellp() > 0 ? ", " : "") << k;
        }
        fail(kernel + ": wrote outside the memory of buffer(" + idx.str() + ")");
      }
    }
    std::memcpy(s.base + s.lo, s.copy.data() + kGuard, n);
  }
  for (size_t i = 0; i < bytes_stages.size(); ++i) {
    const auto& st = bytes_stages[i];
    for (size_t k = st.size() - kGuard; k < st.size(); ++k) {
      if (st[k] != kGuardByte) {
        fail(kernel + ": wrote past a set_bytes argument");
      }
    }
  }
}

} // namespace mlx::core::metal
