// The memory ledger (memory_ledger.h): per device a map of live allocations and running totals.
#include "core/memory_ledger.h"
#include <algorithm>
#include <mutex>
#include <unordered_map>

namespace nb {

namespace {

struct Entry {
  size_t bytes;
  MemPart part;
};

struct DeviceLedger {
  std::unordered_map<const void*, Entry> live;
  LedgerSnapshot use;
};

struct Ledger {
  std::mutex mu;
  DeviceLedger dev[2];  // Device::cpu, Device::cuda
};

Ledger& ledger() {
  static Ledger* l = new Ledger();  // leaked on purpose: frees may run during static destruction
  return *l;
}

thread_local MemPart t_part = MemPart::other;

void grow(MemoryUse& u, size_t bytes) {
  u.current += bytes;
  u.peak = std::max(u.peak, u.current);
}

}  // namespace

const char* mem_part_name(MemPart p) {
  static const char* const kNames[kMemParts] = {"other",
                                                "weights, gradients, optimizer state",
                                                "offload staging",
                                                "activations (arena)",
                                                "quantized copies (Linears)",
                                                "quantized transients (shared workspace)",
                                                "weight staging",
                                                "cuBLASLt workspace",
                                                "emulated GEMM scratch",
                                                "attention workspace",
                                                "step inputs, RoPE, loss",
                                                "data-parallel buffers",
                                                "LoRA adapters",
                                                "quantization statistics",
                                                "sample generation"};
  const int i = int(p);
  return i >= 0 && i < kMemParts ? kNames[i] : "?";
}

MemoryScope::MemoryScope(MemPart part) : prev_(t_part) { t_part = part; }
MemoryScope::~MemoryScope() { t_part = prev_; }
MemPart current_mem_part() { return t_part; }

void ledger_add(Device dev, const void* p, size_t bytes) {
  if (!p) return;
  Ledger& l = ledger();
  std::lock_guard<std::mutex> lock(l.mu);
  DeviceLedger& d = l.dev[int(dev)];
  d.live[p] = Entry{bytes, t_part};
  grow(d.use.total, bytes);
  grow(d.use.parts[size_t(t_part)], bytes);
}

void ledger_remove(Device dev, const void* p) {
  if (!p) return;
  Ledger& l = ledger();
  std::lock_guard<std::mutex> lock(l.mu);
  DeviceLedger& d = l.dev[int(dev)];
  auto it = d.live.find(p);
  if (it == d.live.end()) return;  // allocated before the ledger knew of it (never, but harmless)
  d.use.total.current -= it->second.bytes;
  d.use.parts[size_t(it->second.part)].current -= it->second.bytes;
  d.live.erase(it);
}

LedgerSnapshot ledger_snapshot(Device dev) {
  Ledger& l = ledger();
  std::lock_guard<std::mutex> lock(l.mu);
  return l.dev[int(dev)].use;
}

void ledger_reset_peaks(Device dev) {
  Ledger& l = ledger();
  std::lock_guard<std::mutex> lock(l.mu);
  LedgerSnapshot& s = l.dev[int(dev)].use;
  s.total.peak = s.total.current;
  for (MemoryUse& u : s.parts) u.peak = u.current;
}

}  // namespace nb
