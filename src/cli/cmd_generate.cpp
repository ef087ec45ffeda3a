// `nibble generate`: text from a model (--load checkpoint or --load-hf folder, optionally with a PEFT LoRA
// --adapter, applied unmerged as PEFT applies it, or merged into the weights with --merge-adapter) with a KV
// cache (src/infer/). Prompts come one at a time (--prompt) or batched from --prompts FILE.jsonl; greedy at
// --temperature 0 (the default), otherwise seeded sampling with --top-k / --top-p. A sequence stops at the
// tokenizer's end tokens (unless --ignore-eos), after --max-new-tokens, or at the model's context. Prints
// each continuation and the prefill and decode tokens/s; --out FILE.jsonl records prompts, ids and texts;
// --logits-out writes the prefill logits (parity checks: scripts/parity/generate_parity.py). Docs:
// docs/GENERATE.md.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include "cli/commands.h"
#include "cli/generate_inputs.h"
#include "cli/weights_source.h"
#include "core/device_info.h"
#include "infer/generator.h"
#include "io/peft_adapter.h"
#include "tokenizer/utf8.h"

namespace nb::cli {
namespace {

struct GenerateArgs {
  WeightsSource src;
  std::string adapter, tokenizer, prompt, prompts, device = "auto", out, logits_out;
  int64_t max_new_tokens = 64, batch_size = 0;
  infer::SamplingParams sampling;
  bool ignore_eos = false, merge_adapter = false, warmup = false;
};

struct Loaded {
  LlamaConfig cfg;
  Device dev = Device::cpu;
  ParamStore store;
  Buffer adapter;  // the unmerged adapter's A and B
  infer::ModelWeights weights;
};

// The weights in the compute dtype of the device. An adapter is kept apart and applied unmerged after each
// base GEMM (PEFT's arithmetic, y = x W^T + scale (x A^T) B^T), or with --merge-adapter merged into the
// weights as they stream (W + scale B A rounded once: base speed, but last bits differ from PEFT's).
Status load_model(const GenerateArgs& a, const LlamaConfig& cfg, const HfCheckpointReader& reader, Loaded* m) {
  NB_TRY(check_hf_tensors(reader, hf_expected_tensors(cfg), cfg.tied_embeddings));
  HfTensorSource source = [&reader](const HfTensor& t, float* dst) { return reader.read_f32(t.name, dst); };
  LoraAdapter adapter;
  if (!a.adapter.empty()) NB_TRY(read_peft_adapter(a.adapter, cfg, &adapter).context("--adapter"));
  if (!a.adapter.empty() && a.merge_adapter) source = lora_merged_source(adapter, cfg, std::move(source));
  NB_TRY(infer::load_inference_store(source, cfg, m->dev, &m->store));
  NB_TRY(infer::weights_from_store(m->store, cfg, &m->weights));
  if (a.adapter.empty() || a.merge_adapter) return Status::ok();
  return infer::load_inference_adapter(adapter, cfg, m->dev, &m->adapter, &m->weights);
}

std::string decode_text(const BpeTokenizer* tok, const std::vector<int32_t>& ids) {
  return tok ? tok->decode_lenient(ids) : "";
}

std::string ids_text(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) {
    if (!s.empty()) s += ' ';
    s += std::to_string(id);
  }
  return s;
}

Status write_logits(const std::string& path, const infer::GenerateResult& r, const std::vector<PromptInput>& p,
                    int64_t V) {
  SafeTensorsFile f;
  const int64_t B = int64_t(p.size()), S = int64_t(r.prefill_logits.size()) / (B * V);
  SafeTensor& t = f.tensors["prefill_logits"];
  t.dtype = "F32";
  t.shape = {B, S, V};
  t.bytes.resize(r.prefill_logits.size() * 4);
  std::memcpy(t.bytes.data(), r.prefill_logits.data(), t.bytes.size());
  std::vector<int32_t> lens;
  for (const PromptInput& q : p) lens.push_back(int32_t(q.ids.size()));
  SafeTensor& l = f.tensors["lengths"];
  l.dtype = "I32";
  l.shape = {B};
  l.bytes.resize(lens.size() * 4);
  std::memcpy(l.bytes.data(), lens.data(), l.bytes.size());
  return write_safetensors(path, f);
}

// Prints (and records) one batch's results. Text is printed as Hugging Face's tokenizer.decode of the prompt and
// continuation prints it: the bytes of both at once (a prompt given as ids may end inside a character that the
// continuation completes), every ill-formed part, such as a character cut by --max-new-tokens, as U+FFFD.
void report_batch(const std::vector<PromptInput>& p, size_t first, const infer::GenerateResult& r,
                  const BpeTokenizer* tok, std::ofstream* out) {
  for (size_t i = 0; i < r.tokens.size(); ++i) {
    const PromptInput& q = p[first + i];
    const std::string text = decode_text(tok, r.tokens[i]);
    if (p.size() > 1) std::printf("[%zu] ", first + i + 1);
    if (tok) {
      const std::string line = valid_utf8((q.has_text ? q.text : decode_text(tok, q.ids)) + text) + "\n";
      std::fwrite(line.data(), 1, line.size(), stdout);  // not printf's %s, which would stop at a NUL token
    } else {
      std::printf("%s -> %s\n", ids_text(q.ids).c_str(), ids_text(r.tokens[i]).c_str());
    }
    std::printf("    (%zu new tokens, %s)\n", r.tokens[i].size(), r.finish[i].c_str());
    if (out && *out) {
      nlohmann::ordered_json j;
      if (q.has_text) j["prompt"] = q.text;
      j["prompt_ids"] = q.ids;
      j["ids"] = r.tokens[i];
      if (tok) j["text"] = valid_utf8(text);  // the continuation as tokenizer.decode(ids) gives it
      j["finish"] = r.finish[i];
      *out << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";  // a --prompt not in UTF-8
    }
  }
}

Status run_generate(const GenerateArgs& a) {
  LlamaConfig cfg;
  HfCheckpointReader reader;
  NB_TRY(open_weights_source(a.src, &cfg, &reader));
  if (a.max_new_tokens < 1) return errorf("--max-new-tokens %lld must be at least 1", (long long)a.max_new_tokens);
  if (a.merge_adapter && a.adapter.empty()) return errorf("--merge-adapter needs --adapter DIR");
  NB_TRY(infer::validate(a.sampling));
  std::string origin;
  const std::string tok_path = find_tokenizer(a.tokenizer, a.src.load_hf, a.src.load, a.src.ckpt_step, &origin);
  std::unique_ptr<BpeTokenizer> tok;
  if (!tok_path.empty()) NB_TRY(load_tokenizer(tok_path, origin, cfg, &tok));
  const std::string no_tok_why = a.src.load_hf.empty() ? "the checkpoint's training run named no --tokenizer"
                                                       : "the --load-hf folder has no tokenizer.json";
  std::vector<PromptInput> prompts;
  NB_TRY(read_prompts(a.prompt, a.prompts, tok.get(), no_tok_why, &prompts));
  std::vector<std::vector<int32_t>> ids;
  int64_t longest = 0;
  for (const PromptInput& p : prompts) {
    ids.push_back(p.ids);
    longest = std::max(longest, int64_t(p.ids.size()));
  }
  NB_TRY(infer::check_prompts(ids, cfg, cfg.max_seq));
  Loaded m;
  m.cfg = cfg;
  NB_TRY(pick_device(a.device, &m.dev));
  NB_TRY(load_model(a, cfg, reader, &m));
  const int64_t batch = a.batch_size > 0 ? std::min<int64_t>(a.batch_size, int64_t(ids.size())) : int64_t(ids.size());
  infer::Generator gen;
  NB_TRY(gen.init(cfg, m.weights, m.dev, batch, std::min(cfg.max_seq, longest + a.max_new_tokens)));
  infer::GenerateOptions o;
  o.max_new_tokens = a.max_new_tokens;
  o.sampling = a.sampling;
  if (!a.ignore_eos) o.stop_ids = end_token_ids(tok.get(), a.src.load_hf);
  o.prefill_logits = !a.logits_out.empty();
  if (o.prefill_logits && batch < int64_t(ids.size()))
    return errorf("--logits-out needs every prompt in one batch; drop --batch-size");
  std::printf(
      "generate %s%s on %s: %zu prompt(s), batch %lld, context %lld, %s\n", cfg.name.c_str(),
      a.adapter.empty() ? "" : (" + LoRA " + a.adapter + (a.merge_adapter ? " (merged)" : "")).c_str(),
      m.dev == Device::cuda ? "cuda (bf16)" : "cpu (fp32)", ids.size(), (long long)batch, (long long)gen.max_len(),
      a.sampling.greedy()
          ? "greedy"
          : strprintf("temperature %g, top-k %lld, top-p %g, seed %llu", double(a.sampling.temperature),
                      (long long)a.sampling.top_k, double(a.sampling.top_p), (unsigned long long)a.sampling.seed)
                .c_str());
  std::ofstream out;
  if (!a.out.empty()) out.open(a.out);
  if (!a.out.empty() && !out) return errorf("cannot write --out %s", a.out.c_str());
  if (a.warmup) {  // one untimed pass of the first batch: plans, kernels and decode graphs made outside the timing
    infer::GenerateResult r;
    NB_TRY(gen.generate({ids.begin(), ids.begin() + long(std::min(ids.size(), size_t(batch)))}, o, &r));
  }
  double prefill_s = 0, decode_s = 0;
  int64_t prompt_tokens = 0, decode_tokens = 0;
  for (size_t first = 0; first < ids.size(); first += size_t(batch)) {
    const size_t n = std::min(ids.size() - first, size_t(batch));
    const std::vector<std::vector<int32_t>> chunk(ids.begin() + long(first), ids.begin() + long(first + n));
    infer::GenerateResult r;
    NB_TRY(gen.generate(chunk, o, &r));
    report_batch(prompts, first, r, tok.get(), a.out.empty() ? nullptr : &out);
    if (o.prefill_logits) NB_TRY(write_logits(a.logits_out, r, prompts, cfg.vocab));
    prefill_s += r.prefill_s;
    decode_s += r.decode_s;
    prompt_tokens += r.prompt_tokens;
    decode_tokens += r.decode_steps * int64_t(n);
  }
  std::printf("prefill: %lld tokens in %.1f ms (%.0f tokens/s); decode: %lld tokens in %.1f ms (%.1f tokens/s)\n",
              (long long)prompt_tokens, prefill_s * 1e3, prompt_tokens / std::max(prefill_s, 1e-9),
              (long long)decode_tokens, decode_s * 1e3, decode_tokens / std::max(decode_s, 1e-9));
  return Status::ok();
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  auto* cmd = app.add_subcommand("generate", "Generate text from a model with a KV cache (greedy or sampled)");
  cmd->add_option("--load-hf", a->src.load_hf, "A Hugging Face Llama folder");
  cmd->add_option("--load", a->src.load, "A nibble checkpoint folder");
  cmd->add_option("--ckpt-step", a->src.ckpt_step, "Iteration to load from --load (default: the newest)");
  cmd->add_option("--adapter", a->adapter, "A PEFT LoRA folder, applied unmerged beside the base weights (as PEFT)");
  cmd->add_flag("--merge-adapter", a->merge_adapter,
                "Merge --adapter into the weights as they load (base decode speed; rounds differently from PEFT)");
  cmd->add_option("--tokenizer", a->tokenizer,
                  "tokenizer.json or .tiktoken (default: the --load-hf folder's, or the checkpoint's training run's)");
  cmd->add_option("--prompt", a->prompt, "The prompt text");
  cmd->add_option("--prompts", a->prompts, "JSONL, one {\"prompt\": TEXT} or {\"ids\": [...]} per line (batched)");
  cmd->add_option("--max-new-tokens", a->max_new_tokens, "Tokens to generate per prompt")->capture_default_str();
  cmd->add_option("--temperature", a->sampling.temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-k", a->sampling.top_k, "Sample among the k most likely tokens (0 = all)")
      ->capture_default_str();
  cmd->add_option("--top-p", a->sampling.top_p, "Nucleus sampling mass (1 = off)")->capture_default_str();
  cmd->add_option("--seed", a->sampling.seed, "Sampling seed (same seed, same device: same text)")
      ->capture_default_str();
  cmd->add_option("--batch-size", a->batch_size, "Prompts per batch (0 = all at once)")->capture_default_str();
  cmd->add_flag("--ignore-eos", a->ignore_eos, "Do not stop at end tokens (benchmarks, parity checks)");
  cmd->add_flag("--warmup", a->warmup, "Run the first batch once untimed before the timed runs (benchmarks)");
  cmd->add_option("--device", a->device, "cpu (FP32), cuda (BF16) or auto")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--out", a->out, "JSONL: per prompt its ids, the new ids, the text and why it stopped");
  cmd->add_option("--logits-out", a->logits_out, "safetensors: F32 prefill_logits [B, S, V], I32 lengths [B]");
  cmd->callback([a] {
    Status st = run_generate(*a);
    if (!st) std::fprintf(stderr, "error: %s\n", st.message().c_str());
    exit_code() = st ? 0 : 1;
  });
}

}  // namespace nb::cli
