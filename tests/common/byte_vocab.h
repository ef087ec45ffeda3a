// The JSON vocabulary entries of the tests' tiny byte-level BPE tokenizer: the 256 byte tokens (GPT-2's
// byte-to-unicode map, JSON-escaped) and the merges' results "ab" 256, "bc" 257, "Ġa" 258, without the
// surrounding braces, so each test adds its own specials and merges around them.
#pragma once
#include <string>
#include "tokenizer/bpe_tokenizer.h"

namespace nb::test {

inline std::string byte_vocab_entries() {
  std::string vocab;
  for (int b = 0; b < 256; ++b) {
    std::string esc;
    for (char c : bytes_to_unicode_string(std::string(1, char(b)))) {
      if (c == '"' || c == '\\') esc.push_back('\\');
      esc.push_back(c);
    }
    vocab += "\"" + esc + "\": " + std::to_string(b) + ", ";
  }
  return vocab + "\"ab\": 256, \"bc\": 257, \"Ġa\": 258";
}

}  // namespace nb::test
