// Tests that drive the `nibble` command line find the binary at run time, not through a path baked
// in at configure time: a build folder carried to another machine (the GPU machine) keeps working.
// Order: $NIBBLE_BIN, then `nibble` next to the test executable, then `../nibble` from it (the
// layout build/tests/test_<area> + build/nibble).
#pragma once
#include <sys/wait.h>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace nb::test {

// Throws (gtest reports the message and fails the test) when no binary is found, naming every
// place looked at, because a silent "sh: not found" further down says nothing about why.
inline std::string nibble_binary() {
  namespace fs = std::filesystem;
  if (const char* env = std::getenv("NIBBLE_BIN"); env && *env) {
    if (fs::is_regular_file(env)) return env;
    throw std::runtime_error(std::string("NIBBLE_BIN is set to '") + env + "', which is not a file");
  }
  std::error_code ec;
  const fs::path dir = fs::read_symlink("/proc/self/exe", ec).parent_path();
  const fs::path beside = dir / "nibble", above = dir.parent_path() / "nibble";
  if (!ec && fs::is_regular_file(beside)) return beside.string();
  if (!ec && fs::is_regular_file(above)) return above.string();
  throw std::runtime_error("no nibble binary at " + beside.string() + " nor " + above.string() +
                           "; build the `nibble` target or set NIBBLE_BIN to its path");
}

struct CliRun {
  int code = -1;
  std::string out;  // stdout and stderr together
};

// Runs `nibble ARGS` through the shell (ARGS as typed on a command line) and collects its output.
inline CliRun run_nibble(const std::string& args) {
  CliRun r;
  std::string cmd = "'";  // quoted: the build folder's path may hold spaces
  cmd += nibble_binary();
  cmd += "' " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t got;
  while ((got = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), got);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace nb::test
