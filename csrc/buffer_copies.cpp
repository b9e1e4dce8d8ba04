// Layout: host code, every build.
#include "buffer_copies.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "env.h"

namespace turboquant_mlx {

namespace {
std::atomic<int64_t> g_copies{0};

bool debug_copies() {
  static const bool on = env_switch("TURBOQUANT_DEBUG_COPIES").value_or("0") != "0";
  return on;
}
} // namespace

int64_t buffer_copies() {
  return g_copies.load(std::memory_order_relaxed);
}

void count_buffer_copy(const char* op, const mx::array& in) {
  g_copies.fetch_add(1, std::memory_order_relaxed);
  if (debug_copies()) {
    std::fprintf(
        stderr,
        "[turboquant_mlx] %s copies a %zu-byte buffer (row_contiguous=%d, donatable=%d, "
        "data refs=%ld, owned by MLX's allocator=%d)\n",
        op,
        in.nbytes(),
        int(in.flags().row_contiguous),
        int(in.is_donatable()),
        long(in.data_shared_ptr().use_count()),
        int(in.data_shared_ptr()->is_owned()));
  }
}

} // namespace turboquant_mlx
