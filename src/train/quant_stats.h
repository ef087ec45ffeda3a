// --quant-stats in the training loop: which steps collect, and the JSONL records (and TensorBoard scalars)
// they write (trainer_quant_stats.cpp; schema and definitions in docs/RECIPES.md, "Quantization telemetry").
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>
#include "model/llama_model.h"
#include "recipe/linear.h"
#include "train/train_config.h"

namespace nb {

// True when step `it` (0-based, about to run) collects statistics: every --quant-stats-interval steps
// (--log-interval when 0) and the last step.
bool quant_stats_step(const TrainConfig& c, int64_t it);

// The JSONL lines of one statistics step, each ending in '\n': the summary record (worst over the
// Linears: quant_worst_sqnr_db, quant_max_flushed, quant_max_saturated, quant_min_wgrad_snr), then one
// record per quantized Linear. Non-finite numbers are written as null.
std::string format_quant_stats(int64_t iteration, const recipe::LinearHealth& worst,
                               const std::vector<LlamaModel::LinearStats>& linears);

// The numbers of those records as TensorBoard scalars (--tensorboard-dir): the summary's as
// quant/worst_sqnr_db, quant/max_flushed, quant/max_saturated, quant/min_wgrad_snr, each Linear's as
// quant/<linear>/<path in its record>, e.g. quant/model.layers.3.mlp.down_proj/roles/grad/sqnr_db.
// A null of the JSONL (not measured, not finite) has no scalar.
std::vector<std::pair<std::string, double>> quant_stats_scalars(const recipe::LinearHealth& worst,
                                                                const std::vector<LlamaModel::LinearStats>& linears);

}  // namespace nb
