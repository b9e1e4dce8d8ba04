// Layout: host code, every build.
// Python module turboquant_mlx._ext. The public Python API lives in
// turboquant_mlx.ops, which adds the rotation and the plain-MLX fallbacks.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "buffer_copies.h"
#include "gpu.h"
#include "kernel_overrides.h"
#include "ops.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace tq = turboquant_mlx;

#if defined(TURBOQUANT_EXTRA_BINDINGS)
// A build of this module for tests adds its own functions (tools/metal_emu).
void TURBOQUANT_EXTRA_BINDINGS(nb::module_& m);
#endif

NB_MODULE(_ext, m) {
  m.doc() = "TurboQuant compressed KV-cache primitives for MLX (rotated space).";
  // mx.Dtype defaults below are converted by mlx.core's bindings: load them first.
  nb::module_::import_("mlx.core");

  m.attr("MAX_TAIL_TOKENS") = TQ_MAX_TAIL; // most tail tokens compressed_attention takes

  m.def(
      "words_per_token",
      &tq::words_per_token,
      "head_dim"_a,
      "bits"_a,
      "32-bit words one token of `head_dim` coordinates takes at `bits` bits.");

  m.def(
      "buffer_copies",
      &tq::buffer_copies,
      "Cache-buffer copies the primitives made so far in this process: a quantize_append "
      "that could not reuse the cache's buffers (O(capacity) instead of O(new tokens)), or "
      "an attention call that copied codes its kernel cannot read in place. "
      "TURBOQUANT_DEBUG_COPIES=1 prints each one's cause to stderr.");
  m.def(
      "_set_kernel_override",
      [](const std::string& name, std::optional<std::variant<int, std::string>> value) {
        std::optional<std::string> text;
        if (value) {
          text = std::holds_alternative<int>(*value) ? std::to_string(std::get<int>(*value))
                                                     : std::get<std::string>(*value);
        }
        tq::set_kernel_override(name, text);
      },
      "name"_a,
      "value"_a.none(),
      "For tests and benchmarks: forces a GPU kernel choice until set back to None (the "
      "backend's own). 'attention': 'portable' (the portable kernel where CUDA's "
      "tensor-core or Metal's simdgroup-matrix kernel would run) or 'simd' (CUDA: the "
      "simdgroup-matrix kernel on the emulation of simdgroup matrices, float16/bfloat16 "
      "queries at head dims 64/128/256); 'splits': the split-K count; 'ctas': the "
      "threadgroups the split heuristic aims at; 'min_steps' (CUDA): least block "
      "iterations per split. Counts are positive integers.");
  m.def(
      "_kernel_overrides",
      [] {
        nb::dict d;
        const auto kernel = tq::attention_kernel_override();
        d["attention"] = kernel == tq::AttentionKernel::portable ? nb::cast("portable")
            : kernel == tq::AttentionKernel::simd                ? nb::cast("simd")
                                                                 : nb::none();
        auto count = [](int n) { return n > 0 ? nb::cast(n) : nb::none(); };
        d["splits"] = count(tq::splits_override());
        d["ctas"] = count(tq::ctas_override());
        d["min_steps"] = count(tq::min_steps_override());
        return d;
      },
      "The overrides _set_kernel_override set, as a dict (None: the backend's choice).");
  nb::class_<tq::KernelSupport>(
      m,
      "KernelSupport",
      "Which kernels this build runs on one device (kernel_support). kernels: the "
      "primitives run as kernels (else the ops take the plain-MLX fallback); write_tokens: "
      "the in-place token write has one (else slice updates); out_in_query_dtype / "
      "out_in_any_dtype: attention writes a float16/bfloat16 out itself for queries of "
      "that dtype / of any dtype; self_check: the kernels run only once the first-use "
      "self-check passed (selfcheck.py).")
      .def_ro("kernels", &tq::KernelSupport::kernels)
      .def_ro("write_tokens", &tq::KernelSupport::write_tokens)
      .def_ro("out_in_query_dtype", &tq::KernelSupport::out_in_query_dtype)
      .def_ro("out_in_any_dtype", &tq::KernelSupport::out_in_any_dtype)
      .def_ro("self_check", &tq::KernelSupport::self_check)
      .def("__repr__", [](const tq::KernelSupport& k) {
        auto b = [](bool v) { return v ? std::string("True") : std::string("False"); };
        return "KernelSupport(kernels=" + b(k.kernels) + ", write_tokens=" + b(k.write_tokens) +
            ", out_in_query_dtype=" + b(k.out_in_query_dtype) +
            ", out_in_any_dtype=" + b(k.out_in_any_dtype) + ", self_check=" + b(k.self_check) + ")";
      });
  m.def(
      "kernel_support",
      [](const mlx::core::Device& device) { return tq::kernel_support(device); },
      "device"_a,
      "Which kernels this build runs on `device` (an mx.Device): the one answer the ops ask.");
  m.def(
      "gpu_available",
      [] { return tq::gpu::kernel_support().kernels; },
      "True when this build carries GPU kernels.");
  m.def(
      "gpu_backend", &tq::gpu::backend_name, "GPU backend compiled in: 'cuda', 'metal' or 'none'.");
  m.def(
      "gpu_pool_memory",
      &tq::gpu::pool_memory,
      "reset_peak"_a = false,
      "[in use, peak in use, held free] bytes of device memory the GPU backend allocates "
      "outside MLX's allocator (CUDA: outputs and temporaries of the ops), which "
      "mx.get_peak_memory does not see; reset_peak restarts the peak. Zeros elsewhere.");
  m.def(
      "_simdgroup_matrix_check",
      &tq::gpu::simdgroup_matrix_check,
      "a"_a,
      "b"_a,
      "c"_a,
      "For tests: the CUDA build's emulation of Metal's simdgroup matrices run on 8x8 "
      "row-major a, b, c (64 floats each); returns 8 x 64 floats (what the lanes held and "
      "stored, see csrc/cuda/simdgroup_matrix_check.cu). Raises on other builds.");

  nb::class_<tq::RotationSigns>(
      m,
      "RotationSigns",
      "The D signs s of a rotation R = H diag(s) / sqrt(D) (power-of-two D), as the ops' "
      "rotation_signs take them. Ops also accept a plain sequence of floats, converted on "
      "every call; a cache builds this once. A sequence of the signs itself.")
      .def(nb::init_implicit<std::vector<float>>(), "signs"_a)
      .def("__len__", [](const tq::RotationSigns& s) { return s.values.size(); })
      .def(
          "__getitem__",
          [](const tq::RotationSigns& s, Py_ssize_t i) {
            const auto n = static_cast<Py_ssize_t>(s.values.size());
            if (i < 0) {
              i += n;
            }
            if (i < 0 || i >= n) {
              throw nb::index_error();
            }
            return s.values[i];
          })
      .def(
          "__repr__",
          [](const tq::RotationSigns& s) {
            return "RotationSigns(<" + std::to_string(s.values.size()) + " signs>)";
          })
      // Immutable: a copy is the object itself (caches holding it are copied and
      // deep-copied); pickling stores the signs.
      .def("__copy__", [](nb::handle self) { return nb::borrow<nb::object>(self); })
      .def(
          "__deepcopy__",
          [](nb::handle self, nb::handle /* memo */) { return nb::borrow<nb::object>(self); },
          "memo"_a)
      .def("__getstate__", [](const tq::RotationSigns& s) { return s.values; })
      .def("__setstate__", [](tq::RotationSigns& s, std::vector<float> values) {
        new (&s) tq::RotationSigns(std::move(values));
      });

  m.def(
      "quantize_append",
      &tq::quantize_append,
      "codes"_a,
      "scales"_a,
      "x"_a,
      "centroids"_a,
      "offset"_a,
      "bits"_a,
      nb::kw_only(),
      "rotation_signs"_a = nb::none(),
      "mean"_a = nb::none(),
      "in_place"_a = false,
      "stream"_a = nb::none(),
      R"(Quantize tokens into the cache buffers at ``offset``.

        Args:
            codes (array): ``uint32`` cache codes, shape ``(B, H, capacity, D*bits/32)``.
            scales (array): ``float16`` per-token scales, shape ``(B, H, capacity)``.
            x (array): new tokens, shape ``(B, H, L, D)``, rotated, or in model space
                with ``rotation_signs``.
            centroids (array): the ``2**bits`` codebook values.
            offset (int): first token slot written.
            bits (int): 2, 3 or 4.
            rotation_signs (RotationSigns or list[float], optional): the ``D`` signs
                ``s`` of the rotation ``R = H diag(s) / sqrt(D)`` (power-of-two ``D``),
                which the kernels then apply to ``x`` themselves.
            mean (array, optional): ``(B, H, 1, D)``, in ``x``'s space: ``x - mean``
                is quantized (a mean-centered cache).
            in_place (bool): write into the input buffers even while other arrays
                reference them (they see the new tokens too). For a caller that owns
                the buffers and whose other readers only look at slots before
                ``offset``; it keeps appends O(L) under pipelined decoding.

        Returns:
            list[array]: the updated ``[codes, scales]``; they reuse the input buffers
            when those are not referenced elsewhere, or with ``in_place``.)");

  m.def(
      "quantize_append_kv",
      &tq::quantize_append_kv,
      "k_codes"_a,
      "k_scales"_a,
      "v_codes"_a,
      "v_scales"_a,
      "keys"_a,
      "values"_a,
      "k_centroids"_a,
      "v_centroids"_a,
      "offset"_a,
      "key_bits"_a,
      "value_bits"_a,
      nb::kw_only(),
      "key_rotation_signs"_a = nb::none(),
      "value_rotation_signs"_a = nb::none(),
      "key_mean"_a = nb::none(),
      "value_mean"_a = nb::none(),
      "stream"_a = nb::none(),
      R"(A layer's keys and values quantized into their caches at ``offset``, in place,
        as one graph node (``quantize_append`` with ``in_place`` for each, in one).

        Each tensor takes the arguments ``quantize_append`` takes for it; keys and
        values bring the same number of tokens into caches of the same capacity.

        Returns:
            list[array]: ``[k_codes, k_scales, v_codes, v_scales]``, sharing the input
            buffers.)");

  m.def(
      "ring_append_kv",
      &tq::ring_append_kv,
      "k_codes"_a,
      "k_scales"_a,
      "v_codes"_a,
      "v_scales"_a,
      "k_ring"_a,
      "v_ring"_a,
      "keys"_a,
      "values"_a,
      "k_centroids"_a,
      "v_centroids"_a,
      "offset"_a,
      "slot"_a,
      "key_bits"_a,
      "value_bits"_a,
      nb::kw_only(),
      "key_rotation_signs"_a = nb::none(),
      "value_rotation_signs"_a = nb::none(),
      "key_mean"_a = nb::none(),
      "value_mean"_a = nb::none(),
      "after"_a = std::vector<tq::mx::array>{},
      "stream"_a = nb::none(),
      R"(A window ring's exchange as one graph node (CPU, CUDA and Metal streams).

        The tokens in slots ``[slot, slot + L)`` of ``k_ring`` / ``v_ring``
        ``(B, H, slots, D)`` (the ones leaving a cache's window) are quantized into
        the caches at ``offset``, as ``quantize_append_kv`` with the same arguments
        would from those tokens; then ``keys`` / ``values`` ``(B, H, L, D)`` (in the
        rings' dtype) are written into those slots, as ``write_tokens_kv`` with
        ``after`` would.

        Returns:
            list[array]: ``[k_codes, k_scales, v_codes, v_scales, k_ring, v_ring]``,
            sharing the input buffers.)");

  m.def(
      "write_tokens",
      &tq::write_tokens,
      "buffer"_a,
      "x"_a,
      "offset"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      R"(Write tokens into a dense cache buffer in place (CPU and CUDA streams).

        Args:
            buffer (array): ``(B, H, capacity, D)`` float16, bfloat16 or float32.
            x (array): ``(B, H, L, D)`` in the buffer's dtype.
            offset (int): first token slot written.

        Returns:
            array: the buffer with ``x`` at ``[offset, offset + L)``, in the input
            buffer's memory even while other arrays reference it (they see the new
            tokens too; a buffer that is not row-contiguous is copied first). For a
            caller that owns the buffer and whose other readers only look at slots
            before ``offset``: the benchmarks' fp16 cache that does not copy itself
            under pipelined decoding (``bench/bench_decode.py --caches fp16:inplace``).)");

  m.def(
      "write_tokens_kv",
      &tq::write_tokens_kv,
      "k_buffer"_a,
      "v_buffer"_a,
      "keys"_a,
      "values"_a,
      "offset"_a,
      nb::kw_only(),
      "after"_a = std::vector<tq::mx::array>{},
      "stream"_a = nb::none(),
      R"(``write_tokens`` into a layer's key and value buffers as one graph node.

        Args:
            k_buffer, v_buffer (array): ``(B, H, capacity, D)`` float16, bfloat16 or
                float32.
            keys, values (array): ``(B, H, L, D)`` in their buffer's dtype.
            offset (int): first token slot written.
            after (list[array]): arrays this write must follow: earlier readers of
                the slots it overwrites (e.g. the previous decode step's attention
                output, when the buffers are a ring of recent tokens). They are
                inputs of the node, not read.

        Returns:
            list[array]: ``[k_buffer, v_buffer]`` written in place (see
            ``write_tokens``).)");

  m.def(
      "compressed_attention",
      &tq::compressed_attention,
      "q"_a,
      "k_codes"_a,
      "k_scales"_a,
      "v_codes"_a,
      "v_scales"_a,
      "k_centroids"_a,
      "v_centroids"_a,
      "kv_len"_a,
      "scale"_a,
      "key_bits"_a,
      "value_bits"_a,
      "causal"_a,
      "mask"_a = nb::none(),
      nb::kw_only(),
      "tail_k"_a = nb::none(),
      "tail_v"_a = nb::none(),
      "rotation_signs"_a = nb::none(),
      "rotate_output"_a = true,
      "key_mean"_a = nb::none(),
      "value_mean"_a = nb::none(),
      "out_dtype"_a = nb::none(),
      "stream"_a = nb::none(),
      R"(Attention of queries ``(B, Hq, L<=8, D)`` over the compressed cache and, when
        given, the tail: up to 256 uncompressed keys and values ``(B, Hkv, T, D)`` in
        the queries' space that every query sees.

        The queries are rotated, or in model space with ``rotation_signs`` (see
        ``quantize_append``): the kernels rotate them, and with ``rotate_output``
        (values stored rotated) return ``out`` in model space. The tail is always in
        the queries' space, so with ``rotation_signs`` it is in model space.

        ``key_mean`` / ``value_mean`` ``(B, Hkv, 1, D)``, in the queries' space: the
        compressed tokens were appended with those means (``quantize_append``'s
        ``mean``) and the tail was not; the op adds them back, so that ``out`` and
        ``lse`` are those of the uncentered keys and values.

        ``out_dtype`` (float32 when None; float16 or bfloat16): ``out`` in that dtype,
        written by the kernels (a decode step's layer output without a conversion of
        its own; on Metal converted after the kernels).

        Returns:
            list[array]: ``[out, lse]``: ``out`` ``(B, Hq, L, D)`` (``out_dtype``) and the
            float32 log-sum-exp ``(B, Hq, L)`` of the scaled, masked scores.)");

  m.def(
      "dequantize",
      &tq::dequantize,
      "codes"_a,
      "scales"_a,
      "centroids"_a,
      "bits"_a,
      "start"_a,
      "length"_a,
      nb::kw_only(),
      "dtype"_a = mlx::core::float32,
      "before"_a = 0,
      "after"_a = 0,
      "prefix"_a = nb::none(),
      "suffix"_a = nb::none(),
      "into"_a = nb::none(),
      "stream"_a = nb::none(),
      "Decode tokens [start, start + length) to rotated-space vectors of dtype at slots\n"
      "[before, before + length) of a (B, H, before + length + after, D) array whose other\n"
      "slots are zero, or the rows of prefix (B, H, before, D) / suffix (B, H, after, D)\n"
      "where given. into: a row-contiguous array of dtype with at least as many elements;\n"
      "the result is written into its buffer (a temporary reused call after call).");
#if defined(TURBOQUANT_EXTRA_BINDINGS)
  TURBOQUANT_EXTRA_BINDINGS(m);
#endif
}
