// Fuzz target: a .bin against its .idx. Input = [u16 length][.idx bytes][.bin bytes]; an accepted pair
// is read sequence by sequence and scanned for its token-id range.
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string idx, bin;
  nb::fuzz::split(data, size, &idx, &bin);
  nb::fuzz::write_file("p.idx", idx);
  nb::fuzz::write_file("p.bin", bin);
  nb::fuzz::open_and_read_dataset(nb::fuzz::scratch() + "/p");
  return 0;
}
