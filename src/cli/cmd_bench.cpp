// `nibble bench`: kernel benchmarks against measured ceilings (filled in by the formats work).
#include <cstdio>
#include "cli/commands.h"

namespace nb::cli {
void add_bench_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "Benchmark kernels against the measured copy bandwidth and GEMM ceiling");
  cmd->require_subcommand(1);
}
}  // namespace nb::cli
