// `nibble preprocess --sft`: SFT JSONL (NeMo {"input","output"} or chat {"messages"} lines) ->
// PREFIX_tokens_document.{bin,idx} (token ids) + PREFIX_mask_document.{bin,idx} (uint8, 1 = answer token),
// one document per kept sample in both, and PREFIX_sft_stats.json. Lines are parsed and templated by
// --workers threads in rounds and written in input order, so the output does not depend on --workers.
#include <cstdio>
#include <fstream>
#include <future>
#include <memory>
#include "cli/commands.h"
#include "data/indexed_dataset.h"
#include "data/sft.h"
#include "tokenizer/bpe_tokenizer.h"

namespace nb::cli {

namespace {
struct Line {
  std::string text;
  size_t file = 0;
  int64_t number = 0;  // 1-based, for file:line in errors
};

// Reads the inputs' non-blank lines in rounds of about 8 MB; an empty round means the end.
class LineReader {
 public:
  explicit LineReader(const std::vector<std::string>& paths) : paths_(paths) {}
  Status next_round(std::vector<Line>* out) {
    out->clear();
    size_t bytes = 0;
    while (bytes < (size_t(8) << 20) && file_ < paths_.size()) {
      if (!in_.is_open()) {
        in_.open(paths_[file_], std::ios::binary);
        if (!in_) return errorf("cannot open the input %s; check the --input path", paths_[file_].c_str());
        number_ = 0;
      }
      Line l{{}, file_, ++number_};
      if (!std::getline(in_, l.text)) {
        in_.close();
        ++file_;
        continue;
      }
      if (l.text.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines separate nothing
      bytes += l.text.size();
      out->push_back(std::move(l));
    }
    return Status::ok();
  }
  const std::string& path(size_t i) const { return paths_[i]; }

 private:
  const std::vector<std::string>& paths_;
  std::ifstream in_;
  size_t file_ = 0;
  int64_t number_ = 0;
};

struct Result {
  SftTokens t;
  SftOutcome outcome = SftOutcome::kept;
  Status status;
};

// Each worker parses and templates a contiguous slice of the round.
void process_sft_round(const SftFormatter& f, const LineReader& reader, const std::vector<Line>& lines, int workers,
                       std::vector<Result>* out) {
  out->assign(lines.size(), Result{});
  std::vector<std::future<void>> futs;
  for (int w = 0; w < workers; ++w)
    futs.push_back(std::async(std::launch::async, [&, w] {
      SftSample sample;
      for (size_t i = size_t(w) * lines.size() / workers; i < size_t(w + 1) * lines.size() / workers; ++i) {
        const Line& l = lines[i];
        Result& r = (*out)[i];
        r.status = parse_sft_sample(l.text, reader.path(l.file) + ":" + std::to_string(l.number), &sample);
        if (r.status) r.outcome = f.process(sample, &r.t);
      }
    }));
  for (auto& fut : futs) fut.get();
}

// The two datasets (same document lengths) and the counts.
class SftOutput {
 public:
  Status open(const std::string& prefix, IndexedDtype token_dtype) {
    NB_TRY(IndexedDatasetWriter::create(prefix + "_tokens_document", token_dtype, &tokens_));
    return IndexedDatasetWriter::create(prefix + "_mask_document", IndexedDtype::u8, &mask_);
  }
  Status add(const Result& r) {
    stats_.add(r.outcome, r.t);
    if (r.outcome == SftOutcome::dropped_no_answer || r.outcome == SftOutcome::dropped_too_long) return Status::ok();
    mask32_.assign(r.t.mask.begin(), r.t.mask.end());
    NB_TRY(tokens_->add_document(r.t.tokens.data(), int64_t(r.t.tokens.size())));
    return mask_->add_document(mask32_.data(), int64_t(mask32_.size()));
  }
  Status finish(const std::string& prefix, const SftOptions& opt) {
    NB_TRY(tokens_->finalize());
    NB_TRY(mask_->finalize());
    const std::string path = prefix + "_sft_stats.json";
    std::ofstream f(path);
    f << stats_.to_json(opt);
    f.close();
    if (!f) return errorf("cannot write %s; check that its folder is writable", path.c_str());
    return Status::ok();
  }
  const SftStats& stats() const { return stats_; }

 private:
  std::unique_ptr<IndexedDatasetWriter> tokens_, mask_;
  std::vector<int32_t> mask32_;
  SftStats stats_;
};

Status run_sft(const SftPreprocessArgs& a, const SftOptions& opt, IndexedDtype* dtype, SftStats* stats) {
  std::unique_ptr<BpeTokenizer> tok;
  NB_TRY(BpeTokenizer::load(a.tokenizer, a.family, &tok));
  SftFormatter formatter;
  NB_TRY(SftFormatter::create(tok.get(), opt, &formatter).context(a.tokenizer));
  *dtype = token_dtype_for_vocab(tok->vocab_size());
  SftOutput output;
  NB_TRY(output.open(a.output_prefix, *dtype));
  LineReader reader(a.inputs);
  std::vector<Line> lines;
  std::vector<Result> results;
  for (;;) {
    NB_TRY(reader.next_round(&lines));
    if (lines.empty()) break;
    process_sft_round(formatter, reader, lines, std::max(1, a.workers), &results);
    for (const Result& r : results) {
      NB_TRY(r.status);
      NB_TRY(output.add(r));
    }
  }
  NB_TRY(output.finish(a.output_prefix, opt));
  *stats = output.stats();
  return Status::ok();
}
}  // namespace

int run_preprocess_sft(const SftPreprocessArgs& a) {
  SftOptions opt;
  opt.chat_template = a.chat_template == "plain" ? ChatTemplate::plain : ChatTemplate::llama3;
  opt.truncation = a.truncation == "drop" ? SftTruncation::drop : SftTruncation::truncate;
  opt.seq_length = a.seq_length;
  opt.add_bos = a.add_bos;
  IndexedDtype dtype = IndexedDtype::u16;
  SftStats s;
  if (Status st = run_sft(a, opt, &dtype, &s); !st) {
    // Half-written datasets would load as if complete: remove what this run wrote.
    for (const char* suffix : {"_tokens_document.bin", "_tokens_document.idx", "_mask_document.bin",
                               "_mask_document.idx", "_sft_stats.json"})
      std::remove((a.output_prefix + suffix).c_str());
    std::fprintf(stderr, "error: %s (no output was kept)\n", st.message().c_str());
    return 1;
  }
  std::printf(
      "wrote %s_{tokens,mask}_document.{bin,idx}: %lld samples written, %lld truncated (%lld with the answer cut), "
      "%lld dropped (%lld without an answer, %lld too long), %lld tokens (%s), %lld answer tokens (answer fraction "
      "%.3f); counts in %s_sft_stats.json\n",
      a.output_prefix.c_str(), (long long)s.samples, (long long)s.truncated(), (long long)s.answer_cut,
      (long long)s.dropped(), (long long)s.dropped_no_answer, (long long)s.dropped_too_long, (long long)s.tokens,
      dtype == IndexedDtype::u16 ? "uint16" : "int32", (long long)s.answer_tokens, s.answer_fraction(),
      a.output_prefix.c_str());
  return 0;
}

}  // namespace nb::cli
