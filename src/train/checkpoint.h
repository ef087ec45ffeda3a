// Checkpoints in Megatron's layout: SAVE/latest_checkpointed_iteration.txt names the newest complete
// checkpoint, SAVE/iter_0000100/ holds it:
//   model.safetensors       FP32 master weights, one tensor per Hugging Face name (model/hf_layout.h)
//   optimizer.safetensors   AdamW state: "<name>.exp_avg" and "<name>.exp_avg_sq" per HF tensor
//   trainer_state.json      iteration, consumed samples, RNG step, delayed-scaling histories, the
//                           resolved config and model (their only record), nibble version, the CRC-32
//                           and size of both files above, and "state_crc32" over the rest of itself
// A save writes SAVE/iter_0000100.tmp/, fsyncs every file, renames the folder, fsyncs SAVE, and only
// then replaces the tracker file atomically; so at any moment (SIGKILL, power loss) the tracker names
// a complete checkpoint. Older checkpoints beyond --save-keep are deleted after the tracker moved.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
#include <nlohmann/json.hpp>
#include "core/status.h"
#include "model/hf_layout.h"
#include "model/llama_config.h"
#include "train/train_config.h"

namespace nb {

struct CheckpointRef {
  std::string dir;  // SAVE/iter_0000100
  int64_t iteration = 0;
};

std::string checkpoint_folder_name(int64_t iteration);  // iter_0000100
// The checkpoint to load from `load_dir`: `step` < 0 reads latest_checkpointed_iteration.txt.
// *found = false (and ok) when step < 0 and the folder has no tracker file: nothing saved yet.
Status find_checkpoint(const std::string& load_dir, int64_t step, CheckpointRef* out, bool* found = nullptr);
// trainer_state.json of a checkpoint after checking its own CRC and the CRC and size of every file
// (FileCheck::size: only that each file exists with its size; a caller that reads the files whole with
// read_checkpoint_file checks their CRCs there, so each file is read once).
enum class FileCheck { crc, size };
Status read_checkpoint_state(const CheckpointRef& ref, nlohmann::json* state, FileCheck check = FileCheck::crc);
// The training configuration and model shape a checkpoint was saved with (checksums verified).
Status checkpoint_config(const CheckpointRef& ref, TrainConfig* cfg, LlamaConfig* model);
// The same from a trainer_state.json already read (`where` names it in messages).
Status checkpoint_config_of(const nlohmann::json& state, const std::string& where, TrainConfig* cfg,
                            LlamaConfig* model);
// The model shape as trainer_state.json records it ("model"), and back.
nlohmann::json model_config_json(const LlamaConfig& c);
Status model_config_from_json(const nlohmann::json& j, const std::string& where, LlamaConfig* out);
inline std::string checkpoint_model_file(const CheckpointRef& ref) { return ref.dir + "/model.safetensors"; }
inline std::string checkpoint_optimizer_file(const CheckpointRef& ref) { return ref.dir + "/optimizer.safetensors"; }
// One sequential pass over the checkpoint file `name` (model.safetensors or optimizer.safetensors): each
// target (suffix, flat host array) receives the tensors "<name><suffix>" of `layout` at their flat
// offsets, and the file's CRC-32 and size are checked against `state` ("files") on the way, so an 8B
// checkpoint's 90 GiB are read once. A damaged file is refused in one sentence (its targets then hold
// partial data; the caller stops).
struct CheckpointTarget {
  std::string suffix;
  float* host_flat = nullptr;
};
Status read_checkpoint_file(const CheckpointRef& ref, const nlohmann::json& state, const std::string& name,
                            const std::vector<HfTensor>& layout, const std::vector<CheckpointTarget>& targets);

// What one save writes. The host arrays (flat, ParamStore layout) must stay valid until the write ends.
struct CheckpointData {
  int64_t iteration = 0;
  std::vector<HfTensor> layout;
  const float* master = nullptr;
  const float* exp_avg = nullptr;
  const float* exp_avg_sq = nullptr;
  nlohmann::json state;  // trainer state; "files" and "state_crc32" are added by the writer
};
struct CheckpointWriteStats {
  uint64_t bytes = 0;
  double seconds = 0;
};

// Writes one checkpoint synchronously (temporary folder, rename, tracker), then prunes to `keep`
// (0 = keep all). On failure the temporary folder is removed and the tracker is untouched.
Status write_checkpoint(const std::string& save_dir, const CheckpointData& data, int64_t keep,
                        CheckpointWriteStats* stats);

// One background thread that runs write_checkpoint: start() returns at once; the caller keeps the host
// arrays alive and unchanged until wait() (or the next start(), which waits first) returns.
class AsyncCheckpointWriter {
 public:
  AsyncCheckpointWriter(std::string save_dir, int64_t keep) : save_dir_(std::move(save_dir)), keep_(keep) {}
  ~AsyncCheckpointWriter();
  Status start(CheckpointData data);
  Status wait(CheckpointWriteStats* last = nullptr);  // the result of the save in flight (ok when none)
  bool failed();                                      // a finished save failed (non-blocking)

 private:
  std::string save_dir_;
  int64_t keep_ = 0;
  std::thread thread_;
  std::mutex mu_;
  bool done_ = true;
  Status result_ = Status::ok();
  CheckpointWriteStats stats_;
};

}  // namespace nb
