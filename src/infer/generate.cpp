// Generator::generate: prefill, then decode steps until every row has stopped (an end token, its token
// budget, or the cache's end), choosing each token greedily on the device or by the seeded sampler on
// the host (infer/sampler.h). Timing: prefill is measured up to the first tokens on the host, decode over
// the steps after it; both include the host round trip of every step (the tokens are needed to stop).
#include <algorithm>
#include <chrono>
#include "infer/decode_ops.h"
#include "infer/generator.h"

namespace nb::infer {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The next token of every row: greedy from the device argmax (step() did it), or sampled from host logits.
void choose(const std::vector<float>& logits, int64_t V, const SamplingParams& sp, uint32_t step,
            std::vector<int32_t>* next) {
  for (size_t b = 0; b < next->size(); ++b)
    (*next)[b] = sample_token(logits.data() + int64_t(b) * V, V, sp, step, uint32_t(b));
}

}  // namespace

Status Generator::generate(const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& o,
                           GenerateResult* r) {
  NB_TRY(validate(o.sampling));
  LlamaConfig whole = config();
  whole.vocab = vocab();  // the ids a prompt may hold: the whole vocabulary under tensor parallelism
  NB_TRY(check_prompts(prompts, whole, L_));
  const int64_t Bn = int64_t(prompts.size()), V = vocab();
  if (Bn > max_batch()) return errorf("%lld prompts exceed the batch of %lld", (long long)Bn, (long long)max_batch());
  const bool greedy = o.sampling.greedy() || o.sampling.top_k == 1;
  *r = GenerateResult{};
  r->tokens.assign(size_t(Bn), {});
  r->finish.assign(size_t(Bn), "");
  for (const auto& p : prompts) r->prompt_tokens += int64_t(p.size());
  auto t0 = std::chrono::steady_clock::now();
  std::vector<float> logits;
  std::vector<int32_t> next(static_cast<size_t>(Bn));
  NB_TRY(prefill(prompts, greedy ? nullptr : &logits, o.prefill_logits ? &r->prefill_logits : nullptr));
  if (greedy)
    NB_TRY(first_argmax(&next));
  else
    choose(logits, V, o.sampling, 0, &next);
  r->prefill_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  // Row b may add tokens until its budget or the context: prompt + new tokens <= L_.
  int64_t active = Bn;
  for (uint32_t step_index = 1;; ++step_index) {
    for (int64_t b = 0; b < Bn; ++b) {
      if (!r->finish[size_t(b)].empty()) continue;
      auto& toks = r->tokens[size_t(b)];
      toks.push_back(next[size_t(b)]);
      const int64_t total = int64_t(prompts[size_t(b)].size() + toks.size());
      const char* why = std::find(o.stop_ids.begin(), o.stop_ids.end(), toks.back()) != o.stop_ids.end() ? "stop"
                        : int64_t(toks.size()) >= o.max_new_tokens                                       ? "length"
                        : total >= L_                                                                    ? "context"
                                                                                                         : nullptr;
      if (why) {
        r->finish[size_t(b)] = why;
        freeze_row(b);
        --active;
      }
    }
    if (active == 0) break;
    if (greedy) {
      NB_TRY(step(nullptr, nullptr, &next));
    } else {
      NB_TRY(copy_ids(next));
      NB_TRY(step(nullptr, &logits));
      choose(logits, V, o.sampling, step_index, &next);
    }
    ++r->decode_steps;
  }
  r->decode_s = seconds_since(t0);
  return Status::ok();
}

}  // namespace nb::infer
