// What `nibble generate` reads besides the weights (cmd_generate_inputs.cpp): the tokenizer (--tokenizer,
// else the HF folder's tokenizer.json, else the one a checkpoint's training run named), the prompts
// (--prompt TEXT, or --prompts FILE.jsonl with one {"prompt": TEXT} or {"ids": [TOKEN, ...]} per line), and
// the end tokens a sequence stops at (the tokenizer's end-of-text / end-of-turn tokens and the HF folder's
// eos_token_id, an integer or a list, from config.json and generation_config.json).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include "core/status.h"
#include "model/llama_config.h"
#include "tokenizer/bpe_tokenizer.h"

namespace nb::cli {

struct PromptInput {
  std::string text;          // empty when given as ids
  std::vector<int32_t> ids;  // the encoded prompt (BOS included when the tokenizer adds one)
  bool has_text = false;
};

// The tokenizer file to use, or "" when there is none; `origin` says where it came from (for messages).
std::string find_tokenizer(const std::string& flag, const std::string& load_hf, const std::string& load,
                           int64_t ckpt_step, std::string* origin);
// Loads `path` and checks it against the model's vocabulary.
Status load_tokenizer(const std::string& path, const std::string& origin, const LlamaConfig& cfg,
                      std::unique_ptr<BpeTokenizer>* out);
// --prompt / --prompts into prompts; text prompts need `tok` (nullptr: the reason is `no_tok_why`).
Status read_prompts(const std::string& prompt, const std::string& file, const BpeTokenizer* tok,
                    const std::string& no_tok_why, std::vector<PromptInput>* out);
// The token ids generation stops at (sorted, unique).
std::vector<int32_t> end_token_ids(const BpeTokenizer* tok, const std::string& load_hf);

}  // namespace nb::cli
