// Layout: host code, every build.
// Error messages built without iostreams. The CUDA build's module carries its own
// instantiations of the standard stream inserters (nvcc-compiled code), bound inside
// the module with hidden visibility; their locale facet ids are never registered with
// the process's libstdc++, so formatting a number through an ostream there reads the
// wrong facet and crashes. std::to_string and string concatenation do not touch
// locales.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>

namespace turboquant_mlx {

namespace detail {
inline void append_one(std::string& s, std::string_view v) {
  s.append(v);
}
inline void append_one(std::string& s, const char* v) {
  s.append(v);
}
inline void append_one(std::string& s, const std::string& v) {
  s.append(v);
}
inline void append_one(std::string& s, char v) {
  s.push_back(v);
}
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
void append_one(std::string& s, T v) {
  if constexpr (std::is_floating_point_v<T>) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.6g", static_cast<double>(v)); // as ostream
    s.append(buf);
  } else {
    s.append(std::to_string(v));
  }
}
} // namespace detail

/// The arguments (strings, characters, numbers) concatenated.
template <typename... Args>
std::string message(const Args&... args) {
  std::string s;
  (detail::append_one(s, args), ...);
  return s;
}

} // namespace turboquant_mlx
