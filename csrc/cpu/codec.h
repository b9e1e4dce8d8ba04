// Layout: host code, every build (CPU kernels).
// Scalar codec pieces shared by the CPU kernels. The packing is the LSB-first bit
// stream of docs/ARCHITECTURE.md; on a little-endian CPU its bytes are the bytes of
// the uint32 words in memory order, which is how the decoders read it.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

static_assert(std::endian::native == std::endian::little, "the CPU kernels assume little-endian");

namespace turboquant_mlx::cpu {

/// Float32 midpoints between adjacent centroids, computed as every backend does.
inline std::vector<float> boundaries(const float* centroids, int bits) {
  std::vector<float> t((1 << bits) - 1);
  for (size_t k = 0; k < t.size(); ++k) {
    t[k] = (centroids[k] + centroids[k + 1]) * 0.5f;
  }
  return t;
}

/// v <- H v (unnormalized Walsh-Hadamard transform, Sylvester order, D a power of two):
/// butterflies in order of increasing stride, each an exact a + b, a - b. The GPU
/// kernels (tq_rotate_* in metal/tq_kernels.h) pair the same operands, so the
/// quantizer's input is the same float32 on every backend.
inline void walsh_hadamard(float* v, int head_dim) {
  for (int h = 1; h < head_dim; h <<= 1) {
    for (int i = 0; i < head_dim; i += 2 * h) {
      for (int k = i; k < i + h; ++k) {
        float a = v[k], b = v[k + h];
        v[k] = a + b;
        v[k + h] = a - b;
      }
    }
  }
}

inline bool negated(const uint32_t* sign_bits, int d) {
  return (sign_bits[d >> 5] >> (d & 31)) & 1u;
}

/// v <- R v for R = H diag(s) * scale (bit d of sign_bits set: s_d = -1): the signs,
/// the transform, then the scale.
inline void rotate_signed_hadamard(float* v, int head_dim, const uint32_t* sign_bits, float scale) {
  for (int d = 0; d < head_dim; ++d) {
    v[d] = negated(sign_bits, d) ? -v[d] : v[d];
  }
  walsh_hadamard(v, head_dim);
  for (int d = 0; d < head_dim; ++d) {
    v[d] *= scale;
  }
}

/// A copy of `rows` row-major vectors of head_dim coordinates, each rotated by R (see
/// rotate_signed_hadamard).
inline std::vector<float> rotated_rows(
    const float* x,
    int64_t rows,
    int head_dim,
    const uint32_t* sign_bits,
    float scale) {
  std::vector<float> y(x, x + rows * head_dim);
  for (int64_t r = 0; r < rows; ++r) {
    rotate_signed_hadamard(y.data() + r * head_dim, head_dim, sign_bits, scale);
  }
  return y;
}

/// v <- R^T v = diag(s) H v * scale (H is symmetric).
inline void unrotate_signed_hadamard(
    float* v,
    int head_dim,
    const uint32_t* sign_bits,
    float scale) {
  walsh_hadamard(v, head_dim);
  for (int d = 0; d < head_dim; ++d) {
    float y = v[d] * scale;
    v[d] = negated(sign_bits, d) ? -y : y;
  }
}

/// Result of quantizing one rotated vector.
struct QuantizedVector {
  float norm; // ‖y‖, non-finite when y has NaN/Inf
  float scale; // norm / ‖c‖
};

/// Quantizes y[0..d) to codes (one per coordinate) following the codec contract.
inline QuantizedVector quantize_vector(
    const float* y,
    int head_dim,
    const float* centroids,
    const std::vector<float>& bounds,
    uint8_t* codes) {
  float norm2 = 0.0f;
  for (int i = 0; i < head_dim; ++i) {
    norm2 += y[i] * y[i];
  }
  float norm = std::sqrt(norm2);
  float inv = norm > 0.0f ? 1.0f / norm : 0.0f;
  float cn2 = 0.0f;
  for (int i = 0; i < head_dim; ++i) {
    float u = y[i] * inv;
    int code = 0;
    for (float t : bounds) {
      code += u > t; // ties go to the lower code
    }
    codes[i] = static_cast<uint8_t>(code);
    cn2 += centroids[code] * centroids[code];
  }
  float cn = std::sqrt(cn2);
  return {norm, cn > 0.0f ? norm / cn : 0.0f};
}

/// Packs head_dim codes of `bits` bits into head_dim*bits/32 words (zeroed first).
inline void pack_codes(const uint8_t* codes, int head_dim, int bits, uint32_t* words) {
  for (int w = 0; w < head_dim * bits / 32; ++w) {
    words[w] = 0;
  }
  for (int i = 0; i < head_dim; ++i) {
    int bit = i * bits, w = bit >> 5, off = bit & 31;
    words[w] |= uint32_t(codes[i]) << off;
    if (off + bits > 32) {
      words[w + 1] |= uint32_t(codes[i]) >> (32 - off);
    }
  }
}

/// Expands packed codes to centroid values with a small table indexed by a few
/// packed bits at once: 4-bit reads a byte (2 codes), 2-bit a byte (4 codes),
/// 3-bit 6 bits (2 codes) out of each 3-byte group of 8 codes.
template <int BITS>
struct Decoder {
  static constexpr int kIndexBits = BITS == 3 ? 6 : 8;
  static constexpr int kPerEntry = kIndexBits / BITS;

  explicit Decoder(const float* centroids) : table((1 << kIndexBits) * kPerEntry) {
    for (int e = 0; e < (1 << kIndexBits); ++e) {
      for (int k = 0; k < kPerEntry; ++k) {
        table[e * kPerEntry + k] = centroids[(e >> (k * BITS)) & ((1 << BITS) - 1)];
      }
    }
  }

  /// Writes the (unscaled) centroid values of one token to out[0..head_dim).
  void decode(const uint32_t* words, int head_dim, float* out) const {
    auto bytes = reinterpret_cast<const uint8_t*>(words);
    const float* tab = table.data();
    if constexpr (BITS == 3) {
      for (int i = 0; i < head_dim; i += 8, bytes += 3) {
        uint32_t v = bytes[0] | (uint32_t(bytes[1]) << 8) | (uint32_t(bytes[2]) << 16);
        for (int k = 0; k < 4; ++k) {
          const float* e = tab + ((v >> (6 * k)) & 63) * 2;
          out[i + 2 * k] = e[0];
          out[i + 2 * k + 1] = e[1];
        }
      }
    } else {
      for (int i = 0; i < head_dim; i += kPerEntry) {
        const float* e = tab + bytes[i / kPerEntry] * kPerEntry;
        for (int k = 0; k < kPerEntry; ++k) {
          out[i + k] = e[k];
        }
      }
    }
  }

  std::vector<float> table;
};

/// Calls f.template operator()<BITS>() for a runtime bit width in {2, 3, 4}.
template <typename F>
void dispatch_bits(int bits, F&& f) {
  switch (bits) {
    case 2: return f.template operator()<2>();
    case 3: return f.template operator()<3>();
    default: return f.template operator()<4>();
  }
}

} // namespace turboquant_mlx::cpu
