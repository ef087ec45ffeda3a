// SFT samples: JSONL parsing (nlohmann-json without exceptions: a malformed line is data, not a bug),
// the Llama 3 Instruct and plain templates with their answer masks, truncation and the counts.
#include "data/sft.h"
#include <algorithm>
#include <type_traits>
#include <nlohmann/json.hpp>

namespace nb {

namespace {
const char* const kShapes =
    "each line must be {\"input\": \"...\", \"output\": \"...\"} or "
    "{\"messages\": [{\"role\": \"system|user|assistant\", \"content\": \"...\"}, ...]}";

Status bad_line(const std::string& where, const std::string& what) {
  return errorf("%s: %s; %s", where.c_str(), what.c_str(), kShapes);
}

Status parse_messages(const nlohmann::json& msgs, const std::string& where, SftSample* out) {
  if (!msgs.is_array() || msgs.empty()) return bad_line(where, "\"messages\" is not a non-empty array");
  for (size_t i = 0; i < msgs.size(); ++i) {
    const auto& m = msgs[i];
    const auto role = m.is_object() ? m.find("role") : m.end();
    const auto content = m.is_object() ? m.find("content") : m.end();
    const bool ok = m.is_object() && role != m.end() && role->is_string() && content != m.end() && content->is_string();
    const std::string r = ok ? role->get<std::string>() : "";
    if (!ok || (r != "system" && r != "user" && r != "assistant"))
      return bad_line(where,
                      strprintf("messages[%zu] needs a role of system, user or assistant and a string content", i));
    out->push_back({r, content->get<std::string>()});
  }
  return Status::ok();
}

// Llama 3's chat template trims every message (`message['content'] | trim`), as Jinja does.
std::string trimmed(const std::string& s) {
  const char* ws = " \t\n\r\v\f";
  const size_t a = s.find_first_not_of(ws);
  if (a == std::string::npos) return {};
  return s.substr(a, s.find_last_not_of(ws) - a + 1);
}

int32_t special_id(const BpeTokenizer& tok, const char* text) {
  for (const auto& s : tok.specials())
    if (s.text == text) return s.id;
  return -1;
}
}  // namespace

Status parse_sft_sample(const std::string& line, const std::string& where, SftSample* out) {
  out->clear();
  const auto j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded()) return bad_line(where, "not valid JSON");
  if (!j.is_object()) return bad_line(where, "not a JSON object");
  const auto msgs = j.find("messages"), in = j.find("input"), outp = j.find("output");
  if (msgs != j.end() && (in != j.end() || outp != j.end()))
    return bad_line(where, "both \"messages\" and \"input\"/\"output\" are present, so the shape is ambiguous");
  if (msgs != j.end()) return parse_messages(*msgs, where, out);
  if (in == j.end() || outp == j.end() || !in->is_string() || !outp->is_string())
    return bad_line(where, "no string fields \"input\" and \"output\" and no \"messages\"");
  out->push_back({"user", in->get<std::string>()});
  out->push_back({"assistant", outp->get<std::string>()});
  return Status::ok();
}

int64_t SftTokens::answer_tokens() const { return std::count(mask.begin(), mask.end(), uint8_t(1)); }

SftOutcome truncate_sft(SftTokens* s, int64_t seq_length, SftTruncation mode, int64_t keep_head) {
  const int64_t n = seq_length, len = int64_t(s->tokens.size());
  if (len <= n) return SftOutcome::kept;
  if (mode == SftTruncation::drop) return SftOutcome::dropped_too_long;
  const int64_t p = std::find(s->mask.begin(), s->mask.end(), uint8_t(1)) - s->mask.begin();
  const int64_t a = len - p;
  NB_CHECK(a > 0, "truncate_sft needs a sample with an answer token");
  // The whole answer if the prompt can still keep a quarter of the window, else the prompt keeps that
  // quarter (its end: the question and the assistant header) and the answer its beginning.
  const int64_t kp = std::min(p, std::max(n - a, n / 4));
  const int64_t head = std::min(keep_head, kp), tail = kp - head;
  auto cut = [&](auto& v) {
    using V = std::remove_reference_t<decltype(v)>;
    V kept(v.begin(), v.begin() + head);
    kept.insert(kept.end(), v.begin() + (p - tail), v.begin() + p);
    kept.insert(kept.end(), v.begin() + p, v.begin() + p + (n - kp));
    v = std::move(kept);
  };
  cut(s->tokens);
  cut(s->mask);
  return n - kp < a ? SftOutcome::answer_cut : SftOutcome::prompt_cut;
}

Status SftFormatter::create(const BpeTokenizer* tok, const SftOptions& opt, SftFormatter* out) {
  if (opt.seq_length < 1)
    return errorf("--seq-length is %lld; SFT needs the longest sample length in tokens, e.g. --seq-length 4096",
                  (long long)opt.seq_length);
  out->tok_ = tok;
  out->opt_ = opt;
  if (opt.chat_template == ChatTemplate::llama3) {
    out->begin_ = special_id(*tok, "<|begin_of_text|>");
    out->start_header_ = special_id(*tok, "<|start_header_id|>");
    out->end_header_ = special_id(*tok, "<|end_header_id|>");
    out->eot_ = special_id(*tok, "<|eot_id|>");
    if (std::min({out->begin_, out->start_header_, out->end_header_, out->eot_}) < 0)
      return errorf(
          "the tokenizer lacks the Llama 3 special tokens <|begin_of_text|>, <|start_header_id|>, "
          "<|end_header_id|> and <|eot_id|> that --chat-template llama3 needs; use a Llama 3 tokenizer or "
          "--chat-template plain");
    return Status::ok();
  }
  if (tok->eod() < 0)
    return errorf(
        "the tokenizer has no end-of-document token, which --chat-template plain appends to every "
        "sample; use a tokenizer with one (<|endoftext|>, <|end_of_text|>, </s>)");
  if (opt.add_bos && tok->bos() < 0)
    return errorf("--add-bos: the tokenizer has no beginning-of-text token; leave out --add-bos");
  return Status::ok();
}

void SftFormatter::add_text(const std::string& text, uint8_t mask, bool content, SftTokens* out) const {
  const size_t before = out->tokens.size();
  tok_->encode(text, &out->tokens);
  const size_t added = out->tokens.size() - before;
  out->mask.insert(out->mask.end(), added, mask);
  if (content && mask) out->answer_content += int64_t(added);
}

void SftFormatter::format_llama3(const SftSample& sample, SftTokens* out) const {
  auto special = [&](int32_t id, uint8_t mask) {
    out->tokens.push_back(id);
    out->mask.push_back(mask);
  };
  special(begin_, 0);
  for (const auto& m : sample) {
    const uint8_t answer = m.role == "assistant" ? 1 : 0;
    special(start_header_, 0);
    add_text(m.role, 0, false, out);
    special(end_header_, 0);
    add_text("\n\n", 0, false, out);
    add_text(trimmed(m.content), answer, true, out);
    special(eot_, answer);  // the model learns to stop after an answer
  }
}

void SftFormatter::format_plain(const SftSample& sample, SftTokens* out) const {
  if (opt_.add_bos) {
    out->tokens.push_back(tok_->bos());
    out->mask.push_back(0);
  }
  for (const auto& m : sample) add_text(m.content, m.role == "assistant" ? 1 : 0, true, out);
  out->tokens.push_back(tok_->eod());
  out->mask.push_back(1);
}

void SftFormatter::format(const SftSample& sample, SftTokens* out) const {
  out->tokens.clear();
  out->mask.clear();
  out->answer_content = 0;
  if (opt_.chat_template == ChatTemplate::llama3)
    format_llama3(sample, out);
  else
    format_plain(sample, out);
}

SftOutcome SftFormatter::process(const SftSample& sample, SftTokens* out) const {
  format(sample, out);
  if (out->answer_content == 0) return SftOutcome::dropped_no_answer;
  const bool head = opt_.chat_template == ChatTemplate::llama3 || opt_.add_bos;
  return truncate_sft(out, opt_.seq_length, opt_.truncation, head ? 1 : 0);
}

void SftStats::add(SftOutcome outcome, const SftTokens& t) {
  switch (outcome) {
    case SftOutcome::dropped_no_answer: ++dropped_no_answer; return;
    case SftOutcome::dropped_too_long: ++dropped_too_long; return;
    case SftOutcome::prompt_cut: ++prompt_cut; break;
    case SftOutcome::answer_cut: ++answer_cut; break;
    case SftOutcome::kept: break;
  }
  ++samples;
  tokens += int64_t(t.tokens.size());
  answer_tokens += t.answer_tokens();
}

std::string SftStats::to_json(const SftOptions& opt) const {
  nlohmann::ordered_json j;
  j["samples"] = samples;
  j["samples_truncated"] = truncated();
  j["samples_answer_cut"] = answer_cut;
  j["samples_dropped"] = dropped();
  j["samples_dropped_no_answer"] = dropped_no_answer;
  j["samples_dropped_too_long"] = dropped_too_long;
  j["tokens"] = tokens;
  j["answer_tokens"] = answer_tokens;
  j["answer_fraction"] = answer_fraction();
  j["seq_length"] = opt.seq_length;
  j["chat_template"] = opt.chat_template == ChatTemplate::llama3 ? "llama3" : "plain";
  j["truncation"] = opt.truncation == SftTruncation::drop ? "drop" : "truncate";
  return j.dump(2) + "\n";
}

}  // namespace nb
