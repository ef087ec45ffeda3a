// Fuzz target: a safetensors file (header JSON, offsets, sizes), read whole.
#include "fuzz/fuzz_util.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nb::SafeTensorsFile f;
  (void)nb::read_safetensors(nb::fuzz::write_file("in.safetensors", data, size), &f);
  return 0;
}
