// Phase profiler on CUDA events (see gpu_profile.h).
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>
#include "core/cuda_check.h"
#include "core/gpu_profile.h"

namespace nb::profile {

namespace {
struct Interval {
  std::string name, parent;
  bool child = false;
  double flops = 0, bytes = 0;
  cudaEvent_t start = nullptr, stop = nullptr;
};
struct Totals {
  double ms = 0, calls = 0, flops = 0, bytes = 0;
};
using Key = std::pair<std::string, std::string>;  // parent, name
struct State {
  std::vector<Interval> open, done;
  std::vector<cudaEvent_t> pool;
  std::map<Key, Totals> totals;
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
std::atomic<bool>& flag() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("NIBBLE_PROFILE");
    return v && v[0] == '1';
  }()};
  return on;
}
// The innermost open phase (children are not parents).
std::string open_phase() {
  const auto& open = state().open;
  for (size_t i = open.size(); i-- > 0;)
    if (!open[i].child) return open[i].name;
  return "";
}
void push(Interval iv) {
  iv.start = take();
  CUDA_CHECK(cudaEventRecord(iv.start, nullptr));
  state().open.push_back(std::move(iv));
}
void close(size_t i) {
  auto& open = state().open;
  Interval iv = open[i];
  open.erase(open.begin() + long(i));
  iv.stop = take();
  CUDA_CHECK(cudaEventRecord(iv.stop, nullptr));
  state().done.push_back(iv);
}
}  // namespace

bool enabled() { return flag().load(std::memory_order_relaxed); }
void set_enabled(bool on) { flag().store(on); }

void begin(const char* phase) {
  Interval iv;
  iv.name = phase;
  iv.parent = open_phase();
  push(std::move(iv));
}

void end(const char* phase) {
  auto& open = state().open;
  for (size_t i = open.size(); i-- > 0;)
    if (!open[i].child && open[i].name == phase) return close(i);
}

void begin_child(const std::string& key, double flops, double bytes) {
  Interval iv;
  iv.name = key;
  iv.parent = open_phase();
  iv.child = true;
  iv.flops = flops;
  iv.bytes = bytes;
  push(std::move(iv));
}

void end_child() {
  auto& open = state().open;
  for (size_t i = open.size(); i-- > 0;)
    if (open[i].child) return close(i);
}

void add_work(const char* phase, double flops, double bytes) {
  std::string parent;
  const auto& open = state().open;
  for (size_t i = open.size(); i-- > 0;)
    if (!open[i].child && open[i].name == phase) {
      parent = open[i].parent;
      break;
    }
  Totals& t = state().totals[{parent, phase}];
  t.flops += flops;
  t.bytes += bytes;
}

void collect(bool print) {
  auto& s = state();
  CUDA_CHECK(cudaDeviceSynchronize());
  for (auto& iv : s.done) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, iv.start, iv.stop));
    Totals& t = s.totals[{iv.parent, iv.name}];
    t.ms += ms;
    t.calls += 1;
    t.flops += iv.flops;
    t.bytes += iv.bytes;
    s.pool.push_back(iv.start);
    s.pool.push_back(iv.stop);
  }
  s.done.clear();
  s.reports++;
  if (!print) return;
  std::printf("profile (GPU ms per step, averaged over %ld steps):\n", s.reports);
  for (const auto& [key, t] : s.totals)
    if (key.first.empty())
      std::printf("  %-28s %9.2f ms  (%.0f calls)\n", key.second.c_str(), t.ms / double(s.reports), t.calls);
}

void reset() {
  collect(false);
  state().totals.clear();
  state().reports = 0;
}

std::vector<Entry> per_step() {
  const auto& s = state();
  const double n = s.reports > 0 ? double(s.reports) : 1.0;
  std::vector<Entry> out;
  for (const auto& [key, t] : s.totals)
    out.push_back({key.second, key.first, t.ms / n, t.calls / n, t.flops / n, t.bytes / n});
  return out;
}

long steps() { return state().reports; }

}  // namespace nb::profile
