// The roofline report's arithmetic, table and JSON (roofline.h; formulas in docs/PERFORMANCE.md).
#include "train/roofline.h"
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

namespace nb::roofline {

namespace {

bool is_gemm(const profile::Entry& e) { return !e.parent.empty() && e.name.rfind("gemm ", 0) == 0; }

// What the profile measured of an entry; the caller fills in the ceilings and the bound.
Row measured_row(const profile::Entry& e, const std::string& parent) {
  Row r;
  r.name = e.name;
  r.parent = parent;
  r.ms = e.ms;
  r.calls = e.calls;
  r.flops = e.flops;
  r.bytes = e.bytes;
  return r;
}

// A GEMM row against its measured ceiling (its own time when no ceiling was measured: nothing is lost).
Row gemm_row(const profile::Entry& e, const Ceilings& c) {
  Row r = measured_row(e, e.parent);
  const auto it = c.gemm_tflops.find(e.name);
  r.ceiling_tflops = it != c.gemm_tflops.end() ? it->second : 0;
  r.ideal_ms = r.ceiling_tflops > 0 ? e.flops / (r.ceiling_tflops * 1e9) : e.ms;
  r.bound = "GEMM";
  return r;
}

// A phase: its own stated work (tensor FLOPs vs copy bandwidth, whichever takes longer) plus its GEMMs at
// their ceilings. The bound is the part with the longest ideal time.
Row phase_row(const profile::Entry& e, const std::vector<Row>& gemms, const Ceilings& c) {
  Row r = measured_row(e, "");
  double gemm_flops = 0, gemm_ideal = 0;
  bool unmeasured = false;  // a GEMM without a ceiling: the phase's GEMM ceiling is unknown
  for (const Row& g : gemms) {
    if (g.parent != e.name) continue;
    unmeasured = unmeasured || g.ceiling_tflops <= 0;
    r.flops += g.flops;
    r.bytes += g.bytes;
    gemm_flops += g.flops;
    gemm_ideal += g.ideal_ms;
  }
  const double t_flops = c.tensor_tflops > 0 ? e.flops / (c.tensor_tflops * 1e9) : 0;
  const double t_bytes = c.copy_gbs > 0 ? e.bytes / (c.copy_gbs * 1e6) : 0;
  r.ideal_ms = gemm_ideal + std::max(t_flops, t_bytes);
  if (gemm_ideal > 0 && gemm_ideal >= std::max(t_flops, t_bytes)) {
    r.bound = "GEMM";
    r.ceiling_tflops = unmeasured ? 0 : gemm_flops / (gemm_ideal * 1e9);
  } else if (t_flops > 0 && t_flops >= t_bytes) {
    r.bound = "tensor";
    r.ceiling_tflops = c.tensor_tflops;
  } else if (t_bytes > 0) {
    r.bound = "memory";
    r.ceiling_gbs = c.copy_gbs;
  } else {
    r.bound = "-";
    r.ideal_ms = 0;
  }
  return r;
}

void finish(Row& r, double step_ms) {
  r.lost_ms = std::max(0.0, r.ms - r.ideal_ms);
  r.lost_share = step_ms > 0 ? r.lost_ms / step_ms : 0;
}

}  // namespace

double Report::phases_ms() const {
  double s = 0;
  for (const Row& r : phases)
    if (r.name != kUnattributed) s += r.ms;
  return s;
}

double Report::ideal_ms() const {
  double s = 0;
  for (const Row& r : phases) s += r.ideal_ms;
  return s;
}

double Report::lost_share() const {
  double s = 0;
  for (const Row& r : phases) s += r.lost_share;
  return s;
}

Report build(const std::vector<profile::Entry>& entries, double step_ms, const Ceilings& c) {
  Report rep;
  rep.step_ms = step_ms;
  rep.ceilings = c;
  for (const auto& e : entries)
    if (is_gemm(e))
      rep.gemms.push_back(gemm_row(e, c));
    else if (!e.parent.empty())
      rep.others.push_back(measured_row(e, e.parent));
  for (const auto& e : entries)
    if (e.parent.empty()) rep.phases.push_back(phase_row(e, rep.gemms, c));
  for (Row& g : rep.gemms) finish(g, step_ms);
  for (Row& p : rep.phases) finish(p, step_ms);
  auto longest = [](const Row& a, const Row& b) { return a.ms > b.ms; };
  std::stable_sort(rep.phases.begin(), rep.phases.end(), longest);
  std::stable_sort(rep.gemms.begin(), rep.gemms.end(), longest);
  std::stable_sort(rep.others.begin(), rep.others.end(), longest);
  Row rest;
  rest.name = kUnattributed;
  rest.ms = step_ms - rep.phases_ms();
  rest.bound = "-";
  rest.lost_ms = std::max(0.0, rest.ms);
  rest.lost_share = step_ms > 0 ? rest.lost_ms / step_ms : 0;
  rep.phases.push_back(rest);
  return rep;
}

namespace {
std::string ceiling_text(const Row& r) {
  char buf[64];
  if (r.ceiling_tflops > 0)
    std::snprintf(buf, sizeof buf, "%s %.0f TFLOP/s", r.bound.c_str(), r.ceiling_tflops);
  else if (r.ceiling_gbs > 0)
    std::snprintf(buf, sizeof buf, "%s %.0f GB/s", r.bound.c_str(), r.ceiling_gbs);
  else
    std::snprintf(buf, sizeof buf, "%s", r.bound == "GEMM" ? "GEMM (not measured)" : r.bound.c_str());
  return buf;
}

void append(std::string& out, const char* fmt, auto... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, fmt, args...);
  out += buf;
}
}  // namespace

std::string format_table(const Report& r) {
  std::string s;
  append(s, "\n==================== roofline of the step: %s ====================\n", r.title.c_str());
  append(s,
         "GPU ms per step, mean of %ld steps after the first; ceilings measured after the run: copy %.0f GB/s, BF16 "
         "8192^3 GEMM %.0f TFLOP/s, each GEMM call alone (nibble bench's code)\n",
         r.steps, r.ceilings.copy_gbs, r.ceilings.tensor_tflops);
  append(s, "%-34s %9s %6s %9s %8s %8s %8s  %-20s %9s %8s %7s\n", "phase", "ms", "share", "GFLOP", "GB", "TFLOP/s",
         "GB/s", "bound (ceiling)", "ideal ms", "lost ms", "lost %");
  for (const Row& p : r.phases)
    append(s, "%-34s %9.2f %5.1f%% %9.0f %8.2f %8.1f %8.0f  %-20s %9.2f %8.2f %6.1f%%\n", p.name.c_str(), p.ms,
           r.step_ms > 0 ? 100.0 * p.ms / r.step_ms : 0.0, p.flops / 1e9, p.bytes / 1e9, p.tflops(), p.gbs(),
           ceiling_text(p).c_str(), p.ideal_ms, p.lost_ms, 100.0 * p.lost_share);
  append(s, "%-34s %9.2f %5.1f%%   (phases %.2f ms = %.1f%% of the step; at the ceilings %.2f ms; lost %.1f%%)\n",
         "step", r.step_ms, 100.0, r.phases_ms(), r.step_ms > 0 ? 100.0 * r.phases_ms() / r.step_ms : 0.0, r.ideal_ms(),
         100.0 * r.lost_share());
  append(s, "\nGEMMs inside the phases (per step; ceiling = the same call timed alone):\n");
  append(s, "%-24s %-58s %6s %9s %8s %8s %6s %7s\n", "phase", "GEMM (A x B, M x N x K, C)", "calls", "ms", "TFLOP/s",
         "ceiling", "ratio", "lost %");
  for (const Row& g : r.gemms)
    append(s, "%-24s %-58s %6.0f %9.2f %8.1f %8.1f %6.2f %6.1f%%\n", g.parent.c_str(), g.name.substr(5).c_str(),
           g.calls, g.ms, g.tflops(), g.ceiling_tflops, g.ceiling_tflops > 0 ? g.tflops() / g.ceiling_tflops : 0.0,
           100.0 * g.lost_share);
  if (!r.others.empty()) append(s, "\nOther measured work inside the phases (per step):\n");
  for (const Row& o : r.others)
    append(s, "%-24s %-58s %6.0f %9.2f %6.2f%% of the step\n", o.parent.c_str(), o.name.c_str(), o.calls, o.ms,
           r.step_ms > 0 ? 100.0 * o.ms / r.step_ms : 0.0);
  return s;
}

std::string to_json(const Report& r) {
  using nlohmann::json;
  auto row = [](const Row& x) {
    return json{{"name", x.name},
                {"parent", x.parent},
                {"ms", x.ms},
                {"calls", x.calls},
                {"flops", x.flops},
                {"bytes", x.bytes},
                {"tflops", x.tflops()},
                {"gbs", x.gbs()},
                {"bound", x.bound},
                {"ceiling_tflops", x.ceiling_tflops},
                {"ceiling_gbs", x.ceiling_gbs},
                {"ideal_ms", x.ideal_ms},
                {"lost_ms", x.lost_ms},
                {"lost_share", x.lost_share}};
  };
  json j;
  j["title"] = r.title;
  j["steps"] = r.steps;
  j["step_ms"] = r.step_ms;
  j["phases_ms"] = r.phases_ms();
  j["ideal_ms"] = r.ideal_ms();
  j["lost_share"] = r.lost_share();
  j["ceilings"] = {{"copy_gbs", r.ceilings.copy_gbs},
                   {"tensor_tflops", r.ceilings.tensor_tflops},
                   {"gemm_tflops", r.ceilings.gemm_tflops}};
  j["phases"] = json::array();
  for (const Row& p : r.phases) j["phases"].push_back(row(p));
  j["gemms"] = json::array();
  for (const Row& g : r.gemms) j["gemms"].push_back(row(g));
  j["others"] = json::array();
  for (const Row& o : r.others)
    j["others"].push_back(
        {{"name", o.name}, {"parent", o.parent}, {"ms", o.ms}, {"calls", o.calls}, {"bytes", o.bytes}});
  return j.dump(1) + "\n";
}

}  // namespace nb::roofline
