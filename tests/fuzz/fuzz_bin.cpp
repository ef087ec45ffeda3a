// Fuzz target: a .bin against its .idx. Input = [u16 length][.idx bytes][.bin bytes]; an accepted pair
// is read sequence by sequence and scanned for its token-id range.
#include <memory>
#include <vector>
#include "data/indexed_dataset.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string idx, bin;
  nb::fuzz::split(data, size, &idx, &bin);
  nb::fuzz::write_file("p.idx", idx);
  nb::fuzz::write_file("p.bin", bin);
  std::unique_ptr<nb::IndexedDataset> ds;
  if (!nb::IndexedDataset::open(nb::fuzz::scratch() + "/p", &ds)) return 0;
  std::vector<int32_t> tokens;
  for (int64_t i = 0; i < ds->sequence_count() && i < 4096; ++i) {
    tokens.clear();
    ds->read(i, 0, -1, &tokens);
  }
  int64_t lo = 0, hi = 0;
  ds->token_id_range(&lo, &hi);
  return 0;
}
