// Shared by the fuzz targets: most of nibble's parsers read files, so a target writes its input to a
// per-process scratch folder first. Every target defines LLVMFuzzerTestOneInput; built with clang's
// -fsanitize=fuzzer it is a libFuzzer binary, built with replay_main.cpp it replays a corpus (CI).
#pragma once
#include <unistd.h>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

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

}  // namespace nb::fuzz
