// Layout: host code, every build.
// Environment switches: the one place the C++ code reads TURBOQUANT_* variables
// (the list is in docs/ARCHITECTURE.md, "Environment variables"). Each is read from the
// environment at its first use and kept for the rest of the process, so that kernels
// and evals look it up without scanning the environment on every call; tests and
// benchmarks that change one while the process runs go through set_env_switch
// (`_ext._set_env_switch` in Python).
#pragma once

#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

namespace turboquant_mlx {

namespace env_detail {

struct Switches {
  std::mutex mutex;
  std::map<std::string, std::optional<std::string>, std::less<>> values;
};

inline Switches& switches() {
  static Switches s;
  return s;
}

} // namespace env_detail

/// The value of switch `name` (nullopt: unset or empty): the environment's at the
/// switch's first use, unless set_env_switch has replaced it.
inline std::optional<std::string> env_switch(const char* name) {
  auto& s = env_detail::switches();
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.values.find(std::string_view(name));
  if (it == s.values.end()) {
    const char* v = std::getenv(name);
    it = s.values
             .emplace(
                 name, v != nullptr && *v != '\0' ? std::optional<std::string>(v) : std::nullopt)
             .first;
  }
  return it->second;
}

/// env_switch as an integer (atoi), or `fallback` where it is unset.
inline int env_int(const char* name, int fallback) {
  const auto v = env_switch(name);
  return v ? std::atoi(v->c_str()) : fallback;
}

/// Replaces the value of switch `name` (nullopt: unset) for the rest of the process.
/// Switches that a caller caches itself (the CUDA device pool, the CPU thread count,
/// the copy report) keep the value they read first.
inline void set_env_switch(const std::string& name, std::optional<std::string> value) {
  auto& s = env_detail::switches();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (value && value->empty()) {
    value.reset();
  }
  s.values[name] = std::move(value);
}

} // namespace turboquant_mlx
