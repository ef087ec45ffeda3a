// A phase profiler for the training step: with NIBBLE_PROFILE=1 in the environment, GPU time between
// NB_PROFILE_BEGIN/END marks is measured with CUDA events on the (serialized) default stream and
// summed per phase name; report() prints the table. Off by default: the marks then cost one branch.
#pragma once
#include <string>

namespace nb::profile {

bool enabled();
void begin(const char* phase);
void end(const char* phase);
// Waits for the GPU, folds the recorded intervals into the per-phase totals, and prints them (ms per call
// of report, i.e. per step when called once per step) if `print`.
void collect(bool print);
// Forgets the totals so far (e.g. after a warm-up step).
void reset();

}  // namespace nb::profile

#define NB_PROFILE_BEGIN(name)                                \
  do {                                                        \
    if (::nb::profile::enabled()) ::nb::profile::begin(name); \
  } while (0)
#define NB_PROFILE_END(name)                                \
  do {                                                      \
    if (::nb::profile::enabled()) ::nb::profile::end(name); \
  } while (0)
