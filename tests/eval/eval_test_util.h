// Shared by the eval tests: a tiny byte-level tokenizer whose ids are readable (a byte is its own id;
// merges "b c" -> 257, "a b" -> 256, " a" -> 258; specials 259 <|endoftext|>, 260 <|begin_of_text|>,
// which a TemplateProcessing post-processor prepends when `adds_bos`), a small random Llama over its
// 261 ids (GQA, llama3 RoPE scaling) and per-process temporary folders.
#pragma once
#include <gtest/gtest.h>
#include "common/byte_vocab.h"
#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include "eval/loglik.h"
#include "model/llama_model.h"
#include "tokenizer/bpe_tokenizer.h"

namespace nb::test {

inline std::string tiny_tokenizer_json(bool adds_bos) {
  const std::string vocab = byte_vocab_entries();
  const std::string post = adds_bos ? R"("post_processor": {"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]},)"
                                    : "";
  return R"({"added_tokens": [{"id": 259, "content": "<|endoftext|>", "special": true},
                              {"id": 260, "content": "<|begin_of_text|>", "special": true}],
             "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},)" +
         post + R"("model": {"type": "BPE", "vocab": {)" + vocab + R"(}, "merges": ["b c", "a b", "Ġ a"]}})";
}

inline std::unique_ptr<BpeTokenizer> tiny_tokenizer(bool adds_bos) {
  std::unique_ptr<BpeTokenizer> tok;
  Status st = BpeTokenizer::from_hf_json_text(tiny_tokenizer_json(adds_bos), "tiny.json", &tok);
  EXPECT_TRUE(st) << st.message();
  return tok;
}

// 2 layers, 4 heads over 2 KV heads of 16, llama3 RoPE with original 16 (all frequency bands occur).
inline LlamaConfig tiny_eval_config() {
  LlamaConfig c;
  c.name = "eval-tiny";
  c.hidden = 64;
  c.ffn = 128;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 16;
  c.vocab = 261;
  c.rope_theta = 10000.0;
  c.rope_original_max_pos = 16;
  c.max_seq = 64;
  return c;
}

// A CPU model of `shape` with the seeded random weights.
inline void init_model(LlamaModel* m, MicroBatchShape shape, uint64_t seed = 7) {
  Status st = m->init(tiny_eval_config(), Device::cpu, shape, Recompute::none, seed);
  ASSERT_TRUE(st) << st.message();
}

inline std::filesystem::path temp_dir(const std::string& name) {
  auto d = std::filesystem::temp_directory_path() / ("nibble_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

inline void write_text(const std::filesystem::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary);
  f << s;
}

}  // namespace nb::test
