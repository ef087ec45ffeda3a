// Multiple-choice task files, the harness's request encoding, predictions and metrics (see tasks.h).
#include "eval/tasks.h"
#include <cmath>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include "eval/text_stats.h"

namespace nb::eval {
namespace {

// One JSONL line into a document; the message names what is wrong (the caller adds file:line).
Status parse_doc(const std::string& line, McDoc* d) {
  const auto j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded()) return errorf("not valid JSON");
  if (!j.is_object()) return errorf("not a JSON object");
  auto ctx = j.find("context");
  if (ctx == j.end() || !ctx->is_string()) return errorf("\"context\" must be a string");
  d->context = ctx->get<std::string>();
  auto ch = j.find("choices");
  if (ch == j.end() || !ch->is_array() || ch->empty()) return errorf("\"choices\" must be a non-empty list of strings");
  d->choices.clear();
  for (const auto& c : *ch) {
    if (!c.is_string()) return errorf("\"choices\" must be a non-empty list of strings");
    d->choices.push_back(c.get<std::string>());
  }
  auto lab = j.find("label");
  if (lab == j.end() || !lab->is_number_integer()) return errorf("\"label\" must be an integer (the answer's index)");
  d->label =
      lab->is_number_unsigned() ? int64_t(std::min<uint64_t>(lab->get<uint64_t>(), INT64_MAX)) : lab->get<int64_t>();
  if (d->label < 0 || d->label >= int64_t(d->choices.size()))
    return errorf("label %lld is out of range for %zu choices (0 to %zu)", (long long)d->label, d->choices.size(),
                  d->choices.size() - 1);
  return Status::ok();
}

// argmax of lls[c] / len[c] over the choices, first of equals (numpy's argmax); len == nullptr: 1.
int64_t argmax(const double* lls, const std::vector<double>* len, size_t n) {
  size_t best = 0;
  auto score = [&](size_t c) { return len ? lls[c] / (*len)[c] : lls[c]; };
  for (size_t c = 1; c < n; ++c)
    if (score(c) > score(best)) best = c;
  return int64_t(best);
}

// The harness's mean_stderr of 0/1 scores with mean p: sqrt(p (1 - p) / (n - 1)).
double stderr_of(double p, int64_t n) {
  return n < 2 ? std::numeric_limits<double>::quiet_NaN() : std::sqrt(p * (1 - p) / double(n - 1));
}

}  // namespace

Status parse_mc_task(const std::string& text, const std::string& where, McTask* out) {
  out->docs.clear();
  size_t pos = 0;
  for (int64_t line_no = 1; pos < text.size(); ++line_no) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;  // blank lines are skipped
    McDoc d;
    d.line = line_no;
    Status st = parse_doc(line, &d);
    if (!st) return errorf("%s:%lld: %s", where.c_str(), (long long)line_no, st.message().c_str());
    out->docs.push_back(std::move(d));
  }
  if (out->docs.empty()) return errorf("%s holds no documents (one JSON object per line)", where.c_str());
  return Status::ok();
}

Status read_mc_task(const std::string& path, McTask* out) {
  std::string text;
  NB_TRY(read_text_file(path, &text));
  out->path = path;
  out->name = std::filesystem::path(path).stem().string();
  return parse_mc_task(text, path, out);
}

int32_t TaskEncoder::prefix_token() const { return tok->bos() >= 0 ? tok->bos() : tok->eod(); }

std::vector<int32_t> TaskEncoder::encode(const std::string& text, bool special) const {
  std::vector<int32_t> ids;
  if (special && add_bos && tok->bos() >= 0) {
    std::string bos_text;
    for (const SpecialToken& s : tok->specials())
      if (s.id == tok->bos()) bos_text = s.text;
    if (bos_text.empty() || text.compare(0, bos_text.size(), bos_text) != 0) ids.push_back(tok->bos());
  }
  tok->encode_with_specials(text, &ids);
  return ids;
}

Status TaskEncoder::encode_pair(const std::string& context, const std::string& continuation, std::vector<int32_t>* ctx,
                                std::vector<int32_t>* cont) const {
  if (context.empty()) {  // the harness conditions on its prefix token
    *cont = encode(continuation, false);
    const int32_t p = prefix_token();
    if (p < 0) return errorf("the context is empty and the tokenizer has no BOS or end-of-text token to start from");
    *ctx = {p};
    if (!cont->empty() && (*cont)[0] == p) cont->erase(cont->begin());  // the text starts with it already
  } else {
    const size_t n = size_t(trailing_space_bytes(context));
    const std::string c = context.substr(0, context.size() - n);
    const std::vector<int32_t> whole = encode(c + context.substr(context.size() - n) + continuation, true);
    *ctx = encode(c, true);
    cont->assign(whole.begin() + std::ptrdiff_t(std::min(ctx->size(), whole.size())), whole.end());
  }
  if (ctx->empty())
    return errorf("the context is only whitespace and the tokenizer adds no BOS: nothing to condition on");
  if (cont->empty()) return errorf("the continuation encodes to no tokens of its own");
  if (int64_t(cont->size()) > max_length)
    return errorf("the continuation is %zu tokens, more than the maximum length %lld", cont->size(),
                  (long long)max_length);
  return Status::ok();
}

Status build_mc_requests(const McTask& task, const TaskEncoder& enc, std::vector<LoglikRequest>* reqs,
                         std::vector<size_t>* first) {
  reqs->clear();
  first->clear();
  for (const McDoc& d : task.docs) {
    first->push_back(reqs->size());
    for (size_t c = 0; c < d.choices.size(); ++c) {
      std::vector<int32_t> ctx, cont;
      Status st = enc.encode_pair(d.context, enc.target_delimiter + d.choices[c], &ctx, &cont);
      if (!st) return errorf("%s:%lld, choice %zu: %s", task.path.c_str(), (long long)d.line, c, st.message().c_str());
      // The harness's (context_enc + continuation_enc)[-(max_length + 1):][:-1].
      std::vector<int32_t> full = std::move(ctx);
      full.insert(full.end(), cont.begin(), cont.end());
      const size_t keep = std::min(full.size(), size_t(enc.max_length + 1));
      LoglikRequest r;
      r.input.assign(full.end() - std::ptrdiff_t(keep), full.end() - 1);
      r.targets = std::move(cont);
      reqs->push_back(std::move(r));
    }
  }
  return Status::ok();
}

McPrediction predict(const McDoc& doc, const double* lls) {
  std::vector<double> chars, bytes;
  for (const std::string& c : doc.choices) {
    chars.push_back(double(count_code_points(c)));
    bytes.push_back(double(c.size()));
  }
  const size_t n = doc.choices.size();
  return {argmax(lls, nullptr, n), argmax(lls, &chars, n), argmax(lls, &bytes, n)};
}

McMetrics mc_metrics(const McTask& task, const std::vector<double>& lls, const std::vector<size_t>& first) {
  McMetrics m;
  m.n = int64_t(task.docs.size());
  for (size_t i = 0; i < task.docs.size(); ++i) {
    const McPrediction p = predict(task.docs[i], lls.data() + first[i]);
    m.acc += p.pred == task.docs[i].label ? 1 : 0;
    m.acc_norm += p.pred_norm == task.docs[i].label ? 1 : 0;
    m.acc_bytes += p.pred_bytes == task.docs[i].label ? 1 : 0;
  }
  if (m.n > 0) {
    m.acc /= double(m.n);
    m.acc_norm /= double(m.n);
    m.acc_bytes /= double(m.n);
  }
  m.acc_stderr = stderr_of(m.acc, m.n);
  m.acc_norm_stderr = stderr_of(m.acc_norm, m.n);
  m.acc_bytes_stderr = stderr_of(m.acc_bytes, m.n);
  return m;
}

}  // namespace nb::eval
