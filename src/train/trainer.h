// The training job: resolves and prints the configuration, estimates memory before step 1, runs
// the optimizer loop (gradient accumulation, clipping, AdamW, LR schedule), validates, and reports
// per-step metrics (log lines and JSONL) and an end-of-run summary.
#pragma once
#include <string>
#include <vector>
#include "core/status.h"
#include "train/train_config.h"

namespace nb {

struct TrainSummary {
  int64_t steps = 0, skipped = 0;
  double first_loss = 0, final_loss = 0, final_val_loss = -1;
  double mean_step_ms = 0, tokens_per_s = 0, tflops = 0, mfu = 0, peak_mem_gib = 0;
  std::string device;
  std::vector<double> losses;  // per step
};

// Runs the whole job. Every failure comes back as one sentence; nothing already saved is touched.
Status run_training(TrainConfig cfg, TrainSummary* summary);

}  // namespace nb
