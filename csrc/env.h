// Layout: host code, every build.
// Environment switches: the one place the C++ code reads TURBOQUANT_* variables (the
// list is in docs/ARCHITECTURE.md, "Environment variables"). Each caller reads its
// switch once, at its first use, and keeps the value for the rest of the process.
// Kernel choices that only tests and benchmarks force are not read here but set
// through kernel_overrides.h.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace turboquant_mlx {

/// The value of environment variable `name` (nullopt: unset or empty).
inline std::optional<std::string> env_switch(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::optional<std::string>(v) : std::nullopt;
}

} // namespace turboquant_mlx
