// The memory ledger: every allocation nibble makes (device_malloc on the GPU, Buffers and arenas on the
// host) is recorded under the part of the job it belongs to, so a run reports its allocator high-water
// mark per part and a failed allocation names what it was for. The same part names label the rows of
// the memory estimate (train/memory_estimate.h), so estimate and measurement line up part by part.
// A part is set by a MemoryScope on the calling thread (innermost wins); without one, allocations go
// to MemPart::other. Cost: one mutex and one hash-map update per allocation (never on a hot path:
// activations come from an arena reserved once).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include "core/tensor.h"

namespace nb {

enum class MemPart : int {
  other = 0,
  params,             // FP32 master, gradient, AdamW m/v and the compute copy (or their shards and windows)
  optimizer_staging,  // --optimizer-cpu-offload's streaming windows
  activations,        // the micro-batch arena
  quantized_copies,   // weight copies and kept input copies owned by the Linears
  linear_workspace,   // transient quantized copies shared by the Linears
  weight_stage,       // a quantized layer's weight cast from its FP32 master
  gemm_workspace,     // cuBLASLt's workspace
  emulated_scratch,   // the BF16 scratch of emulated MXFP8/NVFP4 GEMMs
  attention_workspace,
  step_inputs,   // staged tokens, labels, segment starts, positions, RoPE tables, loss sums
  comm_buffers,  // gradient-reduction and gather scratch of data parallelism
  lora,          // adapters and their helpers
  quant_stats,   // --quant-stats' scratch
  samples,       // generation while training (KV cache, decode buffers)
  count
};
constexpr int kMemParts = int(MemPart::count);
const char* mem_part_name(MemPart p);

// Sets the part that allocations on this thread are recorded under until it is destroyed.
class MemoryScope {
 public:
  explicit MemoryScope(MemPart part);
  ~MemoryScope();
  MemoryScope(const MemoryScope&) = delete;
  MemoryScope& operator=(const MemoryScope&) = delete;

 private:
  MemPart prev_;
};
MemPart current_mem_part();

struct MemoryUse {
  size_t current = 0, peak = 0;
};
struct LedgerSnapshot {
  MemoryUse total;
  std::array<MemoryUse, kMemParts> parts{};  // each part's own high-water mark
};

// Records an allocation of `bytes` at p on dev (under the current part) and its release.
void ledger_add(Device dev, const void* p, size_t bytes);
void ledger_remove(Device dev, const void* p);
LedgerSnapshot ledger_snapshot(Device dev);
// Peaks restart from the current use (a test measuring one phase).
void ledger_reset_peaks(Device dev);

}  // namespace nb
