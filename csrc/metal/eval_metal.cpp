// Layout: Metal only (host code).
// GPU backend on MLX's Metal build (macOS): names the kernel instantiation of
// metal/turboquant.metal, takes its pipeline from MLX's per-library cache, binds the
// buffers and dispatches. The kernel bodies are the ones the CUDA build runs
// (metal/tq_kernels.h), their arguments and the split of the keys the ones it fills
// (csrc/gpu_params.h).
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <string>

#include "mlx/backend/metal/device.h"

#include "buffer_copies.h"
#include "env.h"
#include "gpu.h"
#include "gpu_params.h"
#include "tq_params.h"

namespace turboquant_mlx::gpu {

namespace {

/// Directory of the loaded extension module; turboquant_mlx.metallib sits beside it.
const std::string& binary_dir() {
  static const std::string dir = []() {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(&binary_dir), &info)) {
      throw std::runtime_error("[turboquant_mlx] cannot locate the extension module.");
    }
    return std::filesystem::path(info.dli_fname).parent_path().string();
  }();
  return dir;
}

/// Pipeline of one kernel of turboquant_mlx.metallib (MLX caches it by name).
MTL::ComputePipelineState* get_kernel(mx::metal::Device& d, const std::string& name) {
  auto* lib = d.get_library("turboquant_mlx", binary_dir());
  return d.get_kernel(name, lib);
}

const char* type_name(mx::Dtype t) {
  switch (t) {
    case mx::float32: return "float32";
    case mx::float16: return "float16";
    case mx::bfloat16: return "bfloat16";
    default:
      throw std::invalid_argument(
          "[turboquant_mlx.compressed_attention] queries must be float32, float16 or bfloat16.");
  }
}

/// TQAttnConfig<D> at runtime.
struct AttnShape {
  int DL, RC, STEP;
};

AttnShape attn_shape(int d) {
  AttnShape s{0, 0, 0};
  switch (d) {
#define TQ_SHAPE_CASE(n) \
  case n: s = {TQAttnConfig<n>::DL, TQAttnConfig<n>::RC, TQAttnConfig<n>::STEP}; break;
    TQ_SHAPE_CASE(32)
    TQ_SHAPE_CASE(64)
    TQ_SHAPE_CASE(96)
    TQ_SHAPE_CASE(128)
    TQ_SHAPE_CASE(160)
    TQ_SHAPE_CASE(192)
    TQ_SHAPE_CASE(224)
    TQ_SHAPE_CASE(256)
#undef TQ_SHAPE_CASE
    default: break;
  }
  return s;
}

/// Whether the simdgroup-matrix kernel (metal/tq_attention_simd.h) runs this call:
/// float16 / bfloat16 queries at head dims 64, 128, 256, unless
/// TURBOQUANT_METAL_ATTENTION=portable asks for the portable kernel.
bool simd_attention(mx::Dtype q, int d) {
  if ((q != mx::float16 && q != mx::bfloat16) || (d != 64 && d != 128 && d != 256)) {
    return false;
  }
  return env_switch("TURBOQUANT_METAL_ATTENTION") != "portable";
}

/// Whether a cache's code rows satisfy the kernel's vector loads: lanes that read 2 or
/// 4 whole words need every row start 8 / 16-byte aligned.
bool vector_aligned(const mx::array& codes, int dl, int bits) {
  if (codes.strides()[3] != 1) {
    return false; // a token's words must be adjacent
  }
  int nb = dl * bits;
  int na = nb / 32;
  if (nb % 32 != 0 || (na != 2 && na != 4)) {
    return true; // scalar loads
  }
  if ((codes.offset() / 4) % na != 0) {
    return false;
  }
  for (int a = 0; a < 3; ++a) {
    if (codes.strides()[a] % na != 0) {
      return false;
    }
  }
  return codes.strides()[3] == 1;
}

/// Gives `out` fresh memory holding a row-contiguous copy of `in` (4- or 2-byte
/// elements, up to 4 axes), made by tq_copy_u32 / tq_copy_u16.
void copy_buffer(const mx::array& in, mx::array& out, mx::metal::Device& d, const mx::Stream& s) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  TQCopyParams p{};
  int nd = in.ndim();
  for (int a = 0; a < 4; ++a) {
    int src = a - (4 - nd);
    p.shape[a] = src >= 0 ? in.shape(src) : 1;
    p.stride[a] = src >= 0 ? in.strides()[src] : 0;
  }
  p.size = static_cast<int64_t>(in.size());
  if (p.size == 0) {
    return;
  }
  auto& enc = mx::metal::get_command_encoder(s);
  enc.set_compute_pipeline_state(get_kernel(d, in.itemsize() == 4 ? "tq_copy_u32" : "tq_copy_u16"));
  enc.set_input_array(in, 0);
  enc.set_output_array(out, 1);
  enc.set_bytes(p, 2);
  enc.dispatch_threadgroups(
      MTL::Size((p.size + TQ_COPY_THREADS - 1) / TQ_COPY_THREADS, 1, 1),
      MTL::Size(TQ_COPY_THREADS, 1, 1));
}

/// Makes `out` hold the cache buffer `in`: its own memory when donatable or when the
/// caller asked for in_place (the O(new tokens) path), else a row-contiguous copy.
void take_buffer(
    const mx::array& in,
    mx::array& out,
    bool in_place,
    mx::metal::Device& d,
    const mx::Stream& s) {
  if (in.flags().row_contiguous && (in_place || in.is_donatable())) {
    out.copy_shared_buffer(in);
    return;
  }
  count_buffer_copy("quantize_append", in);
  copy_buffer(in, out, d, s);
}

/// A row-contiguous copy of `a` that lives as long as this launch.
mx::array temporary_copy(const mx::array& a, mx::metal::Device& d, const mx::Stream& s) {
  mx::array copy(a.shape(), a.dtype(), nullptr, {});
  copy_buffer(a, copy, d, s);
  mx::metal::get_command_encoder(s).add_temporary(copy);
  return copy;
}

/// `a` itself when its last axis is contiguous (what the kernels indexing it by
/// strides assume), else a row-contiguous copy: the ops hand GPU inputs over in any
/// layout, so that a decode step needs no Contiguous nodes.
mx::array last_axis_contiguous(const mx::array& a, mx::metal::Device& d, const mx::Stream& s) {
  if (a.strides()[a.ndim() - 1] == 1 || a.shape(a.ndim() - 1) == 1) {
    return a;
  }
  return temporary_copy(a, d, s);
}

/// `a` itself when row-contiguous, else a row-contiguous copy.
mx::array row_contiguous(const mx::array& a, mx::metal::Device& d, const mx::Stream& s) {
  return a.flags().row_contiguous ? a : temporary_copy(a, d, s);
}

/// `codes` itself when the attention kernel can read it, else a row-contiguous copy.
mx::array readable_codes(
    const mx::array& codes,
    int dl,
    int bits,
    mx::metal::Device& d,
    const mx::Stream& s) {
  if (vector_aligned(codes, dl, bits)) {
    return codes;
  }
  count_buffer_copy("compressed_attention", codes);
  return temporary_copy(codes, d, s);
}

} // namespace

bool available() {
  return true;
}

const char* backend_name() {
  return "metal";
}

std::vector<size_t> pool_memory(bool) {
  return {0, 0, 0}; // every buffer comes from MLX's allocator
}

bool quantize_append_at_once(
    const QuantizeAppend&,
    const mx::Stream&,
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  return false; // one dispatch per part
}

void quantize_append_part(
    const QuantizeAppend& prim,
    const AppendPart& part,
    const mx::Stream& s,
    const mx::array* in,
    mx::array* out) {
  auto& d = mx::metal::device(s.device);
  const int nb = prim.buffers();
  for (int i = 0; i < nb; ++i) {
    take_buffer(in[i], out[i], prim.in_place(), d, s);
  }
  // The buffer not written (a one-buffer node) is bound to the written one; the kernel
  // touches only those p.write names.
  mx::array& codes = out[0];
  mx::array& scales = out[nb - 1];
  const mx::array x = last_axis_contiguous(in[nb], d, s);
  auto& cent = in[nb + 1];
  const int head_dim = x.shape(3);
  check_kernel_head_dim("quantize_append", "Metal", head_dim);
  const int64_t n = int64_t(x.shape(0)) * x.shape(1) * x.shape(2);
  if (n == 0) {
    return;
  }
  // Without a mean, slot 2 is bound to the centroids and never read.
  const mx::array mean = part.centered ? row_contiguous(in[nb + 2], d, s) : cent;
  const TQQuantParams p = quantize_params(
      prim,
      part,
      x,
      prim.writes_codes() ? &codes : nullptr,
      prim.writes_scales() ? &scales : nullptr,
      part.centered ? &mean : nullptr);
  std::ostringstream name;
  name << "tq_quantize_"
       << (x.dtype() == mx::float16        ? "float16"
               : x.dtype() == mx::bfloat16 ? "bfloat16"
                                           : "float32")
       << "_d" << head_dim << "_b" << part.bits;
  auto& enc = mx::metal::get_command_encoder(s);
  enc.set_compute_pipeline_state(get_kernel(d, name.str()));
  enc.set_input_array(x, 0);
  enc.set_input_array(cent, 1);
  enc.set_input_array(mean, 2);
  enc.set_output_array(codes, 3);
  enc.set_output_array(scales, 4);
  enc.set_bytes(p, 5);
  enc.dispatch_threadgroups(
      MTL::Size((n + TQ_QUANT_SIMDGROUPS - 1) / TQ_QUANT_SIMDGROUPS, 1, 1),
      MTL::Size(TQ_QUANT_THREADS, 1, 1));
}

void attention(
    const CompressedAttention& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& d = mx::metal::device(s.device);
  const auto& ap = prim.params();
  const mx::array q = last_axis_contiguous(inputs[0], d, s);
  auto& out = outputs[0];
  auto& lse = outputs[1];
  const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), D = q.shape(3);
  const int Hkv = inputs[1].shape(1);
  check_kernel_head_dim("compressed_attention", "Metal", D);
  AttnShape sh = attn_shape(D);
  const mx::array kc = readable_codes(inputs[1], sh.DL, ap.key_bits, d, s);
  const mx::array vc = readable_codes(inputs[3], sh.DL, ap.value_bits, d, s);
  out.set_data(mx::allocator::malloc(out.nbytes()));
  lse.set_data(mx::allocator::malloc(lse.nbytes()));

  TQAttnParams p = attention_params(
      ap, q, kc, inputs[2], vc, inputs[4], Hkv, ap.has_mask ? &inputs[7] : nullptr);
  // The simdgroup-matrix kernel takes up to 8 query rows per threadgroup (a fragment's
  // rows: a GQA group at decode), the portable one sh.RC; both in steps of `step` keys.
  const bool simd = simd_attention(q.dtype(), D);
  const int chunk_rows = simd ? TQ_ATTN_SIMD_ROWS : sh.RC;
  const int step = simd ? TQ_ATTN_SIMD_STEP : sh.STEP;
  const int n_chunks = (p.rows + chunk_rows - 1) / chunk_rows;
  p.rows_per_tg = (p.rows + n_chunks - 1) / n_chunks;

  // Split the keys over enough threadgroups to keep every GPU core busy; Apple GPUs
  // have 8 to 80 cores, so aim for a few hundred threadgroups (not tuned on hardware).
  const int units = B * Hkv * n_chunks;
  const int target = env_int("TURBOQUANT_ATTN_CTAS", 512);
  // (splits of at least two iterations)
  const auto [splits, split_len] =
      key_splits(ap.kv_len, units, target, step, 2 * step, SplitRounding::up);
  p.n_splits = splits;
  p.split_len = split_len;
  // The merge attends to the tail, rotates the output back to model space and adds
  // the means back, so with any of them a single split writes partials too.
  const bool partials = splits > 1 || ap.has_tail || ap.rotate_output || ap.centered;
  p.partials = partials ? 1 : 0;

  const int rows_total = B * Hq * L;
  mx::array o_part = out;
  mx::array ml_part = lse;
  if (partials) {
    o_part = mx::array({rows_total, splits, D}, mx::float32, nullptr, {});
    ml_part = mx::array({rows_total, splits, 2}, mx::float32, nullptr, {});
    o_part.set_data(mx::allocator::malloc(o_part.nbytes()));
    ml_part.set_data(mx::allocator::malloc(ml_part.nbytes()));
  }

  std::ostringstream name;
  // The two kernels take the same arguments and write the same outputs: the choice is
  // the name.
  name << (simd ? "tq_attention_simd_" : "tq_attention_") << type_name(q.dtype()) << "_d" << D
       << "_k" << ap.key_bits << "_v" << ap.value_bits;
  auto& enc = mx::metal::get_command_encoder(s);
  enc.set_compute_pipeline_state(get_kernel(d, name.str()));
  enc.set_input_array(q, 0);
  enc.set_input_array(kc, 1);
  enc.set_input_array(inputs[2], 2);
  enc.set_input_array(vc, 3);
  enc.set_input_array(inputs[4], 4);
  enc.set_input_array(inputs[5], 5);
  enc.set_input_array(inputs[6], 6);
  // Without a mask, slot 7 is bound to the queries and never read.
  enc.set_input_array(ap.has_mask ? inputs[7] : q, 7);
  enc.set_output_array(out, 8);
  enc.set_output_array(lse, 9);
  enc.set_output_array(o_part, 10);
  enc.set_output_array(ml_part, 11);
  enc.set_bytes(p, 12);
  enc.dispatch_threadgroups(MTL::Size(n_chunks, splits, B * Hkv), MTL::Size(TQ_ATTN_THREADS, 1, 1));

  if (partials) {
    // The tail (q's dtype, see ops.cpp) and the means, as the merge reads them.
    std::vector<mx::array> tail, means;
    if (ap.has_tail) {
      tail = {
          last_axis_contiguous(inputs[ap.tail_input()], d, s),
          last_axis_contiguous(inputs[ap.tail_input() + 1], d, s)};
    }
    if (ap.centered) {
      means = {
          row_contiguous(inputs[ap.mean_input()], d, s),
          row_contiguous(inputs[ap.mean_input() + 1], d, s)};
    }
    const TQMergeParams mp = merge_params(q, ap, tail, means, Hkv, splits);
    std::ostringstream merge;
    merge << "tq_attention_merge_" << type_name(q.dtype()) << "_d" << D;
    enc.set_compute_pipeline_state(get_kernel(d, merge.str()));
    enc.set_input_array(o_part, 0);
    enc.set_input_array(ml_part, 1);
    enc.set_input_array(q, 2);
    // Slots of an absent tail or means are bound to the partials and never read.
    enc.set_input_array(ap.has_tail ? tail[0] : o_part, 3);
    enc.set_input_array(ap.has_tail ? tail[1] : o_part, 4);
    enc.set_input_array(ap.centered ? means[0] : o_part, 5);
    enc.set_input_array(ap.centered ? means[1] : o_part, 6);
    enc.set_output_array(out, 7);
    enc.set_output_array(lse, 8);
    enc.set_bytes(mp, 9);
    enc.dispatch_threadgroups(MTL::Size(rows_total, 1, 1), MTL::Size(TQ_MERGE_THREADS, 1, 1));
    enc.add_temporary(o_part);
    enc.add_temporary(ml_part);
  }
}

void write_tokens(
    const WriteTokens&,
    const mx::Stream&,
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  // (ops.write_tokens_kv writes with slice updates on Metal; the benchmarks'
  // fp16:inplace cache runs on CPU and CUDA)
  throw std::runtime_error("[turboquant_mlx.write_tokens] has no Metal kernel in this build.");
}

void ring_append(
    const RingAppend&,
    const mx::Stream&,
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  // (ops.ring_append_kv is an append and slice updates on Metal)
  throw std::runtime_error("[turboquant_mlx.ring_append_kv] has no Metal kernel in this build.");
}

void dequantize(
    const Dequantize& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& d = mx::metal::device(s.device);
  auto& codes = inputs[0];
  auto& scales = inputs[1];
  auto& out = outputs[0];
  prim.place_output(
      inputs, out, [](mx::array& a) { a.set_data(mx::allocator::malloc(a.nbytes())); });
  const TQDequantParams p = dequantize_params(prim, codes, scales, out);
  const int64_t total = int64_t(out.size());
  if (total == 0) {
    return;
  }
  std::ostringstream name;
  name << "tq_dequantize_" << type_name(out.dtype()) << "_b" << prim.bits();
  auto& enc = mx::metal::get_command_encoder(s);
  enc.set_compute_pipeline_state(get_kernel(d, name.str()));
  enc.set_input_array(codes, 0);
  enc.set_input_array(scales, 1);
  enc.set_input_array(inputs[2], 2);
  enc.set_output_array(out, 3);
  enc.set_bytes(p, 4);
  // An absent prefix / suffix binds the codes (never read: p.has_prefix / has_suffix).
  const int rows[2] = {prim.prefix_input(), prim.suffix_input()};
  for (int i = 0; i < 2; ++i) {
    enc.set_input_array(inputs[rows[i] >= 0 ? rows[i] : 0], 5 + i);
  }
  enc.dispatch_threadgroups(
      MTL::Size((total + TQ_DEQUANT_THREADS - 1) / TQ_DEQUANT_THREADS, 1, 1),
      MTL::Size(TQ_DEQUANT_THREADS, 1, 1));
}

std::vector<float> simdgroup_matrix_check(
    const std::vector<float>&,
    const std::vector<float>&,
    const std::vector<float>&) {
  // (Metal runs simdgroup matrices natively; the emulation being tested is CUDA's.)
  throw std::runtime_error(
      "[turboquant_mlx._simdgroup_matrix_check] tests the CUDA build's emulation of "
      "simdgroup matrices; this is the Metal build.");
}

} // namespace turboquant_mlx::gpu
