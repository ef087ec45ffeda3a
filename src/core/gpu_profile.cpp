// Phase profiler: the CPU-only build has nothing to time on a GPU.
#include "core/gpu_profile.h"

#if !defined(NIBBLE_HAVE_CUDA)
namespace nb::profile {
bool enabled() { return false; }
void begin(const char*) {}
void end(const char*) {}
void collect(bool) {}
void reset() {}
}  // namespace nb::profile
#endif
