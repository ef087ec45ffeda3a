// Trainer phases of a LoRA run (--peft lora): the adapter spec and the recipe its base precision
// chooses, where the frozen base comes from, and the PEFT adapter folder written at the end.
//   base source   --load-hf DIR; or --load of a full-model nibble checkpoint (its weights become the
//                 base); or, resuming a LoRA checkpoint, the base that run named (its --load-hf, or
//                 the seeded random base); else the seeded random base of a fresh model.
#include <cstdio>
#include <filesystem>
#include "core/log.h"
#include "train/trainer.h"

namespace nb {

namespace {
const char* base_recipe(const std::string& precision) {
  if (precision == "fp8") return "bf16_with_fp8_current_scaling_mixed";
  if (precision == "nvfp4") return "bf16_with_nvfp4_mixed";
  if (precision == "mor_fp8") return "bf16_with_mor_fp8_mixed";  // each operand E4M3 or BF16 by its data
  return "bf16_mixed";
}
}  // namespace

Status Trainer::resolve_lora() {
  if (cfg_.peft != "lora") return Status::ok();
  cfg_.recipe = base_recipe(cfg_.lora_base_precision);
  lora_spec_.rank = cfg_.lora_rank;
  lora_spec_.alpha = cfg_.lora_alpha;
  lora_spec_.dropout = cfg_.lora_dropout;
  NB_TRY(parse_lora_targets(cfg_.lora_target, &lora_spec_.targets).context("--lora-target"));
  return validate(lora_spec_);
}

// Model FLOPs of a LoRA token: the frozen linears and the LM head run forward and Dgrad only (4 per
// weight), attention forward and backward as in pretraining, the adapters all three GEMMs.
double Trainer::lora_flops_per_token() const {
  const LlamaConfig& m = model_cfg_;
  return 4.0 * double(m.matmul_params()) + 6.0 * double(m.layers) * double(m.q_dim()) * double(cfg_.seq_length) +
         6.0 * double(lora_param_count(m, lora_spec_));
}

Status Trainer::open_lora_base() {
  if (cfg_.peft != "lora") return Status::ok();
  std::string dir = cfg_.load_hf, file;
  if (dir.empty() && !cfg_.load.empty()) {
    CheckpointRef ref;
    bool found = false;
    NB_TRY(find_checkpoint(cfg_.load, cfg_.ckpt_step, &ref, &found));
    if (found) {
      TrainConfig saved;
      LlamaConfig saved_model;
      NB_TRY(checkpoint_config(ref, &saved, &saved_model));
      if (saved.peft == "lora")
        dir = saved.load_hf;  // resuming adapters: the base that run started from
      else
        file = checkpoint_model_file(ref);  // a full-model checkpoint: its weights are the base
    }
  }
  if (dir.empty() && file.empty()) {
    std::printf("LoRA base: randomly initialized (seed %lld; pass --load-hf DIR for real weights)\n",
                (long long)cfg_.seed);
    return Status::ok();
  }
  lora_base_ = std::make_unique<HfCheckpointReader>();
  lora_base_from_checkpoint_ = !file.empty();
  NB_TRY((file.empty() ? lora_base_->open(dir) : lora_base_->open_file(file)).context("the LoRA base"));
  std::printf("LoRA base: %s, frozen as %s\n", lora_base_->where().c_str(), cfg_.lora_base_precision.c_str());
  return Status::ok();
}

void Trainer::print_lora_plan() const {
  if (cfg_.peft != "lora") return;
  const int64_t n = lora_param_count(model_cfg_, lora_spec_);
  std::string targets;
  for (LoraTarget t : lora_spec_.targets) targets += std::string(targets.empty() ? "" : ",") + lora_target_name(t);
  // Under tensor parallelism each rank holds the whole A of q/k/v and gate/up and B of o and down, and its part
  // of the other halves (model/tensor_parallel.h).
  const std::string per_rank =
      tp_size() > 1 ? strprintf(
                          ", %.2f M on each tensor-parallel rank (A of qkv and fc1, B of proj and fc2 whole; the other "
                          "halves split with their base)",
                          double(lora_param_count(tp::local_config(model_cfg_, tp_size()), lora_spec_)) / 1e6)
                    : std::string();
  std::printf(
      "LoRA: rank %lld, alpha %g (scale %g), dropout %g, targets %s: %.2f M trainable parameters (%.3f%% of the "
      "model%s); base frozen in %s (no gradients, no optimizer state)\n",
      (long long)lora_spec_.rank, lora_spec_.alpha, lora_spec_.scale(), lora_spec_.dropout, targets.c_str(), n / 1e6,
      100.0 * double(n) / double(model_cfg_.total_params()), per_rank.c_str(), cfg_.lora_base_precision.c_str());
}

// SAVE/peft_adapter_iter_0000100: adapter_config.json + adapter_model.safetensors, loadable by
// PeftModel.from_pretrained on the base (nibble export --merge-lora merges it). Under tensor parallelism the ranks
// of rank 0's group first gather their parts into whole tensors on rank 0 (gather_whole), as the stages do.
Status Trainer::write_lora_adapter() {
  if (cfg_.peft != "lora" || cfg_.save.empty()) return Status::ok();
  LoraAdapter ad;
  if (whole_differs()) {  // (tensor or pipeline parallelism, or both)
    if (!state_rank()) return Status::ok();
    const ParamStore& P = model_.params();
    std::vector<float> local(size_t(P.total())), whole;
    int64_t whole_total = 0;
    const std::vector<ParamInfo> layout = P.whole_layout(&whole_total);
    if (logging_rank()) whole.resize(size_t(whole_total));
    NB_TRY(P.get_state(optim::StateArray::master, local.data()));
    NB_TRY(gather_whole(local.data(), whole.data()));
    if (logging_rank()) lora_adapter_from_values(whole.data(), layout, model_cfg_, lora_spec_, &ad);
  }
  if (!logging_rank()) return Status::ok();
  const std::string dir = cfg_.save + "/peft_adapter_" + checkpoint_folder_name(iteration_);
  if (std::filesystem::exists(dir)) {
    std::printf("PEFT adapter: %s exists already, not rewritten\n", dir.c_str());
    return Status::ok();
  }
  if (!whole_differs()) NB_TRY(lora_adapter_from_store(model_.params(), model_cfg_, lora_spec_, &ad));
  ad.base_model_name_or_path = cfg_.load_hf;
  NB_TRY(write_peft_adapter(dir, model_cfg_, ad).context("writing the PEFT adapter"));
  std::printf("PEFT adapter written to %s (adapter_config.json + adapter_model.safetensors)\n", dir.c_str());
  return Status::ok();
}

}  // namespace nb
