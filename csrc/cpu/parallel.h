// Layout: host code, every build (CPU kernels).
// A minimal parallel-for for the CPU kernels, which run inside one MLX CPU-stream task.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <thread>
#include <vector>

#include "env.h"

namespace turboquant_mlx::cpu {

/// Worker threads used by the kernels: TURBOQUANT_NUM_THREADS, else all cores.
inline int num_threads() {
  static const int n = [] {
    if (const auto asked = env_switch("TURBOQUANT_NUM_THREADS")) {
      return std::max(1, std::atoi(asked->c_str()));
    }
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }();
  return n;
}

/// Runs f(i) for i in [0, n), items handed out dynamically. Work below `min_items`
/// stays on the calling thread, where spawning threads would cost more than it saves.
template <typename F>
void parallel_for(int n, F&& f, int min_items = 2) {
  int threads = std::min(n, num_threads());
  if (threads <= 1 || n < min_items) {
    for (int i = 0; i < n; ++i) {
      f(i);
    }
    return;
  }
  std::atomic<int> next{0};
  auto worker = [&] {
    for (int i; (i = next.fetch_add(1)) < n;) {
      f(i);
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    pool.emplace_back(worker);
  }
  worker();
  for (auto& t : pool) {
    t.join();
  }
}

} // namespace turboquant_mlx::cpu
