// --tensorboard-dir (tensorboard_log.h): the tag of each step figure, the interval, and the policy that a
// failed write stops the TensorBoard log, never the run.
#include "train/tensorboard_log.h"
#include <unistd.h>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>
#include "core/log.h"

namespace nb {

namespace {

constexpr const char* kAdvice = "; pass a folder this process can create and write to";

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

// Megatron's tags keep Megatron's units (seconds, TFLOP/s/GPU), so a nibble run and a Megatron run
// share TensorBoard's charts; metrics.jsonl keeps milliseconds (docs/TENSORBOARD.md has the table).
ScalarList step_scalars(const StepMetrics& m) {
  ScalarList out = {
      {"lm loss", m.loss},
      {"learning-rate", m.lr},
      {"grad-norm", m.grad_norm},
      {"batch-size", double(m.global_batch)},
      {"consumed-samples", double(m.consumed_samples)},
      {"iteration-time", m.step_ms / 1000.0},
      {"throughput", m.tflops},
      {"throughput/tokens_per_sec_per_gpu", m.tokens_per_s},
      {"throughput/mfu", m.mfu},
      {"mem/peak_gib", m.peak_mem_gib},
      {"skipped-iterations", double(m.skipped)},
      {"nan-iterations", double(m.nan_iters)},
      {"optimizer-time", m.optimizer_ms / 1000.0},
      {"data-wait-time", m.data_wait_ms / 1000.0},
  };
  if (m.mor_fp8_blocks >= 0) {
    out.emplace_back("mor/fp8_blocks", m.mor_fp8_blocks);
    out.emplace_back("mor/e5m2_blocks", m.mor_e5m2_blocks);
  }
  if (m.mor_nvfp4_blocks >= 0) out.emplace_back("mor/nvfp4_blocks", m.mor_nvfp4_blocks);
  if (m.mor_fp8_operands >= 0) {
    out.emplace_back("mor/fp8_operands", m.mor_fp8_operands);
    out.emplace_back("mor/fp8_gemms", m.mor_fp8_gemms);
  }
  if (m.mor_nvfp4_operands >= 0) {
    out.emplace_back("mor/nvfp4_operands", m.mor_nvfp4_operands);
    out.emplace_back("mor/nvfp4_gemms", m.mor_nvfp4_gemms);
  }
  return out;
}

Status check_tensorboard_dir(const std::string& dir) {
  if (dir.empty()) return Status::ok();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    return errorf("--tensorboard-dir: cannot create the folder %s: %s%s", dir.c_str(), ec.message().c_str(), kAdvice);
  if (access(dir.c_str(), W_OK | X_OK) != 0)
    return errorf("--tensorboard-dir: cannot write to the folder %s: %s%s", dir.c_str(), std::strerror(errno), kAdvice);
  return Status::ok();
}

Status TensorBoardLog::open(const TrainConfig& c) {
  interval_ = c.tensorboard_log_interval;
  Status st = writer_.open(c.tensorboard_dir);
  if (!st) return errorf("--tensorboard-dir: %s%s", st.message().c_str(), kAdvice);
  std::printf("tensorboard: scalars every %lld steps to %s\n", (long long)interval_, writer_.path().c_str());
  return Status::ok();
}

Status open_tensorboard_log(const TrainConfig& c, std::unique_ptr<TensorBoardLog>* out) {
  out->reset();
  if (c.tensorboard_dir.empty()) return Status::ok();
  auto log = std::make_unique<TensorBoardLog>();
  NB_TRY(log->open(c));
  *out = std::move(log);
  return Status::ok();
}

void TensorBoardLog::log_step(const StepMetrics& m) {
  if (m.iteration % interval_ == 0 || m.iteration == m.total_iters) write(m.iteration, step_scalars(m));
}

void TensorBoardLog::log_validation(int64_t iteration, double loss) {
  write(iteration, {{"lm loss validation", loss}, {"lm loss validation ppl", std::exp(loss)}});
}

void TensorBoardLog::log_scalars(int64_t iteration, const ScalarList& scalars) { write(iteration, scalars); }

void TensorBoardLog::write(int64_t iteration, const ScalarList& scalars) {
  if (!writer_.is_open()) return;
  const double now = unix_seconds();
  Status st = Status::ok();
  for (const auto& [tag, value] : scalars) {
    st = writer_.add_scalar(tag, iteration, float(value), now);
    if (!st) break;
  }
  if (st) st = writer_.flush();
  if (st) return;
  NB_LOG_WARN("TensorBoard log stopped at iteration %lld: %s (metrics.jsonl and the log keep every figure)",
              (long long)iteration, st.message().c_str());
  writer_.close();
}

}  // namespace nb
