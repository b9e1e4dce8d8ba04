// executor.cpp: threadgroups of cooperative fibers (see executor.h for the schedule).
#include "executor.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <sstream>

namespace tq_exec {

namespace {

std::map<std::string, KernelInfo>& registry() {
  static std::map<std::string, KernelInfo> r;
  return r;
}

constexpr size_t kStack = 256 * 1024;
constexpr size_t kGuard = 64; // guard bytes after each threadgroup allocation
constexpr unsigned char kPoison = 0xff;

enum class State { runnable, at_simd, at_barrier, done };

struct Fiber {
  ucontext_t ctx;
  void* stack = nullptr;
  State state = State::done;
  ThreadCoords coords;
};

struct Simdgroup {
  int first = 0, count = 0; // fibers [first, first + count)
  int arrived = 0;
  uint64_t generation = 0;
  Collective kind{};
  alignas(16) unsigned char slots[2][32 * 16];
};

/// One threadgroup's fibers and the scheduler's state; reused across threadgroups.
struct Group {
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  std::vector<Simdgroup> simds;
  int current = -1; // the running fiber
  std::exception_ptr error;
  const Launch* launch = nullptr;
  const Invoker* invoke = nullptr;
  Launch per_thread; // (the running fiber's Launch; copied from *launch)
  std::vector<Launch> launches;
};

Group* g_group = nullptr; // the threadgroup being run (one at a time)

void* new_stack() {
  // A guard page below the stack: an overflow faults instead of corrupting memory.
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  void* p =
      mmap(nullptr, kStack + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    throw std::runtime_error("metal_emu: cannot map a fiber stack");
  }
  mprotect(p, page, PROT_NONE);
  return static_cast<char*>(p) + page;
}

std::string where(const Group& g) {
  const Fiber& f = g.fibers[g.current];
  std::ostringstream s;
  s << *g.launch->kernel << " (threadgroup " << f.coords.tg.x << "," << f.coords.tg.y << ","
    << f.coords.tg.z << ", thread " << f.coords.index << ")";
  return s.str();
}

void yield_to_scheduler() {
  Group& g = *g_group;
  swapcontext(&g.fibers[g.current].ctx, &g.scheduler);
}

void fiber_entry(unsigned hi, unsigned lo) {
  Group& g = *reinterpret_cast<Group*>((uintptr_t(hi) << 32) | uintptr_t(lo));
  try {
    (*g.invoke)(g.launches[g.current]);
  } catch (...) {
    if (!g.error) {
      g.error = std::current_exception();
    }
  }
  g.fibers[g.current].state = State::done;
  // Returning resumes uc_link: the scheduler.
}

[[noreturn]] void fail(const std::string& what) {
  throw KernelError(where(*g_group) + ": " + what);
}

const char* collective_name(Collective k) {
  switch (k) {
    case Collective::shuffle_xor: return "simd_shuffle_xor";
    case Collective::shuffle: return "simd_shuffle";
    case Collective::sum: return "simd_sum";
    case Collective::max: return "simd_max";
    case Collective::min: return "simd_min";
    case Collective::ballot: return "simd_ballot";
    case Collective::simd_barrier: return "simdgroup_barrier";
    case Collective::matrix: return "a simdgroup_matrix operation";
  }
  return "?";
}

/// Runs one threadgroup to completion.
void run_group(Group& g, bool reverse) {
  const int n = int(g.fibers.size());
  const int nsimd = int(g.simds.size());
  for (int i = 0; i < n; ++i) {
    Fiber& f = g.fibers[i];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &g.scheduler;
    const uintptr_t gp = reinterpret_cast<uintptr_t>(&g);
    makecontext(
        &f.ctx, reinterpret_cast<void (*)()>(fiber_entry), 2, unsigned(gp >> 32), unsigned(gp));
    f.state = State::runnable;
  }
  for (auto& s : g.simds) {
    s.arrived = 0;
    s.generation = 0;
  }
  g.error = nullptr;

  auto order = [&](int k, int count) { return reverse ? count - 1 - k : k; };
  int sk = 0; // position of the running simdgroup in the order
  while (true) {
    // The running simdgroup's lanes in turn while any is runnable.
    bool ran = false;
    const Simdgroup& sg = g.simds[order(sk, nsimd)];
    for (int k = 0; k < sg.count; ++k) {
      const int i = sg.first + order(k, sg.count);
      if (g.fibers[i].state == State::runnable) {
        g.current = i;
        swapcontext(&g.scheduler, &g.fibers[i].ctx);
        ran = true;
        if (g.error) {
          std::rethrow_exception(g.error);
        }
      }
    }
    if (ran) {
      continue;
    }
    // No lane of this simdgroup can run: lanes waiting at a collective that the others
    // never reach are an error; otherwise on to the next simdgroup.
    for (int k = 0; k < sg.count; ++k) {
      const int i = sg.first + k;
      if (g.fibers[i].state == State::at_simd) {
        g.current = i;
        fail(
            std::string("lanes of simdgroup ") + std::to_string(order(sk, nsimd)) + " wait at " +
            collective_name(sg.kind) +
            " that other lanes never reach (they returned or wait at a threadgroup barrier)");
      }
    }
    if (++sk < nsimd) {
      continue;
    }
    // Every simdgroup waits at the barrier or has finished.
    int done = 0, waiting = 0;
    for (auto& f : g.fibers) {
      done += f.state == State::done;
      waiting += f.state == State::at_barrier;
    }
    if (waiting == 0) {
      return; // all finished
    }
    if (done > 0) {
      for (int i = 0; i < n; ++i) {
        if (g.fibers[i].state == State::at_barrier) {
          g.current = i;
          break;
        }
      }
      fail(
          std::to_string(waiting) + " threads wait at threadgroup_barrier, " +
          std::to_string(done) + " returned without reaching it");
    }
    for (auto& f : g.fibers) {
      f.state = State::runnable;
    }
    sk = 0;
  }
}

} // namespace

const unsigned char* simd_exchange(Collective kind, const void* value, int bytes) {
  Group& g = *g_group;
  Fiber& f = g.fibers[g.current];
  Simdgroup& sg = g.simds[f.coords.simd];
  if (sg.count != 32) {
    fail(
        std::string(collective_name(kind)) + " in a simdgroup of " + std::to_string(sg.count) +
        " threads (the kernels assume full simdgroups of 32)");
  }
  const int parity = int(sg.generation & 1);
  unsigned char* slot = sg.slots[parity] + f.coords.lane * 16;
  std::memset(slot, 0, 16);
  std::memcpy(slot, value, size_t(bytes));
  // (Not compared: call sites. The compiler may turn one source-level call into several,
  // e.g. into both arms of a branch before it.)
  if (sg.arrived == 0) {
    sg.kind = kind;
  } else if (sg.kind != kind) {
    fail(
        std::string("divergent collectives in simdgroup ") + std::to_string(f.coords.simd) +
        ": this lane is at " + collective_name(kind) + ", others at " + collective_name(sg.kind));
  }
  // Lanes that returned cannot take part: the kernels keep collectives uniform.
  for (int i = sg.first; i < sg.first + sg.count; ++i) {
    if (g.fibers[i].state == State::done) {
      fail(
          std::string(collective_name(kind)) + " after lane " +
          std::to_string(g.fibers[i].coords.lane) + " of its simdgroup returned");
    }
  }
  if (++sg.arrived == sg.count) {
    sg.arrived = 0;
    ++sg.generation;
    for (int i = sg.first; i < sg.first + sg.count; ++i) {
      if (g.fibers[i].state == State::at_simd) {
        g.fibers[i].state = State::runnable;
      }
    }
    // The last lane to arrive runs on; the others resume in turn.
  } else {
    f.state = State::at_simd;
    yield_to_scheduler();
  }
  return sg.slots[parity];
}

void threadgroup_rendezvous() {
  Group& g = *g_group;
  Fiber& f = g.fibers[g.current];
  f.state = State::at_barrier;
  yield_to_scheduler();
}

unsigned lane_id() {
  return g_group->fibers[g_group->current].coords.lane;
}

uint64_t builtin_scalar(const Launch& l, Param kind) {
  const ThreadCoords& t = l.self;
  switch (kind) {
    case Param::thread_index_in_threadgroup: return t.index;
    case Param::thread_index_in_simdgroup: return t.lane;
    case Param::simdgroup_index_in_threadgroup: return t.simd;
    case Param::threads_per_simdgroup: return 32;
    case Param::simdgroups_per_threadgroup: return (l.tg_size.count() + 31) / 32;
    case Param::thread_position_in_grid: return t.tg.x * l.tg_size.x + t.local.x;
    case Param::thread_position_in_threadgroup: return t.local.x;
    case Param::threadgroup_position_in_grid: return t.tg.x;
    case Param::threads_per_threadgroup: return l.tg_size.x;
    case Param::threadgroups_per_grid: return l.grid_tgs.x;
    case Param::threads_per_grid: return l.grid_threads.x;
    default: break;
  }
  throw KernelError(*l.kernel + ": a parameter without a binding attribute");
}

Dim3 builtin_vector(const Launch& l, Param kind) {
  const ThreadCoords& t = l.self;
  switch (kind) {
    case Param::thread_position_in_grid:
      return {
          t.tg.x * l.tg_size.x + t.local.x,
          t.tg.y * l.tg_size.y + t.local.y,
          t.tg.z * l.tg_size.z + t.local.z};
    case Param::thread_position_in_threadgroup: return t.local;
    case Param::threadgroup_position_in_grid: return t.tg;
    case Param::threads_per_threadgroup: return l.tg_size;
    case Param::threadgroups_per_grid: return l.grid_tgs;
    case Param::threads_per_grid: return l.grid_threads;
    default: break;
  }
  throw KernelError(*l.kernel + ": a vector builtin this executor does not know");
}

void register_kernel(const std::string& name, const char* func, const char* args, Invoker invoke) {
  registry()[name] = KernelInfo{func, args, std::move(invoke)};
}

const KernelInfo* find_kernel(const std::string& name) {
  auto it = registry().find(name);
  return it == registry().end() ? nullptr : &it->second;
}

void run(
    const std::string& kernel,
    const std::vector<Binding>& buffers,
    const std::vector<size_t>& tg_lengths,
    Dim3 grid,
    Dim3 tg,
    bool grid_is_threads) {
  const KernelInfo* info = find_kernel(kernel);
  if (info == nullptr) {
    throw KernelError("no kernel named " + kernel + " in the library");
  }
  const Invoker& invoke = info->invoke;
  const uint64_t threads = tg.count();
  if (threads == 0 || threads > kMaxThreadsPerThreadgroup) {
    throw KernelError(
        kernel + ": " + std::to_string(threads) +
        " threads per threadgroup (the pipeline allows 1 to " +
        std::to_string(kMaxThreadsPerThreadgroup) + ")");
  }
  size_t tg_total = 0;
  for (size_t i = 0; i < tg_lengths.size(); ++i) {
    if (tg_lengths[i] % 16 != 0) {
      throw KernelError(
          kernel + ": threadgroup memory length " + std::to_string(tg_lengths[i]) + " at index " +
          std::to_string(i) + " is not a multiple of 16 bytes");
    }
    tg_total += tg_lengths[i];
  }
  if (tg_total > kMaxThreadgroupMemory) {
    throw KernelError(
        kernel + ": " + std::to_string(tg_total) +
        " bytes of threadgroup memory (Apple GPUs have " + std::to_string(kMaxThreadgroupMemory) +
        ")");
  }
  Dim3 grid_tgs = grid, grid_threads = grid;
  if (grid_is_threads) {
    grid_tgs = {(grid.x + tg.x - 1) / tg.x, (grid.y + tg.y - 1) / tg.y, (grid.z + tg.z - 1) / tg.z};
  } else {
    grid_threads = {grid.x * tg.x, grid.y * tg.y, grid.z * tg.z};
  }
  if (grid_tgs.count() == 0) {
    return;
  }

  static Group group;
  static std::vector<void*> stacks;
  Group& g = group;
  // Threadgroup memory with guard bytes after each allocation.
  std::vector<std::unique_ptr<unsigned char[]>> tg_mem;
  std::vector<Binding> tg_bind;
  for (size_t len : tg_lengths) {
    tg_mem.emplace_back(new unsigned char[len + kGuard]);
    tg_bind.push_back({tg_mem.back().get(), len});
  }

  Launch base;
  base.kernel = &kernel;
  base.buffers = &buffers;
  base.tg_buffers = &tg_bind;
  base.grid_tgs = grid_tgs;
  base.tg_size = tg;
  base.grid_threads = grid_threads;
  g.launch = &base;
  g.invoke = &invoke;
  g_group = &g;

  uint64_t linear = 0;
  for (uint64_t z = 0; z < grid_tgs.z; ++z) {
    for (uint64_t y = 0; y < grid_tgs.y; ++y) {
      for (uint64_t x = 0; x < grid_tgs.x; ++x, ++linear) {
        // This threadgroup's threads (fewer at the edges of a dispatch_threads grid).
        Dim3 size = tg;
        if (grid_is_threads) {
          size.x = std::min(tg.x, grid.x - x * tg.x);
          size.y = std::min(tg.y, grid.y - y * tg.y);
          size.z = std::min(tg.z, grid.z - z * tg.z);
        }
        const int n = int(size.count());
        while (stacks.size() < size_t(n)) {
          stacks.push_back(new_stack());
        }
        g.fibers.resize(n);
        g.launches.assign(n, base);
        int t = 0;
        for (uint64_t lz = 0; lz < size.z; ++lz) {
          for (uint64_t ly = 0; ly < size.y; ++ly) {
            for (uint64_t lx = 0; lx < size.x; ++lx, ++t) {
              Fiber& f = g.fibers[t];
              f.stack = stacks[t];
              f.coords = {{x, y, z}, {lx, ly, lz}, uint32_t(t), uint32_t(t % 32), uint32_t(t / 32)};
              g.launches[t].self = f.coords;
              g.launches[t].tg_size = size;
            }
          }
        }
        g.simds.resize((n + 31) / 32);
        for (int s = 0; s < int(g.simds.size()); ++s) {
          g.simds[s].first = s * 32;
          g.simds[s].count = std::min(32, n - s * 32);
        }
        for (size_t i = 0; i < tg_mem.size(); ++i) {
          std::memset(tg_mem[i].get(), kPoison, tg_lengths[i] + kGuard);
        }
        run_group(g, (linear & 1) != 0);
        for (size_t i = 0; i < tg_mem.size(); ++i) {
          const unsigned char* guard = tg_mem[i].get() + tg_lengths[i];
          for (size_t b = 0; b < kGuard; ++b) {
            if (guard[b] != kPoison) {
              throw KernelError(
                  kernel + ": threadgroup " + std::to_string(x) + "," + std::to_string(y) + "," +
                  std::to_string(z) + " wrote past the " + std::to_string(tg_lengths[i]) +
                  " bytes of threadgroup(" + std::to_string(i) + ")");
            }
          }
        }
      }
    }
  }
  g_group = nullptr;
}

} // namespace tq_exec
