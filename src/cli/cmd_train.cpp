// `nibble train`: every key of the training configuration is a flag (Megatron spelling) and a key of
// the optional TOML file given by --config; flags override the file. Errors are one sentence.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include "cli/commands.h"
#include "core/device_info.h"
#include "optim/optimizer_state.h"
#include "distributed/spawn.h"
#include "train/trainer.h"

namespace nb::cli {

namespace {
struct TrainArgs {
  std::string config_file;
  std::map<std::string, std::string> values;
  int nproc_per_node = 0;
  // --dry-run: the memory estimate for a planned machine, without a GPU (memory in GiB; 0 = this machine's).
  bool dry_run = false;
  int nnodes = 1;
  double gpu_memory_gib = 0, host_memory_gib = 0;
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

// --dry-run: exit 0 when the job fits, 3 when it does not, 1 on an error (one sentence), 2 on bad flags.
int dry_run(const TrainArgs& args, const char* name, TrainConfig cfg) {
  Trainer::DryRun plan;
  plan.ranks_per_node = std::max(1, args.nproc_per_node);
  plan.ranks = plan.ranks_per_node * args.nnodes;
  plan.gpu_bytes = args.gpu_memory_gib * 1073741824.0;
  if (!(plan.gpu_bytes > 0)) {
    std::string why;
    const auto gpus = query_gpus(&why);
    if (gpus.empty()) {
      std::fprintf(stderr,
                   "nibble %s --dry-run: no GPU here to size the job for (%s); pass --gpu-memory GiB, the memory of "
                   "one GPU of the machine you plan to run on (80 for an H100, 141 for an H200)\n",
                   name, why.c_str());
      return 2;
    }
    plan.gpu_bytes = gpus[0].memory_gib * 1073741824.0;
  }
  plan.host_bytes =
      args.host_memory_gib > 0 ? args.host_memory_gib * 1073741824.0 : optim::host_memory_available_bytes();
  Trainer t;
  bool fits = false;
  Status st = t.dry_run(std::move(cfg), plan, &fits);
  if (!st) {
    std::fprintf(stderr, "nibble %s --dry-run: %s\n", name, st.message().c_str());
    return 1;
  }
  return fits ? 0 : 3;
}

void run_train(const TrainArgs& args, const char* name, bool finetune) {
  if (!args.dry_run && (args.nnodes != 1 || args.gpu_memory_gib > 0 || args.host_memory_gib > 0)) {
    std::fprintf(stderr,
                 "nibble %s: --nnodes, --gpu-memory and --host-memory describe a planned machine for --dry-run; "
                 "add --dry-run, or leave them out (a launcher sets the ranks of a real run)\n",
                 name);
    exit_code() = 2;
    return;
  }
  if (args.dry_run) {
    TrainConfig cfg;
    cfg.sft = finetune;
    if (int rc = resolve_train_config(args, name, &cfg); rc != 0) {
      exit_code() = rc;
      return;
    }
    if (finetune && !cfg.load.empty() && args.values.count("finetune") == 0) cfg.finetune = true;
    exit_code() = dry_run(args, name, std::move(cfg));
    return;
  }
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
  cmd->add_flag("--dry-run", args->dry_run,
                "resolve the configuration and print the memory estimate per GPU for the planned machine "
                "(--nproc-per-node, --nnodes, --gpu-memory, --host-memory), with the changes that would fit; "
                "no GPU, weights or data are touched; exit 0 when it fits, 3 when not");
  cmd->add_option("--nnodes", args->nnodes, "with --dry-run: machines of --nproc-per-node GPUs each")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--gpu-memory", args->gpu_memory_gib,
                  "with --dry-run: GiB of one GPU (default: this machine's first GPU)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--host-memory", args->host_memory_gib,
                  "with --dry-run: GiB of host memory per machine (default: what this machine has available)")
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
