// Megatron's pipeline layout string (model/pipeline_layout.h): repeats unrolled as Megatron's two substitutions do
// (groups first, then single letters), then each '|'-separated stage counted.
#include "model/pipeline_layout.h"
#include <algorithm>
#include <cctype>

namespace nb::pp {

namespace {

constexpr const char* kFlag = "--pipeline-model-parallel-layout";
// No model has a million layers; a bound keeps a mistyped count from filling memory.
constexpr int64_t kMaxUnrolled = int64_t(1) << 20;

// The count of a repeat: "*n" at text[at], n >= 1; *next is the position after it.
Status read_count(const std::string& layout, const std::string& text, size_t at, int64_t* n, size_t* next) {
  if (at >= text.size() || text[at] != '*')
    return errorf("%s \"%s\": a group \"(...)\" must be followed by its count, as \"(tt|)*4\"", kFlag, layout.c_str());
  size_t end = at + 1;
  int64_t v = 0;
  while (end < text.size() && std::isdigit(static_cast<unsigned char>(text[end])) && v <= kMaxUnrolled)
    v = v * 10 + (text[end++] - '0');
  if (end == at + 1) return errorf("%s \"%s\": '*' must be followed by a count, as \"t*3\"", kFlag, layout.c_str());
  if (v < 1 || v > kMaxUnrolled)
    return errorf("%s \"%s\": a repeat's count must be from 1 to %lld; got %s", kFlag, layout.c_str(),
                  (long long)kMaxUnrolled, text.substr(at + 1, end - at - 1).c_str());
  *n = v;
  *next = end;
  return Status::ok();
}

Status append_repeated(const std::string& layout, const std::string& part, int64_t n, std::string* out) {
  if (int64_t(out->size()) + int64_t(part.size()) * n > kMaxUnrolled)
    return errorf("%s \"%s\" unrolls to more than %lld letters; no model has that many layers", kFlag, layout.c_str(),
                  (long long)kMaxUnrolled);
  for (int64_t i = 0; i < n; ++i) *out += part;
  return Status::ok();
}

// "(ab|)*2" -> "ab|ab|" (Megatron's first substitution; groups do not nest).
Status unroll_groups(const std::string& layout, const std::string& text, std::string* out) {
  for (size_t i = 0; i < text.size();) {
    if (text[i] == ')') return errorf("%s \"%s\": ')' without its '('", kFlag, layout.c_str());
    if (text[i] != '(') {
      *out += text[i++];
      continue;
    }
    const size_t close = text.find(')', i + 1);
    if (close == std::string::npos) return errorf("%s \"%s\": '(' without its ')'", kFlag, layout.c_str());
    const std::string group = text.substr(i + 1, close - i - 1);
    if (group.find('(') != std::string::npos)
      return errorf("%s \"%s\": groups do not nest (as in Megatron); write the inner group out", kFlag, layout.c_str());
    if (group.empty()) return errorf("%s \"%s\": an empty group \"()\"", kFlag, layout.c_str());
    int64_t n = 0;
    NB_TRY(read_count(layout, text, close + 1, &n, &i));
    NB_TRY(append_repeated(layout, group, n, out));
  }
  return Status::ok();
}

// "t*3" -> "ttt", "|*2" -> "||" (Megatron's second substitution: the one character before '*').
Status unroll_letters(const std::string& layout, const std::string& text, std::string* out) {
  for (size_t i = 0; i < text.size();) {
    if (text[i] != '*') {
      *out += text[i++];
      continue;
    }
    if (out->empty())
      return errorf("%s \"%s\": '*' must follow the letter it repeats, as \"t*3\"", kFlag, layout.c_str());
    const std::string last(1, out->back());
    out->pop_back();
    int64_t n = 0;
    NB_TRY(read_count(layout, text, i, &n, &i));
    NB_TRY(append_repeated(layout, last, n, out));
  }
  return Status::ok();
}

Status count_stage_letter(const std::string& layout, char ch, bool at_stage_start, LayoutStage* stage) {
  switch (ch) {
    case 't': ++stage->decoder_layers; return Status::ok();
    case 'E':
      if (!at_stage_start)
        return errorf("%s \"%s\": the embedding 'E' must open the first stage", kFlag, layout.c_str());
      stage->embedding = true;
      return Status::ok();
    case 'L': stage->loss = true; return Status::ok();
    case 'm':
      return errorf("%s \"%s\": 'm' is a multi-token-prediction layer, which nibble's Llama models do not have", kFlag,
                    layout.c_str());
    default:
      return errorf(
          "%s \"%s\": '%c' names no layer; use 'E' (embedding), 't' (decoder layer), 'L' (loss) and '|' "
          "between stages",
          kFlag, layout.c_str(), ch);
  }
}

// Exactly one 'E', opening stage 0, and one 'L', closing the last stage (nibble builds the embedding on the first
// virtual stage and the head on the last, as Megatron's pre_process / post_process do).
Status check_ends(const std::string& layout, const std::string& flat, const std::vector<LayoutStage>& stages) {
  const auto count = [&](char ch) { return std::count(flat.begin(), flat.end(), ch); };
  if (count('E') != 1 || !stages.front().embedding)
    return errorf("%s \"%s\": the embedding 'E' must be given once, opening the first stage", kFlag, layout.c_str());
  if (count('L') != 1 || !stages.back().loss || flat.back() != 'L')
    return errorf("%s \"%s\": the loss 'L' must be given once, closing the last stage", kFlag, layout.c_str());
  return Status::ok();
}

}  // namespace

Status parse_pipeline_layout(const std::string& layout, std::vector<LayoutStage>* stages) {
  std::string text;
  for (const char ch : layout)
    if (ch != ',') text += ch;
  if (text.empty()) return errorf("%s is empty; leave it out for an even split", kFlag);
  std::string grouped, flat;
  NB_TRY(unroll_groups(layout, text, &grouped));
  NB_TRY(unroll_letters(layout, grouped, &flat));
  stages->assign(1, LayoutStage{});
  bool at_stage_start = true;
  for (const char ch : flat) {
    if (ch == '|') {
      stages->emplace_back();
      at_stage_start = true;
      continue;
    }
    if (stages->back().loss) return errorf("%s \"%s\": the loss 'L' must close the last stage", kFlag, layout.c_str());
    NB_TRY(count_stage_letter(layout, ch, at_stage_start && stages->size() == 1, &stages->back()));
    at_stage_start = false;
  }
  return check_ends(layout, flat, *stages);
}

}  // namespace nb::pp
