// `nibble eval --tasks FILE.jsonl ... | --text FILE | --data-path PREFIX`: multiple-choice accuracy by
// log-likelihood (lm-evaluation-harness's semantics, eval/tasks.h) and perplexity (eval/perplexity.h) of
// a model from --load / --load-hf (+ --adapter). Everything is tokenized and planned first (so a bad
// input fails before the model loads), then one model of one micro-batch shape scores it all.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include "cli/eval_tasks.h"
#include "core/device_info.h"
#include "eval/perplexity.h"
#include "eval/tasks.h"
#include "io/file_util.h"

namespace nb::cli {
namespace {

struct TaskRun {
  eval::McTask task;
  std::vector<eval::LoglikRequest> reqs;
  std::vector<size_t> first;  // document i's first request
  std::vector<eval::LoglikResult> results;
  eval::McMetrics metrics;
};

// Everything one invocation evaluates, and the model it needs.
struct EvalRun {
  LlamaConfig cfg;
  HfCheckpointReader reader;
  Device dev = Device::cpu;
  std::unique_ptr<BpeTokenizer> tok;
  int64_t max_length = 0;
  std::vector<TaskRun> tasks;
  std::vector<eval::LoglikRequest> windows;  // --text
  eval::PerplexityResult text;
  std::shared_ptr<SampleSet> data;  // --data-path
  int64_t data_samples = 0;
  eval::PerplexityResult data_result;
  MicroBatchShape shape;
};

// --tokenizer, else the tokenizer.json of the --load-hf folder when there is one.
Status load_task_tokenizer(const WeightsSource& src, const EvalTaskArgs& a, std::unique_ptr<BpeTokenizer>* tok) {
  std::string path = a.tokenizer;
  if (path.empty() && !src.load_hf.empty() && std::filesystem::exists(src.load_hf + "/tokenizer.json"))
    path = src.load_hf + "/tokenizer.json";
  if (path.empty())
    return errorf("--tasks and --text need a tokenizer: pass --tokenizer FILE (the model's tokenizer.json)");
  return BpeTokenizer::load(path, a.tokenizer_family, tok).context("--tokenizer");
}

Status prepare_tasks(const EvalTaskArgs& a, EvalRun* r) {
  if (a.tasks.empty()) return Status::ok();
  eval::TaskEncoder enc;
  enc.tok = r->tok.get();
  enc.add_bos = a.add_bos == "auto" ? r->tok->adds_bos() : a.add_bos == "true";
  enc.target_delimiter = a.target_delimiter;
  enc.max_length = r->max_length;
  for (const std::string& path : a.tasks) {
    TaskRun t;
    NB_TRY(eval::read_mc_task(path, &t.task));
    for (const TaskRun& u : r->tasks)
      if (u.task.name == t.task.name)
        return errorf("--tasks %s and %s share the name '%s' (a task is named by its file's stem)", u.task.path.c_str(),
                      path.c_str(), t.task.name.c_str());
    NB_TRY(eval::build_mc_requests(t.task, enc, &t.reqs, &t.first));
    NB_TRY(eval::check_request_tokens(t.reqs, r->cfg.vocab, path.c_str()));
    r->tasks.push_back(std::move(t));
  }
  return Status::ok();
}

// The validation split as the trainer builds it (GPTDataset indices, no index cache written).
Status prepare_data(const EvalTaskArgs& a, EvalRun* r) {
  if (a.seq_length < 1)
    return errorf(
        "--data-path needs --seq-length: the training run's sequence length (samples and their order "
        "depend on it)");
  DataConfig dc;
  dc.data_path = a.data_path;
  dc.split = a.split;
  dc.seq_length = a.seq_length;
  dc.seed = uint64_t(a.seed);
  dc.cache_path = "none";
  const bool blend = a.data_path.find(' ') != std::string::npos;
  if (a.eval_samples < 1 && blend)
    return errorf("--data-path with a blend needs --eval-samples N (one epoch is defined for one dataset only)");
  // One sample asked for builds one epoch of a single dataset, in the order any request within an epoch has.
  dc.num_samples[1] = std::max<int64_t>(a.eval_samples, 1);
  NB_TRY(make_gpt_samples(dc, Split::valid, &r->data).context("--data-path"));
  r->data_samples = a.eval_samples > 0 ? a.eval_samples : r->data->size();
  if (r->data_samples > r->data->size())
    return errorf("--eval-samples %lld: the validation split has only %lld samples of %lld tokens",
                  (long long)a.eval_samples, (long long)r->data->size(), (long long)a.seq_length);
  return Status::ok();
}

// One shape for everything: the longest input, rounded up to 16 where the model allows; the batch
// keeps the host logits (tasks) under 1 GiB and a micro-batch near 16k tokens.
MicroBatchShape choose_shape(const EvalTaskArgs& a, const EvalRun& r) {
  int64_t seq = eval::longest_input(r.windows);
  for (const TaskRun& t : r.tasks) seq = std::max(seq, eval::longest_input(t.reqs));
  if (r.data) seq = std::max(seq, a.seq_length);
  seq = std::max<int64_t>(seq, 1);  // nothing to score (an empty text) still makes a valid model
  const int64_t rounded = (seq + 15) / 16 * 16;
  if (rounded <= r.cfg.max_seq) seq = rounded;
  int64_t batch = std::clamp<int64_t>(16384 / seq, 1, 64);
  if (!r.tasks.empty()) batch = std::min(batch, std::max<int64_t>(1, (int64_t(1) << 30) / (seq * r.cfg.vocab * 4)));
  if (a.batch_size > 0) batch = a.batch_size;
  return {batch, seq};
}

Status load_eval_model(const std::string& adapter_dir, EvalRun& r, LlamaModel* model) {
  LoraAdapter adapter;
  if (!adapter_dir.empty()) {
    NB_TRY(read_peft_adapter(adapter_dir, r.cfg, &adapter).context("--adapter"));
    LoraSpec spec = adapter.spec;
    spec.dropout = 0;  // evaluation
    model->set_lora(spec, &r.reader);
  }
  NB_TRY(model->init(r.cfg, r.dev, r.shape, Recompute::none, /*seed=*/0));
  if (adapter_dir.empty()) return load_hf_weights(r.reader, r.cfg, model->params());
  return lora_store_from_adapter(adapter, r.cfg, model->params());
}

// Four decimals, or four significant digits for large values (a random model's word perplexity).
std::string fmt(double v) {
  if (std::isnan(v)) return "n/a";
  return strprintf(std::abs(v) >= 1e5 ? "%.4g" : "%.4f", v);
}

// A Markdown table whose columns are as wide as their widest cell; rows[0] is the header.
void print_table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> w(rows[0].size(), 0);
  for (const auto& row : rows)
    for (size_t c = 0; c < row.size(); ++c) w[c] = std::max(w[c], row[c].size());
  auto line = [&](const std::vector<std::string>& row) {
    std::string s = "|";
    for (size_t c = 0; c < row.size(); ++c)
      s +=
          " " +
          (c == 0 ? row[c] + std::string(w[c] - row[c].size(), ' ') : std::string(w[c] - row[c].size(), ' ') + row[c]) +
          " |";
    std::printf("%s\n", s.c_str());
  };
  std::printf("\n");
  line(rows[0]);
  std::string sep = "|";
  for (size_t c = 0; c < w.size(); ++c) sep += std::string(w[c] + 2, '-') + "|";
  std::printf("%s\n", sep.c_str());
  for (size_t i = 1; i < rows.size(); ++i) line(rows[i]);
}

void print_tables(const EvalRun& r, const EvalTaskArgs& a) {
  if (!r.tasks.empty()) {
    std::vector<std::vector<std::string>> rows = {{"task", "n", "acc", "stderr", "acc_norm", "stderr"}};
    for (const TaskRun& t : r.tasks) {
      const eval::McMetrics& m = t.metrics;
      rows.push_back(
          {t.task.name, std::to_string(m.n), fmt(m.acc), fmt(m.acc_stderr), fmt(m.acc_norm), fmt(m.acc_norm_stderr)});
    }
    print_table(rows);
  }
  if (!a.text.empty()) {
    const eval::PerplexityResult& p = r.text;
    print_table({{"text", "documents", "tokens", "token ppl", "word ppl", "bits/byte"},
                 {a.text, std::to_string(p.documents), std::to_string(p.tokens), fmt(p.token_perplexity()),
                  fmt(p.word_perplexity()), fmt(p.bits_per_byte())}});
  }
  if (r.data) {
    const eval::PerplexityResult& p = r.data_result;
    print_table({{"validation split", "samples", "tokens", "mean loss", "ppl"},
                 {a.data_path, std::to_string(p.documents), std::to_string(p.tokens),
                  fmt(p.tokens > 0 ? p.nll / double(p.tokens) : NAN), fmt(p.token_perplexity())}});
  }
}

nlohmann::ordered_json number(double v) {
  return std::isnan(v) ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(v);
}

nlohmann::ordered_json task_json(const TaskRun& t, bool samples) {
  const eval::McMetrics& m = t.metrics;
  nlohmann::ordered_json j = {{"path", t.task.path},
                              {"n", m.n},
                              {"acc", m.acc},
                              {"acc_stderr", number(m.acc_stderr)},
                              {"acc_norm", m.acc_norm},
                              {"acc_norm_stderr", number(m.acc_norm_stderr)},
                              {"acc_bytes", m.acc_bytes},
                              {"acc_bytes_stderr", number(m.acc_bytes_stderr)}};
  if (!samples) return j;
  nlohmann::ordered_json docs = nlohmann::ordered_json::array();
  for (size_t i = 0; i < t.task.docs.size(); ++i) {
    const eval::McDoc& d = t.task.docs[i];
    std::vector<double> lls;
    nlohmann::ordered_json greedy = nlohmann::ordered_json::array(), tokens = nlohmann::ordered_json::array(),
                           inputs = nlohmann::ordered_json::array();
    for (size_t c = 0; c < d.choices.size(); ++c) {
      lls.push_back(t.results[t.first[i] + c].loglik);
      greedy.push_back(t.results[t.first[i] + c].greedy);
      tokens.push_back(t.reqs[t.first[i] + c].targets.size());
      inputs.push_back(t.reqs[t.first[i] + c].input.size());
    }
    const eval::McPrediction p = eval::predict(d, lls.data());
    docs.push_back({{"line", d.line},
                    {"label", d.label},
                    {"loglikelihoods", lls},
                    {"is_greedy", greedy},
                    {"continuation_tokens", tokens},
                    {"input_tokens", inputs},
                    {"pred", p.pred},
                    {"pred_norm", p.pred_norm},
                    {"pred_bytes", p.pred_bytes}});
  }
  j["samples"] = docs;
  return j;
}

nlohmann::ordered_json perplexity_json(const eval::PerplexityResult& p, bool text) {
  nlohmann::ordered_json j;
  if (text) {
    j["documents"] = p.documents;
    j["windows"] = p.windows;
  } else {
    j["samples"] = p.documents;
  }
  j["tokens"] = p.tokens;
  j["nll"] = p.nll;
  j["mean_nll"] = number(p.tokens > 0 ? p.nll / double(p.tokens) : NAN);
  j["token_perplexity"] = number(p.token_perplexity());
  if (!text) return j;
  j["words"] = p.words;
  j["bytes"] = p.bytes;
  j["word_perplexity"] = number(p.word_perplexity());
  j["byte_perplexity"] = number(p.byte_perplexity());
  j["bits_per_byte"] = number(p.bits_per_byte());
  return j;
}

Status write_json(const std::string& out, const EvalTaskArgs& a, const EvalRun& r) {
  nlohmann::ordered_json j = {{"model", r.cfg.name},
                              {"device", r.dev == Device::cuda ? "cuda (bf16_mixed)" : "cpu (fp32)"},
                              {"max_length", r.max_length},
                              {"micro_batch", {r.shape.batch, r.shape.seq}}};
  if (!r.tasks.empty()) {
    j["target_delimiter"] = a.target_delimiter;
    for (const TaskRun& t : r.tasks) j["tasks"][t.task.name] = task_json(t, a.log_samples);
  }
  if (!a.text.empty()) {
    j["text"] = perplexity_json(r.text, true);
    j["text"]["path"] = a.text;
  }
  if (r.data) {
    j["data"] = perplexity_json(r.data_result, false);
    j["data"]["data_path"] = a.data_path;
    j["data"]["split"] = a.split;
    j["data"]["seq_length"] = a.seq_length;
  }
  return replace_file_atomically(out, j.dump(2) + "\n").context("--out");
}

// Tokenizes and checks every input, then sizes the model's micro-batch.
Status plan(const WeightsSource& src, const EvalTaskArgs& a, EvalRun* r) {
  NB_TRY(open_weights_source(src, &r->cfg, &r->reader));
  r->max_length = a.max_length > 0 ? a.max_length : r->cfg.max_seq;
  if (!a.tasks.empty() || !a.text.empty()) NB_TRY(load_task_tokenizer(src, a, &r->tok));
  NB_TRY(prepare_tasks(a, r));
  if (!a.text.empty()) {
    std::vector<std::string> docs;
    NB_TRY(eval::read_text_documents(a.text, a.text_key, &docs));
    NB_TRY(eval::text_windows(docs, *r->tok, r->max_length, &r->windows, &r->text));
    NB_TRY(eval::check_request_tokens(r->windows, r->cfg.vocab, a.text.c_str()));
  }
  if (!a.data_path.empty()) NB_TRY(prepare_data(a, r));
  r->shape = choose_shape(a, *r);
  return Status::ok();
}

}  // namespace

bool eval_tasks_requested(const EvalTaskArgs& a) { return !a.tasks.empty() || !a.text.empty() || !a.data_path.empty(); }

Status run_eval_tasks(const WeightsSource& src, const std::string& adapter, const std::string& device,
                      const std::string& out, const EvalTaskArgs& a) {
  EvalRun r;
  NB_TRY(pick_device(device, &r.dev));
  NB_TRY(plan(src, a, &r));
  size_t requests = 0;
  for (const TaskRun& t : r.tasks) requests += t.reqs.size();
  std::printf(
      "eval %s%s on %s: %zu task(s), %zu requests, %zu text windows, %lld samples; max length %lld, "
      "micro-batch %lld x %lld\n",
      r.cfg.name.c_str(), adapter.empty() ? "" : (" + LoRA " + adapter).c_str(),
      r.dev == Device::cuda ? "cuda (bf16_mixed)" : "cpu (fp32)", r.tasks.size(), requests, r.windows.size(),
      (long long)r.data_samples, (long long)r.max_length, (long long)r.shape.batch, (long long)r.shape.seq);
  std::fflush(stdout);
  LlamaModel model;
  NB_TRY(load_eval_model(adapter, r, &model));
  eval::EvalModel m{&model, r.shape};
  for (TaskRun& t : r.tasks) {
    NB_TRY(eval::score_requests(m, t.reqs, &t.results));
    std::vector<double> lls;
    for (const auto& x : t.results) lls.push_back(x.loglik);
    t.metrics = eval::mc_metrics(t.task, lls, t.first);
  }
  if (!r.windows.empty()) NB_TRY(eval::score_windows(m, r.windows, &r.text));
  if (r.data) NB_TRY(eval::dataset_perplexity(m, *r.data, r.data_samples, &r.data_result));
  print_tables(r, a);
  if (!out.empty()) {
    NB_TRY(write_json(out, a, r));
    std::printf("\nwrote %s\n", out.c_str());
  }
  return Status::ok();
}

void add_eval_task_options(CLI::App* cmd, EvalTaskArgs* a) {
  cmd->add_option("--tasks", a->tasks,
                  "Multiple-choice JSONL files ({context, choices, label} per line; choices without the leading "
                  "delimiter): acc and acc_norm by log-likelihood, as lm-evaluation-harness");
  cmd->add_option("--text", a->text, "Perplexity of a text file (.jsonl: one document per line's --text-key field)");
  cmd->add_option("--text-key", a->text_key, "The JSONL field of --text documents")->capture_default_str();
  cmd->add_option("--data-path", a->data_path, "Perplexity of a Megatron dataset's validation split (prefix or blend)");
  cmd->add_option("--split", a->split, "Train,valid,test split weights of --data-path")->capture_default_str();
  cmd->add_option("--seq-length", a->seq_length, "--data-path: the training run's sequence length");
  cmd->add_option("--eval-samples", a->eval_samples,
                  "--data-path: validation samples to evaluate (default: one epoch of the split)");
  cmd->add_option("--seed", a->seed, "--data-path: the training run's seed (sample order)")->capture_default_str();
  cmd->add_option("--tokenizer", a->tokenizer, "tokenizer.json (default: the --load-hf folder's) or a tiktoken file");
  cmd->add_option("--tokenizer-family", a->tokenizer_family, "For tiktoken rank files: gpt2, llama3 or auto")
      ->capture_default_str();
  cmd->add_option("--add-bos", a->add_bos, "Prepend the BOS to contexts: auto (the tokenizer's own rule), true, false")
      ->check(CLI::IsMember({"auto", "true", "false"}))
      ->capture_default_str();
  cmd->add_option("--target-delimiter", a->target_delimiter, "Put between context and choice (harness default: space)")
      ->capture_default_str();
  cmd->add_option("--max-length", a->max_length,
                  "Longest model input; the --text window (default: the model's max_position_embeddings)");
  cmd->add_option("--batch-size", a->batch_size, "Sequences per forward (default: sized to the inputs)");
  cmd->add_flag("--log-samples", a->log_samples, "Also write every document's log-likelihoods to --out");
}

}  // namespace nb::cli
