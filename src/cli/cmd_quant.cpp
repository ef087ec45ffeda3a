// `nibble quant`: quantize a tensor with a chosen format and report error statistics.
#include <cstdio>
#include "cli/commands.h"

namespace nb::cli {
void add_quant_command(CLI::App& app) {
  app.add_subcommand("quant", "Quantize a tensor (safetensors or random) and report SQNR, flushes and saturation");
}
}  // namespace nb::cli
