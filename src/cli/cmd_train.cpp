// `nibble train`: every key of the training configuration is a flag (Megatron spelling) and a key of
// the optional TOML file given by --config; flags override the file. Errors are one sentence.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include "cli/commands.h"
#include "distributed/spawn.h"
#include "train/trainer.h"

namespace nb::cli {

namespace {
struct TrainArgs {
  std::string config_file;
  std::map<std::string, std::string> values;
  int nproc_per_node = 0;
};

// `--nproc-per-node N` outside a launcher: start N local ranks of this same command line (without that
// flag) and supervise them; under torchrun, srun or mpirun the launcher has already started the ranks.
int run_local_ranks(int n) {
  dist::World w;
  if (dist::detect_world(&w).is_ok() && w.launcher != "none") {
    std::fprintf(stderr,
                 "nibble train: --nproc-per-node starts its own ranks, but %s already did (rank %d of %d); leave "
                 "--nproc-per-node out under a launcher\n",
                 w.launcher.c_str(), w.rank, w.size);
    return 2;
  }
  std::error_code ec;
  std::vector<std::string> argv{std::filesystem::read_symlink("/proc/self/exe", ec).string()};
  if (ec) argv[0] = "nibble";
  const auto& args = process_args();
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--nproc-per-node") {
      ++i;
      continue;
    }
    if (args[i].rfind("--nproc-per-node=", 0) == 0) continue;
    argv.push_back(args[i]);
  }
  int code = 0;
  Status st = dist::spawn_local_ranks(n, argv, std::chrono::seconds(10), &code);
  if (!st) {
    std::fprintf(stderr, "nibble train: %s\n", st.message().c_str());
    return code != 0 ? code : 1;
  }
  return 0;
}

// Applies --config, then the flags, to cfg (which holds the subcommand's defaults); 2 on a bad value.
int resolve_train_config(const TrainArgs& args, const char* name, TrainConfig* cfg) {
  if (!args.config_file.empty()) {
    Status st = apply_config_file(args.config_file, *cfg);
    if (!st) {
      std::fprintf(stderr, "nibble %s: %s\n", name, st.message().c_str());
      return 2;
    }
  }
  auto keys = config_keys(*cfg);
  for (const auto& [key, value] : args.values) {
    for (const auto& k : keys) {
      if (k.name != key) continue;
      Status st = k.set(value);
      if (!st) {
        std::fprintf(stderr, "nibble %s: %s\n", name, st.message().c_str());
        return 2;
      }
    }
  }
  return 0;
}

void run_train(const TrainArgs& args, const char* name, bool finetune) {
  if (args.nproc_per_node > 1) {
    exit_code() = run_local_ranks(args.nproc_per_node);
    return;
  }
  TrainConfig cfg;
  cfg.sft = finetune;  // `nibble finetune` is `nibble train --sft`, loading --load's weights only
  if (int rc = resolve_train_config(args, name, &cfg); rc != 0) {
    exit_code() = rc;
    return;
  }
  if (finetune && !cfg.load.empty() && args.values.count("finetune") == 0) cfg.finetune = true;
  TrainSummary summary;
  Status st = run_training(cfg, &summary);
  if (!st) {
    dist::World w;  // with several ranks, say which one failed
    const bool ranks = dist::detect_world(&w).is_ok() && w.distributed();
    std::fprintf(stderr, "nibble %s%s: %s\n", name, ranks ? strprintf(" (rank %d)", w.rank).c_str() : "",
                 st.message().c_str());
    exit_code() = 1;
    return;
  }
  exit_code() = 0;
}

// `train` and `finetune` share every key; finetune starts from SFT data and loaded weights.
void add_training_command(CLI::App& app, const char* name, const char* description, bool finetune) {
  auto* cmd = app.add_subcommand(name, description);
  auto args = std::make_shared<TrainArgs>();
  cmd->add_option("--config", args->config_file, "TOML file with any of the keys below (flags override it)");
  cmd->add_option("--nproc-per-node", args->nproc_per_node,
                  "start N data-parallel ranks on this machine (one per GPU), as torchrun --nproc-per-node does")
      ->check(CLI::PositiveNumber);
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
  cmd->callback([args, name, finetune] { run_train(*args, name, finetune); });
}

}  // namespace

void add_train_command(CLI::App& app) {
  add_training_command(app, "train", "Pretrain a Llama model (mock data or Megatron .bin/.idx data)", false);
  add_training_command(app, "finetune",
                       "Supervised fine-tuning (nibble train --sft): SFT data from nibble preprocess --sft, loss on "
                       "answer tokens, packed rows; start from --load-hf DIR or --load CKPT (weights only)",
                       true);
}

}  // namespace nb::cli
