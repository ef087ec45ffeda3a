// The roofline of the training step (--profile, or NIBBLE_PROFILE=1), after the hierarchical and
// time-based roofline analyses of Yang, Wang, Farrell et al. (2020): every phase of the step (the
// profiler's marks, core/gpu_profile.h) with its measured time, its work from the shapes (FLOPs and
// the bytes it must move), the achieved TFLOP/s and GB/s, the ceiling that bounds it, the time it would
// take at its ceilings, and the share of the step lost to the distance between the two. The GEMMs inside
// the phases are a second level, each against its own ceiling: the same call (shape, formats, layout)
// timed alone by nibble bench's code on this GPU at the end of the run. Time outside every phase is its
// own row ("unattributed"), so the phases' rows sum to the step time. docs/PERFORMANCE.md ("Roofline")
// states the formulas and how to read the table.
#pragma once
#include <map>
#include <string>
#include <vector>
#include "core/gpu_profile.h"
#include "core/status.h"

namespace nb::roofline {

// Ceilings measured on this GPU.
struct Ceilings {
  double copy_gbs = 0;                        // device-to-device copy, read + write
  double tensor_tflops = 0;                   // BF16 8192^3 GEMM: the bound of attention's and elementwise FLOPs
  std::map<std::string, double> gemm_tflops;  // per GEMM sub-interval name ("gemm " + GemmCall::key())
};

struct Row {
  std::string name, parent;                        // parent: the phase of a GEMM row, empty for a phase
  double ms = 0, calls = 0, flops = 0, bytes = 0;  // per step
  double ideal_ms = 0;                             // the same work at the ceilings
  std::string bound;                               // "GEMM", "tensor", "memory", or "-" (no work stated)
  double ceiling_tflops = 0;           // GEMM/tensor bound: the (harmonic mean) TFLOP/s ceiling of its FLOPs
  double ceiling_gbs = 0;              // memory bound: the copy bandwidth
  double lost_ms = 0, lost_share = 0;  // max(0, ms - ideal_ms), and that over the step time
  double tflops() const { return ms > 0 ? flops / (ms * 1e9) : 0; }
  double gbs() const { return ms > 0 ? bytes / (ms * 1e6) : 0; }
};

struct Report {
  std::string title;        // model, recipe, device
  long steps = 0;           // profiled steps (the first step of the run is a warm-up, not profiled)
  double step_ms = 0;       // mean wall time of those steps
  std::vector<Row> phases;  // by time, longest first; the last row is "unattributed"
  std::vector<Row> gemms;   // the GEMM calls inside the phases, by time
  // Other measured sub-intervals of the phases (e.g. MoR's error statistic), by time: their cost, no ceiling.
  std::vector<Row> others;
  Ceilings ceilings;
  double phases_ms() const;   // the phases without the unattributed row
  double ideal_ms() const;    // the step at its ceilings (phases' ideal times)
  double lost_share() const;  // sum of the rows' lost shares (unattributed included)
};

inline constexpr const char* kUnattributed = "unattributed (outside the phases)";

// The report from the profiler's per-step entries, the measured step time and the ceilings. Pure
// arithmetic (tested on the CPU).
Report build(const std::vector<profile::Entry>& entries, double step_ms, const Ceilings& c);
// The table printed at the end of the run.
std::string format_table(const Report& r);
// roofline.json: every row and ceiling.
std::string to_json(const Report& r);
// roofline.svg: the phases and GEMMs on a log-log roofline, and a bar per phase (time and lost time).
std::string to_svg(const Report& r);

// GPU, at the end of a profiled run: measures the ceilings (copy bandwidth, the BF16 8192^3 GEMM, and each
// GEMM call the run recorded, with nibble bench's code), prints the table and writes roofline.json and
// roofline.svg into `dir` (none when empty). Turns the profiler off first.
Status report(const std::string& title, double step_ms, const std::string& dir);

}  // namespace nb::roofline
