// Fuzz target: a Megatron .idx (beside a fixed 4 KiB .bin); every sequence of an accepted dataset is read
// and the token-id range scanned, so a lying index cannot make the reader step outside the .bin.
#include <vector>
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool bin_written = [] {
    std::vector<uint8_t> b(4096);
    for (size_t i = 0; i < b.size(); ++i) b[i] = uint8_t(i * 7);
    nb::fuzz::write_file("d.bin", b.data(), b.size());
    return true;
  }();
  (void)bin_written;
  nb::fuzz::write_file("d.idx", data, size);
  nb::fuzz::open_and_read_dataset(nb::fuzz::scratch() + "/d");
  return 0;
}
