// Layout: host code, every build.
// Counts the cache-buffer copies the primitives make. Appending to a cache is O(new
// tokens) only while quantize_append can reuse (donate) the cache's buffers; when it
// cannot, it copies the whole buffer, which at long context costs more than the
// attention itself. Tests and benchmarks read the count to catch that.
#pragma once

#include <cstdint>

#include "mlx/array.h"

namespace turboquant_mlx {

namespace mx = mlx::core;

/// Cache-buffer copies made so far by this process (all devices).
int64_t buffer_copies();

/// Records one copy of `in` by `op`. With TURBOQUANT_DEBUG_COPIES=1 also prints why
/// the buffer could not be reused.
void count_buffer_copy(const char* op, const mx::array& in);

} // namespace turboquant_mlx
