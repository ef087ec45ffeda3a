// Fuzz target: JSONL documents as `nibble preprocess` reads them, one line at a time.
#include <sstream>
#include <string>
#include "data/jsonl.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  std::string line, text;
  while (std::getline(in, line)) (void)nb::jsonl_field(line, "text", &text);
  return 0;
}
