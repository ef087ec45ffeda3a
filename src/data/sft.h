// Supervised fine-tuning samples, prepared offline as NeMo does: one JSONL line per sample, either
// {"input", "output"} (NeMo) or {"messages": [{"role", "content"}, ...]} (chat), templated (Llama 3
// Instruct or plain), turned into token ids plus an answer mask, and cut to a longest length.
// `nibble preprocess --sft` (cli/cmd_preprocess_sft.cpp) writes the results; docs/DATA.md has the rules.
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include "core/status.h"
#include "tokenizer/bpe_tokenizer.h"

namespace nb {

struct SftMessage {
  std::string role;  // "system", "user" or "assistant"; assistant turns are the answers
  std::string content;
};
using SftSample = std::vector<SftMessage>;

// Parses one JSONL line in either shape ({"input","output"} becomes [user: input, assistant: output]).
// `where` ("file:line") starts the error message, which also says what a line must look like.
Status parse_sft_sample(const std::string& line, const std::string& where, SftSample* out);

enum class ChatTemplate { llama3, plain };
enum class SftTruncation { truncate, drop };

struct SftOptions {
  ChatTemplate chat_template = ChatTemplate::llama3;
  SftTruncation truncation = SftTruncation::truncate;
  int64_t seq_length = 0;  // the longest sample kept, in tokens (>= 1)
  bool add_bos = false;    // plain template: prepend the tokenizer's BOS (llama3 always starts with it)
};

// One templated sample: mask[i] = 1 when tokens[i] is an answer token, whose prediction is trained.
struct SftTokens {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  int64_t answer_content = 0;  // assistant content tokens (no eot/eod): 0 means the sample has no answer
  int64_t answer_tokens() const;
};

enum class SftOutcome {
  kept,               // fits as it is
  prompt_cut,         // truncated: the prompt lost tokens from its start, the answer is whole
  answer_cut,         // truncated: the answer lost tokens from its end too
  dropped_no_answer,  // no assistant content tokens (empty output, no assistant turn)
  dropped_too_long,   // longer than seq_length under SftTruncation::drop
};

// Cuts `s` to at most seq_length tokens. The prompt is tokens [0, P) before the first answer token, the
// answer A tokens [P, end) (later turns included). When P + A > N the prompt keeps
// kp = min(P, max(N - A, N / 4)) tokens: its first `keep_head` tokens (the BOS) and then its last ones;
// the answer keeps its first N - kp tokens. `s` must hold at least one answer token.
SftOutcome truncate_sft(SftTokens* s, int64_t seq_length, SftTruncation mode, int64_t keep_head);

// Templates samples with one tokenizer; cheap to copy, safe to share between threads.
class SftFormatter {
 public:
  // Checks that the tokenizer has what the template needs (Llama 3 special tokens, EOD, BOS).
  static Status create(const BpeTokenizer* tok, const SftOptions& opt, SftFormatter* out);
  // The template alone, no truncation. Each text piece is tokenized on its own (see docs/DATA.md).
  void format(const SftSample& sample, SftTokens* out) const;
  // format, then the no-answer drop and truncate_sft: what `preprocess --sft` writes.
  SftOutcome process(const SftSample& sample, SftTokens* out) const;
  const SftOptions& options() const { return opt_; }

 private:
  void format_llama3(const SftSample& sample, SftTokens* out) const;
  void format_plain(const SftSample& sample, SftTokens* out) const;
  void add_text(const std::string& text, uint8_t mask, bool content, SftTokens* out) const;
  const BpeTokenizer* tok_ = nullptr;
  SftOptions opt_;
  int32_t begin_ = -1, start_header_ = -1, end_header_ = -1, eot_ = -1;  // Llama 3 specials
};

// Counts for the summary line and PREFIX_sft_stats.json.
struct SftStats {
  int64_t samples = 0, prompt_cut = 0, answer_cut = 0, dropped_no_answer = 0, dropped_too_long = 0;
  int64_t tokens = 0, answer_tokens = 0;
  void add(SftOutcome outcome, const SftTokens& t);
  int64_t truncated() const { return prompt_cut + answer_cut; }
  int64_t dropped() const { return dropped_no_answer + dropped_too_long; }
  double answer_fraction() const { return tokens ? double(answer_tokens) / double(tokens) : 0.0; }
  std::string to_json(const SftOptions& opt) const;
};

}  // namespace nb
