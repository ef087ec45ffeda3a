// Shared by the fuzz targets: most of nibble's parsers read files, so a target writes its input to a
// per-process scratch folder first. Every target defines LLVMFuzzerTestOneInput; built with clang's
// -fsanitize=fuzzer it is a libFuzzer binary, built with replay_main.cpp it replays a corpus (CI).
#pragma once
#include <unistd.h>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>
#include "data/indexed_dataset.h"

namespace nb::fuzz {

inline const std::string& scratch() {
  static const std::string dir = [] {
    auto p = std::filesystem::temp_directory_path() / ("nibble_fuzz_" + std::to_string(::getpid()));
    std::filesystem::create_directories(p);
    return p.string();
  }();
  return dir;
}

inline std::string write_file(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch() + "/" + name;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f) {
    if (size) std::fwrite(data, 1, size, f);
    std::fclose(f);
  }
  return path;
}

inline std::string write_file(const std::string& name, const std::string& text) {
  return write_file(name, reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

// Splits an input at a 2-byte little-endian length prefix: the first part and the rest.
inline void split(const uint8_t* data, size_t size, std::string* first, std::string* rest) {
  size_t n = size >= 2 ? size_t(data[0]) | size_t(data[1]) << 8 : 0;
  const uint8_t* p = data + (size >= 2 ? 2 : size);
  const size_t left = size >= 2 ? size - 2 : 0;
  n = n < left ? n : left;
  first->assign(reinterpret_cast<const char*>(p), n);
  rest->assign(reinterpret_cast<const char*>(p + n), left - n);
}

// Opens PREFIX.idx/.bin and, when accepted, reads every sequence (at most 4096) and scans the token ids:
// what a lying index or a short .bin must not turn into an out-of-bounds read.
inline void open_and_read_dataset(const std::string& prefix) {
  std::unique_ptr<IndexedDataset> ds;
  if (!IndexedDataset::open(prefix, &ds)) return;
  std::vector<int32_t> tokens;
  for (int64_t i = 0; i < ds->sequence_count() && i < 4096; ++i) {
    tokens.clear();
    ds->read(i, 0, -1, &tokens);
  }
  int64_t lo = 0, hi = 0;
  ds->token_id_range(&lo, &hi);
}

}  // namespace nb::fuzz
