// `nibble eval --tasks / --text / --data-path` (cmd_eval_tasks.cpp): multiple-choice accuracy with
// lm-evaluation-harness's semantics and perplexity, printed as a table and written as JSON (docs/EVAL.md).
// cmd_eval.cpp registers these options beside its parity mode (--tokens) and dispatches here.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>
#include "cli/weights_source.h"

namespace nb::cli {

struct EvalTaskArgs {
  std::vector<std::string> tasks;  // multiple-choice JSONL files
  std::string text, text_key = "text";
  std::string data_path, split = "969,30,1";
  int64_t seq_length = 0, eval_samples = 0, seed = 1234;
  std::string tokenizer, tokenizer_family = "auto", add_bos = "auto", target_delimiter = " ";
  int64_t max_length = 0, batch_size = 0;
  bool log_samples = false;
};

void add_eval_task_options(CLI::App* cmd, EvalTaskArgs* a);
bool eval_tasks_requested(const EvalTaskArgs& a);
// `device` is "cpu", "cuda" or "auto"; `out` the JSON file ("" = none).
Status run_eval_tasks(const WeightsSource& src, const std::string& adapter, const std::string& device,
                      const std::string& out, const EvalTaskArgs& a);

}  // namespace nb::cli
