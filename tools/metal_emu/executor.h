// executor.h: runs compute kernels written in Metal Shading Language (compiled as C++
// through msl_exec.h) on the CPU, one threadgroup at a time, each thread a cooperative
// fiber.
//
// Scheduling (what makes races and wrong collectives visible): a fiber runs until its
// next collective (simd_* / simdgroup_barrier / simdgroup_matrix operation) or
// threadgroup_barrier. The lanes of one simdgroup take turns until each of them waits
// at a threadgroup barrier or has returned; only then does the next simdgroup run. So
// a simdgroup reads threadgroup memory that other simdgroups wrote only through a
// barrier, and a lane reads what other lanes wrote only through a collective. Even
// threadgroups run their simdgroups and lanes in increasing order, odd ones in
// decreasing order: a missing barrier fails whichever way the data flows.
// Threadgroup memory starts filled with 0xff bytes (NaN as float) in every threadgroup.
//
// Errors (thrown as tq_exec::KernelError naming the kernel): lanes of a simdgroup at
// different kinds of collectives, a barrier that not every thread reaches, a
// collective after some lanes returned, a write into the guard bytes around a staged
// buffer or the threadgroup memory, more threads than the pipeline allows, more
// threadgroup memory than Apple GPUs have (32 KiB), a length not a multiple of 16.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace tq_exec {

struct KernelError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Dim3 {
  uint64_t x = 1, y = 1, z = 1;
  uint64_t count() const {
    return x * y * z;
  }
};

/// What a kernel parameter is bound to, from its attribute in the kernel's signature.
enum class Param {
  buffer, // [[buffer(i)]]: a pointer or a constant reference
  tg_memory, // [[threadgroup(i)]]
  thread_position_in_grid,
  thread_position_in_threadgroup,
  thread_index_in_threadgroup,
  threadgroup_position_in_grid,
  threads_per_threadgroup,
  threadgroups_per_grid,
  threads_per_grid,
  thread_index_in_simdgroup,
  simdgroup_index_in_threadgroup,
  threads_per_simdgroup,
  simdgroups_per_threadgroup,
};

struct ParamSpec {
  Param kind;
  int index; // buffer / threadgroup index, else -1
};

/// One bound argument of a dispatch: memory the kernel may touch and its size.
struct Binding {
  void* data = nullptr;
  size_t bytes = 0;
};

/// The coordinates of one thread, as the position builtins give them.
struct ThreadCoords {
  Dim3 tg; // threadgroup_position_in_grid
  Dim3 local; // thread_position_in_threadgroup
  uint32_t index; // thread_index_in_threadgroup
  uint32_t lane, simd;
};

/// A dispatch as the kernel sees it: bindings by index, geometry, and this thread.
struct Launch {
  const std::string* kernel;
  const std::vector<Binding>* buffers; // by [[buffer(i)]]
  const std::vector<Binding>* tg_buffers; // by [[threadgroup(i)]]
  Dim3 grid_tgs, tg_size, grid_threads;
  ThreadCoords self;
};

/// A kernel's invoker: reads its arguments from `launch` by the kernel's ParamSpecs.
using Invoker = std::function<void(const Launch&)>;

/// A kernel of the library: the instantiation it is (func<args>) and its invoker.
struct KernelInfo {
  std::string func, args;
  Invoker invoke;
};

/// Registers kernel `name` (its [[host_name]]) as the instantiation func<args>.
void register_kernel(const std::string& name, const char* func, const char* args, Invoker invoke);
/// A registered kernel, or nullptr.
const KernelInfo* find_kernel(const std::string& name);

/// Runs `kernel` over `grid` threadgroups of `tg` threads (dispatch_threadgroups), or
/// over `threads` threads in threadgroups of `tg` (dispatch_threads: edge threadgroups
/// partial), with the given bindings; `tg_lengths[i]` bytes of threadgroup memory at
/// [[threadgroup(i)]]. Blocks until every threadgroup finished.
void run(
    const std::string& kernel,
    const std::vector<Binding>& buffers,
    const std::vector<size_t>& tg_lengths,
    Dim3 grid,
    Dim3 tg,
    bool grid_is_threads);

/// Most threads in a threadgroup (a pipeline's maxTotalThreadsPerThreadgroup) and
/// threadgroup memory per threadgroup on Apple GPUs.
constexpr uint32_t kMaxThreadsPerThreadgroup = 1024;
constexpr size_t kMaxThreadgroupMemory = 32768;

// ---- argument conversion (used by the generated invokers) ------------------------

template <class T>
struct arg_of;

template <class T>
struct arg_of<T*> {
  static T* get(const Launch& l, ParamSpec s) {
    const auto& table = s.kind == Param::tg_memory ? *l.tg_buffers : *l.buffers;
    if (s.index < 0 || size_t(s.index) >= table.size() || table[s.index].data == nullptr) {
      throw KernelError(
          *l.kernel + ": nothing bound at " +
          (s.kind == Param::tg_memory ? "threadgroup(" : "buffer(") + std::to_string(s.index) +
          ")");
    }
    return static_cast<T*>(table[s.index].data);
  }
};

template <class T>
struct arg_of<T&> {
  static T& get(const Launch& l, ParamSpec s) {
    T* p = arg_of<T*>::get(l, s);
    const size_t have = (*l.buffers)[s.index].bytes;
    if (have < sizeof(T)) {
      throw KernelError(
          *l.kernel + ": buffer(" + std::to_string(s.index) + ") holds " + std::to_string(have) +
          " bytes, the kernel reads a " + std::to_string(sizeof(T)) + "-byte struct");
    }
    return *p;
  }
};

uint64_t builtin_scalar(const Launch& l, Param kind);
Dim3 builtin_vector(const Launch& l, Param kind);

template <class T>
struct arg_of {
  static T get(const Launch& l, ParamSpec s) {
    if constexpr (std::is_integral_v<T>) {
      return T(builtin_scalar(l, s.kind));
    } else {
      const Dim3 v = builtin_vector(l, s.kind);
      T r;
      r[0] = decltype(+r[0])(v.x);
      if constexpr (sizeof(r) / sizeof(r[0]) > 1) {
        r[1] = decltype(+r[0])(v.y);
      }
      if constexpr (sizeof(r) / sizeof(r[0]) > 2) {
        r[2] = decltype(+r[0])(v.z);
      }
      return r;
    }
  }
};

template <class... A, size_t... I>
void call_with(
    void (*f)(A...),
    const Launch& l,
    const ParamSpec* specs,
    std::index_sequence<I...>) {
  f(arg_of<A>::get(l, specs[I])...);
}

/// The invoker of kernel function `f` whose parameters are bound as `specs` says.
template <class... A>
Invoker make_invoker(void (*f)(A...), const std::vector<ParamSpec>& specs, const char* func) {
  if (specs.size() != sizeof...(A)) {
    throw KernelError(
        std::string(func) + ": the signature table lists " + std::to_string(specs.size()) +
        " parameters, the function has " + std::to_string(sizeof...(A)));
  }
  return [f, specs](const Launch& l) {
    call_with(f, l, specs.data(), std::index_sequence_for<A...>{});
  };
}

// ---- the executor's side of the collectives (executor.cpp) -----------------------

enum class Collective { shuffle_xor, shuffle, sum, max, min, ballot, simd_barrier, matrix };

/// Rendezvous of the calling lane's simdgroup: deposits `bytes` bytes of `value`, waits
/// until every lane of the simdgroup has reached the same kind of collective, and returns the
/// deposits of all 32 lanes (lane i's at i * 16), valid until the lane's next collective.
const unsigned char* simd_exchange(Collective kind, const void* value, int bytes);
/// threadgroup_barrier: waits until every thread of the threadgroup reached a barrier.
void threadgroup_rendezvous();
/// The calling lane's index in its simdgroup and the simdgroup's lane count.
unsigned lane_id();

template <class T>
T lane_value(const unsigned char* all, unsigned lane) {
  T v;
  std::memcpy(&v, all + lane * 16, sizeof(T));
  return v;
}

template <class T>
T exchange_reduce(Collective kind, T x) {
  static_assert(sizeof(T) <= 16, "collective value of at most 16 bytes");
  const unsigned char* all = simd_exchange(kind, &x, sizeof(T));
  T acc = lane_value<T>(all, 0);
  for (unsigned l = 1; l < 32; ++l) {
    const T v = lane_value<T>(all, l);
    if (kind == Collective::sum) {
      acc = acc + v;
    } else if (kind == Collective::max) {
      acc = acc > v ? acc : v;
    } else {
      acc = acc < v ? acc : v;
    }
  }
  return acc;
}

} // namespace tq_exec
