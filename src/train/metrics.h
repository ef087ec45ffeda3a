// Step metrics in the units Megatron, torchtitan and llm.c users read: tokens/s/GPU, model
// TFLOP/s/GPU (the benchmark protocol's FLOP formula: recompute and emulation not counted), MFU
// against a stated peak, and the log line / JSONL record that carry them.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>

namespace nb {

struct StepMetrics {
  int64_t iteration = 0, total_iters = 0, consumed_samples = 0, global_batch = 0, skipped = 0, nan_iters = 0;
  double step_ms = 0, tokens_per_s = 0, tflops = 0, mfu = 0, lr = 0, loss = 0, grad_norm = 0, peak_mem_gib = 0,
         eta_s = 0, data_wait_ms = 0;
  double optimizer_ms = 0;  // the AdamW update on the compute stream (streaming included with offload)
  // Megatron-FSDP (optim_grads, optim_grads_params): bytes this rank all-gathered (weights) and
  // reduce-scattered (gradients) in the step; -1 without it (not written).
  double fsdp_gathered_bytes = -1, fsdp_reduced_bytes = -1;
  // Tensor parallelism: bytes this rank's group collectives all-gathered (outputs) and reduced (all-reduce and
  // reduce-scatter inputs) in the step, as tp::collective_bytes counts them; -1 without it.
  double tp_gathered_bytes = -1, tp_reduced_bytes = -1;
  // Mixture of Representations: the shares of GEMM operands and of GEMMs in FP8 (E4M3) this step, and on the NVFP4
  // ladder in NVFP4; -1 without it.
  double mor_fp8_operands = -1, mor_fp8_gemms = -1;
  double mor_nvfp4_operands = -1, mor_nvfp4_gemms = -1;
  // MoR's block rule: the share of the step's 128x128 operand blocks in FP8 (E4M3 or E5M2) and in E5M2, and (the
  // ladder per block) in NVFP4; -1 without it.
  double mor_fp8_blocks = -1, mor_e5m2_blocks = -1, mor_nvfp4_blocks = -1;
};

// Dense BF16 datasheet peak for a device name (H100/H200 SXM 989.4), 0 if unknown.
double bf16_peak_tflops(const std::string& device_name);
std::string format_log_line(const StepMetrics& m);
std::string format_jsonl(const StepMetrics& m);

}  // namespace nb
