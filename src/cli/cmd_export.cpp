// `nibble export --hf OUT`: a nibble checkpoint (--load) or an HF folder (--load-hf) written as a
// Hugging Face Llama folder (config.json, safetensors shards + index, tokenizer.json), streamed one
// tensor at a time so exporting a large model needs memory for its largest tensor only. With
// --adapter DIR --merge-lora, a PEFT LoRA folder for that model is merged into the weights as they
// stream (W + scale * B A, accumulated in FP64 and rounded once to FP32, before the --dtype rounding).
#include <cstdio>
#include <memory>
#include <string>
#include "cli/commands.h"
#include "cli/weights_source.h"
#include "io/peft_adapter.h"

namespace nb::cli {
namespace {

struct ExportArgs {
  WeightsSource src;
  std::string out, dtype = "bf16", tokenizer, max_shard = "5GB", adapter;
  bool merge_lora = false;
  int64_t bos = -1, eos = -1;
};

// --adapter and --merge-lora come together: nibble writes merged models only.
Status check_lora_flags(const ExportArgs& a) {
  if (a.merge_lora && a.adapter.empty())
    return errorf("--merge-lora needs --adapter DIR, the Hugging Face PEFT LoRA folder to merge into the weights");
  if (!a.adapter.empty() && !a.merge_lora)
    return errorf(
        "--adapter %s was given without --merge-lora; nibble writes merged models only; pass --merge-lora to write "
        "the base weights with the adapter merged in",
        a.adapter.c_str());
  return Status::ok();
}

// "rank 8, alpha 16 (scale 2), targets linear_qkv,linear_fc2, layers 0-1, 8 tensors"
std::string describe_merge(const LoraAdapter& ad, const LlamaConfig& cfg) {
  std::string targets;
  size_t modules = 0;
  for (LoraTarget t : ad.spec.targets) {
    targets += std::string(targets.empty() ? "" : ",") + lora_target_name(t);
    modules += peft_modules(cfg, t).size();
  }
  int64_t first = -1, last = -1;
  for (const LoraLinear& L : ad.linears) {
    if (first < 0 || L.layer < first) first = L.layer;
    if (L.layer > last) last = L.layer;
  }
  const size_t layers = ad.spec.targets.empty() ? 0 : ad.linears.size() / ad.spec.targets.size();
  return strprintf("rank %lld, alpha %g (scale %g%s), targets %s, layers %lld-%lld, %zu tensors",
                   (long long)ad.spec.rank, ad.spec.alpha, ad.spec.scale(), ad.spec.use_rslora ? ", rsLoRA" : "",
                   targets.c_str(), (long long)first, (long long)last, modules * layers);
}

Status run_export(const ExportArgs& a) {
  NB_TRY(check_lora_flags(a));
  LlamaConfig cfg;
  HfCheckpointReader reader;
  NB_TRY(open_weights_source(a.src, &cfg, &reader));
  const std::vector<HfTensor> tensors = hf_expected_tensors(cfg);
  NB_TRY(check_hf_tensors(reader, tensors, cfg.tied_embeddings));
  LoraAdapter adapter;  // read before anything is written, so a bad adapter leaves no folder behind
  if (a.merge_lora) NB_TRY(read_peft_adapter(a.adapter, cfg, &adapter));
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
  HfTensorSource source = [&reader](const HfTensor& t, float* dst) { return reader.read_f32(t.name, dst); };
  if (a.merge_lora) source = lora_merged_source(adapter, cfg, std::move(source));
  NB_TRY(write_hf_folder(a.out, cfg, tensors, source, opt));
  if (a.merge_lora)
    std::printf("merged LoRA adapter %s: %s\n", a.adapter.c_str(), describe_merge(adapter, cfg).c_str());
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
  cmd->add_option("--adapter", a->adapter,
                  "A Hugging Face PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) for the model "
                  "of --load/--load-hf; needs --merge-lora");
  cmd->add_flag("--merge-lora", a->merge_lora,
                "Write the weights with the --adapter merged in (W + scale * B A for every adapted module)");
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
