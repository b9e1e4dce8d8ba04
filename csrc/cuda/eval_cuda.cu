// Layout: CUDA only (host code).
// GPU backend on MLX's CUDA build: picks the kernel instantiation, sizes the grid,
// allocates outputs and records the launches in MLX's CUDA command encoder.
//
// Two facts of MLX's CUDA build shape this file:
//   - libmlx.so links its own static CUDA runtime, so a __global__ function of this
//     module must be handed to MLX's encoder as a driver handle (CUfunction) taken
//     with cudaGetFuncBySymbol from this module's runtime;
//   - libmlx.so exports neither its stream-ordered device allocator nor copy_gpu.
//     mx::allocator::malloc gives managed memory, and MLX's buffer cache converts a
//     recycled device buffer to managed memory with a synchronous copy. Outputs and
//     temporaries therefore come from a small device-memory pool of this module
//     (DevicePool below).
#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"

#include "attention_mma.cuh"
#include "buffer_copies.h"
#include "gpu.h"
#include "gpu_params.h"
#include "kernel_overrides.h"
#include "message.h"
#include "tq_entry.cuh"

namespace turboquant_mlx::gpu {

namespace ck = turboquant_mlx::cuda_kernels;

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(
        message("[turboquant_mlx] CUDA error in ", what, ": ", cudaGetErrorString(err)));
  }
}

/// `lookup()` for one of this module's kernels, asked once per kernel: one cache per
/// call site (each passes its own lambda type); a lookup that throws is not cached.
template <typename T, typename Lookup>
T once_per_kernel(const void* symbol, Lookup&& lookup) {
  static std::mutex mu;
  static std::unordered_map<const void*, T> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(symbol);
  if (it != cache.end()) {
    return it->second;
  }
  const T value = lookup();
  cache.emplace(symbol, value);
  return value;
}

/// Driver handle of one of this module's kernels (cached).
CUfunction get_function(const void* symbol, const char* name) {
  return once_per_kernel<CUfunction>(symbol, [&] {
    if (symbol == nullptr) {
      throw std::invalid_argument(
          message("[turboquant_mlx] no CUDA kernel compiled for ", name, "."));
    }
    cudaFunction_t f = nullptr;
    check(cudaGetFuncBySymbol(&f, symbol), name);
    return reinterpret_cast<CUfunction>(f);
  });
}

/// Lets `symbol` (one of this module's kernels) use `bytes` of dynamic shared memory
/// (above the default 48 KiB needs an opt-in); once per kernel.
void set_max_dynamic_smem(const void* symbol, int bytes) {
  static std::mutex mu;
  static std::unordered_map<const void*, int> done;
  std::lock_guard<std::mutex> lock(mu);
  auto it = done.find(symbol);
  if (it != done.end() && it->second >= bytes) {
    return;
  }
  check(
      cudaFuncSetAttribute(symbol, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
      "cudaFuncSetAttribute");
  done[symbol] = bytes;
}

/// A device attribute, read once per device.
int device_attribute(cudaDeviceAttr attr, int device, const char* what) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(int(attr), device);
  auto it = cache.find(key);
  if (it != cache.end()) {
    return it->second;
  }
  int n = 0;
  check(cudaDeviceGetAttribute(&n, attr, device), what);
  cache.emplace(key, n);
  return n;
}

int sm_count(int device) {
  return device_attribute(cudaDevAttrMultiProcessorCount, device, "sm count");
}

/// Largest dynamic shared memory a block may opt in to (H100/H200 227 KiB, A100 163 KiB,
/// most other GPUs 99 KiB or less).
int max_block_smem(int device) {
  return device_attribute(
      cudaDevAttrMaxSharedMemoryPerBlockOptin, device, "shared memory per block");
}

/// Device-memory pool for outputs and temporaries. Buffers are allocated stream-ordered
/// on MLX's stream (as MLX's own allocator does) and recycled by size. At most
/// kMaxHeldBytes of freed buffers are kept for reuse: the rest go back (stream-ordered)
/// at once. Without that bound, buffers whose size never comes again (a long prompt's
/// per-block decoded keys and values grow by a block each time; a cache buffer left
/// behind when the cache grows) piled up until the device ran out of memory. A buffer
/// that MLX moved to managed memory (a host read of the array) is freed instead of
/// recycled. The pool counts what it hands out (MLX's memory counters do not see it).
class DevicePool {
 public:
  static DevicePool& get() {
    static DevicePool* pool = new DevicePool(); // never destroyed: outlives every array
    return *pool;
  }

  mx::allocator::Data alloc(size_t nbytes, int device, cudaStream_t stream) {
    size_t size = round_size(nbytes);
    mx::cu::CudaBuffer* buf = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(std::make_pair(device, size));
      if (it != free_.end()) {
        buf = it->second;
        free_.erase(it);
        held_ -= size;
      }
    }
    if (buf == nullptr) {
      void* data = nullptr;
      check(cudaMallocAsync(&data, size, stream), "cudaMallocAsync");
      buf = new mx::cu::CudaBuffer{data, size, device};
      std::lock_guard<std::mutex> lock(mu_);
      streams_[data] = stream;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      active_ += size;
      peak_ = std::max(peak_, active_);
    }
    return mx::allocator::Data(
        mx::allocator::Buffer(buf), [this](mx::allocator::Buffer b) { release(b); });
  }

  std::vector<size_t> memory(bool reset_peak) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<size_t> out{active_, peak_, held_};
    if (reset_peak) {
      peak_ = active_;
    }
    return out;
  }

 private:
  static constexpr size_t kMaxHeldBytes = size_t(1) << 30;

  static size_t round_size(size_t n) {
    if (n <= 256) {
      return 256;
    }
    size_t p = 256;
    while (p < n) {
      p <<= 1;
    }
    return p <= (size_t(1) << 24) ? p : ((n + (size_t(1) << 20) - 1) >> 20) << 20;
  }

  void release(mx::allocator::Buffer b) {
    auto* buf = static_cast<mx::cu::CudaBuffer*>(b.ptr());
    if (buf == nullptr) {
      return;
    }
    std::unique_lock<std::mutex> lock(mu_);
    active_ -= std::min(active_, buf->size);
    if (buf->device < 0) {
      // MLX moved it to managed memory (a host read); its device memory is gone.
      streams_.erase(buf->data);
      lock.unlock();
      cudaFree(buf->data);
      delete buf;
      return;
    }
    if (held_ + buf->size <= kMaxHeldBytes) {
      held_ += buf->size;
      free_.emplace(std::make_pair(buf->device, buf->size), buf);
      return;
    }
    // Not kept: back to the device's memory pool, ordered after the work that was
    // queued on the buffer's stream (MLX releases a buffer once no queued kernel needs it).
    cudaStream_t stream = streams_[buf->data];
    streams_.erase(buf->data);
    lock.unlock();
    if (cudaFreeAsync(buf->data, stream) != cudaSuccess) {
      cudaGetLastError(); // (a deleter must not throw)
      cudaFree(buf->data);
    }
    delete buf;
  }

  std::mutex mu_;
  std::multimap<std::pair<int, size_t>, mx::cu::CudaBuffer*> free_;
  std::unordered_map<void*, cudaStream_t> streams_;
  size_t active_ = 0;
  size_t peak_ = 0;
  size_t held_ = 0;
};

/// Gives `a` fresh device memory of a.nbytes().
void allocate(mx::array& a, mx::cu::CommandEncoder& enc) {
  if (a.nbytes() > 0) {
    a.set_data(DevicePool::get().alloc(
        a.nbytes(), enc.device().cuda_device(), static_cast<cudaStream_t>(enc.stream())));
  } else {
    a.set_data(mx::allocator::malloc(a.nbytes()));
  }
}

template <typename T>
const T* cptr(const mx::array& a) {
  return mx::gpu_ptr<T>(a);
}
template <typename T>
T* mptr(mx::array& a) {
  return mx::gpu_ptr<T>(a);
}

/// The kernels' element type for float32, float16 or bfloat16 inputs.
ck::QType qtype_of(mx::Dtype t) {
  return t == mx::float16 ? ck::QType::Float16
      : t == mx::bfloat16 ? ck::QType::BFloat16
                          : ck::QType::Float32;
}

/// The arguments of a row-contiguous copy of `in` (4- or 2-byte elements, up to 4 axes)
/// into `out`'s memory; with `at_token` >= 0 (4-axis arrays that agree but in their
/// tokens, axis 2), into out's tokens [at_token, at_token + in.shape(2)) along out's
/// strides. p.size == 0: nothing to copy.
ck::TQCopyArgs copy_args(const mx::array& in, mx::array& out, int at_token) {
  ck::TQCopyArgs a{};
  TQCopyParams& p = a.p;
  int nd = in.ndim();
  for (int ax = 0; ax < 4; ++ax) {
    int src = ax - (4 - nd);
    p.shape[ax] = src >= 0 ? in.shape(src) : 1;
    p.stride[ax] = src >= 0 ? in.strides()[src] : 0;
    p.dst_stride[ax] = at_token >= 0 ? out.strides()[ax] : 0;
  }
  p.dst_strided = at_token >= 0 ? 1 : 0;
  p.size = static_cast<int64_t>(in.size());
  a.src = mx::gpu_ptr<void>(in);
  a.dst = static_cast<char*>(mx::gpu_ptr<void>(out)) +
      (at_token >= 0 ? int64_t(at_token) * out.strides()[2] * int64_t(out.itemsize()) : 0);
  return a;
}

/// Writes a row-contiguous copy of `in` into `out`'s memory (see copy_args).
void copy_into(
    const mx::array& in,
    mx::array& out,
    mx::cu::CommandEncoder& enc,
    int at_token = -1) {
  if (in.size() == 0) {
    return;
  }
  ck::TQCopyArgs a = copy_args(in, out, at_token); // (the encoder takes lvalues)
  auto f = get_function(ck::copy_kernel(static_cast<int>(in.itemsize())), "copy");
  enc.set_input_array(in);
  enc.set_output_array(out);
  dim3 grid(static_cast<unsigned>((a.p.size + TQ_COPY_THREADS - 1) / TQ_COPY_THREADS));
  enc.add_kernel_node_ex(f, grid, dim3(TQ_COPY_THREADS), dim3(), 0u, a.src, a.dst, a.p);
}

/// A row-contiguous copy of `a` that lives as long as this launch.
mx::array temporary_copy(const mx::array& a, mx::cu::CommandEncoder& enc) {
  mx::array copy(a.shape(), a.dtype(), nullptr, {});
  allocate(copy, enc);
  copy_into(a, copy, enc);
  enc.add_temporary(copy);
  return copy;
}

/// `a` itself when its last axis is contiguous (what the kernels index it by strides
/// assume), else a row-contiguous copy (a temporary of this launch). The ops hand GPU
/// inputs over in whatever layout they have, so that a decode step needs no
/// Contiguous nodes; this is where the rare strided one gets copied.
mx::array last_axis_contiguous(const mx::array& a, mx::cu::CommandEncoder& enc) {
  if (a.strides()[a.ndim() - 1] == 1 || a.shape(a.ndim() - 1) == 1) {
    return a;
  }
  return temporary_copy(a, enc);
}

/// `a` itself when its rows (last axis) are contiguous and each starts at a multiple of
/// `bytes` bytes, else a row-contiguous copy (a temporary of this launch).
mx::array aligned_rows(const mx::array& a, int bytes, mx::cu::CommandEncoder& enc) {
  const int nd = a.ndim();
  bool ok = a.strides()[nd - 1] == 1 &&
      reinterpret_cast<uintptr_t>(mx::gpu_ptr<void>(a)) % bytes == 0 &&
      int64_t(a.shape(nd - 1)) * a.itemsize() % bytes == 0;
  for (int ax = 0; ax < nd - 1; ++ax) {
    ok = ok && (a.shape(ax) == 1 || int64_t(a.strides()[ax]) * a.itemsize() % bytes == 0);
  }
  return ok ? a : temporary_copy(a, enc);
}

/// `a` itself when row-contiguous, else a row-contiguous copy.
mx::array row_contiguous(const mx::array& a, mx::cu::CommandEncoder& enc) {
  return a.flags().row_contiguous ? a : temporary_copy(a, enc);
}

/// Makes `out` hold the cache buffer `in`: its own memory when it can be donated or
/// the caller asked for in_place (the O(new tokens) path), else a row-contiguous copy.
/// The copy lives in memory of MLX's allocator: MLX donates only buffers its allocator
/// owns, and a cache buffer in the pool above could then never be reused again --
/// every later append would copy it.
void take_buffer(
    const char* op,
    const mx::array& in,
    mx::array& out,
    bool in_place,
    mx::cu::CommandEncoder& enc) {
  if (in.flags().row_contiguous && (in_place || in.is_donatable())) {
    out.copy_shared_buffer(in);
    return;
  }
  count_buffer_copy(op, in);
  out.set_data(mx::allocator::malloc(out.nbytes()));
  copy_into(in, out, enc);
}

/// Attention kernel shape for a runtime head dim (see TQAttnConfig).
struct AttnShape {
  int DL, RC, STEP;
};

AttnShape attn_shape(int d) {
  AttnShape s{0, 0, 0};
  ck::dispatch_head_dim(d, [&](auto dd) {
    using C = TQAttnConfig<decltype(dd)::value>;
    s = {C::DL, C::RC, C::STEP};
  });
  return s;
}

/// Whether a cache's code rows allow the kernels' vector loads of per-lane slices of
/// `slice_bits` bits: a slice of a multiple of 4 (2) whole words is read with 16-byte
/// (8-byte) loads, so every row start must be 16 (8)-byte aligned.
bool vector_aligned(const mx::array& codes, int slice_bits) {
  if (codes.ndim() == 4 && codes.strides()[3] != 1) {
    return false; // a token's words must be adjacent
  }
  if (slice_bits <= 0 || slice_bits % 32 != 0) {
    return true; // word (or, for scales, element) loads
  }
  const int nw = slice_bits / 32;
  const int vec = nw % 4 == 0 ? 4 : (nw % 2 == 0 ? 2 : 1);
  if (vec == 1) {
    return true;
  }
  auto addr = reinterpret_cast<uintptr_t>(mx::gpu_ptr<void>(codes));
  if (addr % (4 * vec) != 0 || codes.strides()[3] != 1) {
    return false;
  }
  for (int a = 0; a < 3; ++a) {
    if (codes.strides()[a] % vec != 0) {
      return false;
    }
  }
  return true;
}

/// Whether tokens follow each other without gaps along axis 2 (codes: rows of shape(3)
/// words; scales: one value each), as the tensor-core kernel's addressing assumes.
bool dense_tokens(const mx::array& a) {
  if (a.ndim() == 4) {
    return a.strides()[3] == 1 && a.strides()[2] == a.shape(3);
  }
  return a.strides()[2] == 1;
}

/// `codes` itself when the kernel can read it (slices of `slice_bits` bits per lane;
/// `dense`: a dense token axis too), else a contiguous copy (a temporary of this launch).
/// Scales go through it too, with slice_bits 0 (element loads: only `dense` applies).
mx::array readable_codes(
    const mx::array& codes,
    int slice_bits,
    bool dense,
    mx::cu::CommandEncoder& enc) {
  if (vector_aligned(codes, slice_bits) && (!dense || dense_tokens(codes))) {
    return codes;
  }
  count_buffer_copy("compressed_attention", codes);
  return temporary_copy(codes, enc);
}

/// The tensor-core kernel for this call, or nullptr when the exact SIMT kernel runs:
/// float32 queries, head dims other than 64/128/256, value bits above key bits, a GPU
/// with less shared memory per block than the kernel takes, or another kernel asked for
/// (attention_kernel_override: the portable one, or the simdgroup-matrix one, see
/// simd_kernel_for).
const void* mma_kernel_for(
    const mx::array& q,
    int d,
    int kb,
    int vb,
    int nrb,
    int kv_len,
    int device) {
  if (q.dtype() != mx::float16 && q.dtype() != mx::bfloat16) {
    return nullptr;
  }
  // its byte offsets into one head's codes are 32-bit
  if (int64_t(kv_len) * d * std::max(kb, vb) / 8 > int64_t(UINT32_MAX)) {
    return nullptr;
  }
  if (attention_kernel_override() != AttentionKernel::automatic) {
    return nullptr;
  }
  const void* k = nullptr;
  switch (d) {
    case 64: k = ck::attention_mma_kernel_d64(kb, vb, nrb); break;
    case 128: k = ck::attention_mma_kernel_d128(kb, vb, nrb); break;
    case 256: k = ck::attention_mma_kernel_d256(kb, vb, nrb); break;
    default: break;
  }
  if (k != nullptr && ck::attention_mma_shape(d, kb, vb, nrb).smem > max_block_smem(device)) {
    return nullptr;
  }
  return k;
}

/// The simdgroup-matrix kernel (metal/tq_attention_simd.h, Metal's fast path, run here
/// on the emulation of simdgroup matrices) for this call when the tests ask for it
/// (AttentionKernel::simd): float16 / bfloat16 queries at head dims 64, 128, 256 (any
/// bit widths); else nullptr. It makes the GPU tests run that kernel's body; it is not
/// fast.
const void* simd_kernel_for(const mx::array& q, int d, int kb, int vb) {
  if (attention_kernel_override() != AttentionKernel::simd) {
    return nullptr;
  }
  const ck::QType qt = q.dtype() == mx::float16 ? ck::QType::Float16
      : q.dtype() == mx::bfloat16               ? ck::QType::BFloat16
                                                : ck::QType::Float32;
  if (qt == ck::QType::Float32) {
    return nullptr;
  }
  switch (d) {
    case 64: return ck::attention_simd_kernel_d64(kb, vb, qt);
    case 128: return ck::attention_simd_kernel_d128(kb, vb, qt);
    case 256: return ck::attention_simd_kernel_d256(kb, vb, qt);
    default: return nullptr;
  }
}

} // namespace

KernelSupport kernel_support() {
  // The answer cannot change while the process runs.
  static const KernelSupport k = [] {
    int n = 0;
    KernelSupport s;
    s.kernels = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
    s.write_tokens = true;
    s.out_in_query_dtype = true; // (the merge kernel writes the queries' type)
    return s;
  }();
  return k;
}

std::vector<size_t> pool_memory(bool reset_peak) {
  return DevicePool::get().memory(reset_peak);
}

const char* backend_name() {
  return "cuda";
}

namespace {

/// One part of a QuantizeAppend node, ready to launch: its buffers taken (in place, or
/// copied), its inputs as the kernel reads them, and the kernel's arguments.
struct PreparedPart {
  mx::array x, cent;
  std::optional<mx::array> mean;
  mx::array* out;
  int buffers, head_dim, bits;
  ck::QType xt;
  int64_t vectors; // B * H * L tokens' vectors (0: nothing to write)
  ck::TQQuantArgs args;
};

/// Takes the part's buffers and makes its inputs readable. Copies this needs are
/// kernel nodes of their own, so they all come before the registration of the launch
/// (register_part), which the next kernel node takes.
PreparedPart prepare_part(
    const QuantizeAppend& prim,
    const AppendPart& part,
    mx::cu::CommandEncoder& enc,
    const mx::array* in,
    mx::array* out) {
  const int nb = prim.buffers();
  for (int i = 0; i < nb; ++i) {
    take_buffer("quantize_append", in[i], out[i], prim.in_place(), enc);
  }
  mx::array x = last_axis_contiguous(in[nb], enc);
  std::optional<mx::array> mean;
  if (part.centered) {
    mean = row_contiguous(in[nb + 2], enc);
  }
  mx::array* codes = prim.writes_codes() ? &out[0] : nullptr;
  mx::array* scales = prim.writes_scales() ? &out[nb - 1] : nullptr;
  const int head_dim = x.shape(3);
  const ck::QType xt = qtype_of(x.dtype());
  ck::TQQuantArgs a{};
  a.p = quantize_params(prim, part, x, codes, scales, mean ? &*mean : nullptr);
  const TQQuantParams& p = a.p;
  if (mean) {
    a.mean = cptr<float>(*mean);
  }
  a.x = mx::gpu_ptr<void>(x);
  a.cent = cptr<float>(in[nb + 1]);
  a.codes = codes ? mptr<unsigned int>(*codes) : nullptr;
  a.scales = scales ? static_cast<__half*>(mx::gpu_ptr<void>(*scales)) : nullptr;
  const int64_t vectors = int64_t(p.batch) * p.heads * p.length;
  return PreparedPart{
      std::move(x), in[nb + 1], std::move(mean), out, nb, head_dim, part.bits, xt, vectors, a};
}

/// The arrays a prepared part's launch reads and writes, for the graph's ordering.
void register_part(const PreparedPart& pp, mx::cu::CommandEncoder& enc) {
  if (pp.mean) {
    enc.set_input_array(*pp.mean);
  }
  enc.set_input_array(pp.x);
  enc.set_input_array(pp.cent);
  for (int i = 0; i < pp.buffers; ++i) {
    enc.set_output_array(pp.out[i]);
  }
}

dim3 quantize_grid(int64_t vectors, unsigned parts) {
  const int64_t blocks = (vectors + TQ_QUANT_SIMDGROUPS - 1) / TQ_QUANT_SIMDGROUPS;
  return dim3(static_cast<unsigned>(blocks), parts);
}

/// One prepared part's launch (its arrays registered by the caller).
void launch_part(const PreparedPart& pp, mx::cu::CommandEncoder& enc) {
  auto f = get_function(ck::quantize_kernel(pp.head_dim, pp.bits, pp.xt), "quantize_append");
  ck::TQQuantArgs a = pp.args; // (the encoder takes lvalues)
  enc.add_kernel_node_ex(
      f,
      quantize_grid(pp.vectors, 1),
      dim3(TQ_QUANT_THREADS),
      dim3(),
      0u,
      a.x,
      a.cent,
      a.mean,
      a.codes,
      a.scales,
      a.x_slots,
      a.incoming,
      a.p);
}

/// Two prepared parts (keys, values) of the same bits, input type and token count as
/// one launch (its arrays registered by the caller).
void launch_pair(
    const PreparedPart& k,
    const PreparedPart& v,
    const char* op,
    mx::cu::CommandEncoder& enc) {
  auto f = get_function(ck::quantize_kernel(k.head_dim, k.bits, k.xt, /* pair = */ true), op);
  ck::TQQuantArgs ka = k.args, va = v.args; // (the encoder takes lvalues)
  enc.add_kernel_node_ex(
      f, quantize_grid(k.vectors, 2), dim3(TQ_QUANT_THREADS), dim3(), 0u, ka, va);
}

} // namespace

void quantize_append_part(
    const QuantizeAppend& prim,
    const AppendPart& part,
    const mx::Stream& s,
    const mx::array* in,
    mx::array* out) {
  auto& enc = mx::cu::get_command_encoder(s);
  const PreparedPart pp = prepare_part(prim, part, enc, in, out);
  if (pp.vectors == 0) {
    return;
  }
  register_part(pp, enc);
  launch_part(pp, enc);
}

bool quantize_append_at_once(
    const QuantizeAppend& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  const auto& parts = prim.parts();
  if (parts.size() != 2 || parts[0].bits != parts[1].bits) {
    return false;
  }
  const size_t v_in = prim.inputs_of(0), nb = prim.buffers();
  const mx::array& xk = inputs[nb];
  const mx::array& xv = inputs[v_in + nb];
  if (xk.dtype() != xv.dtype() || xk.shape() != xv.shape()) {
    return false; // (one kernel instance, one grid: the same shapes and input type)
  }
  auto& enc = mx::cu::get_command_encoder(s);
  const PreparedPart k = prepare_part(prim, parts[0], enc, &inputs[0], &outputs[0]);
  const PreparedPart v = prepare_part(prim, parts[1], enc, &inputs[v_in], &outputs[nb]);
  if (k.vectors == 0) {
    return true;
  }
  register_part(k, enc);
  register_part(v, enc);
  launch_pair(k, v, "quantize_append", enc);
  return true;
}

void ring_append(
    const RingAppend& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& enc = mx::cu::get_command_encoder(s);
  const QuantizeAppend& append = prim.append();
  const size_t v_in = append.inputs_of(0), parts_end = v_in + append.inputs_of(1);
  const int length = inputs[parts_end].shape(2);
  // The rings in place; each part's x is a view of its ring's slots, which its launch
  // quantizes and then overwrites with the incoming tokens.
  std::vector<mx::array> in(inputs.begin(), inputs.begin() + parts_end);
  mx::array* rings[2] = {&outputs[4], &outputs[5]};
  const size_t ring_in[2] = {2, v_in + 2};
  std::vector<mx::array> incoming;
  for (int t = 0; t < 2; ++t) {
    take_buffer("ring_append_kv", inputs[ring_in[t]], *rings[t], true, enc);
    in[ring_in[t]] = ring_slots_view(*rings[t], prim.slot(), length);
    incoming.push_back(last_axis_contiguous(inputs[parts_end + t], enc));
  }
  const auto& parts = append.parts();
  std::vector<PreparedPart> pps;
  for (int t = 0; t < 2; ++t) {
    PreparedPart pp =
        prepare_part(append, parts[t], enc, &in[t == 0 ? 0 : v_in], &outputs[t == 0 ? 0 : 2]);
    // The kernel writes where it read (x must be the slots themselves, not a copy), and
    // reads the incoming tokens as x's type (the op checked they are in the ring's).
    if (mx::gpu_ptr<void>(pp.x) != mx::gpu_ptr<void>(in[ring_in[t]])) {
      throw std::logic_error("[turboquant_mlx.ring_append_kv] ring slots were copied.");
    }
    if (incoming[t].dtype() != pp.x.dtype()) {
      throw std::logic_error("[turboquant_mlx.ring_append_kv] new tokens not in the ring's dtype.");
    }
    pp.args.x_slots = mx::gpu_ptr<void>(in[ring_in[t]]);
    pp.args.incoming = mx::gpu_ptr<void>(incoming[t]);
    for (int a = 0; a < 3; ++a) {
      pp.args.p.in_stride[a] = incoming[t].strides()[a];
    }
    pps.push_back(std::move(pp));
  }
  if (pps[0].vectors == 0) {
    return;
  }
  // Besides a part's own arrays: the incoming tokens, the earlier readers of the slots
  // (ordering only: MLX's CUDA graph orders a kernel after the writers of its inputs)
  // and the ring it writes.
  auto register_exchange = [&](int t) {
    register_part(pps[t], enc);
    enc.set_input_array(incoming[t]);
    for (size_t a = parts_end + 2; a < inputs.size(); ++a) {
      enc.set_input_array(inputs[a]);
    }
    enc.set_output_array(*rings[t]);
  };
  const bool pair =
      parts[0].bits == parts[1].bits && pps[0].xt == pps[1].xt && pps[0].vectors == pps[1].vectors;
  if (!pair) {
    for (int t = 0; t < 2; ++t) {
      register_exchange(t);
      launch_part(pps[t], enc);
    }
    return;
  }
  register_exchange(0);
  register_exchange(1);
  launch_pair(pps[0], pps[1], "ring_append_kv", enc);
}

void attention(
    const CompressedAttention& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& enc = mx::cu::get_command_encoder(s);
  const auto& ap = prim.params();
  const mx::array q = last_axis_contiguous(inputs[0], enc);
  auto& kcent = inputs[5];
  auto& vcent = inputs[6];
  auto& out = outputs[0];
  auto& lse = outputs[1];

  const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), D = q.shape(3);
  const int Hkv = inputs[1].shape(1);
  check_kernel_head_dim("compressed_attention", "CUDA", D);
  const int kb = ap.key_bits, vb = ap.value_bits;
  const int rows = (Hq / Hkv) * L;
  // Tensor-core path (float16/bfloat16 queries): 8 or (head dims <= 128) 16 query rows
  // per block.
  const int nrb = rows <= 8 || D > 128 ? 1 : 2;
  const void* mma_sym = mma_kernel_for(q, D, kb, vb, nrb, ap.kv_len, enc.device().cuda_device());
  // AttentionKernel::simd: the simdgroup-matrix kernel, with the SIMT kernel's
  // arguments, threads and outputs (its rows and steps: TQ_ATTN_SIMD_ROWS / _STEP).
  const void* simd_sym = simd_kernel_for(q, D, kb, vb);
  AttnShape sh = attn_shape(D);
  if (simd_sym != nullptr) {
    sh.RC = TQ_ATTN_SIMD_ROWS;
    sh.STEP = TQ_ATTN_SIMD_STEP;
    sh.DL = 0; // word loads only: no alignment beyond the words'
  }
  ck::TQMmaShape msh{0, 0, 0, 0, false};
  if (mma_sym != nullptr) {
    msh = ck::attention_mma_shape(D, kb, vb, nrb);
  }
  // Bits of codes one lane reads per token: tensor-core kernel D/4 key and D/8 value
  // coordinates, SIMT kernel DL of each; the staged tensor-core kernel copies 16-byte
  // chunks (slices of 128 bits ask for the same alignment).
  const int k_slice = msh.staged ? 128 : mma_sym != nullptr ? D / 4 * kb : sh.DL * kb;
  const int v_slice = msh.staged ? 128 : mma_sym != nullptr ? D / 8 * vb : sh.DL * vb;
  // The tensor-core kernel addresses tokens as dense rows with 32-bit byte offsets.
  const bool dense = mma_sym != nullptr;
  // The tensor-core kernel reads each query row's quarters with 16-byte loads.
  const mx::array qk = mma_sym != nullptr ? aligned_rows(q, 16, enc) : q;
  const mx::array kc = readable_codes(inputs[1], k_slice, dense, enc);
  const mx::array vc = readable_codes(inputs[3], v_slice, dense, enc);
  const mx::array ks = dense ? readable_codes(inputs[2], 0, true, enc) : inputs[2];
  const mx::array vs = dense ? readable_codes(inputs[4], 0, true, enc) : inputs[4];

  allocate(out, enc);
  allocate(lse, enc);

  TQAttnParams p =
      attention_params(ap, qk, kc, ks, vc, vs, Hkv, ap.has_mask ? &inputs[7] : nullptr);
  const int chunk_rows = mma_sym != nullptr ? 8 * nrb : sh.RC;
  const int n_chunks = (p.rows + chunk_rows - 1) / chunk_rows;
  p.rows_per_tg = mma_sym != nullptr ? chunk_rows : (p.rows + n_chunks - 1) / n_chunks;
  const unsigned char* mask_ptr = ap.has_mask ? cptr<unsigned char>(inputs[7]) : nullptr;

  // Split the keys so that the grid fills the GPU: SIMT kernel about twice over (2
  // threadgroups of ~240 registers per thread fit an SM; measured on an H200: 2-4 per
  // SM beat 8), splits of at least two iterations; tensor-core kernel: as many blocks
  // as its registers were budgeted for (one block of 8-16 warps per SM with 4-bit keys,
  // else 1-3 of 4 warps; H200 device time, d128 K3V3 at 128k: 3 per SM 16% faster than
  // 2), splits of one iteration or more (4k keys: 8% faster than two). One wave.
  const int units = B * Hkv * n_chunks;
  const int sms = sm_count(enc.device().cuda_device());
  const int target = ctas_override() > 0 ? ctas_override()
                                         : (mma_sym != nullptr ? msh.blocks_per_sm * sms : 4 * sms);
  // At most `target` blocks (the resident ones): rounding up would start a second wave.
  // (min_steps_override replaces the least block iterations per split)
  const int step = mma_sym != nullptr ? msh.step : sh.STEP;
  const int min_steps =
      min_steps_override() > 0 ? min_steps_override() : (mma_sym != nullptr ? 1 : 2);
  const auto [splits, split_len] =
      key_splits(ap.kv_len, units, target, step, min_steps * step, SplitRounding::down);
  p.n_splits = splits;
  p.split_len = split_len;
  // The merge attends to the tail, rotates the output back to model space and adds
  // the means back, so with any of them a single split writes partials too.
  // An out in the queries' type is written by the merge kernel only.
  const bool out_f32 = ap.out_dtype == mx::float32;
  const bool partials = splits > 1 || ap.has_tail || ap.rotate_output || ap.centered || !out_f32;
  p.partials = partials ? 1 : 0;

  const bool lo = D <= 128;
  const void* sym = mma_sym != nullptr ? mma_sym : simd_sym; // else the SIMT kernel
  if (sym == nullptr) {
    switch (q.dtype()) {
      case mx::float32:
        sym = lo ? ck::attention_kernel_f32_lo(D, kb, vb) : ck::attention_kernel_f32_hi(D, kb, vb);
        break;
      case mx::float16:
        sym = lo ? ck::attention_kernel_f16_lo(D, kb, vb) : ck::attention_kernel_f16_hi(D, kb, vb);
        break;
      case mx::bfloat16:
        sym =
            lo ? ck::attention_kernel_bf16_lo(D, kb, vb) : ck::attention_kernel_bf16_hi(D, kb, vb);
        break;
      default:
        throw std::invalid_argument(
            "[turboquant_mlx.compressed_attention] queries must be float32, float16 or bfloat16.");
    }
  }
  auto f = get_function(sym, "compressed_attention");

  const int rows_total = B * Hq * L;
  mx::array o_part({1}, mx::float32, nullptr, {});
  mx::array ml_part({1}, mx::float32, nullptr, {});
  // The merge's inputs besides the partials: the tail (q's dtype, see ops.cpp) and the
  // means, as it reads them.
  std::vector<mx::array> tail, means;
  TQMergeParams mp{};
  if (partials) {
    o_part = mx::array({rows_total, splits, D}, mx::float32, nullptr, {});
    ml_part = mx::array({rows_total, splits, 2}, mx::float32, nullptr, {});
    allocate(o_part, enc);
    allocate(ml_part, enc);
    enc.add_temporary(o_part);
    enc.add_temporary(ml_part);
    if (ap.has_tail) {
      tail = {
          last_axis_contiguous(inputs[ap.tail_input()], enc),
          last_axis_contiguous(inputs[ap.tail_input() + 1], enc)};
    }
    if (ap.centered) {
      means = {
          row_contiguous(inputs[ap.mean_input()], enc),
          row_contiguous(inputs[ap.mean_input() + 1], enc)};
    }
    mp = merge_params(qk, ap, tail, means, Hkv, splits);
  }
  const void* tkp = ap.has_tail ? mx::gpu_ptr<void>(tail[0]) : nullptr;
  const void* tvp = ap.has_tail ? mx::gpu_ptr<void>(tail[1]) : nullptr;
  const float* kmp = ap.centered ? cptr<float>(means[0]) : nullptr;
  const float* vmp = ap.centered ? cptr<float>(means[1]) : nullptr;

  enc.set_input_array(qk);
  enc.set_input_array(kc);
  enc.set_input_array(ks);
  enc.set_input_array(vc);
  enc.set_input_array(vs);
  enc.set_input_array(kcent);
  enc.set_input_array(vcent);
  if (ap.has_mask) {
    enc.set_input_array(inputs[7]);
  }
  float* op = nullptr;
  float* mlp = nullptr;
  if (partials) {
    enc.set_output_array(o_part);
    enc.set_output_array(ml_part);
    op = mptr<float>(o_part);
    mlp = mptr<float>(ml_part);
  }
  // The node that writes out and lse (the attention kernel, or the merge kernel after
  // it) reads the tail and the means.
  auto final_node_io = [&] {
    for (const auto& a : tail) {
      enc.set_input_array(a);
    }
    for (const auto& a : means) {
      enc.set_input_array(a);
    }
    enc.set_output_array(out);
    enc.set_output_array(lse);
  };
  if (!partials) {
    final_node_io();
  }
  const void* qp = mx::gpu_ptr<void>(qk);
  const unsigned int* kcp = cptr<unsigned int>(kc);
  const void* ksp = mx::gpu_ptr<void>(ks);
  const unsigned int* vcp = cptr<unsigned int>(vc);
  const void* vsp = mx::gpu_ptr<void>(vs);
  const float* kcentp = cptr<float>(kcent);
  const float* vcentp = cptr<float>(vcent);
  // (the attention kernels write out only when it is float32: see partials)
  float* outp = out_f32 ? mptr<float>(out) : nullptr;
  float* lsep = mptr<float>(lse);
  dim3 grid(n_chunks, splits, B * Hkv);
  if (mma_sym != nullptr) {
    set_max_dynamic_smem(mma_sym, msh.smem);
    int q_bf16 = q.dtype() == mx::bfloat16 ? 1 : 0;
    enc.add_kernel_node_ex(
        f,
        grid,
        dim3(msh.threads),
        dim3(),
        static_cast<unsigned>(msh.smem),
        qp,
        kcp,
        ksp,
        vcp,
        vsp,
        kcentp,
        vcentp,
        mask_ptr,
        outp,
        lsep,
        op,
        mlp,
        p,
        q_bf16);
  } else {
    enc.add_kernel_node_ex(
        f,
        grid,
        dim3(TQ_ATTN_THREADS),
        dim3(),
        0u,
        qp,
        kcp,
        ksp,
        vcp,
        vsp,
        kcentp,
        vcentp,
        mask_ptr,
        outp,
        lsep,
        op,
        mlp,
        p);
  }

  // The merge is a kernel of its own: merging in the tensor-core kernel's last block
  // per unit was slower (H200, d128 K4V4, 4k / 128k / 256k keys: 15.6 / 53.0 / 93.2 µs
  // of device time against 11.7 / 50.1 / 90.1; the fences and arrival atomics sat on the
  // critical path).
  if (partials) {
    const ck::QType qt = qtype_of(q.dtype());
    if (!out_f32 && out.dtype() != q.dtype()) {
      throw std::invalid_argument(
          "[turboquant_mlx.compressed_attention] out_dtype must be float32 or the queries' "
          "dtype on CUDA.");
    }
    auto fm =
        get_function(ck::attention_merge_kernel(D, qt, !out_f32), "compressed_attention merge");
    enc.set_input_array(o_part);
    enc.set_input_array(ml_part);
    final_node_io();
    const float* opc = op;
    const float* mlc = mlp;
    void* outv = mx::gpu_ptr<void>(out);
    enc.add_kernel_node_ex(
        fm,
        dim3(rows_total),
        dim3(TQ_MERGE_THREADS),
        dim3(),
        0u,
        opc,
        mlc,
        qp,
        tkp,
        tvp,
        kmp,
        vmp,
        outv,
        lsep,
        mp);
  }
}

void write_tokens(
    const WriteTokens& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& enc = mx::cu::get_command_encoder(s);
  const int n = prim.buffers();
  for (int i = 0; i < n; ++i) {
    take_buffer("write_tokens", inputs[i], outputs[i], true, enc);
  }
  // The earlier readers of the overwritten slots: MLX's CUDA graph orders a kernel
  // after the writers of its inputs only, so they are inputs of every copy.
  auto follow_readers = [&] {
    for (size_t a = 2 * n; a < inputs.size(); ++a) {
      enc.set_input_array(inputs[a]);
    }
  };
  const bool pair = n == 2 && inputs[2].itemsize() == inputs[3].itemsize();
  if (!pair) {
    for (int i = 0; i < n; ++i) {
      follow_readers();
      copy_into(inputs[n + i], outputs[i], enc, prim.offset());
    }
    return;
  }
  // Keys and values as one launch.
  ck::TQCopyArgs k = copy_args(inputs[2], outputs[0], prim.offset());
  ck::TQCopyArgs v = copy_args(inputs[3], outputs[1], prim.offset());
  const int64_t most = std::max(k.p.size, v.p.size);
  if (most == 0) {
    return;
  }
  const int itemsize = static_cast<int>(inputs[2].itemsize());
  auto f = get_function(ck::copy_kernel(itemsize, /* pair = */ true), "write_tokens");
  follow_readers();
  for (int i = 0; i < 2; ++i) {
    enc.set_input_array(inputs[2 + i]);
    enc.set_output_array(outputs[i]);
  }
  dim3 grid(static_cast<unsigned>((most + TQ_COPY_THREADS - 1) / TQ_COPY_THREADS), 2);
  enc.add_kernel_node_ex(f, grid, dim3(TQ_COPY_THREADS), dim3(), 0u, k, v);
}

void dequantize(
    const Dequantize& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& enc = mx::cu::get_command_encoder(s);
  auto& codes = inputs[0];
  auto& scales = inputs[1];
  auto& cent = inputs[2];
  auto& out = outputs[0];
  prim.place_output(inputs, out, [&](mx::array& a) { allocate(a, enc); });

  TQDequantParams p = dequantize_params(prim, codes, scales, out); // (the encoder takes lvalues)
  const int64_t total = int64_t(out.size());
  if (total == 0) {
    return;
  }
  auto f = get_function(ck::dequantize_kernel(prim.bits(), qtype_of(out.dtype())), "dequantize");
  enc.set_input_array(codes);
  enc.set_input_array(scales);
  enc.set_input_array(cent);
  const void* rows[2] = {nullptr, nullptr}; // prefix, suffix
  for (int i = 0; i < 2; ++i) {
    const int at = i == 0 ? prim.prefix_input() : prim.suffix_input();
    if (at >= 0) {
      enc.set_input_array(inputs[at]);
      rows[i] = mx::gpu_ptr<void>(inputs[at]);
    }
  }
  enc.set_output_array(out);
  const unsigned int* cp = cptr<unsigned int>(codes);
  const void* sp = mx::gpu_ptr<void>(scales);
  const float* tp = cptr<float>(cent);
  void* outp = mptr<void>(out);
  dim3 grid(static_cast<unsigned>((total + TQ_DEQUANT_THREADS - 1) / TQ_DEQUANT_THREADS));
  enc.add_kernel_node_ex(
      f, grid, dim3(TQ_DEQUANT_THREADS), dim3(), 0u, cp, sp, tp, rows[0], rows[1], outp, p);
}

} // namespace turboquant_mlx::gpu
