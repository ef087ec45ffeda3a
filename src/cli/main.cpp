// nibble: low-precision LLM training in one C++/CUDA program. Entry point: parses the subcommand.
#include <cstdio>
#include <exception>
#include "cli/commands.h"

namespace nb::cli {
int& exit_code() {
  static int code = 0;
  return code;
}
std::vector<std::string>& process_args() {
  static std::vector<std::string> args;
  return args;
}
}  // namespace nb::cli

// Every error is meant to reach the user as a Status sentence; an exception that still escapes (a
// library's, or memory exhaustion) is reported in one line instead of terminating with a core dump.
int main(int argc, char** argv) try {
  CLI::App app{"nibble " NIBBLE_VERSION ": pretrain and fine-tune Llama-family LLMs in BF16, FP8, MXFP8 and NVFP4"};
  app.require_subcommand(1);
  nb::cli::process_args().assign(argv + 1, argv + argc);
  nb::cli::add_info_command(app);
  nb::cli::add_train_command(app);
  nb::cli::add_quant_command(app);
  nb::cli::add_bench_command(app);
  nb::cli::add_preprocess_command(app);
  nb::cli::add_tokenizer_command(app);
  nb::cli::add_export_command(app);
  nb::cli::add_eval_command(app);
  nb::cli::add_generate_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) { return app.exit(e); }
  return nb::cli::exit_code();
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
