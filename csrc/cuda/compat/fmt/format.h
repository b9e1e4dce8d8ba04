// Layout: CUDA only (host code).
// Stand-in for {fmt}'s <fmt/format.h>. MLX's CUDA headers (lru_cache.h, reached from
// mlx/backend/cuda/device.h) name fmt::format inside templates this module never
// instantiates, but the MLX wheel does not ship {fmt}; a declaration is all the
// compiler needs. Nothing here is ever called.
#pragma once

#include <string>

namespace fmt {
template <typename... Args>
std::string format(const char* spec, Args&&... args);
} // namespace fmt
