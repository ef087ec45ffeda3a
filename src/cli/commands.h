// Subcommand registration. Each command lives in cli/cmd_<name>.cpp and registers itself on the
// CLI11 app; its callback stores the process exit code in exit_code().
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

namespace nb::cli {

int& exit_code();
// The command line as main() received it (argv[1..]), for commands that start copies of themselves.
std::vector<std::string>& process_args();
void add_info_command(CLI::App& app);
void add_quant_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_bench_gemm_command(CLI::App& bench);  // registers `bench gemm` under `bench`
void add_preprocess_command(CLI::App& app);
// `nibble preprocess --sft` (cmd_preprocess_sft.cpp): prompt/answer JSONL -> token and answer-mask datasets.
struct SftPreprocessArgs {
  std::vector<std::string> inputs;
  std::string output_prefix, tokenizer, family, chat_template, truncation;
  int64_t seq_length = 0;
  int workers = 2;
  bool add_bos = false;
};
int run_preprocess_sft(const SftPreprocessArgs& a);
void add_tokenizer_command(CLI::App& app);
void add_train_command(CLI::App& app);
void add_export_command(CLI::App& app);
void add_eval_command(CLI::App& app);
void add_generate_command(CLI::App& app);

}  // namespace nb::cli
