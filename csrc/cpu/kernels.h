// Layout: host code, every build (CPU kernels).
// CPU backend of the primitives (eval_cpu).
#pragma once

#include <atomic>
#include <memory>
#include <vector>

#include "kernel_support.h"
#include "primitives.h"

namespace turboquant_mlx::cpu {

/// Every primitive has a CPU kernel; out is written in any dtype.
inline KernelSupport kernel_support() {
  KernelSupport k;
  k.kernels = k.write_tokens = k.out_in_query_dtype = k.out_in_any_dtype = true;
  return k;
}

/// Counts the tasks of a node that completed, for a later task of the node that must
/// not run after a failed one (RingAppend's write after its append).
using TaskCount = std::shared_ptr<std::atomic<int>>;

/// A QuantizeAppend node, all its parts (inputs and outputs as the node's), as one task
/// of the stream's encoder. The tokens of every part are checked and quantized into
/// scratch before any buffer is written: a token that cannot be stored (NaN/Inf, a
/// scale beyond float16) makes the task raise, naming prim.op(), and every buffer keeps
/// its contents. `done` (optional) is incremented once all parts are written.
/// `ring_slot` >= 0: x holds the tokens of ring slots [ring_slot, ring_slot + L)
/// (RingAppend's leaving tokens), which messages name.
void quantize_append(
    const QuantizeAppend& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    TaskCount done = nullptr,
    int ring_slot = -1);

/// Tokens [slot, slot + length) of a ring (B, H, slots, D; float32, float16 or
/// bfloat16) as a float32 row-major array (B, H, length, D), filled by a task of the
/// stream's encoder (RingAppend's leaving tokens, as the quantize kernel reads them).
mx::array ring_slots_f32(const mx::array& ring, int slot, int length, const mx::Stream& s);

/// One WriteTokens node. With `after`, its copies run only if `after` counts `needed`
/// completed tasks by then (they follow those tasks on the stream): otherwise the
/// buffers keep their contents.
void write_tokens(
    const WriteTokens& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs,
    TaskCount after = nullptr,
    int needed = 0);

void attention(
    const CompressedAttention& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs);

void dequantize(
    const Dequantize& prim,
    const mx::Stream& s,
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs);

} // namespace turboquant_mlx::cpu
