// Fuzz target: a Hugging Face tokenizer.json; an accepted tokenizer encodes and decodes a fixed text.
#include <memory>
#include <string>
#include <vector>
#include "fuzz/fuzz_util.h"
#include "tokenizer/bpe_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::unique_ptr<nb::BpeTokenizer> tok;
  const std::string text(reinterpret_cast<const char*>(data), size);
  if (!nb::BpeTokenizer::from_hf_json_text(text, "fuzz", &tok)) return 0;
  std::vector<int32_t> ids;
  tok->encode_with_specials("Hello world! It's 2026: <|endoftext|> caf\xc3\xa9 12345", &ids);
  std::string back;
  (void)tok->decode(ids, &back);
  return 0;
}
