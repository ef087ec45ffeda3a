// --tensorboard-dir: rank 0 writes the figures of the log line and metrics.jsonl as TensorBoard scalars,
// with Megatron's tags and units where Megatron logs the same figure ("lm loss", "learning-rate",
// "grad-norm", "iteration-time" in seconds, "throughput" in TFLOP/s/GPU, "lm loss validation", ...),
// and nibble's own tags with the unit in the name otherwise. docs/TENSORBOARD.md lists every tag.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>
#include "core/status.h"
#include "io/tensorboard_writer.h"
#include "train/metrics.h"
#include "train/train_config.h"

namespace nb {

using ScalarList = std::vector<std::pair<std::string, double>>;  // (tag, value)

// The step's scalars: every figure of format_log_line and format_jsonl except the iteration (the
// event's step) and the ETA (a forecast, not a measurement).
ScalarList step_scalars(const StepMetrics& m);

// Refuses a --tensorboard-dir that cannot be created or written before any work is done (every rank:
// the folder is created where rank 0 will write; empty = off).
Status check_tensorboard_dir(const std::string& dir);

class TensorBoardLog {
 public:
  // Creates the folder and a new event file in it; an error names --tensorboard-dir and the path.
  Status open(const TrainConfig& c);
  // Writes the step's scalars every --tensorboard-log-interval steps and at the last step, then flushes.
  void log_step(const StepMetrics& m);
  // "lm loss validation" and "lm loss validation ppl" at an evaluation, flushed.
  void log_validation(int64_t iteration, double loss);
  // Any other scalars of one iteration (--quant-stats' "quant/..."), flushed.
  void log_scalars(int64_t iteration, const ScalarList& scalars);

 private:
  // A write that fails (a full disk) stops the TensorBoard log with one warning, not the training run:
  // metrics.jsonl and the log line still carry every figure.
  void write(int64_t iteration, const ScalarList& scalars);
  TensorBoardWriter writer_;
  int64_t interval_ = 1;
};

// The log of a run with --tensorboard-dir, opened (null without the flag): what rank 0 calls before step 1.
Status open_tensorboard_log(const TrainConfig& c, std::unique_ptr<TensorBoardLog>* out);

}  // namespace nb
