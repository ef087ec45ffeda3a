// Phase profiler: the CPU-only build has nothing to time on a GPU (enabled() stays false).
#include "core/gpu_profile.h"

#if !defined(NIBBLE_HAVE_CUDA)
namespace nb::profile {
bool enabled() { return false; }
void set_enabled(bool) {}
void begin(const char*) {}
void end(const char*) {}
void begin_child(const std::string&, double, double) {}
void end_child() {}
void add_work(const char*, double, double) {}
void collect(bool) {}
void reset() {}
std::vector<Entry> per_step() { return {}; }
long steps() { return 0; }
}  // namespace nb::profile
#endif
