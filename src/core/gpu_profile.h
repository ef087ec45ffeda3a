// A phase profiler for the training step: with `nibble train --profile` (or NIBBLE_PROFILE=1 in the
// environment), GPU time between NB_PROFILE_BEGIN/END marks is measured with CUDA events on the
// (serialized) default stream and summed per phase name. Besides time, each phase carries work: the
// FLOPs and bytes its call sites state from the shapes (NB_PROFILE_WORK), and measured sub-intervals
// (begin_child/end_child: the GEMMs inside a phase, with their own work). train/roofline.h turns the
// totals into the roofline report. Off by default: the marks then cost one branch.
#pragma once
#include <string>
#include <vector>

namespace nb::profile {

bool enabled();
// Turns the profiler on (--profile) or off; NIBBLE_PROFILE=1 in the environment starts it on.
void set_enabled(bool on);
void begin(const char* phase);
void end(const char* phase);
// A measured sub-interval of the innermost open phase (e.g. one GEMM call): `key` names it (calls with the
// same key and parent are summed), `flops` and `bytes` are the work of this call.
void begin_child(const std::string& key, double flops, double bytes);
void end_child();
// The work of one call of `phase` (FLOPs; bytes moved at the least), stated by the call site from the shapes.
void add_work(const char* phase, double flops, double bytes);
// Waits for the GPU, folds the recorded intervals into the per-phase totals, and prints them (ms per call
// of collect, i.e. per step when called once per step) if `print`.
void collect(bool print);
// Forgets the totals so far (e.g. after a warm-up step).
void reset();

// One phase (parent empty) or sub-interval (parent = its phase) with its totals per step: the sums since
// the last reset divided by the number of collects.
struct Entry {
  std::string name, parent;
  double ms = 0, calls = 0, flops = 0, bytes = 0;
};
std::vector<Entry> per_step();
// Collects since the last reset (the steps the totals cover).
long steps();

}  // namespace nb::profile

#define NB_PROFILE_BEGIN(name)                                \
  do {                                                        \
    if (::nb::profile::enabled()) ::nb::profile::begin(name); \
  } while (0)
#define NB_PROFILE_END(name)                                \
  do {                                                      \
    if (::nb::profile::enabled()) ::nb::profile::end(name); \
  } while (0)
// The work expression is evaluated only while profiling: NB_PROFILE_WORK("fwd: rope", work::rope(...)).
#define NB_PROFILE_WORK(name, work)                                                  \
  do {                                                                               \
    if (::nb::profile::enabled()) {                                                  \
      const auto nb_profile_work_ = (work);                                          \
      ::nb::profile::add_work(name, nb_profile_work_.flops, nb_profile_work_.bytes); \
    }                                                                                \
  } while (0)
