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

// One preprocess run's state, shared by its steps: the tokenizer, one writer per json key, the progress.
struct PreprocessRun {
  const PreprocessArgs& a;
  std::unique_ptr<BpeTokenizer> tok{};
  IndexedDtype dtype = IndexedDtype::u16;
  std::vector<std::unique_ptr<IndexedDatasetWriter>> writers{};
  int workers = 1;
  std::chrono::steady_clock::time_point t0{}, last{};  // the start and the last progress line
  int64_t docs = 0, tokens = 0;
  double mb = 0;
};

// Token ids per document of a round, then per json key.
using RoundIds = std::vector<std::vector<std::vector<int32_t>>>;

// Loads the tokenizer and checks it has the tokens that --append-eod and --add-bos need; false once reported.
bool load_run_tokenizer(PreprocessRun* r) {
  const PreprocessArgs& a = r->a;
  if (Status st = BpeTokenizer::load(a.tokenizer, a.family, &r->tok); !st) {
    std::fprintf(stderr, "error: %s\n", st.message().c_str());
    return false;
  }
  if (a.append_eod && r->tok->eod() < 0) {
    std::fprintf(stderr, "error: --append-eod: the tokenizer %s has no end-of-document token\n", a.tokenizer.c_str());
    return false;
  }
  if (a.add_bos && r->tok->bos() < 0) {
    std::fprintf(stderr, "error: --add-bos: the tokenizer %s has no beginning-of-text token\n", a.tokenizer.c_str());
    return false;
  }
  return true;
}

// Opens PREFIX_<key>_document for every json key, in the token dtype the vocabulary needs; false once reported.
bool create_writers(PreprocessRun* r) {
  const PreprocessArgs& a = r->a;
  r->dtype = token_dtype_for_vocab(r->tok->vocab_size());
  r->writers.resize(a.json_keys.size());
  for (size_t k = 0; k < a.json_keys.size(); ++k)
    if (Status st = IndexedDatasetWriter::create(a.output_prefix + "_" + a.json_keys[k] + "_document", r->dtype,
                                                 &r->writers[k]);
        !st) {
      std::fprintf(stderr, "error: %s\n", st.message().c_str());
      return false;
    }
  return true;
}

// Each worker tokenizes a contiguous slice of the round; returns the first worker's error, empty if none.
std::string tokenize_round(const PreprocessRun& r, const std::vector<std::string>& raw, bool jsonl, RoundIds* ids) {
  const PreprocessArgs& a = r.a;
  const int workers = r.workers;
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
                                      (long long)(r.docs + i + 1), a.json_keys[k].c_str());
              continue;
            }
          } else {
            text = raw[i];
          }
          auto& out = (*ids)[i][k];
          if (a.add_bos) out.push_back(r.tok->bos());
          r.tok->encode(text, &out);
          if (a.append_eod && !out.empty()) out.push_back(r.tok->eod());
        }
      }
    }));
  for (auto& f : futs) f.get();
  for (const auto& e : errors)
    if (!e.empty()) return e;
  return {};
}

// Appends the round's documents in input order, an empty document where a text had no tokens; false once reported.
bool write_round(PreprocessRun* r, const std::vector<std::string>& raw, const RoundIds& ids) {
  for (size_t i = 0; i < raw.size(); ++i) {
    for (size_t k = 0; k < r->a.json_keys.size(); ++k) {
      const auto& v = ids[i][k];
      if (v.empty()) {
        r->writers[k]->add_empty_document();
      } else if (Status st = r->writers[k]->add_document(v.data(), int64_t(v.size())); !st) {
        std::fprintf(stderr, "\nerror: %s\n", st.message().c_str());
        return false;
      }
      r->tokens += int64_t(v.size());
    }
    r->mb += double(raw[i].size()) / 1e6;
  }
  r->docs += int64_t(raw.size());
  return true;
}

// Tokenizes one round and writes it; false once an error is reported.
bool process_round(PreprocessRun* r, const std::vector<std::string>& raw, bool jsonl) {
  RoundIds ids(raw.size(), std::vector<std::vector<int32_t>>(r->a.json_keys.size()));
  if (std::string e = tokenize_round(*r, raw, jsonl, &ids); !e.empty()) {
    std::fprintf(stderr, "\nerror: %s; check --json-keys\n", e.c_str());
    return false;
  }
  return write_round(r, raw, ids);
}

// Redraws the progress line in place, at most once a second.
void show_progress(PreprocessRun* r) {
  auto now = std::chrono::steady_clock::now();
  if (std::chrono::duration<double>(now - r->last).count() > 1.0) {
    double s = std::chrono::duration<double>(now - r->t0).count();
    std::fprintf(stderr, "\r  %lld docs | %.1f MB | %.2f MB/s | %.0f docs/s | %lld tokens   ", (long long)r->docs,
                 r->mb, r->mb / s, r->docs / s, (long long)r->tokens);
    r->last = now;
  }
}

// Writes every dataset's index; false once an error is reported.
bool finalize_writers(const PreprocessRun& r) {
  for (const auto& w : r.writers)
    if (Status st = w->finalize(); !st) {
      std::fprintf(stderr, "\nerror: %s\n", st.message().c_str());
      return false;
    }
  return true;
}

// The last progress line on stderr, then the one-line summary on stdout.
void print_summary(const PreprocessRun& r) {
  const PreprocessArgs& a = r.a;
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - r.t0).count();
  std::fprintf(stderr, "\r  %lld docs | %.1f MB | %.2f MB/s | %.0f docs/s | %lld tokens   \n", (long long)r.docs, r.mb,
               r.mb / s, r.docs / s, (long long)r.tokens);
  std::printf(
      "wrote %s_%s_document.{bin,idx}: %lld documents, %lld tokens, dtype %s (vocab %lld), %.1f s, %.2f MB/s with %d "
      "workers\n",
      a.output_prefix.c_str(), a.json_keys[0].c_str(), (long long)r.docs, (long long)r.tokens,
      r.dtype == IndexedDtype::u16 ? "uint16" : "int32", (long long)r.tok->vocab_size(), s, r.mb / s, r.workers);
}

int run_preprocess(const PreprocessArgs& a) {
  PreprocessRun r{a};
  if (!load_run_tokenizer(&r) || !create_writers(&r)) return 1;
  DocReader reader(a);
  r.t0 = r.last = std::chrono::steady_clock::now();
  r.workers = std::max(1, a.workers);
  for (;;) {
    std::vector<std::string> raw;
    bool jsonl = false, done = false;
    if (Status st = reader.next_round(&raw, &jsonl, &done); !st) {
      std::fprintf(stderr, "\nerror: %s\n", st.message().c_str());
      return 1;
    }
    if (done) break;
    if (!process_round(&r, raw, jsonl)) return 1;
    show_progress(&r);
  }
  if (!finalize_writers(r)) return 1;
  print_summary(r);
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
