// `nibble preprocess`: JSONL or plain text -> Megatron PREFIX_<key>_document.{bin,idx}, like Megatron's
// tools/preprocess_data.py (same files byte for byte for the same token ids; token dtype uint16 when
// vocab < 65500, else int32). Documents are tokenized by --workers threads in rounds and written in
// input order; a progress line shows MB/s and docs/s. `--sft` runs cmd_preprocess_sft.cpp instead.
#include <memory>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <future>
#include "cli/commands.h"
#include "data/jsonl.h"
#include "data/indexed_dataset.h"
#include "tokenizer/bpe_tokenizer.h"

namespace nb::cli {

namespace {
struct PreprocessArgs {
  std::vector<std::string> inputs;
  std::string output_prefix, tokenizer, family = "auto", text_unit = "file";
  std::vector<std::string> json_keys{"text"};
  int workers = 2;
  bool append_eod = false, add_bos = false;
  int64_t round_mb = 16;
  bool sft = false;  // supervised fine-tuning samples (cmd_preprocess_sft.cpp)
  std::string chat_template = "llama3", sft_truncation = "truncate";
  int64_t seq_length = 0;
};

struct Doc {
  std::vector<std::string> fields;  // one text per json key
  size_t bytes = 0;
};

bool is_jsonl(const std::string& path) {
  auto ends = [&](const char* e) {
    size_t n = std::strlen(e);
    return path.size() >= n && path.compare(path.size() - n, n, e) == 0;
  };
  return ends(".jsonl") || ends(".json");
}

// Reads up to `budget` bytes of documents from the current input; false at the end of all inputs.
class DocReader {
 public:
  explicit DocReader(const PreprocessArgs& a) : a_(a) {}
  Status next_round(std::vector<std::string>* raw, bool* jsonl, bool* done) {
    raw->clear();
    size_t bytes = 0;
    while (bytes < size_t(a_.round_mb) << 20) {
      if (!in_.is_open()) {
        if (file_ >= a_.inputs.size()) {
          *done = raw->empty();
          return Status::ok();
        }
        const std::string& path = a_.inputs[file_];
        in_.open(path, std::ios::binary);
        if (!in_) return errorf("cannot open input %s", path.c_str());
        jsonl_ = is_jsonl(path);
        if (!raw->empty() && jsonl_ != *jsonl) {
          in_.close();
          break;
        }  // keep one kind per round
        line_no_ = 0;
      }
      *jsonl = jsonl_;
      std::string doc;
      bool got = false;
      if (jsonl_ || a_.text_unit == "line") {
        got = bool(std::getline(in_, doc));
        if (got && doc.empty() && jsonl_) continue;
      } else if (a_.text_unit == "paragraph") {
        std::string line;
        while (std::getline(in_, line)) {
          got = true;
          if (line.empty() && !doc.empty()) break;
          if (!line.empty()) {
            doc += line;
            doc += '\n';
          }
        }
      } else {  // the whole file is one document
        doc.assign(std::istreambuf_iterator<char>(in_), {});
        got = true;
        in_.setstate(std::ios::eofbit);
      }
      if (got) {
        bytes += doc.size();
        raw->push_back(std::move(doc));
      }
      if (!got || in_.eof()) {
        in_.close();
        ++file_;
      }
    }
    *done = false;
    return Status::ok();
  }

 private:
  const PreprocessArgs& a_;
  std::ifstream in_;
  size_t file_ = 0;
  bool jsonl_ = false;
  int64_t line_no_ = 0;
};

// NOLINTNEXTLINE(readability-function-size): a listed offender (docs/HARDENING.md), to shrink when next changed
int run_preprocess(const PreprocessArgs& a) {
  std::unique_ptr<BpeTokenizer> tok;
  if (Status st = BpeTokenizer::load(a.tokenizer, a.family, &tok); !st) {
    std::fprintf(stderr, "error: %s\n", st.message().c_str());
    return 1;
  }
  if (a.append_eod && tok->eod() < 0) {
    std::fprintf(stderr, "error: --append-eod: the tokenizer %s has no end-of-document token\n", a.tokenizer.c_str());
    return 1;
  }
  if (a.add_bos && tok->bos() < 0) {
    std::fprintf(stderr, "error: --add-bos: the tokenizer %s has no beginning-of-text token\n", a.tokenizer.c_str());
    return 1;
  }
  const IndexedDtype dtype = token_dtype_for_vocab(tok->vocab_size());
  std::vector<std::unique_ptr<IndexedDatasetWriter>> writers(a.json_keys.size());
  for (size_t k = 0; k < a.json_keys.size(); ++k)
    if (Status st =
            IndexedDatasetWriter::create(a.output_prefix + "_" + a.json_keys[k] + "_document", dtype, &writers[k]);
        !st) {
      std::fprintf(stderr, "error: %s\n", st.message().c_str());
      return 1;
    }
  DocReader reader(a);
  const auto t0 = std::chrono::steady_clock::now();
  auto last = t0;
  int64_t docs = 0, tokens = 0;
  double mb = 0;
  const int workers = std::max(1, a.workers);
  for (;;) {
    std::vector<std::string> raw;
    bool jsonl = false, done = false;
    if (Status st = reader.next_round(&raw, &jsonl, &done); !st) {
      std::fprintf(stderr, "\nerror: %s\n", st.message().c_str());
      return 1;
    }
    if (done) break;
    // Each worker tokenizes a contiguous slice; results are written in input order.
    std::vector<std::vector<std::vector<int32_t>>> ids(raw.size(),
                                                       std::vector<std::vector<int32_t>>(a.json_keys.size()));
    std::vector<std::string> errors(static_cast<size_t>(workers));
    std::vector<std::future<void>> futs;
    for (int w = 0; w < workers; ++w)
      futs.push_back(std::async(std::launch::async, [&, w] {
        for (size_t i = size_t(w) * raw.size() / workers; i < size_t(w + 1) * raw.size() / workers; ++i) {
          for (size_t k = 0; k < a.json_keys.size(); ++k) {
            std::string text;
            if (jsonl) {
              if (!jsonl_field(raw[i], a.json_keys[k], &text)) {
                if (errors[w].empty())
                  errors[w] = strprintf("input document %lld is not a JSON object with a string field \"%s\"",
                                        (long long)(docs + i + 1), a.json_keys[k].c_str());
                continue;
              }
            } else {
              text = raw[i];
            }
            auto& out = ids[i][k];
            if (a.add_bos) out.push_back(tok->bos());
            tok->encode(text, &out);
            if (a.append_eod && !out.empty()) out.push_back(tok->eod());
          }
        }
      }));
    for (auto& f : futs) f.get();
    for (const auto& e : errors)
      if (!e.empty()) {
        std::fprintf(stderr, "\nerror: %s; check --json-keys\n", e.c_str());
        return 1;
      }
    for (size_t i = 0; i < raw.size(); ++i) {
      for (size_t k = 0; k < a.json_keys.size(); ++k) {
        const auto& v = ids[i][k];
        if (v.empty()) {
          writers[k]->add_empty_document();
        } else if (Status st = writers[k]->add_document(v.data(), int64_t(v.size())); !st) {
          std::fprintf(stderr, "\nerror: %s\n", st.message().c_str());
          return 1;
        }
        tokens += int64_t(v.size());
      }
      mb += double(raw[i].size()) / 1e6;
    }
    docs += int64_t(raw.size());
    auto now = std::chrono::steady_clock::now();
    if (std::chrono::duration<double>(now - last).count() > 1.0) {
      double s = std::chrono::duration<double>(now - t0).count();
      std::fprintf(stderr, "\r  %lld docs | %.1f MB | %.2f MB/s | %.0f docs/s | %lld tokens   ", (long long)docs, mb,
                   mb / s, docs / s, (long long)tokens);
      last = now;
    }
  }
  for (auto& w : writers)
    if (Status st = w->finalize(); !st) {
      std::fprintf(stderr, "\nerror: %s\n", st.message().c_str());
      return 1;
    }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr, "\r  %lld docs | %.1f MB | %.2f MB/s | %.0f docs/s | %lld tokens   \n", (long long)docs, mb,
               mb / s, docs / s, (long long)tokens);
  std::printf(
      "wrote %s_%s_document.{bin,idx}: %lld documents, %lld tokens, dtype %s (vocab %lld), %.1f s, %.2f MB/s with %d "
      "workers\n",
      a.output_prefix.c_str(), a.json_keys[0].c_str(), (long long)docs, (long long)tokens,
      dtype == IndexedDtype::u16 ? "uint16" : "int32", (long long)tok->vocab_size(), s, mb / s, workers);
  return 0;
}

// Checks that the SFT flags and the pretraining-only flags are not mixed, then runs the SFT path.
int dispatch_sft(const PreprocessArgs& a, const CLI::App& cmd) {
  auto given = [&](const char* name) { return cmd.get_option(name)->count() > 0; };
  for (const char* name : {"--json-keys", "--append-eod", "--text-unit"})
    if (given(name)) {
      std::fprintf(stderr, "error: %s does not apply to --sft (samples are JSONL with fixed shapes); leave it out\n",
                   name);
      return 1;
    }
  if (!given("--seq-length")) {
    std::fprintf(stderr, "error: --sft needs --seq-length N, the longest sample kept in tokens (e.g. 4096)\n");
    return 1;
  }
  return run_preprocess_sft({.inputs = a.inputs,
                             .output_prefix = a.output_prefix,
                             .tokenizer = a.tokenizer,
                             .family = a.family,
                             .chat_template = a.chat_template,
                             .truncation = a.sft_truncation,
                             .seq_length = a.seq_length,
                             .workers = a.workers,
                             .add_bos = a.add_bos});
}

int dispatch(const PreprocessArgs& a, const CLI::App& cmd) {
  if (a.sft) return dispatch_sft(a, cmd);
  for (const char* name : {"--chat-template", "--seq-length", "--sft-truncation"})
    if (cmd.get_option(name)->count() > 0) {
      std::fprintf(stderr, "error: %s applies only to supervised fine-tuning data; add --sft or leave it out\n", name);
      return 1;
    }
  return run_preprocess(a);
}
}  // namespace

void add_preprocess_command(CLI::App& app) {
  // Shared with the callback, which the app keeps: CLI11 binds options to these fields by reference.
  auto a = std::make_shared<PreprocessArgs>();
  auto* cmd = app.add_subcommand(
      "preprocess", "Tokenize JSONL or text files into a Megatron indexed dataset (PREFIX_text_document.bin/.idx)");
  cmd->add_option("--input,-i", a->inputs, "Input files: *.jsonl/*.json (one JSON object per line) or plain text")
      ->required();
  cmd->add_option("--output-prefix,-o", a->output_prefix, "Output prefix; writes PREFIX_<key>_document.{bin,idx}")
      ->required();
  cmd->add_option("--tokenizer,-t", a->tokenizer, "tokenizer.json (HF byte-level BPE) or a tiktoken rank file")
      ->required();
  cmd->add_option("--tokenizer-family", a->family, "For tiktoken rank files: gpt2, llama3 or auto")
      ->capture_default_str();
  cmd->add_option("--json-keys", a->json_keys, "JSON fields to tokenize, one dataset each")->capture_default_str();
  cmd->add_option("--text-unit", a->text_unit, "Plain text: one document per file, paragraph or line")
      ->check(CLI::IsMember({"file", "paragraph", "line"}))
      ->capture_default_str();
  cmd->add_option("--workers,-j", a->workers, "Tokenizer threads")->capture_default_str();
  cmd->add_flag("--append-eod", a->append_eod, "Append the end-of-document token to every document");
  cmd->add_flag("--add-bos", a->add_bos, "Prepend the beginning-of-text token (HF Llama 3 tokenizers do this)");
  cmd->add_flag("--sft", a->sft,
                "Supervised fine-tuning samples ({\"input\",\"output\"} or {\"messages\"} lines): writes "
                "PREFIX_tokens_document, PREFIX_mask_document and PREFIX_sft_stats.json");
  cmd->add_option("--chat-template", a->chat_template, "--sft: llama3 (Llama 3 Instruct headers) or plain")
      ->check(CLI::IsMember({"llama3", "plain"}))
      ->capture_default_str();
  cmd->add_option("--seq-length", a->seq_length, "--sft: the longest sample kept, in tokens (required with --sft)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--sft-truncation", a->sft_truncation,
                  "--sft: truncate (cut the prompt's start, then the answer's end) or drop longer samples")
      ->check(CLI::IsMember({"truncate", "drop"}))
      ->capture_default_str();
  cmd->callback([a, cmd] { exit_code() = dispatch(*a, *cmd); });
}

}  // namespace nb::cli
