// Precision annealing (the NVFP4 pretraining paper, "Pretraining LLMs with NVFP4", appendix D): the last
// part of training runs a higher-precision recipe. Steps 1..S run --recipe exactly as a run without
// annealing; from step S+1 on (S = round(F x train-iters)) every Linear runs --anneal-recipe, or with
// --anneal-fprop-only only the Fprop GEMM runs in BF16. Everything the switch needs is reserved at setup
// (the memory estimate, the activation arena and every weight's compute copy), so the switch itself only
// replaces the Linears' quantized copies: the old ones are released before the new ones allocate.
// A checkpoint past S resumes into the anneal recipe before its FP8 delayed-scaling state is restored.
#include <cmath>
#include <cstdio>
#include <string>
#include "io/json_checked.h"
#include "train/trainer.h"

namespace nb {

namespace {

// The recipes one may anneal into: every preset but NVFP4 (BF16 or FP8: a higher precision), listed.
std::string anneal_recipe_list() {
  std::string list;
  for (const std::string& n : recipe::recipe_names())
    if (n != "bf16_with_nvfp4_mixed") list += (list.empty() ? "" : ", ") + n;
  return list;
}

// The refusals that need only the configuration (one sentence each).
Status check_anneal_keys(const TrainConfig& c, bool lora) {
  if (c.anneal_start_fraction == 0) {
    if (!c.anneal_recipe.empty())
      return errorf(
          "--anneal-recipe %s names the recipe of the last part of training but no --anneal-start-fraction says "
          "when it starts; pass --anneal-start-fraction F (0 < F < 1) or drop --anneal-recipe",
          c.anneal_recipe.c_str());
    if (c.anneal_fprop_only)
      return errorf(
          "--anneal-fprop-only applies to precision annealing; pass --anneal-start-fraction F and --anneal-recipe "
          "bf16_mixed too, or drop it");
    return Status::ok();
  }
  if (!(c.anneal_start_fraction > 0 && c.anneal_start_fraction < 1))
    return errorf("--anneal-start-fraction must lie strictly between 0 and 1 (0 = no annealing); got %g",
                  c.anneal_start_fraction);
  if (c.anneal_recipe.empty())
    return errorf(
        "--anneal-start-fraction %g needs --anneal-recipe for the steps after the switch: bf16_mixed or an FP8 "
        "recipe",
        c.anneal_start_fraction);
  if (lora)
    return errorf(
        "precision annealing switches the recipe of trained weights, but a LoRA base is frozen in its "
        "--lora-base-precision formats; drop the --anneal-* keys or --peft lora");
  if (c.anneal_recipe == "bf16_with_nvfp4_mixed")
    return errorf(
        "--anneal-recipe bf16_with_nvfp4_mixed is not a higher precision to anneal into; choose bf16_mixed or an "
        "FP8 recipe");
  const std::string allowed = anneal_recipe_list();
  if ((", " + allowed + ", ").find(", " + c.anneal_recipe + ", ") == std::string::npos)
    return errorf("--anneal-recipe must be one of %s; got '%s'", allowed.c_str(), c.anneal_recipe.c_str());
  if (c.anneal_fprop_only && c.anneal_recipe != "bf16_mixed")
    return errorf(
        "--anneal-fprop-only needs --anneal-recipe bf16_mixed: an FP8 Fprop would need a second set of quantized "
        "copies of the input and weight beside the ones --recipe %s keeps for the backward",
        c.recipe.c_str());
  return Status::ok();
}

}  // namespace

Status Trainer::resolve_anneal() {
  anneal_recipe_ = recipe::Recipe{};
  anneal_step_ = 0;
  NB_TRY(check_anneal_keys(cfg_, lora()));
  if (cfg_.anneal_start_fraction == 0) return Status::ok();
  // Nearest step, halves up (std::llround), as the docs and --help say.
  const int64_t s = std::llround(cfg_.anneal_start_fraction * double(cfg_.train_iters));
  if (s < 1 || s > cfg_.train_iters - 1)
    return errorf(
        "--anneal-start-fraction %g of --train-iters %lld puts the switch after step %lld (the nearest step); it "
        "must fall after step 1 to %lld so that both recipes run, so choose another fraction",
        cfg_.anneal_start_fraction, (long long)cfg_.train_iters, (long long)s, (long long)(cfg_.train_iters - 1));
  // The preset as it is: its own BF16 layer counts; the --fp4-* and layer-count knobs shape --recipe only.
  NB_TRY(recipe::recipe_preset(cfg_.anneal_recipe, &anneal_recipe_).context("--anneal-recipe"));
  anneal_recipe_.seed = uint64_t(cfg_.seed);
  anneal_step_ = s;
  return Status::ok();
}

void Trainer::print_anneal_plan() const {
  if (!anneal_configured()) return;
  const int64_t layers = model_cfg_.layers;
  std::printf("precision annealing: steps %lld-%lld (after step S = round(%g x %lld) = %lld) run %s%s\n",
              (long long)(anneal_step_ + 1), (long long)cfg_.train_iters, cfg_.anneal_start_fraction,
              (long long)cfg_.train_iters, (long long)anneal_step_, anneal_recipe_.name.c_str(),
              cfg_.anneal_fprop_only ? " in Fprop only (Dgrad and Wgrad keep the recipe above)" : ":");
  if (cfg_.anneal_fprop_only) return;
  for (int64_t l = 0; l < layers;) {
    const bool bf16 = anneal_recipe_.layer_in_bf16(l, layers);
    int64_t e = l;
    while (e + 1 < layers && anneal_recipe_.layer_in_bf16(e + 1, layers) == bf16) ++e;
    std::printf("  layers %lld-%lld: %s\n", (long long)l, (long long)e,
                recipe::describe_gemms(anneal_recipe_, bf16, cc_major_, cc_minor_).c_str());
    l = e + 1;
  }
}

// With annealing every weight keeps its compute copy (2 bytes per weight on CUDA that a quantized layer
// would not hold otherwise): the BF16 GEMMs after the switch read it. A BF16 recipe counts exactly that.
recipe::Recipe Trainer::param_plan_recipe() const { return anneal_configured() ? recipe::Recipe{} : recipe_; }

recipe::Recipe Trainer::activation_plan_recipe() const {
  if (!anneal_configured()) return recipe_;
  return LlamaModel::activation_plan_recipe(recipe_, {anneal_recipe_, cfg_.anneal_fprop_only});
}

void Trainer::plan_anneal() {
  if (anneal_configured()) model_.planned_switch = LlamaModel::RecipeSwitch{anneal_recipe_, cfg_.anneal_fprop_only};
}

// The anneal keys must match the checkpoint's: a run that changed them would be neither configuration.
Status Trainer::check_anneal_resume(const TrainConfig& saved) const {
  TrainConfig then = saved, now = cfg_;
  const auto then_keys = config_keys(then), now_keys = config_keys(now);
  for (size_t i = 0; i < now_keys.size() && i < then_keys.size(); ++i) {
    const std::string& key = now_keys[i].name;
    if (key.rfind("anneal-", 0) != 0 || then_keys[i].get() == now_keys[i].get()) continue;
    return errorf(
        "it was saved with --%s %s but this run has --%s %s (precision annealing continues as configured); "
        "resume with --%s %s, or pass --finetune to start a new run from its weights",
        key.c_str(), then_keys[i].get().c_str(), key.c_str(), now_keys[i].get().c_str(), key.c_str(),
        then_keys[i].get().c_str());
  }
  return Status::ok();
}

Status Trainer::resume_anneal(const nlohmann::json& state) {
  const bool saved_after = state.contains("anneal") && json_bool(json_field(state, "anneal"), "active");
  const bool due = anneal_configured() && iteration_ >= anneal_step_;
  if (saved_after && !due)
    return errorf(
        "the checkpoint of iteration %lld was saved after the precision-annealing switch, but --train-iters %lld "
        "puts the switch after step %lld; pass the checkpoint's --train-iters",
        (long long)iteration_, (long long)cfg_.train_iters, (long long)anneal_step_);
  if (!due) return Status::ok();
  NB_TRY(model_.set_recipe(anneal_recipe_, cfg_.anneal_fprop_only).context("precision annealing"));
  annealed_ = true;
  anneal_announced_ = saved_after;  // the run that wrote the checkpoint logged the switch
  if (logging_rank())
    std::printf("precision annealing: resuming after iteration %lld, past the switch after step %lld: %s%s\n",
                (long long)iteration_, (long long)anneal_step_, anneal_recipe_.name.c_str(),
                cfg_.anneal_fprop_only ? " (fprop only)" : "");
  return Status::ok();
}

Status Trainer::anneal_if_due() {
  if (!anneal_configured() || anneal_announced_ || iteration_ < anneal_step_) return Status::ok();
  streamer_.wait_all();  // the switch rebuilds quantized weights from the compute copies
  if (!annealed_) NB_TRY(model_.set_recipe(anneal_recipe_, cfg_.anneal_fprop_only).context("precision annealing"));
  annealed_ = anneal_announced_ = true;
  const char* fprop = cfg_.anneal_fprop_only ? "true" : "false";
  if (logging_rank())
    std::printf("precision annealing: step %lld onwards runs %s%s\n", (long long)(iteration_ + 1),
                anneal_recipe_.name.c_str(), cfg_.anneal_fprop_only ? " (fprop only)" : "");
  if (jsonl_)
    jsonl_ << "{\"iteration\":" << iteration_ << ",\"anneal\":\"" << anneal_recipe_.name
           << "\",\"fprop_only\":" << fprop << "}\n"
           << std::flush;
  return Status::ok();
}

nlohmann::json Trainer::anneal_state() const {
  return {{"recipe", anneal_recipe_.name},
          {"fprop_only", cfg_.anneal_fprop_only},
          {"start_iteration", anneal_step_},
          {"active", annealed_}};
}

}  // namespace nb
