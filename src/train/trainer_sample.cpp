// Samples while training (--sample-interval N, --sample-prompt TEXT, --sample-tokens K): every N steps rank 0
// prints a greedy continuation of the prompt from the current weights and writes it to metrics.jsonl as
// {"iteration", "sample_prompt", "sample"}. The continuation runs the KV-cache generator (src/infer/) over
// the model's compute copies (BF16 on CUDA; a quantized layer's linear weights, which keep only FP32
// masters, are rounded to BF16 on use), so a sample shows what the weights say without the recipe's
// quantization. Its buffers (cache and activations for one prompt) live only during the sample.
// Under tensor parallelism rank 0's tensor-parallel group (the first T ranks) samples together, each rank over
// its own shard (infer/generator.h), and rank 0 prints; the other groups hold the same weights and skip it.
#include <cstdio>
#include <nlohmann/json.hpp>
#include "core/memory_ledger.h"
#include "infer/generator.h"
#include "tokenizer/utf8.h"
#include "train/trainer.h"

namespace nb {

// At setup: the tokenizer and the prompt, or one sentence on why samples cannot be taken in this run.
Status Trainer::setup_sampling() {
  if (cfg_.sample_interval == 0) return Status::ok();
  if (cfg_.tokenizer.empty())
    return errorf(
        "--sample-interval needs --tokenizer FILE (the tokenizer of the model's vocabulary) to encode "
        "--sample-prompt and decode the samples");
  if (lora())
    return errorf(
        "--sample-interval does not sample LoRA runs yet; export the adapter and run nibble generate "
        "--adapter on it");
  if (cfg_.overlap_param_gather || cfg_.sharding_strategy() == "optim_grads_params")
    return errorf(
        "--sample-interval needs every rank's whole weights after a step; drop --overlap-param-gather "
        "and a sharding strategy that shards the weights");
  NB_TRY(BpeTokenizer::load(cfg_.tokenizer, "auto", &sample_tok_).context("--tokenizer"));
  if (sample_tok_->vocab_size() > model_cfg_.vocab)
    return errorf("the tokenizer %s has %lld tokens but model %s has a vocabulary of %lld", cfg_.tokenizer.c_str(),
                  (long long)sample_tok_->vocab_size(), model_cfg_.name.c_str(), (long long)model_cfg_.vocab);
  sample_ids_.clear();
  if (sample_tok_->adds_bos() && sample_tok_->bos() >= 0) sample_ids_.push_back(sample_tok_->bos());
  sample_tok_->encode_with_specials(cfg_.sample_prompt, &sample_ids_);
  return infer::check_prompts({sample_ids_}, model_cfg_, model_cfg_.max_seq).context("--sample-prompt");
}

Status Trainer::sample(int64_t iteration) {
  if (!(logging_rank() || (tp_size() > 1 && state_rank()))) return Status::ok();
  streamer_.wait_all();                 // a streamed update may still be writing the weights' compute copies
  MemoryScope scope(MemPart::samples);  // the estimate's row for them (train/memory_estimate.h)
  infer::ModelWeights w;
  NB_TRY(infer::weights_from_store(model_.params(), model_.config(), &w));  // this rank's shard under TP
  infer::TensorParallelGroup tp;
  if (tp_size() > 1) tp = {model_.tp_group, tp::vocab_begin(model_cfg_, model_.tp_shard()), model_cfg_.vocab};
  infer::Generator gen;
  const int64_t context = std::min<int64_t>(model_cfg_.max_seq, int64_t(sample_ids_.size()) + cfg_.sample_tokens);
  NB_TRY(gen.init(model_.config(), w, dev_, 1, context, tp));
  infer::GenerateOptions o;
  o.max_new_tokens = cfg_.sample_tokens;
  o.stop_ids = sample_tok_->end_ids();
  infer::GenerateResult r;
  NB_TRY(gen.generate({sample_ids_}, o, &r));
  // A token may end inside a character (--sample-tokens cuts the sample anywhere): the ill-formed bytes print as
  // U+FFFD, as Hugging Face's tokenizer.decode prints them (tokenizer/utf8.h).
  if (!logging_rank()) return Status::ok();
  const std::string text = sample_tok_->decode_lenient(r.tokens[0]);
  const std::string line = valid_utf8(cfg_.sample_prompt + text);
  std::printf("sample at iteration %lld: %s\n", (long long)iteration, line.c_str());
  std::fflush(stdout);
  if (jsonl_) {
    nlohmann::ordered_json j;
    j["iteration"] = iteration;
    j["sample_prompt"] = cfg_.sample_prompt;
    j["sample"] = valid_utf8(text);  // the prompt keeps the JSON writer's replacement: it is the user's text
    jsonl_ << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n" << std::flush;
  }
  return Status::ok();
}

}  // namespace nb
