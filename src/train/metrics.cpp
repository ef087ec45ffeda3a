// Formatting of the per-step log line and JSONL record.
#include "train/metrics.h"
#include <cmath>
#include <nlohmann/json.hpp>

namespace nb {

double bf16_peak_tflops(const std::string& name) {
  if (name.find("H100") != std::string::npos && name.find("PCIe") != std::string::npos) return 756.0;
  if (name.find("H100") != std::string::npos || name.find("H200") != std::string::npos ||
      name.find("H20") != std::string::npos)
    return 989.4;
  if (name.find("B200") != std::string::npos) return 2250.0;
  if (name.find("A100") != std::string::npos) return 312.0;
  return 0.0;
}

static std::string hms(double s) {
  if (!(s >= 0) || !std::isfinite(s)) return "-";
  long t = std::lround(s);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", t / 3600, (t / 60) % 60, t % 60);
  return buf;
}

std::string format_log_line(const StepMetrics& m) {
  char buf[768];
  std::snprintf(buf, sizeof buf,
                " iteration %8lld/%8lld | consumed samples: %12lld | elapsed time per iteration (ms): %.1f | "
                "tokens/s/GPU: %.0f | throughput per GPU (TFLOP/s/GPU): %.1f | MFU: %.1f%% | learning rate: %.6E | "
                "global batch size: %5lld | lm loss: %.6E | grad norm: %.3f | peak memory: %.2f GiB | "
                "number of skipped iterations: %3lld | number of nan iterations: %3lld | ETA %s |",
                (long long)m.iteration, (long long)m.total_iters, (long long)m.consumed_samples, m.step_ms,
                m.tokens_per_s, m.tflops, 100.0 * m.mfu, m.lr, (long long)m.global_batch, m.loss, m.grad_norm,
                m.peak_mem_gib, (long long)m.skipped, (long long)m.nan_iters, hms(m.eta_s).c_str());
  std::string line = buf;
  if (m.mor_nvfp4_operands >= 0) {
    char mor[96];
    std::snprintf(mor, sizeof mor, " MoR NVFP4 operands: %.1f%% | MoR NVFP4 GEMMs: %.1f%% |",
                  100.0 * m.mor_nvfp4_operands, 100.0 * m.mor_nvfp4_gemms);
    line += mor;
  }
  if (m.mor_nvfp4_blocks >= 0) {
    char mor[64];
    std::snprintf(mor, sizeof mor, " MoR NVFP4 blocks: %.1f%% |", 100.0 * m.mor_nvfp4_blocks);
    line += mor;
  }
  if (m.mor_fp8_blocks >= 0) {
    char mor[96];
    std::snprintf(mor, sizeof mor, " MoR FP8 blocks: %.1f%% (E5M2 %.1f%%) |", 100.0 * m.mor_fp8_blocks,
                  100.0 * m.mor_e5m2_blocks);
    line += mor;
  }
  if (m.mor_fp8_operands >= 0) {
    char mor[96];
    std::snprintf(mor, sizeof mor, " MoR FP8 operands: %.1f%% | MoR FP8 GEMMs: %.1f%% |", 100.0 * m.mor_fp8_operands,
                  100.0 * m.mor_fp8_gemms);
    line += mor;
  }
  return line;
}

std::string format_jsonl(const StepMetrics& m) {
  nlohmann::ordered_json j;
  j["iteration"] = m.iteration;
  j["consumed_samples"] = m.consumed_samples;
  j["lm_loss"] = std::isfinite(m.loss) ? nlohmann::ordered_json(m.loss) : nlohmann::ordered_json(nullptr);
  j["grad_norm"] = std::isfinite(m.grad_norm) ? nlohmann::ordered_json(m.grad_norm) : nlohmann::ordered_json(nullptr);
  j["lr"] = m.lr;
  j["step_ms"] = m.step_ms;
  j["tokens_per_s_per_gpu"] = m.tokens_per_s;
  j["tflops_per_gpu"] = m.tflops;
  j["mfu"] = m.mfu;
  j["peak_mem_gib"] = m.peak_mem_gib;
  j["data_wait_ms"] = m.data_wait_ms;
  j["optimizer_ms"] = m.optimizer_ms;
  j["skipped_iterations"] = m.skipped;
  j["global_batch_size"] = m.global_batch;
  j["nan_iterations"] = m.nan_iters;
  if (m.fsdp_gathered_bytes >= 0) j["fsdp_gathered_bytes"] = m.fsdp_gathered_bytes;
  if (m.fsdp_reduced_bytes >= 0) j["fsdp_reduced_bytes"] = m.fsdp_reduced_bytes;
  if (m.tp_gathered_bytes >= 0) j["tp_gathered_bytes"] = m.tp_gathered_bytes;
  if (m.tp_reduced_bytes >= 0) j["tp_reduced_bytes"] = m.tp_reduced_bytes;
  if (m.mor_fp8_operands >= 0) j["mor_fp8_operands"] = m.mor_fp8_operands;
  if (m.mor_fp8_blocks >= 0) j["mor_fp8_blocks"] = m.mor_fp8_blocks;
  if (m.mor_e5m2_blocks >= 0) j["mor_e5m2_blocks"] = m.mor_e5m2_blocks;
  if (m.mor_nvfp4_blocks >= 0) j["mor_nvfp4_blocks"] = m.mor_nvfp4_blocks;
  if (m.mor_fp8_gemms >= 0) j["mor_fp8_gemms"] = m.mor_fp8_gemms;
  if (m.mor_nvfp4_operands >= 0) j["mor_nvfp4_operands"] = m.mor_nvfp4_operands;
  if (m.mor_nvfp4_gemms >= 0) j["mor_nvfp4_gemms"] = m.mor_nvfp4_gemms;
  return j.dump();
}

}  // namespace nb
