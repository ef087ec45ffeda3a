// Helpers shared by the data tests.
#pragma once
#include <unistd.h>
#include <filesystem>
#include <string>

// Per-process folder names: CTest may run the cases of a file in parallel processes.
inline std::filesystem::path unique_temp(const std::string& name) {
  return std::filesystem::temp_directory_path() / (name + "_" + std::to_string(::getpid()));
}
