// Checkpoints in Megatron's layout: SAVE/latest_checkpointed_iteration.txt names the newest complete
// checkpoint, SAVE/iter_0000100/ holds it:
//   model.safetensors       FP32 master weights, one tensor per Hugging Face name (model/hf_layout.h)
//   optimizer.safetensors   AdamW state: "<name>.exp_avg" and "<name>.exp_avg_sq" per HF tensor
//   trainer_state.json      iteration, consumed samples, schedule, RNG, delayed-scaling histories,
//                           resolved config, nibble version, and the CRC-32 of every file
// (DECLARATIONS ONLY so far: implemented in checkpoint.cpp.)
#pragma once
#include <cstdint>
#include <string>
#include "core/status.h"
#include "model/llama_config.h"
#include "train/train_config.h"

namespace nb {

struct CheckpointRef {
  std::string dir;        // SAVE/iter_0000100
  int64_t iteration = 0;
};

// The checkpoint to load from `load_dir`: `step` < 0 reads latest_checkpointed_iteration.txt.
Status find_checkpoint(const std::string& load_dir, int64_t step, CheckpointRef* out);
// The training configuration and model shape a checkpoint was saved with (checksums verified).
Status checkpoint_config(const CheckpointRef& ref, TrainConfig* cfg, LlamaConfig* model);
inline std::string checkpoint_model_file(const CheckpointRef& ref) { return ref.dir + "/model.safetensors"; }

}  // namespace nb
