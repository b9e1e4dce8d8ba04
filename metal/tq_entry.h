// Layout: Metal only (kernel entry points).
// The [[kernel]] entry points of the turboquant_mlx kernels: thin wrappers over the
// shared bodies in tq_kernels.h and tq_attention_simd.h (as csrc/cuda/tq_entry.cuh is
// for CUDA). Threadgroup memory is a [[threadgroup(0)]] argument whose length the host
// sets (csrc/metal/eval_metal.cpp; the sizes are in tq_params.h).
// Instantiations: turboquant.metal (metallib), or one per kernel at run time.

#pragma once

#include "tq_attention_simd.h"
#include "tq_kernels.h"

// ============================================================================ entry points

template <typename QT, int D, int KB, int VB>
[[kernel]] void tq_attention(
    const device QT* q [[buffer(0)]],
    const device uint* k_codes [[buffer(1)]],
    const device half* k_scales [[buffer(2)]],
    const device uint* v_codes [[buffer(3)]],
    const device half* v_scales [[buffer(4)]],
    const device float* k_cent [[buffer(5)]],
    const device float* v_cent [[buffer(6)]],
    const device uchar* mask [[buffer(7)]],
    device float* out [[buffer(8)]],
    device float* lse [[buffer(9)]],
    device float* o_part [[buffer(10)]],
    device float* ml_part [[buffer(11)]],
    constant TQAttnParams& p [[buffer(12)]],
    threadgroup float* smem [[threadgroup(0)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]]) {
  TQThread th = {tg.x, tg.y, tg.z, tid, lane, simd};
  tq_attention_impl<QT, D, KB, VB>(
      q,
      k_codes,
      k_scales,
      v_codes,
      v_scales,
      k_cent,
      v_cent,
      mask,
      out,
      lse,
      o_part,
      ml_part,
      p,
      smem,
      th);
}

template <typename QT, int D>
[[kernel]] void tq_attention_merge(
    const device float* o_part [[buffer(0)]],
    const device float* ml_part [[buffer(1)]],
    const device QT* q [[buffer(2)]],
    const device QT* tail_k [[buffer(3)]],
    const device QT* tail_v [[buffer(4)]],
    const device float* key_mean [[buffer(5)]],
    const device float* value_mean [[buffer(6)]],
    device float* out [[buffer(7)]],
    device float* lse [[buffer(8)]],
    constant TQMergeParams& p [[buffer(9)]],
    threadgroup float* smem [[threadgroup(0)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]]) {
  TQThread th = {tg.x, tg.y, tg.z, tid, lane, simd};
  tq_attention_merge_impl<QT, D>(
      o_part, ml_part, q, tail_k, tail_v, key_mean, value_mean, out, lse, p, smem, th);
}

template <typename XT, int D, int B>
[[kernel]] void tq_quantize(
    const device XT* x [[buffer(0)]],
    const device float* cent [[buffer(1)]],
    const device float* mean [[buffer(2)]],
    device uint* codes [[buffer(3)]],
    device half* scales [[buffer(4)]],
    constant TQQuantParams& p [[buffer(5)]],
    threadgroup float* smem [[threadgroup(0)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]]) {
  TQThread th = {tg.x, tg.y, tg.z, tid, lane, simd};
  tq_quantize_impl<XT, D, B>(x, cent, mean, codes, scales, nullptr, nullptr, p, smem, th);
}

template <typename OT, int B>
[[kernel]] void tq_dequantize(
    const device uint* codes [[buffer(0)]],
    const device half* scales [[buffer(1)]],
    const device float* cent [[buffer(2)]],
    device OT* out [[buffer(3)]],
    constant TQDequantParams& p [[buffer(4)]],
    const device OT* prefix [[buffer(5)]],
    const device OT* suffix [[buffer(6)]],
    threadgroup float* smem [[threadgroup(0)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]]) {
  TQThread th = {tg.x, tg.y, tg.z, tid, lane, simd};
  tq_dequantize_impl<OT, B>(codes, scales, cent, prefix, suffix, out, p, smem, th);
}

template <typename T>
[[kernel]] void tq_copy(
    const device T* src [[buffer(0)]],
    device T* dst [[buffer(1)]],
    constant TQCopyParams& p [[buffer(2)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]]) {
  TQThread th = {tg.x, tg.y, tg.z, tid, lane, simd};
  tq_copy_impl<T>(src, dst, p, th);
}

template <typename QT, int D, int KB, int VB>
[[kernel]] void tq_attention_simd(
    const device QT* q [[buffer(0)]],
    const device uint* k_codes [[buffer(1)]],
    const device half* k_scales [[buffer(2)]],
    const device uint* v_codes [[buffer(3)]],
    const device half* v_scales [[buffer(4)]],
    const device float* k_cent [[buffer(5)]],
    const device float* v_cent [[buffer(6)]],
    const device uchar* mask [[buffer(7)]],
    device float* out [[buffer(8)]],
    device float* lse [[buffer(9)]],
    device float* o_part [[buffer(10)]],
    device float* ml_part [[buffer(11)]],
    constant TQAttnParams& p [[buffer(12)]],
    threadgroup float* smem [[threadgroup(0)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]]) {
  TQThread th = {tg.x, tg.y, tg.z, tid, lane, simd};
  tq_attention_simd_impl<QT, D, KB, VB>(
      q,
      k_codes,
      k_scales,
      v_codes,
      v_scales,
      k_cent,
      v_cent,
      mask,
      out,
      lse,
      o_part,
      ml_part,
      p,
      smem,
      th);
}

/// A window ring's exchange (RingAppend): the tokens in a ring's slots are quantized into
/// the compressed cache, then the incoming tokens take their slots. Keys and values in
/// one dispatch (grid y: 0 keys, 1 values; a grid of height 1 runs the keys' arguments
/// alone, for parts of different bits or types).
template <typename XT, int D, int B>
[[kernel]] void tq_exchange(
    device XT* k_slots [[buffer(0)]],
    const device float* k_cent [[buffer(1)]],
    const device float* k_mean [[buffer(2)]],
    device uint* k_codes [[buffer(3)]],
    device half* k_scales [[buffer(4)]],
    const device XT* k_in [[buffer(5)]],
    constant TQQuantParams& k_p [[buffer(6)]],
    device XT* v_slots [[buffer(7)]],
    const device float* v_cent [[buffer(8)]],
    const device float* v_mean [[buffer(9)]],
    device uint* v_codes [[buffer(10)]],
    device half* v_scales [[buffer(11)]],
    const device XT* v_in [[buffer(12)]],
    constant TQQuantParams& v_p [[buffer(13)]],
    threadgroup float* smem [[threadgroup(0)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd [[simdgroup_index_in_threadgroup]]) {
  TQThread th = {tg.x, tg.y, tg.z, tid, lane, simd};
  if (tg.y == 0) {
    tq_quantize_impl<XT, D, B>(
        k_slots, k_cent, k_mean, k_codes, k_scales, k_slots, k_in, k_p, smem, th);
  } else {
    tq_quantize_impl<XT, D, B>(
        v_slots, v_cent, v_mean, v_codes, v_scales, v_slots, v_in, v_p, smem, th);
  }
}

// One instantiation: kernel `name` as func<template arguments>. The metallib build
// instantiates them all (turboquant.metal); the build without Apple's Metal compiler
// compiles this header plus the one line each kernel needs at first use
// (csrc/metal/eval_metal.cpp).
#ifndef TQ_INSTANTIATE
#define TQ_INSTANTIATE(name, func, ...) \
  template [[host_name(name)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;
#endif
