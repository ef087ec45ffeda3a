// Rolling-window text perplexity and dataset-split perplexity (see perplexity.h).
#include "eval/perplexity.h"
#include <algorithm>
#include <cmath>
#include <limits>
#include "data/jsonl.h"
#include "eval/text_stats.h"

namespace nb::eval {
namespace {
double ratio_exp(double nll, int64_t n) {
  return n > 0 ? std::exp(nll / double(n)) : std::numeric_limits<double>::quiet_NaN();
}
}  // namespace

double PerplexityResult::token_perplexity() const { return ratio_exp(nll, tokens); }
double PerplexityResult::word_perplexity() const { return ratio_exp(nll, words); }
double PerplexityResult::byte_perplexity() const { return ratio_exp(nll, bytes); }
double PerplexityResult::bits_per_byte() const {
  return bytes > 0 ? nll / double(bytes) / std::log(2.0) : std::numeric_limits<double>::quiet_NaN();
}

std::vector<LoglikRequest> rolling_windows(const std::vector<int32_t>& tokens, int32_t prefix, int64_t max_length) {
  std::vector<LoglikRequest> out;
  const int64_t n = int64_t(tokens.size()), L = max_length;
  if (n == 0) return out;
  auto at = [&](int64_t i) { return tokens.begin() + std::ptrdiff_t(i); };
  // First window: [prefix] + tokens[:m - 1] predicts tokens[:m].
  const int64_t m = std::min(L, n);
  LoglikRequest first;
  first.input.push_back(prefix);
  first.input.insert(first.input.end(), at(0), at(m - 1));
  first.targets.assign(at(0), at(m));
  out.push_back(std::move(first));
  // Then windows of L predictions (context_len 1: pred_len = L), the input the L tokens before the
  // window's last prediction: tokens[end - L - 1 : end - 1]. Made disjoint, context + continuation[:-1]
  // is that same slice.
  for (int64_t predicted = m; predicted < n;) {
    const int64_t k = std::min(n - predicted, L), end = predicted + k;
    LoglikRequest w;
    w.input.assign(at(end - L - 1), at(end - 1));
    w.targets.assign(at(end - k), at(end));
    out.push_back(std::move(w));
    predicted += k;
  }
  return out;
}

Status read_text_documents(const std::string& path, const std::string& key, std::vector<std::string>* docs) {
  std::string text;
  NB_TRY(read_text_file(path, &text));
  docs->clear();
  const bool jsonl = path.size() >= 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0;
  if (!jsonl) {
    docs->push_back(std::move(text));
    return Status::ok();
  }
  size_t pos = 0;
  for (int64_t line_no = 1; pos < text.size(); ++line_no) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::string doc;
    Status st = jsonl_field(line, key, &doc);
    if (!st) return errorf("%s:%lld: %s", path.c_str(), (long long)line_no, st.message().c_str());
    docs->push_back(std::move(doc));
  }
  if (docs->empty()) return errorf("%s holds no documents", path.c_str());
  return Status::ok();
}

Status text_windows(const std::vector<std::string>& docs, const BpeTokenizer& tok, int64_t max_length,
                    std::vector<LoglikRequest>* windows, PerplexityResult* counts) {
  const int32_t prefix = tok.bos() >= 0 ? tok.bos() : tok.eod();
  if (prefix < 0)
    return errorf("the tokenizer has neither a BOS nor an end-of-text token to start each document's first window");
  windows->clear();
  *counts = PerplexityResult{};
  for (const std::string& d : docs) {
    std::vector<int32_t> ids;
    tok.encode_with_specials(d, &ids);
    std::vector<LoglikRequest> w = rolling_windows(ids, prefix, max_length);
    counts->windows += int64_t(w.size());
    for (auto& r : w) windows->push_back(std::move(r));
    counts->words += count_words(d);
    counts->bytes += int64_t(d.size());
    ++counts->documents;
  }
  return Status::ok();
}

Status score_windows(EvalModel& m, const std::vector<LoglikRequest>& windows, PerplexityResult* r) {
  return sum_nll(m, windows, &r->nll, &r->tokens);
}

Status dataset_perplexity(EvalModel& m, const SampleSet& set, int64_t samples, PerplexityResult* r) {
  *r = PerplexityResult{};
  if (samples < 1 || samples > set.size())
    return errorf("asked for %lld samples of a split that has %lld", (long long)samples, (long long)set.size());
  // One micro-batch's samples at a time, as requests (input = sample[:-1], targets the same shifted).
  std::vector<int32_t> s;
  for (int64_t first = 0; first < samples; first += m.shape.batch) {
    std::vector<LoglikRequest> batch;
    for (int64_t i = first; i < std::min(samples, first + m.shape.batch); ++i) {
      set.sample(i, &s);
      LoglikRequest q;
      q.input.assign(s.begin(), s.end() - 1);
      q.targets.assign(s.begin() + 1, s.end());
      batch.push_back(std::move(q));
    }
    NB_TRY(check_request_tokens(batch, m.model->config().vocab, "the dataset"));
    double nll = 0;
    int64_t n = 0;
    NB_TRY(sum_nll(m, batch, &nll, &n));
    r->nll += nll;
    r->tokens += n;
  }
  r->documents = samples;
  r->windows = samples;
  return Status::ok();
}

}  // namespace nb::eval
