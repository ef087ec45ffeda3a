// Phase profiler on CUDA events (see gpu_profile.h).
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>
#include "core/cuda_check.h"
#include "core/gpu_profile.h"

namespace nb::profile {

namespace {
struct Interval {
  std::string name;
  cudaEvent_t start, stop;
};
struct State {
  std::vector<Interval> open, done;
  std::vector<cudaEvent_t> pool;
  std::map<std::string, std::pair<double, long>> totals;  // ms, calls
  long reports = 0;
};
State& state() {
  static State s;
  return s;
}
cudaEvent_t take() {
  auto& p = state().pool;
  if (p.empty()) {
    cudaEvent_t e;
    CUDA_CHECK(cudaEventCreate(&e));
    return e;
  }
  cudaEvent_t e = p.back();
  p.pop_back();
  return e;
}
}  // namespace

bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("NIBBLE_PROFILE");
    return v && v[0] == '1';
  }();
  return on;
}

void begin(const char* phase) {
  cudaEvent_t e = take();
  CUDA_CHECK(cudaEventRecord(e, nullptr));
  state().open.push_back({phase, e, nullptr});
}

void end(const char* phase) {
  auto& open = state().open;
  for (size_t i = open.size(); i-- > 0;) {
    if (open[i].name != phase) continue;
    Interval iv = open[i];
    open.erase(open.begin() + long(i));
    iv.stop = take();
    CUDA_CHECK(cudaEventRecord(iv.stop, nullptr));
    state().done.push_back(iv);
    return;
  }
}

void collect(bool print) {
  auto& s = state();
  CUDA_CHECK(cudaDeviceSynchronize());
  for (auto& iv : s.done) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, iv.start, iv.stop));
    auto& t = s.totals[iv.name];
    t.first += ms;
    t.second += 1;
    s.pool.push_back(iv.start);
    s.pool.push_back(iv.stop);
  }
  s.done.clear();
  s.reports++;
  if (!print) return;
  std::printf("profile (GPU ms per step, averaged over %ld steps):\n", s.reports);
  for (const auto& [name, t] : s.totals)
    std::printf("  %-28s %9.2f ms  (%ld calls)\n", name.c_str(), t.first / double(s.reports), t.second);
}

void reset() {
  collect(false);
  state().totals.clear();
  state().reports = 0;
}

}  // namespace nb::profile
