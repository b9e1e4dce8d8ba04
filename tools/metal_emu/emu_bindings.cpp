// emu_bindings.cpp: the emulator build's additions to the _ext module (bindings.cpp's
// TURBOQUANT_EXTRA_BINDINGS hook).
//
//   metal_stream(): a stream whose device is the GPU, on which the module's ops build
//     the graphs they build for Metal (kernel_input and the other device-dependent
//     choices of ops.cpp); MLX's CPU build cannot evaluate it, evaluate() does;
//   evaluate(arrays): evaluates their graph: the turboquant primitives through their
//     eval_gpu (eval_metal.cpp, unchanged, dispatching into the fake device and the
//     executor), every other node through MLX's CPU eval on the CPU stream of the same
//     index;
//   dispatches(), libraries(), reset(): what ran.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <unordered_set>

#include "fake_device.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/transforms.h"

#include "mlx/backend/metal/device.h" // (the fake)

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace {

mx::Stream metal_stream() {
  const mx::Stream cpu = mx::default_stream(mx::Device::cpu);
  // Create the CPU stream's encoder first, so that MLX's CPU evals on this stream
  // (same index) enqueue on the CPU stream's thread.
  mx::cpu::get_command_encoder(cpu);
  return mx::Stream(cpu.index, mx::Device::gpu);
}

/// The package's primitives (primitives.h): their names start with these.
bool is_turboquant(const mx::Primitive& p) {
  const std::string name = p.name();
  for (const char* prefix :
       {"QuantizeAppend", "CompressedAttention", "Dequantize", "WriteTokens", "RingAppend"}) {
    if (name.rfind(prefix, 0) == 0) {
      return true;
    }
  }
  return false;
}

void evaluate(const std::vector<mx::array>& outputs) {
  // Post-order over the unevaluated part of the graph.
  std::vector<mx::array> order;
  std::unordered_set<uintptr_t> seen;
  std::vector<std::pair<mx::array, bool>> stack;
  for (auto& o : outputs) {
    stack.push_back({o, false});
  }
  while (!stack.empty()) {
    auto [a, expanded] = stack.back();
    stack.pop_back();
    if (expanded) {
      order.push_back(a);
      continue;
    }
    if (a.status() != mx::array::unscheduled || !a.has_primitive() || !seen.insert(a.id()).second) {
      continue;
    }
    for (auto& s : a.siblings()) {
      seen.insert(s.id());
    }
    stack.push_back({a, true});
    for (auto& in : a.inputs()) {
      stack.push_back({in, false});
    }
  }
  const mx::Stream cpu = mx::default_stream(mx::Device::cpu);
  for (auto& a : order) {
    if (a.status() != mx::array::unscheduled) {
      continue;
    }
    auto outs = a.outputs();
    auto& prim = a.primitive();
    if (prim.stream().device == mx::Device::gpu && is_turboquant(prim)) {
      prim.eval_gpu(a.inputs(), outs);
    } else {
      if (prim.stream().index != cpu.index) {
        throw std::runtime_error(
            std::string("[metal_emu] evaluate: a ") + prim.name() +
            " node on a stream other than metal_stream() or the default CPU stream");
      }
      prim.eval_cpu(a.inputs(), outs);
      mx::synchronize(cpu);
    }
    for (auto& o : outs) {
      o.set_status(mx::array::available);
    }
  }
  // The "command buffer" completed: the launches' temporaries can go.
  mx::metal::get_command_encoder(metal_stream()).clear_temporaries();
  for (auto& a : order) {
    a.detach();
  }
}

} // namespace

void metal_emu_bindings(nb::module_& m) {
  m.def("metal_stream", &metal_stream, "A GPU stream on which the ops build Metal graphs.");
  m.def(
      "evaluate", &evaluate, "outputs"_a, "Evaluates outputs' graph on the emulated Metal device.");
  m.def("dispatches", []() {
    nb::list out;
    for (auto& r : metal_emu::state().log) {
      nb::dict d;
      d["kernel"] = r.kernel;
      d["grid"] = r.grid;
      d["group"] = r.group;
      d["threadgroup_bytes"] = r.tg_lengths;
      d["bindings"] = r.bindings;
      out.append(d);
    }
    return out;
  });
  m.def("libraries", []() { return metal_emu::state().libraries_compiled; });
  m.def("reset", []() { metal_emu::state().log.clear(); });
}
