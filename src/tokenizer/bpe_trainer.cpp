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
}  // namespace

// NOLINTNEXTLINE(readability-function-size): a listed offender (docs/HARDENING.md), to shrink when next changed
Status train_bpe(const std::vector<std::string>& texts, const BpeTrainOptions& opt, const std::string& out_path,
                 std::string* summary) {
  const int64_t target = opt.vocab_size - int64_t(opt.specials.size());
  if (target < 256)
    return errorf("--vocab-size %lld is too small: byte-level BPE needs 256 byte tokens plus %zu special tokens",
                  (long long)opt.vocab_size, opt.specials.size());
  std::unordered_map<std::string, int64_t> counts;
  NB_TRY(count_pieces(texts, opt.pattern, &counts));
  std::vector<std::vector<int32_t>> words;
  std::vector<int64_t> freq;
  for (const auto& [piece, c] : counts) {
    std::vector<int32_t> w;
    for (unsigned char b : piece) w.push_back(int32_t(b));
    words.push_back(std::move(w));
    freq.push_back(c);
  }
  std::vector<std::string> vocab;
  for (int b = 0; b < 256; ++b) vocab.push_back(std::string(1, char(b)));
  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<int32_t>> where;
  for (size_t w = 0; w < words.size(); ++w)
    for (size_t i = 0; i + 1 < words[w].size(); ++i) {
      uint64_t k = pair_key(words[w][i], words[w][i + 1]);
      pair_count[k] += freq[w];
      where[k].push_back(int32_t(w));
    }
  // Max-heap on (count, -key): the most frequent pair, ties to the smaller key. Stale entries are skipped.
  using Entry = std::pair<int64_t, uint64_t>;
  auto cmp = [](const Entry& a, const Entry& b) {
    return a.first != b.first ? a.first < b.first : a.second > b.second;
  };
  std::priority_queue<Entry, std::vector<Entry>, decltype(cmp)> heap(cmp);
  for (const auto& [k, c] : pair_count) heap.push({c, k});
  std::vector<std::pair<int32_t, int32_t>> merges;
  std::vector<int64_t> seen(words.size(), -1);
  while (int64_t(vocab.size()) < target && !heap.empty()) {
    auto [c, k] = heap.top();
    heap.pop();
    auto pc = pair_count.find(k);
    if (pc == pair_count.end() || pc->second != c) continue;  // stale
    if (c < opt.min_frequency) break;
    const int32_t a = int32_t(k >> 32), b = int32_t(k & 0xffffffffu), id = int32_t(vocab.size());
    vocab.push_back(vocab[size_t(a)] + vocab[size_t(b)]);
    merges.push_back({a, b});
    std::vector<int32_t> affected = std::move(where[k]);
    where.erase(k);
    std::unordered_map<uint64_t, int64_t> delta;
    for (int32_t w : affected) {
      if (seen[size_t(w)] == id) continue;
      seen[size_t(w)] = id;
      auto& sym = words[size_t(w)];
      for (size_t i = 0; i + 1 < sym.size(); ++i) delta[pair_key(sym[i], sym[i + 1])] -= freq[size_t(w)];
      std::vector<int32_t> merged;
      for (size_t i = 0; i < sym.size(); ++i) {
        if (i + 1 < sym.size() && sym[i] == a && sym[i + 1] == b) {
          merged.push_back(id);
          ++i;
        } else
          merged.push_back(sym[i]);
      }
      sym = std::move(merged);
      for (size_t i = 0; i + 1 < sym.size(); ++i) {
        uint64_t nk = pair_key(sym[i], sym[i + 1]);
        delta[nk] += freq[size_t(w)];
        if (sym[i] == id || sym[i + 1] == id) where[nk].push_back(w);
      }
    }
    for (const auto& [dk, dv] : delta) {
      if (dv == 0) continue;
      int64_t& cnt = pair_count[dk];
      cnt += dv;
      if (cnt <= 0)
        pair_count.erase(dk);
      else
        heap.push({cnt, dk});
    }
  }
  // Write the HF tokenizer.json.
  nlohmann::ordered_json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = nlohmann::ordered_json::array();
  for (size_t i = 0; i < opt.specials.size(); ++i)
    j["added_tokens"].push_back({{"id", int64_t(vocab.size() + i)},
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
  for (size_t i = 0; i < vocab.size(); ++i) model["vocab"][bytes_to_unicode_string(vocab[i])] = int64_t(i);
  model["merges"] = nlohmann::ordered_json::array();
  for (auto [a, b] : merges)
    model["merges"].push_back({bytes_to_unicode_string(vocab[size_t(a)]), bytes_to_unicode_string(vocab[size_t(b)])});
  j["model"] = std::move(model);
  std::ofstream f(out_path, std::ios::binary);
  if (!f) return errorf("cannot create %s; check that its folder exists and is writable", out_path.c_str());
  f << j.dump(1) << "\n";
  if (!f) return errorf("writing %s failed (disk full?)", out_path.c_str());
  if (summary)
    *summary = strprintf("%zu distinct pieces, %zu merges, vocabulary %zu (+%zu special)", counts.size(), merges.size(),
                         vocab.size(), opt.specials.size());
  return Status::ok();
}

}  // namespace nb
