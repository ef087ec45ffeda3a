// Trainer checkpoint phases: load (resume, --finetune, --load-hf) with Megatron's resume rules, the
// trainer state a checkpoint carries, and save (device-to-host copy, then the background writer).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include "core/log.h"
#include "io/hf_llama.h"
#include "io/json_checked.h"
#include "model/hf_layout.h"
#include "train/trainer.h"

#ifndef NIBBLE_VERSION
#define NIBBLE_VERSION "unknown"
#endif

namespace nb {

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Keys a resume may change freely (Megatron accepts them too); every other change is printed.
bool free_on_resume(const std::string& key) {
  static const char* kFree[] = {"train-iters",
                                "min-lr",
                                "eval-interval",
                                "eval-iters",
                                "log-interval",
                                "save",
                                "save-interval",
                                "save-keep",
                                "async-save",
                                "exit-interval",
                                "load",
                                "ckpt-step",
                                "no-load-optim",
                                "no-load-rng",
                                "finetune",
                                "load-hf",
                                "device",
                                "deterministic-mode",
                                "quant-stats",
                                "on-nan",
                                "peak-tflops",
                                "lr-decay-iters",
                                "quant-stats-interval",
                                "ddp-bucket-size",
                                "overlap-grad-reduce",
                                "overlap-param-gather",
                                "distributed-timeout-minutes",
                                "optimizer-cpu-offload",
                                "optimizer-offload-fraction",
                                "optimizer-state-offload-chunk-size-mb",
                                "tensorboard-dir",
                                "tensorboard-log-interval"};
  for (const char* k : kFree)
    if (key == k) return true;
  return false;
}

// Keys that fix what the saved run computes from here on, with what each fixes: a different value cannot
// continue the run (--finetune starts a new one from the weights).
const char* fixed_on_resume(const std::string& key) {
  static const std::pair<const char*, const char*> kFixed[] = {
      {"seq-length", "the data order and the tokens per step"},
      {"global-batch-size", "the data order and the samples per step"},
      {"seed", "the data order and the random streams"},
      {"mock-data", "the data"},
      {"data-path", "the data"},
      {"split", "the data order"},
      {"sft", "the data and the loss"},
      {"packed-sequence", "the rows of the data"},
      {"pad-seq-to-mult", "the rows of the data"},
      {"peft", "the trained parameters"},
      {"lora-rank", "the adapters' shape"},
      {"lora-target", "the adapted layers"}};
  for (const auto& [k, why] : kFixed)
    if (key == k) return why;
  return nullptr;
}

// The checkpoint's model against this run's. Another shape cannot load at all; other numerics (RoPE, the
// norm's epsilon, the context) would continue the weights as another function, so only --finetune, a new run
// from the weights (a longer context with a new RoPE base, say), accepts them.
Status check_model(const LlamaConfig& m, const LlamaConfig& c, bool finetune) {
  const std::pair<const char*, std::pair<int64_t, int64_t>> shape[] = {
      {"hidden size", {m.hidden, c.hidden}},  {"FFN size", {m.ffn, c.ffn}},
      {"layers", {m.layers, c.layers}},       {"attention heads", {m.heads, c.heads}},
      {"KV heads", {m.kv_heads, c.kv_heads}}, {"head dim", {m.head_dim, c.head_dim}},
      {"vocabulary", {m.vocab, c.vocab}},     {"tied embeddings", {m.tied_embeddings, c.tied_embeddings}}};
  for (const auto& [field, v] : shape)
    if (v.first != v.second)
      return errorf("its model has %s %lld but this run's model (%s) has %lld; pass the model of the checkpoint (%s)",
                    field, (long long)v.first, c.name.c_str(), (long long)v.second, m.name.c_str());
  if (finetune) return Status::ok();
  const std::pair<const char*, std::pair<double, double>> numerics[] = {
      {"RoPE theta", {m.rope_theta, c.rope_theta}},
      {"RoPE scaling factor", {m.rope_factor, c.rope_factor}},
      {"RoPE low-frequency factor", {m.rope_low_freq_factor, c.rope_low_freq_factor}},
      {"RoPE high-frequency factor", {m.rope_high_freq_factor, c.rope_high_freq_factor}},
      {"RoPE original context", {double(m.rope_original_max_pos), double(c.rope_original_max_pos)}},
      {"norm epsilon", {m.norm_eps, c.norm_eps}},
      {"context length", {double(m.max_seq), double(c.max_seq)}}};
  for (const auto& [field, v] : numerics)
    if (v.first != v.second)
      return errorf(
          "its model has %s %.9g but this run's model (%s) has %.9g; pass the model of the checkpoint (%s), or "
          "--finetune to start a new run from its weights",
          field, v.first, c.name.c_str(), v.second, m.name.c_str());
  return Status::ok();
}

}  // namespace

Trainer::HostCopies::~HostCopies() {
  for (float* p : {master, m, v}) {
    if (pinned)
      pinned_host_free(p);
    else
      std::free(p);
  }
}

Status Trainer::HostCopies::allocate(int64_t n, bool page_locked) {
  const size_t bytes = size_t(n) * sizeof(float);
  pinned = page_locked;
  for (float** p : {&master, &m, &v}) {
    if (page_locked) {
      NB_TRY(pinned_host_malloc(reinterpret_cast<void**>(p), bytes));
    } else if (!(*p = static_cast<float*>(std::malloc(bytes)))) {
      return errorf("cannot allocate %.2f GiB of host memory", double(bytes) / 1073741824.0);
    }
  }
  return Status::ok();
}

Status Trainer::load() {
  if (!cfg_.load.empty()) {
    namespace fs = std::filesystem;
    if (!fs::is_directory(cfg_.load) && cfg_.load != cfg_.save)
      return errorf("--load %s is not a folder; pass the --save folder of an earlier run", cfg_.load.c_str());
    CheckpointRef ref;
    bool found = true;
    NB_TRY(find_checkpoint(cfg_.load, cfg_.ckpt_step, &ref, &found));
    if (found && lora_base_from_checkpoint_) {
      std::printf("LoRA: the full-model checkpoint %s is the frozen base; fresh adapters, iteration 0\n",
                  ref.dir.c_str());
      return Status::ok();
    }
    if (found) return load_checkpoint(ref);
    std::printf("no checkpoint in %s yet (no latest_checkpointed_iteration.txt): starting a new run\n",
                cfg_.load.c_str());
  }
  if (!cfg_.load_hf.empty() && lora()) {
    std::printf("LoRA: frozen base loaded from %s; fresh adapters, iteration 0\n", cfg_.load_hf.c_str());
  } else if (!cfg_.load_hf.empty()) {
    NB_TRY(load_hf_weights(cfg_.load_hf, model_cfg_, model_.params()).context("--load-hf"));
    std::printf("loaded Hugging Face weights from %s (AdamW state fresh, iteration 0)\n", cfg_.load_hf.c_str());
  }
  return Status::ok();
}

Status Trainer::load_checkpoint(const CheckpointRef& ref) {
  const auto t0 = std::chrono::steady_clock::now();
  nlohmann::json state;
  NB_TRY(read_checkpoint_state(ref, &state, FileCheck::size));  // CRCs: checked below, while reading
  TrainConfig saved;
  LlamaConfig saved_model;
  NB_TRY(checkpoint_config_of(state, ref.dir + "/trainer_state.json", &saved, &saved_model));
  if (Status st = check_resume_compatible(saved, saved_model); !st)
    return errorf("cannot load the checkpoint %s: %s", ref.dir.c_str(), st.message().c_str());
  ParamStore& P = model_.params();
  // Each file is read once, its CRC checked on the way. An offloaded, unsharded state is read straight into
  // its host arrays (no second host copy of it). Under tensor parallelism the whole arrays are read and this
  // rank's slices kept.
  int64_t whole_total = P.total();
  const std::vector<HfTensor> layout = whole_differs() ? hf_tensors(P.whole_layout(&whole_total)) : hf_tensors(P);
  using optim::StateArray;
  const bool load_optim = !cfg_.finetune && !cfg_.no_load_optim;
  std::vector<float> scratch[3], whole[3];
  auto target = [&](StateArray a) {
    if (saves_from_state()) return P.optimizer_state().host_array(a);
    if (scratch[int(a)].empty()) scratch[int(a)].assign(size_t(P.total()), 0.0f);
    return scratch[int(a)].data();
  };
  auto read_target = [&](StateArray a) {
    if (!whole_differs()) return target(a);
    whole[int(a)].assign(size_t(whole_total), 0.0f);
    return whole[int(a)].data();
  };
  auto keep_slice = [&](StateArray a) {
    if (whole_differs()) P.slice_whole(whole[int(a)].data(), target(a));
    std::vector<float>().swap(whole[int(a)]);
  };
  P.optimizer_state().settle();
  NB_TRY(read_checkpoint_file(ref, state, "model.safetensors", layout, {{"", read_target(StateArray::master)}}));
  keep_slice(StateArray::master);
  NB_TRY(P.set_master(target(StateArray::master)));
  if (load_optim) {
    NB_TRY(
        read_checkpoint_file(ref, state, "optimizer.safetensors", layout,
                             {{".exp_avg", read_target(StateArray::m)}, {".exp_avg_sq", read_target(StateArray::v)}}));
    keep_slice(StateArray::m);
    keep_slice(StateArray::v);
    NB_TRY(P.set_state(StateArray::m, target(StateArray::m)));
    NB_TRY(P.set_state(StateArray::v, target(StateArray::v)));
  }
  if (!cfg_.finetune) NB_TRY(restore_state(state).context("checkpoint " + ref.dir));
  std::printf(
      "loaded checkpoint %s in %.1f s: %s%s%s\n", ref.dir.c_str(), ms_since(t0) / 1000.0,
      cfg_.finetune ? "weights only (--finetune), starting at iteration 0"
                    : strprintf("resuming after iteration %lld", (long long)iteration_).c_str(),
      cfg_.finetune ? "" : (load_optim ? ", AdamW state loaded" : ", AdamW state fresh (--no-load-optim)"),
      cfg_.finetune ? "" : (cfg_.no_load_rng ? ", RNG streams restarted (--no-load-rng)" : ", RNG state loaded"));
  std::fflush(stdout);  // a job killed right after still shows what it resumed from
  return Status::ok();
}

// Refuses what cannot continue the saved run (model shape; model numerics, data order, batch and seed, unless
// --finetune), names the field and both values (the caller names the checkpoint), and prints every other
// change. The saved configuration and model are the checkpoint's one record of its run: trainer_state.json
// repeats none of their fields elsewhere, so nothing saved escapes this comparison.
Status Trainer::check_resume_compatible(const TrainConfig& saved, const LlamaConfig& m) const {
  NB_TRY(check_model(m, model_cfg_, cfg_.finetune));
  if (!cfg_.finetune) NB_TRY(check_anneal_resume(saved));
  TrainConfig saved_copy = saved, now = cfg_;
  // The SFT padding in effect (0 chooses 2C under context parallelism): a packed run resumed at another C would
  // otherwise pack other rows without a word.
  for (TrainConfig* c : {&saved_copy, &now})
    if (c->sft) c->pad_seq_to_mult = c->sft_pad_multiple();
  auto then_keys = config_keys(saved_copy), now_keys = config_keys(now);
  for (size_t i = 0; i < now_keys.size(); ++i) {
    const std::string a = then_keys[i].get(), b = now_keys[i].get(), key = now_keys[i].name;
    if (a == b || free_on_resume(key)) continue;
    if (const char* fixes = fixed_on_resume(key); fixes && !cfg_.finetune)
      return errorf(
          "it was saved with --%s %s but this run has --%s %s (it fixes %s); resume with --%s %s, or pass "
          "--finetune to start a new run from its weights",
          key.c_str(), a.c_str(), key.c_str(), b.c_str(), fixes, key.c_str(), a.c_str());
    if (!cfg_.finetune) std::printf("note: --%s changed on resume: %s -> %s\n", key.c_str(), a.c_str(), b.c_str());
  }
  return Status::ok();
}

Status Trainer::restore_state(const nlohmann::json& s) {
  try {
    iteration_ = json_int(s, "iteration");
    NB_TRY(resume_anneal(s));  // before the delayed-scaling state: it belongs to the recipe of that iteration
    consumed_valid_ = json_int(s, "consumed_valid_samples");
    const auto& opt = json_field(s, "optimizer");
    adam_step_ = cfg_.no_load_optim ? 0 : json_int(opt, "step");
    skipped_ = json_int(opt, "skipped_iterations");
    nan_iters_ = json_int(opt, "nan_iterations");
    rng_step_ = cfg_.no_load_rng ? 0 : json_int(json_field(s, "rng"), "stochastic_rounding_step");
    const int64_t consumed = json_int(s, "consumed_train_samples");
    if (iteration_ < 0 || consumed != iteration_ * cfg_.global_batch_size)
      return errorf("consumed_train_samples %lld is not iteration x global batch (%lld x %lld)", (long long)consumed,
                    (long long)iteration_, (long long)cfg_.global_batch_size);
    std::vector<LlamaModel::LinearScaling> scaling;
    for (const auto& l : json_field(s, "fp8_delayed_scaling")) {
      LlamaModel::LinearScaling ls{json_string(l, "linear"), {}};
      for (const auto& r : json_field(l, "roles")) {
        std::vector<float> history;
        for (const auto& h : json_field(r, "history")) history.push_back(json_float_value(h, "history"));
        ls.roles.push_back({int(json_int(r, "role")), json_bool(r, "has_history"), json_bool(r, "used_in_step"),
                            json_float(r, "scale"), json_float(r, "step_amax"), std::move(history)});
      }
      scaling.push_back(std::move(ls));
    }
    const std::string saved_recipe = json_string(s, "recipe");
    Status st = model_.set_scaling_states(scaling);
    if (!st)
      return errorf(
          "the checkpoint's recipe %s and this run's %s keep different FP8 delayed-scaling state (%s); "
          "resume with --recipe %s, or pass --finetune",
          saved_recipe.c_str(), recipe_.name.c_str(), st.message().c_str(), saved_recipe.c_str());
    NB_TRY(load_mor_state(s));
  } catch (const std::exception& e) {
    return errorf("trainer_state.json lacks a field this nibble needs, or has one of another type (%s)", e.what());
  }
  return Status::ok();
}

nlohmann::json Trainer::trainer_state() const {
  nlohmann::json s;
  s["format"] = "nibble checkpoint";
  s["checkpoint_version"] = 1;
  s["nibble_version"] = NIBBLE_VERSION;
  s["iteration"] = iteration_;
  s["consumed_train_samples"] = iteration_ * cfg_.global_batch_size;
  s["consumed_valid_samples"] = consumed_valid_;
  s["optimizer"] = {
      {"type", "adamw"}, {"step", adam_step_}, {"skipped_iterations", skipped_}, {"nan_iterations", nan_iters_}};
  // Stochastic rounding and the RHT signs draw from Philox4x32-10 keyed by {seed, step, tensor/micro/role}
  // (recipe/linear.h): the seed (the configuration's --seed) and this step counter are the whole RNG state.
  // The LR schedule is a function of the iteration and the configuration, so it has no state of its own.
  s["rng"] = {{"generator", "philox4x32-10"}, {"stochastic_rounding_step", rng_step_}};
  std::vector<LlamaModel::LinearScaling> scaling = pipeline_scaling_;  // the stages' (save gathered them)
  if (pp_size() == 1) {
    Status st = model_.scaling_states(&scaling);
    NB_CHECK(st.is_ok(), "%s", st.message().c_str());
  }
  s["fp8_delayed_scaling"] = nlohmann::json::array();
  for (const auto& l : scaling) {
    nlohmann::json roles = nlohmann::json::array();
    for (const auto& r : l.roles)
      roles.push_back({{"role", r.role},
                       {"has_history", r.has_history},
                       {"used_in_step", r.used_in_step},
                       {"scale", r.scale},
                       {"step_amax", r.step_amax},
                       {"history", r.history}});
    s["fp8_delayed_scaling"].push_back({{"linear", l.linear}, {"roles", roles}});
  }
  s["recipe"] = recipe_.name;
  if (anneal_configured()) s["anneal"] = anneal_state();
  if (nlohmann::json mor = mor_state(); !mor.is_null()) s["mor"] = std::move(mor);
  // The run's configuration and model: the only copy of their fields here, compared whole on resume
  // (check_resume_compatible).
  TrainConfig c = cfg_;
  s["config"] = format_config(c);
  s["model"] = model_config_json(model_cfg_);
  return s;
}

// Page-locked host copies of master, m and v (allocated once: before step 1 when saves are configured,
// else at the first save, e.g. on SIGTERM) and the writer thread.
// Rank 0 alone writes checkpoints: with plain data parallelism every rank holds the same whole state;
// with the distributed optimizer the ranks first gather their shards (save()).
Status Trainer::prepare_saves() {
  if (!state_rank()) return Status::ok();
  if (!host_ && !saves_from_state()) {
    host_ = std::make_unique<HostCopies>();
    NB_TRY(host_->allocate(model_.params().total(), dev_ == Device::cuda).context("checkpoint host copies"));
  }
  if (!logging_rank()) return Status::ok();
  if (!writer_) writer_ = std::make_unique<AsyncCheckpointWriter>(cfg_.save, cfg_.save_keep);
  return Status::ok();
}

// The step loop stalls only for the device-to-host copy; the previous save must have finished first
// (its host copies are about to be overwritten), which finish_saves() also reports.
Status Trainer::save(TrainSummary* summary) {
  streamer_.wait_all();
  if (!state_rank() && !sharded()) return Status::ok();
  NB_TRY(finish_saves(summary));
  ParamStore& P = model_.params();
  NB_TRY(prepare_saves());
  const auto t0 = std::chrono::steady_clock::now();
  using optim::StateArray;
  const float* arrays[3] = {nullptr, nullptr, nullptr};
  if (saves_from_state()) {  // the host arrays are the checkpoint's source: no second copy of the state
    NB_TRY(P.optimizer_state().stage_resident_for_save());
    for (StateArray a : optim::kStateArrays) arrays[int(a)] = P.optimizer_state().host_array(a);
  } else if (sharded()) {  // every rank takes part in gathering the shards; rank 0 writes
    NB_TRY(gather_optimizer_state(StateArray::master, host_ ? host_->master : nullptr));
    NB_TRY(gather_optimizer_state(StateArray::m, host_ ? host_->m : nullptr));
    NB_TRY(gather_optimizer_state(StateArray::v, host_ ? host_->v : nullptr));
    if (!state_rank()) return Status::ok();
  } else {
    NB_TRY(P.get_state(StateArray::master, host_->master));
    NB_TRY(P.get_state(StateArray::m, host_->m));
    NB_TRY(P.get_state(StateArray::v, host_->v));
  }
  if (!arrays[0]) arrays[0] = host_->master, arrays[1] = host_->m, arrays[2] = host_->v;
  std::vector<HfTensor> layout = hf_tensors(P);
  if (whole_differs()) {  // rank 0's tensor-parallel group or the stages' state ranks: the whole arrays on rank 0
    int64_t whole_total = 0;
    layout = hf_tensors(P.whole_layout(&whole_total));
    for (int a = 0; a < 3; ++a) {
      if (logging_rank()) whole_[a].resize(size_t(whole_total));
      NB_TRY(gather_whole(arrays[a], whole_[a].data()));
      arrays[a] = whole_[a].data();
    }
    if (layout_.tp == 0) {  // the stages' delayed-scaling states and MoR decisions (pp_comm_)
      NB_TRY(gather_pipeline_scaling());
      NB_TRY(gather_pipeline_mor());
    }
    if (!logging_rank()) return Status::ok();
  }
  CheckpointData d{iteration_, std::move(layout), arrays[0], arrays[1], arrays[2], trainer_state()};
  const double stall_ms = ms_since(t0);
  summary->save_stall_ms_max = std::max(summary->save_stall_ms_max, stall_ms);
  summary->saves++;
  pending_save_ = iteration_;
  if (cfg_.async_save) {
    NB_TRY(writer_->start(std::move(d)));
    std::printf(
        "saving checkpoint iteration %lld to %s: step stalled %.1f ms for the device-to-host copy; files are "
        "written in the background\n",
        (long long)iteration_, cfg_.save.c_str(), stall_ms);
    std::fflush(stdout);
    return Status::ok();
  }
  CheckpointWriteStats ws;
  Status st = write_checkpoint(cfg_.save, d, cfg_.save_keep, &ws)
                  .context("saving the checkpoint of iteration " + std::to_string(iteration_));
  if (!st) return with_surviving_checkpoint(st);
  note_written(ws, summary);
  return Status::ok();
}

// A failed save's sentence, completed with what survives: the tracker still names the newest
// complete checkpoint (a failed save never touches it).
Status Trainer::with_surviving_checkpoint(const Status& failed) const {
  CheckpointRef ref;
  bool found = false;
  const bool ok = find_checkpoint(cfg_.save, -1, &ref, &found).is_ok() && found;
  return Status::error(failed.message() + (ok ? strprintf("; the checkpoint of iteration %lld in %s is intact",
                                                          (long long)ref.iteration, cfg_.save.c_str())
                                              : std::string("; no earlier checkpoint exists in ") + cfg_.save));
}

Status Trainer::finish_saves(TrainSummary* summary) {
  if (!writer_ || pending_save_ < 0) return Status::ok();
  CheckpointWriteStats ws;
  Status st = writer_->wait(&ws);
  if (!st) return with_surviving_checkpoint(st);
  note_written(ws, summary);
  return Status::ok();
}

void Trainer::note_written(const CheckpointWriteStats& ws, TrainSummary* summary) {
  std::printf("checkpoint iteration %lld written: %.2f GiB in %.2f s (%.2f GiB/s)\n", (long long)pending_save_,
              double(ws.bytes) / 1073741824.0, ws.seconds,
              double(ws.bytes) / 1073741824.0 / std::max(ws.seconds, 1e-9));
  summary->save_write_s_max = std::max(summary->save_write_s_max, ws.seconds);
  summary->checkpoint_gib = double(ws.bytes) / 1073741824.0;
  pending_save_ = -1;
}

}  // namespace nb
