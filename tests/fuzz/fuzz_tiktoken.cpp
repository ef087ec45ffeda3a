// Fuzz target: a tiktoken rank file (base64 token, rank per line) loaded with GPT-2's specials and
// regex; an accepted tokenizer encodes and decodes a fixed text.
#include <memory>
#include <string>
#include <vector>
#include "fuzz/fuzz_util.h"
#include "tokenizer/bpe_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::unique_ptr<nb::BpeTokenizer> tok;
  if (!nb::BpeTokenizer::load(nb::fuzz::write_file("ranks.tiktoken", data, size), "gpt2", &tok)) return 0;
  std::vector<int32_t> ids;
  tok->encode("Hello world! It's 2026: caf\xc3\xa9 12345", &ids);
  std::string back;
  (void)tok->decode(ids, &back);
  return 0;
}
