// Byte-level BPE training (`nibble tokenizer train`): pre-split with the model regex, count pieces,
// then repeatedly merge the most frequent adjacent pair (ties: the smaller pair of ids, so training is
// deterministic). Pair counts are updated incrementally per affected word. Output: HF tokenizer.json
// with ids 0..255 = single bytes in byte order, then merges in order, then the special tokens.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>
#include "tokenizer/bpe_tokenizer.h"

namespace nb {

namespace {
Status count_pieces(const std::vector<std::string>& texts, const std::string& pattern,
                    std::unordered_map<std::string, int64_t>* counts) {
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &off, nullptr);
  if (!code) return errorf("the pre-tokenization regex does not compile at offset %zu", size_t(off));
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
  for (const auto& text : texts) {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t pos = 0, covered = 0;
    while (pos < text.size()) {
      if (pcre2_match(code, subject, text.size(), pos, 0, md, nullptr) < 0) break;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      if (ov[0] > covered) ++(*counts)[text.substr(covered, ov[0] - covered)];
      if (ov[1] > ov[0]) ++(*counts)[text.substr(ov[0], ov[1] - ov[0])];
      covered = ov[1];
      pos = ov[1] > ov[0] ? ov[1] : ov[1] + 1;
    }
    if (covered < text.size()) ++(*counts)[text.substr(covered)];
  }
  pcre2_match_data_free(md);
  pcre2_code_free(code);
  return Status::ok();
}

uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

// Max-heap order on (count, key): the most frequent pair first, ties to the smaller key (deterministic training).
using HeapEntry = std::pair<int64_t, uint64_t>;
struct MoreFrequentFirst {
  bool operator()(const HeapEntry& a, const HeapEntry& b) const {
    return a.first != b.first ? a.first < b.first : a.second > b.second;
  }
};

// The training state: every distinct piece as a symbol sequence with its count, the vocabulary and merges so far,
// and the live pair counts with the words that hold each pair.
struct BpeState {
  std::vector<std::vector<int32_t>> words;
  std::vector<int64_t> freq;
  std::vector<std::string> vocab;  // token id -> bytes
  std::vector<std::pair<int32_t, int32_t>> merges;
  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<int32_t>> where;
  // Stale entries (a count that has since changed) are skipped when popped.
  std::priority_queue<HeapEntry, std::vector<HeapEntry>, MoreFrequentFirst> heap;
  std::vector<int64_t> seen;  // per word: the last merge that rewrote it, so a word listed twice is rewritten once
};

// One merge: the pair (a, b) becomes token `id`.
struct Merge {
  int32_t a, b, id;
};

// Every piece starts as its bytes and the vocabulary as the 256 single bytes; then every adjacent pair is counted.
void start_training(const std::unordered_map<std::string, int64_t>& counts, BpeState* s) {
  for (const auto& [piece, c] : counts) {
    std::vector<int32_t> w;
    for (unsigned char b : piece) w.push_back(int32_t(b));
    s->words.push_back(std::move(w));
    s->freq.push_back(c);
  }
  for (int b = 0; b < 256; ++b) s->vocab.push_back(std::string(1, char(b)));
  for (size_t w = 0; w < s->words.size(); ++w)
    for (size_t i = 0; i + 1 < s->words[w].size(); ++i) {
      uint64_t k = pair_key(s->words[w][i], s->words[w][i + 1]);
      s->pair_count[k] += s->freq[w];
      s->where[k].push_back(int32_t(w));
    }
  for (const auto& [k, c] : s->pair_count) s->heap.push({c, k});
  s->seen.assign(s->words.size(), -1);
}

// Rewrites word `w` with the merge applied, adding its pair-count changes to `delta`; it is indexed under its new
// pairs.
void rewrite_word(BpeState* s, int32_t w, const Merge& m, std::unordered_map<uint64_t, int64_t>* delta) {
  auto& sym = s->words[size_t(w)];
  for (size_t i = 0; i + 1 < sym.size(); ++i) (*delta)[pair_key(sym[i], sym[i + 1])] -= s->freq[size_t(w)];
  std::vector<int32_t> merged;
  for (size_t i = 0; i < sym.size(); ++i) {
    if (i + 1 < sym.size() && sym[i] == m.a && sym[i + 1] == m.b) {
      merged.push_back(m.id);
      ++i;
    } else
      merged.push_back(sym[i]);
  }
  sym = std::move(merged);
  for (size_t i = 0; i + 1 < sym.size(); ++i) {
    uint64_t nk = pair_key(sym[i], sym[i + 1]);
    (*delta)[nk] += s->freq[size_t(w)];
    if (sym[i] == m.id || sym[i + 1] == m.id) s->where[nk].push_back(w);
  }
}

// Adds the merged token and rewrites every word holding pair `k`; pair counts change by difference, and each
// changed count is queued again.
void apply_merge(BpeState* s, uint64_t k) {
  const Merge m{int32_t(k >> 32), int32_t(k & 0xffffffffu), int32_t(s->vocab.size())};
  s->vocab.push_back(s->vocab[size_t(m.a)] + s->vocab[size_t(m.b)]);
  s->merges.push_back({m.a, m.b});
  std::vector<int32_t> affected = std::move(s->where[k]);
  s->where.erase(k);
  std::unordered_map<uint64_t, int64_t> delta;
  for (int32_t w : affected) {
    if (s->seen[size_t(w)] == m.id) continue;
    s->seen[size_t(w)] = m.id;
    rewrite_word(s, w, m, &delta);
  }
  for (const auto& [dk, dv] : delta) {
    if (dv == 0) continue;
    int64_t& cnt = s->pair_count[dk];
    cnt += dv;
    if (cnt <= 0)
      s->pair_count.erase(dk);
    else
      s->heap.push({cnt, dk});
  }
}

// Merges the most frequent pair until the vocabulary reaches `target` or no pair is left with `min_frequency`.
void run_merges(BpeState* s, int64_t target, int64_t min_frequency) {
  while (int64_t(s->vocab.size()) < target && !s->heap.empty()) {
    auto [c, k] = s->heap.top();
    s->heap.pop();
    auto pc = s->pair_count.find(k);
    if (pc == s->pair_count.end() || pc->second != c) continue;  // stale
    if (c < min_frequency) break;
    apply_merge(s, k);
  }
}

// The HF "model" section: byte-level BPE with the vocabulary by id and the merges in training order.
nlohmann::ordered_json hf_bpe_model(const BpeState& s) {
  nlohmann::ordered_json model;
  model["type"] = "BPE";
  model["dropout"] = nullptr;
  model["unk_token"] = nullptr;
  model["continuing_subword_prefix"] = nullptr;
  model["end_of_word_suffix"] = nullptr;
  model["fuse_unk"] = false;
  model["byte_fallback"] = false;
  model["ignore_merges"] = false;
  model["vocab"] = nlohmann::ordered_json::object();
  for (size_t i = 0; i < s.vocab.size(); ++i) model["vocab"][bytes_to_unicode_string(s.vocab[i])] = int64_t(i);
  model["merges"] = nlohmann::ordered_json::array();
  for (auto [a, b] : s.merges)
    model["merges"].push_back(
        {bytes_to_unicode_string(s.vocab[size_t(a)]), bytes_to_unicode_string(s.vocab[size_t(b)])});
  return model;
}

// The whole HF tokenizer.json: the special tokens after the vocabulary, the Split + ByteLevel pre-tokenizer with
// the training regex, the ByteLevel decoder, then the model.
nlohmann::ordered_json hf_tokenizer_json(const BpeTrainOptions& opt, const BpeState& s) {
  nlohmann::ordered_json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = nlohmann::ordered_json::array();
  for (size_t i = 0; i < opt.specials.size(); ++i)
    j["added_tokens"].push_back({{"id", int64_t(s.vocab.size() + i)},
                                 {"content", opt.specials[i]},
                                 {"single_word", false},
                                 {"lstrip", false},
                                 {"rstrip", false},
                                 {"normalized", false},
                                 {"special", true}});
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", opt.pattern}}}, {"behavior", "Isolated"}, {"invert", false}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}};
  j["post_processor"] = nullptr;
  j["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  j["model"] = hf_bpe_model(s);
  return j;
}

// Writes `j` with one-space indents and a final newline.
Status write_json_file(const std::string& out_path, const nlohmann::ordered_json& j) {
  std::ofstream f(out_path, std::ios::binary);
  if (!f) return errorf("cannot create %s; check that its folder exists and is writable", out_path.c_str());
  f << j.dump(1) << "\n";
  if (!f) return errorf("writing %s failed (disk full?)", out_path.c_str());
  return Status::ok();
}
}  // namespace

Status train_bpe(const std::vector<std::string>& texts, const BpeTrainOptions& opt, const std::string& out_path,
                 std::string* summary) {
  const int64_t target = opt.vocab_size - int64_t(opt.specials.size());
  if (target < 256)
    return errorf("--vocab-size %lld is too small: byte-level BPE needs 256 byte tokens plus %zu special tokens",
                  (long long)opt.vocab_size, opt.specials.size());
  std::unordered_map<std::string, int64_t> counts;
  NB_TRY(count_pieces(texts, opt.pattern, &counts));
  BpeState s;
  start_training(counts, &s);
  run_merges(&s, target, opt.min_frequency);
  NB_TRY(write_json_file(out_path, hf_tokenizer_json(opt, s)));
  if (summary)
    *summary = strprintf("%zu distinct pieces, %zu merges, vocabulary %zu (+%zu special)", counts.size(),
                         s.merges.size(), s.vocab.size(), opt.specials.size());
  return Status::ok();
}

}  // namespace nb
