// Fuzz target: a Megatron .idx (beside a fixed 4 KiB .bin); every sequence of an accepted dataset is read
// and the token-id range scanned, so a lying index cannot make the reader step outside the .bin.
#include <memory>
#include <vector>
#include "data/indexed_dataset.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string bin = [] {
    std::vector<uint8_t> b(4096);
    for (size_t i = 0; i < b.size(); ++i) b[i] = uint8_t(i * 7);
    return nb::fuzz::write_file("d.bin", b.data(), b.size());
  }();
  (void)bin;
  nb::fuzz::write_file("d.idx", data, size);
  std::unique_ptr<nb::IndexedDataset> ds;
  if (!nb::IndexedDataset::open(nb::fuzz::scratch() + "/d", &ds)) return 0;
  std::vector<int32_t> tokens;
  for (int64_t i = 0; i < ds->sequence_count() && i < 4096; ++i) {
    tokens.clear();
    ds->read(i, 0, -1, &tokens);
  }
  int64_t lo = 0, hi = 0;
  ds->token_id_range(&lo, &hi);
  return 0;
}
