// `nibble train`: every key of the training configuration is a flag (Megatron spelling) and a key of
// the optional TOML file given by --config; flags override the file. Errors are one sentence.
#include <cstdio>
#include <map>
#include <memory>
#include "cli/commands.h"
#include "train/trainer.h"

namespace nb::cli {

namespace {
struct TrainArgs {
  std::string config_file;
  std::map<std::string, std::string> values;
};
}  // namespace

void add_train_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "Pretrain a Llama model (mock data or Megatron .bin/.idx data)");
  auto args = std::make_shared<TrainArgs>();
  cmd->add_option("--config", args->config_file, "TOML file with any of the keys below (flags override it)");
  static TrainConfig defaults;  // only for the help text's defaults
  for (const auto& key : config_keys(defaults)) {
    std::string name = key.name;
    auto* opt = cmd->add_option_function<std::string>(
                       "--" + name, [args, name](const std::string& v) { args->values[name] = v; },
                       key.help + " [default: " + key.get() + "]")
                    ->type_name("");
    // Booleans are typed bare (`--disable-fp4 --save X`, or last on the line) as well as with a value
    // (`--disable-fp4 false`, `--disable-fp4=true`): zero or one value, and CLI11 passes default_str
    // when none follows. A following word that is not a flag is taken as the value, so a bad one
    // (`maybe`) reaches parse_bool's one-sentence error instead of being silently ignored.
    if (key.is_flag) opt->expected(0, 1)->default_str("true")->option_text("[true|false]");
  }
  cmd->callback([args] {
    TrainConfig cfg;
    if (!args->config_file.empty()) {
      Status st = apply_config_file(args->config_file, cfg);
      if (!st) {
        std::fprintf(stderr, "nibble train: %s\n", st.message().c_str());
        exit_code() = 2;
        return;
      }
    }
    auto keys = config_keys(cfg);
    for (const auto& [name, value] : args->values) {
      for (const auto& k : keys) {
        if (k.name != name) continue;
        Status st = k.set(value);
        if (!st) {
          std::fprintf(stderr, "nibble train: %s\n", st.message().c_str());
          exit_code() = 2;
          return;
        }
      }
    }
    TrainSummary summary;
    Status st = run_training(cfg, &summary);
    if (!st) {
      std::fprintf(stderr, "nibble train: %s\n", st.message().c_str());
      exit_code() = 1;
      return;
    }
    exit_code() = 0;
  });
}

}  // namespace nb::cli
