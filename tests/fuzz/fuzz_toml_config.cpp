// Fuzz target: a training configuration file (TOML); an accepted one is resolved and validated as
// `nibble train --config` does before it touches a device.
#include <string>
#include "fuzz/fuzz_util.h"
#include "train/train_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nb::TrainConfig c;
  if (!nb::apply_config_text(std::string(reinterpret_cast<const char*>(data), size), "fuzz.toml", c)) return 0;
  nb::LlamaConfig m;
  if (!nb::resolve_model(c, &m)) return 0;
  (void)nb::validate_train_config(c, m);
  (void)nb::format_config(c);
  return 0;
}
