// Where `nibble export` and `nibble eval` take weights from: an HF folder (--load-hf DIR, its config.json
// decides the model) or a nibble checkpoint (--load DIR [--ckpt-step N], whose model.safetensors holds
// FP32 tensors under the HF names). Either way the result is a config and an opened tensor reader.
#pragma once
#include <cstdint>
#include <string>
#include "core/tensor.h"
#include "io/hf_llama.h"
#include "train/checkpoint.h"

namespace nb::cli {

struct WeightsSource {
  std::string load, load_hf;
  int64_t ckpt_step = -1;  // -1: the newest (latest_checkpointed_iteration.txt)
};

inline Status open_weights_source(const WeightsSource& s, LlamaConfig* cfg, HfCheckpointReader* reader) {
  if (s.load.empty() == s.load_hf.empty())
    return errorf("pass exactly one of --load DIR (a nibble checkpoint) or --load-hf DIR (a Hugging Face folder)");
  if (!s.load_hf.empty()) {
    NB_TRY(read_hf_config(s.load_hf, cfg));
    return reader->open(s.load_hf);
  }
  CheckpointRef ref;
  bool found = true;
  NB_TRY(find_checkpoint(s.load, s.ckpt_step, &ref, &found));
  if (!found) return errorf("%s holds no checkpoint yet (no latest_checkpointed_iteration.txt)", s.load.c_str());
  TrainConfig tc;
  NB_TRY(checkpoint_config(ref, &tc, cfg));
  return reader->open_file(checkpoint_model_file(ref));
}

// --device auto|cuda|cpu of the commands that load weights (export, eval, generate): cuda when a GPU answers.
inline Status pick_device(const std::string& want, Device* dev) {
  std::string why;
  const bool gpu = want != "cpu" && cuda_device_available(&why);
  if (want == "cuda" && !gpu) return errorf("--device cuda was asked for but %s", why.c_str());
  *dev = gpu ? Device::cuda : Device::cpu;
  return Status::ok();
}

}  // namespace nb::cli
