// The end of a profiled run (roofline.h report()): ceilings measured with nibble bench's code for the
// GEMM calls the run made, then the table on stdout and roofline.json / roofline.svg in the folder.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include "gemm/gemm_bench.h"
#include "gemm/gemm_call.h"
#include "train/roofline.h"

namespace nb::roofline {

namespace {
constexpr int kIters = 10;                        // timed runs per ceiling (median), after 3 warm-ups
constexpr size_t kCopyBytes = size_t(512) << 20;  // the copy-bandwidth buffer

// A ceiling that cannot be measured (e.g. no memory left for the replay) is reported as 0, not fatal.
void warn(const Status& s, const char* what) {
  if (!s) std::fprintf(stderr, "warning: roofline: %s not measured: %s\n", what, s.message().c_str());
}

Ceilings measure() {
  Ceilings c;
  warn(gemm::measure_copy_bandwidth(kCopyBytes, kIters, &c.copy_gbs), "copy bandwidth");
  warn(gemm::measure_gemm_tflops(8192, 8192, 8192, kIters, &c.tensor_tflops), "the BF16 8192^3 GEMM");
  for (const gemm::GemmCall& call : gemm::recorded_gemm_calls()) {
    double t = 0;
    const Status s = gemm::measure_gemm_call_tflops(call, kIters, &t);
    warn(s, call.key().c_str());
    if (s) c.gemm_tflops["gemm " + call.key()] = t;
  }
  return c;
}

Status write_file(const std::filesystem::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << text;
  f.close();
  if (!f) return errorf("roofline: cannot write %s", p.string().c_str());
  return Status::ok();
}
}  // namespace

Status report(const std::string& title, double step_ms, const std::string& dir) {
  const std::vector<profile::Entry> entries = profile::per_step();
  const long steps = profile::steps();
  profile::set_enabled(false);  // the ceilings' own GEMMs are not part of the step
  if (steps < 1) {
    std::printf("roofline: no step was profiled (the first step of a run is a warm-up); run at least 2 steps\n");
    return Status::ok();
  }
  Report r = build(entries, step_ms, measure());
  r.title = title;
  r.steps = steps;
  std::printf("%s", format_table(r).c_str());
  if (dir.empty()) {
    std::printf("roofline: pass --save or --profile-dir for roofline.json and roofline.svg\n");
    return Status::ok();
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return errorf("roofline: cannot create %s: %s", dir.c_str(), ec.message().c_str());
  const std::filesystem::path d(dir);
  NB_TRY(write_file(d / "roofline.json", to_json(r)));
  NB_TRY(write_file(d / "roofline.svg", to_svg(r)));
  std::printf("roofline: %s and %s written\n", (d / "roofline.json").string().c_str(),
              (d / "roofline.svg").string().c_str());
  return Status::ok();
}

}  // namespace nb::roofline
