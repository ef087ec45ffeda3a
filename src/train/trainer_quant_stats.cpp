// --quant-stats records (quant_stats.h): one summary line and one line per quantized Linear, written with
// nlohmann::ordered_json (fields in a fixed order, non-finite numbers as null, as format_jsonl does), and
// the same numbers as TensorBoard scalars, flattened from the same records so the two never disagree.
#include "train/quant_stats.h"

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

namespace nb {

namespace {

using Json = nlohmann::ordered_json;

Json num(double v) { return std::isfinite(v) ? Json(v) : Json(nullptr); }

const char* const kRoleNames[3] = {"input", "weight", "grad"};

Json roles_json(const recipe::LinearHealth& h) {
  Json roles = Json::object();
  for (int r = 0; r < 3; ++r) {
    const recipe::RoleQuantStats& s = h.roles[r];
    if (!s.seen) continue;
    Json j;
    j["fmt"] = recipe::fmt_name(s.fmt);
    if (s.mor_rung >= 0)  // what its GEMMs read
      j["mor_format"] = s.mor_rung == int(recipe::MorRung::nvfp4) ? "nvfp4"
                        : s.mor_rung == int(recipe::MorRung::fp8) ? "fp8_e4m3"
                                                                  : "bf16";
    j["flushed"] = num(s.flushed);
    j["saturated"] = num(s.saturated);
    j["sqnr_db"] = num(s.sqnr_db);
    if (s.has_crest) {
      j["crest"] = num(s.crest);
      j["crest_rht"] = num(s.crest_rht);
    }
    roles[kRoleNames[r]] = std::move(j);
  }
  return roles;
}

// snr = ||dW_ref|| / ||dW_q - dW_ref||: the "FP4 All the Way" criterion compares it with sqrt(3).
double ratio(double num, double den) {
  if (den > 0) return num / den;
  return num > 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
}

Json linear_json(int64_t iteration, const LlamaModel::LinearStats& s) {
  const recipe::LinearHealth& h = s.health;
  Json j;
  j["iteration"] = iteration;
  j["quant_stats"] = s.linear;
  j["layer"] = s.layer;
  j["roles"] = roles_json(h);
  if (h.wgrad.measured) {
    const recipe::WgradQuantStats& w = h.wgrad;
    j["wgrad"] = {{"grad_norm", num(w.grad_norm)},
                  {"noise_norm", num(w.noise_norm)},
                  {"snr", num(ratio(w.grad_norm, w.noise_norm))},
                  {"rel_err", num(ratio(w.noise_norm, w.grad_norm))}};
    if (w.has_alt)
      j["wgrad_alt"] = {{"rht", w.alt_rht},
                        {"noise_norm", num(w.alt_noise_norm)},
                        {"snr", num(ratio(w.grad_norm, w.alt_noise_norm))},
                        {"rel_err", num(ratio(w.alt_noise_norm, w.grad_norm))}};
  }
  j["stats_ms"] = num(h.stats_ms);
  return j;
}

Json summary_json(int64_t iteration, const recipe::LinearHealth& worst,
                  const std::vector<LlamaModel::LinearStats>& linears) {
  double min_snr = std::numeric_limits<double>::infinity();
  bool any_wgrad = false;
  for (const LlamaModel::LinearStats& s : linears) {
    if (!s.health.wgrad.measured) continue;
    any_wgrad = true;
    min_snr = std::fmin(min_snr, ratio(s.health.wgrad.grad_norm, s.health.wgrad.noise_norm));
  }
  Json summary;
  summary["iteration"] = iteration;
  summary["quant_worst_sqnr_db"] = num(worst.sqnr_db);
  summary["quant_max_flushed"] = num(worst.flushed);
  summary["quant_max_saturated"] = num(worst.saturated);
  summary["quant_min_wgrad_snr"] = any_wgrad ? num(min_snr) : Json(nullptr);
  return summary;
}

// The numbers of a record as (prefix + path, value), nested objects joined by '/'; names, flags and
// nulls (not measured, or not finite) are left out.
void flatten(const Json& j, const std::string& prefix, std::vector<std::pair<std::string, double>>* out) {
  for (const auto& [key, v] : j.items()) {
    if (v.is_object())
      flatten(v, prefix + key + "/", out);
    else if (v.is_number())
      out->emplace_back(prefix + key, v.get<double>());
  }
}

}  // namespace

bool quant_stats_step(const TrainConfig& c, int64_t it) {
  if (!c.quant_stats) return false;
  const int64_t every = c.quant_stats_interval > 0 ? c.quant_stats_interval : c.log_interval;
  return (it + 1) % every == 0 || it + 1 == c.train_iters;
}

std::string format_quant_stats(int64_t iteration, const recipe::LinearHealth& worst,
                               const std::vector<LlamaModel::LinearStats>& linears) {
  std::string out = summary_json(iteration, worst, linears).dump() + "\n";
  for (const LlamaModel::LinearStats& s : linears) out += linear_json(iteration, s).dump() + "\n";
  return out;
}

std::vector<std::pair<std::string, double>> quant_stats_scalars(const recipe::LinearHealth& worst,
                                                                const std::vector<LlamaModel::LinearStats>& linears) {
  std::vector<std::pair<std::string, double>> out;
  Json summary = summary_json(0, worst, linears);
  summary.erase("iteration");
  for (const auto& [key, v] : summary.items())  // quant_worst_sqnr_db -> quant/worst_sqnr_db
    if (v.is_number()) out.emplace_back("quant/" + key.substr(6), v.get<double>());
  for (const LlamaModel::LinearStats& s : linears) {
    Json j = linear_json(0, s);
    for (const char* k : {"iteration", "quant_stats", "layer"}) j.erase(k);
    flatten(j, "quant/" + s.linear + "/", &out);
  }
  return out;
}

}  // namespace nb
