// Fuzz target: a Hugging Face config.json (transformers 4.x or 5.x spelling).
#include <string>
#include "fuzz/fuzz_util.h"
#include "io/hf_llama.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nb::LlamaConfig c;
  (void)nb::parse_hf_config(std::string(reinterpret_cast<const char*>(data), size), "fuzz/config.json", &c);
  return 0;
}
