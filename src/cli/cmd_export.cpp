// `nibble export --hf OUT`: a nibble checkpoint (--load) or an HF folder (--load-hf) written as a
// Hugging Face Llama folder (config.json, safetensors shards + index, tokenizer.json), streamed one
// tensor at a time so exporting a large model needs memory for its largest tensor only.
#include <cstdio>
#include <memory>
#include "cli/commands.h"
#include "cli/weights_source.h"

namespace nb::cli {
namespace {

struct ExportArgs {
  WeightsSource src;
  std::string out, dtype = "bf16", tokenizer, max_shard = "5GB";
  int64_t bos = -1, eos = -1;
};

Status run_export(const ExportArgs& a) {
  LlamaConfig cfg;
  HfCheckpointReader reader;
  NB_TRY(open_weights_source(a.src, &cfg, &reader));
  const std::vector<HfTensor> tensors = hf_expected_tensors(cfg);
  NB_TRY(check_hf_tensors(reader, tensors, cfg.tied_embeddings));
  HfExportOptions opt;
  opt.dtype = a.dtype;
  opt.tokenizer_file = a.tokenizer;
  NB_TRY(parse_shard_size(a.max_shard, &opt.max_shard_bytes));
  opt.bos_token_id = a.bos;
  opt.eos_token_id = a.eos;
  if (!a.src.load_hf.empty()) {  // keep the source's token ids unless overridden
    int64_t bos = -1, eos = -1;
    read_hf_token_ids(a.src.load_hf, &bos, &eos);
    if (opt.bos_token_id < 0) opt.bos_token_id = bos;
    if (opt.eos_token_id < 0) opt.eos_token_id = eos;
  }
  int64_t bytes = 0;
  for (const HfTensor& t : tensors) bytes += t.numel * (a.dtype == "bf16" ? 2 : 4);
  auto source = [&reader](const HfTensor& t, float* dst) { return reader.read_f32(t.name, dst); };
  NB_TRY(write_hf_folder(a.out, cfg, tensors, source, opt));
  std::printf("exported %s: %zu tensors, %.3f GB of %s weights, %lld layers, hidden %lld, vocab %lld -> %s\n",
              cfg.name.c_str(), tensors.size(), double(bytes) / 1e9, a.dtype.c_str(), (long long)cfg.layers,
              (long long)cfg.hidden, (long long)cfg.vocab, a.out.c_str());
  return Status::ok();
}

}  // namespace

void add_export_command(CLI::App& app) {
  auto a = std::make_shared<ExportArgs>();
  auto* cmd = app.add_subcommand("export", "Write a nibble checkpoint or an HF folder as a Hugging Face Llama folder");
  cmd->add_option("--hf", a->out, "Output folder (must not exist, or be empty)")->required();
  cmd->add_option("--load", a->src.load, "A nibble checkpoint folder (the --save of a training run)");
  cmd->add_option("--ckpt-step", a->src.ckpt_step, "Iteration to export from --load (default: the newest)");
  cmd->add_option("--load-hf", a->src.load_hf,
                  "A Hugging Face Llama folder (re-export, e.g. to change dtype or shards)");
  cmd->add_option("--dtype", a->dtype, "Weight dtype of the export")
      ->check(CLI::IsMember({"bf16", "fp32"}))
      ->capture_default_str();
  cmd->add_option("--tokenizer", a->tokenizer, "tokenizer.json to copy into the folder");
  cmd->add_option("--max-shard-size", a->max_shard, "Largest shard (e.g. 5GB, 500MB, 2GiB)")->capture_default_str();
  cmd->add_option("--bos-token-id", a->bos, "bos_token_id for config.json (default: the source's, else null)");
  cmd->add_option("--eos-token-id", a->eos, "eos_token_id for config.json (default: the source's, else null)");
  cmd->callback([a] {
    Status st = run_export(*a);
    if (!st) std::fprintf(stderr, "error: %s\n", st.message().c_str());
    exit_code() = st ? 0 : 1;
  });
}

}  // namespace nb::cli
