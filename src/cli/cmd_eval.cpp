// `nibble eval`: the logits and mean token loss of a model (HF folder or nibble checkpoint) on given
// tokens, for parity checks against other implementations (scripts/hf_parity.py). --tokens holds I32
// (or I64) `tokens` [B, S+1]: inputs are [:, :S], labels [:, 1:]. --out receives F32 `logits` [B, S, V]
// and F32 `loss` [1]. The CPU backend computes in FP32; CUDA in BF16 with FP32 accumulation (bf16_mixed).
// --adapter DIR (a PEFT LoRA folder) evaluates the base with that adapter (dropout off) and also writes the
// gradients of the mean loss with respect to the adapter, F32 `grad.<nibble name>` in nibble's fused
// layout (model/lora.h), for parity checks against PEFT (scripts/parity/lora_parity.py).
// With --tasks / --text / --data-path instead of --tokens it evaluates tasks and perplexity
// (cmd_eval_tasks.cpp, docs/EVAL.md).
#include <cstdio>
#include <cstring>
#include <memory>
#include "cli/commands.h"
#include "cli/eval_tasks.h"
#include "cli/weights_source.h"
#include "core/device_info.h"
#include "model/llama_model.h"

namespace nb::cli {
namespace {

struct EvalArgs {
  WeightsSource src;
  std::string tokens, out, device = "auto", adapter;
  EvalTaskArgs tasks;  // the task / perplexity mode
};

void put_f32(SafeTensorsFile& f, const std::string& name, std::vector<int64_t> shape, const float* v, size_t n) {
  SafeTensor& t = f.tensors[name];
  t.dtype = "F32";
  t.shape = std::move(shape);
  t.bytes.resize(n * 4);
  std::memcpy(t.bytes.data(), v, n * 4);
}

// The adapter's gradients of the mean loss (one forward/backward of the same tokens).
Status adapter_grads(LlamaModel& model, const std::vector<int32_t>& in, const std::vector<int32_t>& labels,
                     SafeTensorsFile& out) {
  ParamStore& P = model.params();
  double sum = 0;
  NB_TRY(model.forward_backward(in.data(), labels.data(), 1.f / float(in.size()), &sum));
  std::vector<float> g(size_t(P.total()));
  NB_TRY(P.get_flat(P.flat_grad(), g.data()));
  for (const ParamInfo& p : P.params()) put_f32(out, "grad." + p.name, p.shape, g.data() + p.offset, size_t(p.numel));
  return Status::ok();
}

// tokens [B, S+1] as int32 inputs and labels, each [B * S].
Status read_tokens(const std::string& path, int64_t vocab, MicroBatchShape* shape, std::vector<int32_t>* in,
                   std::vector<int32_t>* labels) {
  SafeTensorsFile f;
  NB_TRY(read_safetensors(path, &f));
  auto it = f.tensors.find("tokens");
  if (it == f.tensors.end()) return errorf("%s has no tensor 'tokens' (I32 [batch, seq + 1])", path.c_str());
  const SafeTensor& t = it->second;
  if (t.shape.size() != 2 || t.shape[0] < 1 || t.shape[1] < 2 || (t.dtype != "I32" && t.dtype != "I64"))
    return errorf("%s: 'tokens' must be I32 or I64 [batch, seq + 1] with seq >= 1, got %s of rank %zu", path.c_str(),
                  t.dtype.c_str(), t.shape.size());
  const int64_t B = t.shape[0], S = t.shape[1] - 1;
  *shape = {B, S};
  in->resize(size_t(B * S));
  labels->resize(size_t(B * S));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s <= S; ++s) {
      const int64_t i = b * (S + 1) + s;
      int64_t v = 0;
      if (t.dtype == "I32") {
        int32_t x;
        std::memcpy(&x, t.bytes.data() + 4 * i, 4);
        v = x;
      } else
        std::memcpy(&v, t.bytes.data() + 8 * i, 8);
      if (v < 0 || v >= vocab)
        return errorf("%s: token %lld at [%lld, %lld] is outside the vocabulary [0, %lld)", path.c_str(), (long long)v,
                      (long long)b, (long long)s, (long long)vocab);
      if (s < S) (*in)[size_t(b * S + s)] = int32_t(v);
      if (s > 0) (*labels)[size_t(b * S + s - 1)] = int32_t(v);
    }
  return Status::ok();
}

Status run_eval(const EvalArgs& a) {
  LlamaConfig cfg;
  HfCheckpointReader reader;
  NB_TRY(open_weights_source(a.src, &cfg, &reader));
  MicroBatchShape shape;
  std::vector<int32_t> in, labels;
  NB_TRY(read_tokens(a.tokens, cfg.vocab, &shape, &in, &labels));
  Device dev = Device::cpu;
  NB_TRY(pick_device(a.device, &dev));
  LlamaModel model;
  LoraAdapter adapter;
  if (!a.adapter.empty()) {
    NB_TRY(read_peft_adapter(a.adapter, cfg, &adapter).context("--adapter"));
    LoraSpec spec = adapter.spec;
    spec.dropout = 0;  // evaluation: no dropout, in the gradients too
    model.set_lora(spec, &reader);
  }
  NB_TRY(model.init(cfg, dev, shape, Recompute::none, /*seed=*/0));
  if (a.adapter.empty())
    NB_TRY(load_hf_weights(reader, cfg, model.params()));
  else
    NB_TRY(lora_store_from_adapter(adapter, cfg, model.params()));
  std::vector<float> logits(size_t(shape.tokens() * cfg.vocab));
  double loss_sum = 0;
  NB_TRY(model.forward_logits(in.data(), labels.data(), logits.data(), &loss_sum));
  const float mean = float(loss_sum / double(shape.tokens()));
  SafeTensorsFile out;
  put_f32(out, "logits", {shape.batch, shape.seq, cfg.vocab}, logits.data(), logits.size());
  put_f32(out, "loss", {1}, &mean, 1);
  if (!a.adapter.empty()) NB_TRY(adapter_grads(model, in, labels, out));
  NB_TRY(write_safetensors(a.out, out));
  std::printf("eval %s%s on %s: %lld x %lld tokens, mean loss %.6f -> %s\n", cfg.name.c_str(),
              a.adapter.empty() ? "" : (" + LoRA " + a.adapter).c_str(),
              dev == Device::cuda ? "cuda (bf16_mixed)" : "cpu (fp32)", (long long)shape.batch, (long long)shape.seq,
              double(mean), a.out.c_str());
  return Status::ok();
}

}  // namespace

void add_eval_command(CLI::App& app) {
  auto a = std::make_shared<EvalArgs>();
  auto* cmd = app.add_subcommand(
      "eval", "Multiple-choice tasks and perplexity of a model, or its logits on given tokens (parity checks)");
  cmd->add_option("--load-hf", a->src.load_hf, "A Hugging Face Llama folder");
  cmd->add_option("--load", a->src.load, "A nibble checkpoint folder");
  cmd->add_option("--ckpt-step", a->src.ckpt_step, "Iteration to load from --load (default: the newest)");
  cmd->add_option("--tokens", a->tokens, "Parity mode: safetensors file with I32 'tokens' [batch, seq + 1]");
  cmd->add_option("--out", a->out,
                  "Parity mode: output safetensors (F32 'logits' [batch, seq, vocab], F32 'loss' [1]); "
                  "tasks and perplexity: a JSON file of the results");
  cmd->add_option("--adapter", a->adapter,
                  "A PEFT LoRA folder: evaluate the base with it (parity mode also writes the adapter's gradients)");
  cmd->add_option("--device", a->device, "cpu (FP32), cuda (BF16 mixed) or auto")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  add_eval_task_options(cmd, &a->tasks);
  cmd->callback([a] {
    Status st;
    if (eval_tasks_requested(a->tasks))
      st = a->tokens.empty() ? run_eval_tasks(a->src, a->adapter, a->device, a->out, a->tasks)
                             : errorf("--tokens (parity mode) does not go with --tasks, --text or --data-path");
    else if (a->tokens.empty() || a->out.empty())
      st = errorf("pass --tokens and --out (logits for parity checks), or --tasks, --text or --data-path");
    else
      st = run_eval(*a);
    if (!st) std::fprintf(stderr, "error: %s\n", st.message().c_str());
    exit_code() = st ? 0 : 1;
  });
}

}  // namespace nb::cli
