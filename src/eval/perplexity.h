// Perplexity of a model on text or on a Megatron dataset's split (docs/EVAL.md has the definitions).
//
// Text: every document's tokens (no BOS: the window's prefix token plays its part) are scored by the
// harness's loglikelihood_rolling with context_len 1: windows of max_length predicted tokens, the first
// conditioned on the prefix token (BOS, else end-of-text) and each later one on the max_length tokens
// before its last prediction, so every token is predicted exactly once with up to max_length tokens of
// context. Reported as the harness does: word perplexity exp(-ll / words) with words =
// len(re.split(r"\s+", doc)), byte perplexity exp(-ll / bytes), bits per byte -ll / bytes / ln 2, plus
// the token perplexity exp(-ll / tokens).
// Dataset: the first N samples of the split in the order the trainer reads them (GPTDataset indices,
// samples of seq_length + 1 tokens, labels the next tokens); perplexity exp(mean token loss), the
// trainer's "lm loss PPL" of a validation pass over the same samples.
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include "data/token_source.h"
#include "eval/loglik.h"
#include "tokenizer/bpe_tokenizer.h"

namespace nb::eval {

struct PerplexityResult {
  int64_t documents = 0, windows = 0, tokens = 0, words = 0, bytes = 0;
  double nll = 0;  // summed negative log-likelihood (nats)
  double token_perplexity() const;
  double word_perplexity() const;  // text only (words > 0)
  double byte_perplexity() const;
  double bits_per_byte() const;
};

// The harness's get_rolling_token_windows(tokens, prefix, max_length, context_len=1), made disjoint.
std::vector<LoglikRequest> rolling_windows(const std::vector<int32_t>& tokens, int32_t prefix, int64_t max_length);

// Documents of a text file: a .jsonl file gives one per line (its string field `key`); any other
// file is one document.
Status read_text_documents(const std::string& path, const std::string& key, std::vector<std::string>* docs);

// The windows of every document, and the word and byte counts of the result (no scoring yet).
Status text_windows(const std::vector<std::string>& docs, const BpeTokenizer& tok, int64_t max_length,
                    std::vector<LoglikRequest>* windows, PerplexityResult* counts);
// Scores windows made by text_windows into `r` (nll, tokens).
Status score_windows(EvalModel& m, const std::vector<LoglikRequest>& windows, PerplexityResult* r);

// The first `samples` samples of `set` (each seq_length + 1 tokens, seq_length <= m.shape.seq).
Status dataset_perplexity(EvalModel& m, const SampleSet& set, int64_t samples, PerplexityResult* r);

}  // namespace nb::eval
