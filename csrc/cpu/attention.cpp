// Layout: host code, every build (CPU kernels).
// Attention over the compressed cache on the CPU.
//
// Work is split into (batch, KV head, key chunk) items. Each item decodes every key
// and value of its chunk once into a float row and uses it for all query rows of that
// KV head (its GQA query heads × query positions), so the packed cache is read once.
// Items produce partial softmax results (max, sum, weighted value sum) that are merged
// with log-sum-exp, like a two-pass split-K GPU kernel; the tail (uncompressed keys and
// values every query sees, in the queries' space) is one more partial. The merge
// rotates the compressed tokens' part back to model space and adds the means of a
// centered cache (see AttentionParams) before the tail's part joins it.
#include <cmath>
#include <limits>

#include "mlx/backend/cpu/encoder.h"

#include "cpu/codec.h"
#include "cpu/kernels.h"
#include "cpu/parallel.h"

namespace turboquant_mlx::cpu {

namespace {

constexpr int kChunk = 1024; // keys per work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The larger of a and b, NaN when either is: a NaN score (a NaN query, mask or cache
// entry) makes its row NaN, as in plain attention, instead of reading as a hidden key.
inline float nan_max(float a, float b) {
  return std::isnan(a) || std::isnan(b) ? kNaN : std::max(a, b);
}

struct MaskView {
  const bool* bools = nullptr;
  const float* adds = nullptr;
  int64_t strides[4] = {0, 0, 0, 0};

  bool active() const {
    return bools || adds;
  }
  // Adds the mask to a score; a false boolean hides the key.
  float apply(float score, int b, int qh, int l, int j) const {
    int64_t at = b * strides[0] + qh * strides[1] + l * strides[2] + j * strides[3];
    if (bools) {
      return bools[at] ? score : kNegInf;
    }
    return score + adds[at];
  }
};

struct Shapes {
  int batch, q_heads, kv_heads, q_len, head_dim, kv_len;
  int k_cap, v_cap, k_words, v_words;
  int group() const {
    return q_heads / kv_heads;
  }
  int rows() const {
    return group() * q_len; // query rows served by one KV head
  }
};

// Dot product with independent partial sums: a single running sum is a serial chain
// of dependent adds that the compiler may not reorder (and so cannot vectorize).
inline float dot(const float* a, const float* b, int n) {
  constexpr int kLanes = 16;
  float part[kLanes] = {};
  for (int i = 0; i < n; i += kLanes) { // n is a multiple of 32
    for (int k = 0; k < kLanes; ++k) {
      part[k] += a[i + k] * b[i + k];
    }
  }
  float sum = 0.0f;
  for (int k = 0; k < kLanes; ++k) {
    sum += part[k];
  }
  return sum;
}

struct Partial {
  std::vector<float> max, sum, acc; // per row; acc is rows × head_dim
};

template <int KB, int VB>
void attention_impl(
    const Shapes& sh,
    const AttentionParams& p,
    const TQRotation& rot,
    const float* q, // queries in code space (rotated)
    const float* q_model, // as given: the tail's space
    const uint32_t* k_codes,
    const mx::float16_t* k_scales,
    const uint32_t* v_codes,
    const mx::float16_t* v_scales,
    const float* k_centroids,
    const float* v_centroids,
    const MaskView& mask,
    const float* tail_k, // (B, Hkv, T, D) or nullptr
    const float* tail_v,
    int tail_len,
    const float* key_mean, // (B, Hkv, D) or nullptr
    const float* value_mean,
    float* out,
    float* lse) {
  Decoder<KB> k_decoder(k_centroids);
  Decoder<VB> v_decoder(v_centroids);
  const int D = sh.head_dim, R = sh.rows(), G = sh.group();
  const int n_chunks = (sh.kv_len + kChunk - 1) / kChunk;
  const int n_items = sh.batch * sh.kv_heads * n_chunks;
  std::vector<Partial> partials(n_items);

  parallel_for(n_items, [&](int item) {
    int chunk = item % n_chunks, bh = item / n_chunks;
    int b = bh / sh.kv_heads, kvh = bh % sh.kv_heads;
    int j0 = chunk * kChunk, j1 = std::min(sh.kv_len, j0 + kChunk), n = j1 - j0;
    // Rows of this KV head: r = g * L + l, query head kvh * G + g, position l.
    const float* q_rows = q + (static_cast<int64_t>(b) * sh.q_heads + kvh * G) * sh.q_len * D;

    std::vector<float> scores(static_cast<size_t>(R) * n);
    std::vector<float> row(D);
    const uint32_t* kc = k_codes + (static_cast<int64_t>(bh) * sh.k_cap + j0) * sh.k_words;
    const mx::float16_t* ks = k_scales + static_cast<int64_t>(bh) * sh.k_cap + j0;
    for (int j = 0; j < n; ++j) {
      k_decoder.decode(kc + static_cast<int64_t>(j) * sh.k_words, D, row.data());
      float gamma = static_cast<float>(ks[j]) * p.scale;
      for (int r = 0; r < R; ++r) {
        scores[static_cast<size_t>(r) * n + j] = dot(q_rows + r * D, row.data(), D) * gamma;
      }
    }

    Partial& part = partials[item];
    part.max.assign(R, kNegInf);
    part.sum.assign(R, 0.0f);
    part.acc.assign(static_cast<size_t>(R) * D, 0.0f);
    for (int r = 0; r < R; ++r) {
      int g = r / sh.q_len, l = r % sh.q_len, qh = kvh * G + g;
      float* sr = scores.data() + static_cast<size_t>(r) * n;
      // Keys past the causal limit of query l are hidden.
      int visible_end = p.causal ? std::min(j1, sh.kv_len - sh.q_len + l + 1) : j1;
      float m = kNegInf;
      for (int j = 0; j < n; ++j) {
        float v = j0 + j < visible_end ? sr[j] : kNegInf;
        if (mask.active() && v != kNegInf) {
          v = mask.apply(v, b, qh, l, j0 + j);
        }
        sr[j] = v;
        m = nan_max(m, v);
      }
      part.max[r] = m;
      if (m == kNegInf || std::isnan(m)) {
        std::fill(sr, sr + n, 0.0f); // nothing visible in this chunk, or a NaN row
        continue;
      }
      float sum = 0.0f;
      for (int j = 0; j < n; ++j) {
        sr[j] = std::exp(sr[j] - m);
        sum += sr[j];
      }
      part.sum[r] = sum;
    }

    const uint32_t* vc = v_codes + (static_cast<int64_t>(bh) * sh.v_cap + j0) * sh.v_words;
    const mx::float16_t* vs = v_scales + static_cast<int64_t>(bh) * sh.v_cap + j0;
    for (int j = 0; j < n; ++j) {
      bool any = false;
      for (int r = 0; r < R; ++r) {
        any |= scores[static_cast<size_t>(r) * n + j] != 0.0f;
      }
      if (!any) {
        continue; // hidden from every row: skip decoding this value
      }
      v_decoder.decode(vc + static_cast<int64_t>(j) * sh.v_words, D, row.data());
      float gamma = static_cast<float>(vs[j]);
      for (int r = 0; r < R; ++r) {
        float w = scores[static_cast<size_t>(r) * n + j] * gamma;
        float* acc = part.acc.data() + static_cast<size_t>(r) * D;
        for (int i = 0; i < D; ++i) {
          acc[i] += w * row[i];
        }
      }
    }
  });

  // Per row: what centering took off every compressed token's score, scale * (q . mu_k).
  std::vector<float> shifts(static_cast<size_t>(sh.batch) * sh.kv_heads * R, 0.0f);
  if (key_mean) {
    for (int bh = 0; bh < sh.batch * sh.kv_heads; ++bh) {
      int b = bh / sh.kv_heads, kvh = bh % sh.kv_heads;
      const float* q_rows =
          q_model + (static_cast<int64_t>(b) * sh.q_heads + kvh * G) * sh.q_len * D;
      for (int r = 0; r < R; ++r) {
        shifts[static_cast<size_t>(bh) * R + r] =
            dot(q_rows + r * D, key_mean + static_cast<int64_t>(bh) * D, D) * p.scale;
      }
    }
  }

  // The tail of each (batch, KV head): every row sees all of it. Scores in the
  // compressed tokens' frame (minus the shift).
  std::vector<Partial> tails(tail_len > 0 ? sh.batch * sh.kv_heads : 0);
  parallel_for(static_cast<int>(tails.size()), [&](int bh) {
    int b = bh / sh.kv_heads, kvh = bh % sh.kv_heads;
    const float* q_rows = q_model + (static_cast<int64_t>(b) * sh.q_heads + kvh * G) * sh.q_len * D;
    const float* tk = tail_k + static_cast<int64_t>(bh) * tail_len * D;
    const float* tv = tail_v + static_cast<int64_t>(bh) * tail_len * D;
    Partial& part = tails[bh];
    part.max.assign(R, kNegInf);
    part.sum.assign(R, 0.0f);
    part.acc.assign(static_cast<size_t>(R) * D, 0.0f);
    std::vector<float> scores(tail_len);
    for (int r = 0; r < R; ++r) {
      float m = kNegInf;
      for (int j = 0; j < tail_len; ++j) {
        scores[j] = dot(q_rows + r * D, tk + static_cast<int64_t>(j) * D, D) * p.scale -
            shifts[static_cast<size_t>(bh) * R + r];
        m = nan_max(m, scores[j]);
      }
      float sum = 0.0f;
      float* acc = part.acc.data() + static_cast<size_t>(r) * D;
      for (int j = 0; j < tail_len; ++j) {
        float w = std::exp(scores[j] - m);
        sum += w;
        const float* v = tv + static_cast<int64_t>(j) * D;
        for (int i = 0; i < D; ++i) {
          acc[i] += w * v[i];
        }
      }
      part.max[r] = m;
      part.sum[r] = sum;
    }
  });

  // Merge the chunks (and the tail) of each (batch, KV head) with log-sum-exp.
  for (int bh = 0; bh < sh.batch * sh.kv_heads; ++bh) {
    const Partial* tail = tails.empty() ? nullptr : &tails[bh];
    int b = bh / sh.kv_heads, kvh = bh % sh.kv_heads;
    for (int r = 0; r < R; ++r) {
      int g = r / sh.q_len, l = r % sh.q_len;
      int64_t row_index = (static_cast<int64_t>(b) * sh.q_heads + kvh * G + g) * sh.q_len + l;
      float* o = out + row_index * D;
      float m = kNegInf;
      for (int c = 0; c < n_chunks; ++c) {
        m = nan_max(m, partials[bh * n_chunks + c].max[r]);
      }
      if (tail) {
        m = nan_max(m, tail->max[r]);
      }
      if (std::isnan(m)) { // a NaN score: the row is NaN
        std::fill(o, o + D, kNaN);
        lse[row_index] = kNaN;
        continue;
      }
      std::fill(o, o + D, 0.0f);
      if (m == kNegInf) { // every key hidden
        lse[row_index] = kNegInf;
        continue;
      }
      // The compressed tokens' part (code space), then in model space.
      float sum_c = 0.0f;
      for (int c = 0; c < n_chunks; ++c) {
        const Partial& part = partials[bh * n_chunks + c];
        if (part.max[r] == kNegInf) {
          continue;
        }
        float w = std::exp(part.max[r] - m);
        sum_c += part.sum[r] * w;
        const float* acc = part.acc.data() + static_cast<size_t>(r) * D;
        for (int i = 0; i < D; ++i) {
          o[i] += acc[i] * w;
        }
      }
      if (p.rotate_output) {
        unrotate_signed_hadamard(o, D, rot.sign_bits, rot.scale);
      }
      if (value_mean) {
        const float* mv = value_mean + static_cast<int64_t>(bh) * D;
        for (int i = 0; i < D; ++i) {
          o[i] += sum_c * mv[i];
        }
      }
      float sum = sum_c;
      if (tail && tail->max[r] != kNegInf) {
        float w = std::exp(tail->max[r] - m);
        sum += tail->sum[r] * w;
        const float* acc = tail->acc.data() + static_cast<size_t>(r) * D;
        for (int i = 0; i < D; ++i) {
          o[i] += acc[i] * w;
        }
      }
      float inv = 1.0f / sum;
      for (int i = 0; i < D; ++i) {
        o[i] *= inv;
      }
      lse[row_index] = m + std::log(sum) + shifts[static_cast<size_t>(bh) * R + r];
    }
  }
}

} // namespace

void attention(
    const CompressedAttention& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  const auto& p = prim.params();
  auto& q = inputs[0];
  auto& out = outputs[0];
  auto& lse = outputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  lse.set_data(mx::allocator::malloc(lse.nbytes()));

  auto& encoder = mx::cpu::get_command_encoder(s);
  for (auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  encoder.set_output_array(lse);

  Shapes sh{
      q.shape(0),
      q.shape(1),
      inputs[1].shape(1),
      q.shape(2),
      q.shape(3),
      p.kv_len,
      inputs[1].shape(2),
      inputs[3].shape(2),
      inputs[1].shape(3),
      inputs[3].shape(3)};
  MaskView mask;
  if (p.has_mask) {
    auto& m = inputs[7];
    if (p.mask_is_bool) {
      mask.bools = m.data<bool>();
    } else {
      mask.adds = m.data<float>();
    }
    for (int i = 0; i < 4; ++i) {
      mask.strides[i] = m.strides()[i];
    }
  }
  const float* tail_k = nullptr;
  const float* tail_v = nullptr;
  int tail_len = 0;
  if (p.has_tail) {
    auto& tk = inputs[p.tail_input()];
    tail_k = tk.data<float>();
    tail_v = inputs[p.tail_input() + 1].data<float>();
    tail_len = tk.shape(2);
  }
  const float* key_mean = p.centered ? inputs[p.mean_input()].data<float>() : nullptr;
  const float* value_mean = p.centered ? inputs[p.mean_input() + 1].data<float>() : nullptr;
  const TQRotation rot = kernel_rotation(p.rotation, sh.head_dim);
  encoder.dispatch([sh,
                    p,
                    rot,
                    mask,
                    tail_k,
                    tail_v,
                    tail_len,
                    key_mean,
                    value_mean,
                    q_ptr = q.data<float>(),
                    kc = inputs[1].data<uint32_t>(),
                    ks = inputs[2].data<mx::float16_t>(),
                    vc = inputs[3].data<uint32_t>(),
                    vs = inputs[4].data<mx::float16_t>(),
                    kcent = inputs[5].data<float>(),
                    vcent = inputs[6].data<float>(),
                    out_raw = out.data<void>(),
                    out_dtype = out.dtype(),
                    lse_ptr = lse.data<float>()]() {
    const int64_t n_rows = static_cast<int64_t>(sh.batch) * sh.q_heads * sh.q_len;
    const int D = sh.head_dim;
    // The kernel writes float32; another out dtype is converted from scratch after it.
    std::vector<float> out_scratch;
    float* out_ptr = static_cast<float*>(out_raw);
    if (out_dtype != mx::float32) {
      out_scratch.resize(n_rows * D);
      out_ptr = out_scratch.data();
    }
    // Queries in model space: rotate them into scratch.
    std::vector<float> q_rotated;
    const float* q_in = q_ptr;
    if (rot.on) {
      q_rotated = rotated_rows(q_ptr, n_rows, D, rot.sign_bits, rot.scale);
      q_in = q_rotated.data();
    }
    dispatch_bits(p.key_bits, [&]<int KB>() {
      dispatch_bits(p.value_bits, [&]<int VB>() {
        attention_impl<KB, VB>(
            sh,
            p,
            rot,
            q_in,
            q_ptr,
            kc,
            ks,
            vc,
            vs,
            kcent,
            vcent,
            mask,
            tail_k,
            tail_v,
            tail_len,
            key_mean,
            value_mean,
            out_ptr,
            lse_ptr);
      });
    });
    auto convert = [&]<typename T>(T* o) {
      for (int64_t i = 0; i < n_rows * D; ++i) {
        o[i] = static_cast<T>(out_ptr[i]);
      }
    };
    if (out_dtype == mx::float16) {
      convert(static_cast<mx::float16_t*>(out_raw));
    } else if (out_dtype == mx::bfloat16) {
      convert(static_cast<mx::bfloat16_t*>(out_raw));
    }
  });
}

} // namespace turboquant_mlx::cpu
