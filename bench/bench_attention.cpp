// C++ benchmark: decode attention on the compressed cache vs
// mx::fast::scaled_dot_product_attention on fp16 (and fp32) K/V, and the cost of
// appending one token at growing cache lengths. Prints markdown tables.
//
//   cmake -B build/bench -DTURBOQUANT_BUILD_BENCH=ON && cmake --build build/bench -j2
//   build/bench/bench_attention [--gpu] [--contexts 1024,4096,...]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "mlx/mlx.h"

#include "ops.h"

namespace mx = mlx::core;
namespace tq = turboquant_mlx;

namespace {

// Median microseconds of fn() + eval over enough runs to fill ~1 s (after warm-up).
double time_us(const std::function<std::vector<mx::array>()>& fn) {
  for (int i = 0; i < 2; ++i) {
    mx::eval(fn());
  }
  std::vector<double> t;
  auto begin = std::chrono::steady_clock::now();
  while (t.size() < 5 ||
         (std::chrono::steady_clock::now() - begin < std::chrono::seconds(1) && t.size() < 200)) {
    auto t0 = std::chrono::steady_clock::now();
    mx::eval(fn());
    t.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// A plain Lloyd–Max-shaped codebook (the Python package computes the exact one; the
// kernel's speed does not depend on the values).
mx::array codebook(int head_dim, int bits) {
  int n = 1 << bits;
  std::vector<float> c(n);
  for (int i = 0; i < n; ++i) {
    c[i] = (2.0f * i + 1.0f - n) / n * 2.0f / std::sqrt(float(head_dim));
  }
  return mx::array(c.data(), {n}, mx::float32);
}

struct Cache {
  mx::array codes, scales, centroids;
};

Cache make_cache(int kv_heads, int context, int head_dim, int bits) {
  Cache c{
      mx::zeros({1, kv_heads, context, tq::words_per_token(head_dim, bits)}, mx::uint32),
      mx::zeros({1, kv_heads, context}, mx::float16),
      codebook(head_dim, bits)};
  for (int start = 0; start < context; start += 8192) {
    int n = std::min(8192, context - start);
    auto x = mx::random::normal({1, kv_heads, n, head_dim});
    auto out = tq::quantize_append(c.codes, c.scales, x, c.centroids, start, bits);
    c.codes = out[0];
    c.scales = out[1];
    mx::eval(c.codes, c.scales);
  }
  return c;
}

std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) {
    v.push_back(std::stoi(item));
  }
  return v;
}

} // namespace

int main(int argc, char** argv) {
  std::vector<int> contexts = {1024, 4096, 16384, 32768, 65536};
  bool gpu = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--gpu")) {
      gpu = true;
    } else if (!std::strcmp(argv[i], "--contexts") && i + 1 < argc) {
      contexts = parse_list(argv[++i]);
    }
  }
  mx::set_default_device(gpu ? mx::Device::gpu : mx::Device::cpu);
  const int q_heads = 32, kv_heads = 8, head_dim = 128;
  const float scale = 1.0f / std::sqrt(float(head_dim));
  auto signs = mx::where(mx::random::bernoulli(0.5, {head_dim}), mx::array(1.0f), mx::array(-1.0f));
  auto rotate = [&](const mx::array& x) {
    return mx::hadamard_transform(mx::multiply(x, signs), 1.0f / std::sqrt(float(head_dim)));
  };
  auto unrotate = [&](const mx::array& y) {
    return mx::multiply(mx::hadamard_transform(y, 1.0f / std::sqrt(float(head_dim))), signs);
  };

  std::printf(
      "\n### Decode attention (C++), %s: B=1, %d query heads, %d KV heads, head dim %d\n\n",
      gpu ? "GPU" : "CPU",
      q_heads,
      kv_heads,
      head_dim);
  std::printf(
      "| context | fp16 SDPA µs | fp32 SDPA µs | TQ K4V4 µs | TQ K3V3 µs | K4V4 vs fp16 | "
      "K4V4 vs fp32 | K3V3 vs fp16 | K4V4 GB/s |\n|---|---|---|---|---|---|---|---|---|\n");
  for (int ctx : contexts) {
    auto q = mx::astype(mx::random::normal({1, q_heads, 1, head_dim}), mx::float16);
    auto k = mx::astype(mx::random::normal({1, kv_heads, ctx, head_dim}), mx::float16);
    auto v = mx::astype(mx::random::normal({1, kv_heads, ctx, head_dim}), mx::float16);
    mx::eval(q, k, v);
    double t16 = time_us(
        [&] { return std::vector{mx::fast::scaled_dot_product_attention(q, k, v, scale)}; });
    auto q32 = mx::astype(q, mx::float32);
    auto k32 = mx::astype(k, mx::float32);
    auto v32 = mx::astype(v, mx::float32);
    mx::eval(q32, k32, v32);
    double t32 = time_us(
        [&] { return std::vector{mx::fast::scaled_dot_product_attention(q32, k32, v32, scale)}; });
    double t_tq[2];
    double bytes44 = 0;
    for (int bits : {4, 3}) {
      auto kc = make_cache(kv_heads, ctx, head_dim, bits);
      auto vc = make_cache(kv_heads, ctx, head_dim, bits);
      t_tq[4 - bits] = time_us([&] {
        auto out = tq::compressed_attention(
            rotate(q),
            kc.codes,
            kc.scales,
            vc.codes,
            vc.scales,
            kc.centroids,
            vc.centroids,
            ctx,
            scale,
            bits,
            bits,
            true);
        return std::vector{mx::astype(unrotate(out[0]), mx::float16)};
      });
      if (bits == 4) {
        bytes44 = kc.codes.nbytes() + kc.scales.nbytes() + vc.codes.nbytes() + vc.scales.nbytes();
      }
    }
    std::printf(
        "| %dk | %.0f | %.0f | %.0f | %.0f | %.2fx | %.2fx | %.2fx | %.2f |\n",
        ctx / 1024,
        t16,
        t32,
        t_tq[0],
        t_tq[1],
        t16 / t_tq[0],
        t32 / t_tq[0],
        t16 / t_tq[1],
        bytes44 / t_tq[0] / 1e3);
    mx::clear_cache();
  }

  std::printf(
      "\n### Append one token (C++), %s: %d KV heads, head dim %d, 4-bit\n\n"
      "| cache length | µs per append | vs first |\n|---|---|---|\n",
      gpu ? "GPU" : "CPU",
      kv_heads,
      head_dim);
  double first = 0;
  for (int ctx : contexts) {
    auto cents = codebook(head_dim, 4);
    auto codes = mx::zeros({1, kv_heads, ctx + 64, tq::words_per_token(head_dim, 4)}, mx::uint32);
    auto scales = mx::zeros({1, kv_heads, ctx + 64}, mx::float16);
    auto x = mx::random::normal({1, kv_heads, 1, head_dim});
    mx::eval(codes, scales, x);
    int n = 0;
    double t = time_us([&] {
      // Move the buffers into the op so the nodes can reuse them in place.
      auto out =
          tq::quantize_append(std::move(codes), std::move(scales), x, cents, ctx + (n++ % 64), 4);
      codes = out[0];
      scales = out[1];
      return out;
    });
    first = first ? first : t;
    std::printf("| %dk | %.1f | %.2fx |\n", ctx / 1024, t, t / first);
  }
  return 0;
}
