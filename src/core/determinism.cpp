// The --deterministic-mode switch (core/determinism.h). Atomic because plan builders may read it from
// any thread; it changes only between runs.
#include "core/determinism.h"

#include <atomic>

namespace nb {
namespace {
std::atomic<bool> g_deterministic{false};
}  // namespace

void set_deterministic_mode(bool on) { g_deterministic.store(on, std::memory_order_relaxed); }
bool deterministic_mode() { return g_deterministic.load(std::memory_order_relaxed); }

}  // namespace nb
