// Byte-level BPE encode/decode (see bpe_tokenizer.h); the file loaders are bpe_loaders.cpp.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <algorithm>
#include "tokenizer/bpe_tokenizer.h"

#include <pcre2.h>

#include <atomic>
#include <cstring>
#include <limits>

namespace nb {

const char* const kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* const kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::atomic<uint64_t> BpeTokenizer::next_instance_id_{1};

namespace {
constexpr uint32_t kNoRank = std::numeric_limits<uint32_t>::max();

inline uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h ^ (h >> 29);
}

// GPT-2 bytes_to_unicode: printable Latin-1 bytes map to themselves, the other 68 to U+0100.. in order.
struct ByteAlphabet {
  uint32_t byte_to_cp[256];
  std::unordered_map<uint32_t, uint8_t> cp_to_byte;
  ByteAlphabet() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      byte_to_cp[b] = printable ? uint32_t(b) : uint32_t(256 + n++);
      cp_to_byte[byte_to_cp[b]] = uint8_t(b);
    }
  }
};
const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

void append_utf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(char(cp));
  } else if (cp < 0x800) {
    out->push_back(char(0xC0 | (cp >> 6)));
    out->push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(char(0xE0 | (cp >> 12)));
    out->push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(char(0x80 | (cp & 0x3F)));
  }
}

}  // namespace

std::string bytes_to_unicode_string(std::string_view bytes) {
  std::string out;
  for (unsigned char b : bytes) append_utf8(alphabet().byte_to_cp[b], &out);
  return out;
}

bool unicode_string_to_bytes(std::string_view s, std::string* out) {
  out->clear();
  for (size_t i = 0; i < s.size();) {
    unsigned char c = s[i];
    uint32_t cp;
    int n;
    if (c < 0x80) {
      cp = c;
      n = 1;
    } else if ((c & 0xE0) == 0xC0) {
      cp = c & 0x1F;
      n = 2;
    } else if ((c & 0xF0) == 0xE0) {
      cp = c & 0x0F;
      n = 3;
    } else
      return false;
    if (i + n > s.size()) return false;
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (uint8_t(s[i + k]) & 0x3F);
    auto it = alphabet().cp_to_byte.find(cp);
    if (it == alphabet().cp_to_byte.end()) return false;
    out->push_back(char(it->second));
    i += n;
  }
  return true;
}

BpeTokenizer::~BpeTokenizer() {
  if (code_) pcre2_code_free(static_cast<pcre2_code*>(code_));
}

Status BpeTokenizer::finish(const std::string& where) {
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern_.c_str()), PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &off, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    return errorf("%s: the pre-tokenization regex does not compile at offset %zu: %s", where.c_str(), size_t(off),
                  (const char*)msg);
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if JIT is unavailable
  code_ = code;
  size_t cap = 16;
  while (cap < 2 * bytes_to_id_.size()) cap *= 2;
  std::vector<Slot> slots(cap, Slot{0, 0, 0, -1});
  arena_.clear();
  for (const auto& [key, id] : bytes_to_id_) {
    const uint64_t h = fnv1a(key);
    uint64_t i = h & (cap - 1);
    while (slots[i].id >= 0) i = (i + 1) & (cap - 1);
    slots[i] = Slot{h, uint32_t(arena_.size()), uint32_t(key.size()), id};
    arena_ += key;
  }
  slot_mask_ = cap - 1;
  slots_ = std::move(slots);
  for (int b = 0; b < 256; ++b)
    if (lookup(std::string(1, char(b))) < 0)
      return errorf("%s: byte 0x%02x has no token; a byte-level BPE vocabulary must contain all 256 bytes",
                    where.c_str(), b);
  for (const auto& s : specials_) {
    if (s.id >= int32_t(id_to_bytes_.size())) id_to_bytes_.resize(size_t(s.id) + 1);
    id_to_bytes_[size_t(s.id)] = s.text;
  }
  for (const char* name : {"<|begin_of_text|>", "<s>", "<bos>"})
    if (bos_ < 0)
      for (const auto& s : specials_)
        if (s.text == name) bos_ = s.id;
  for (const char* name : {"<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>"})
    if (eod_ < 0)
      for (const auto& s : specials_)
        if (s.text == name) eod_ = s.id;
  return Status::ok();
}

int32_t BpeTokenizer::lookup(std::string_view bytes) const {
  if (slots_.empty()) {  // still loading
    auto it = bytes_to_id_.find(bytes);
    return it == bytes_to_id_.end() ? -1 : it->second;
  }
  const uint64_t h = fnv1a(bytes);
  for (uint64_t i = h & slot_mask_;; i = (i + 1) & slot_mask_) {
    const Slot& s = slots_[i];
    if (s.id < 0) return -1;
    if (s.hash == h && s.length == bytes.size() &&
        std::memcmp(arena_.data() + s.offset, bytes.data(), bytes.size()) == 0)
      return s.id;
  }
}

int32_t BpeTokenizer::token_id(const std::string& text) const {
  for (const auto& s : specials_)
    if (s.text == text) return s.id;
  return lookup(text);
}

std::vector<int32_t> BpeTokenizer::end_ids() const {
  std::vector<int32_t> ids;
  if (eod_ >= 0) ids.push_back(eod_);
  for (const char* s : {"<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "<|endoftext|>"})
    if (const int32_t id = token_id(s); id >= 0) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

// Rank of merging parts [a,b) and [b,c) of `piece`; lower merges first.
uint32_t BpeTokenizer::pair_rank(std::string_view piece, size_t a, size_t b, size_t c) const {
  if (merge_priority_.empty()) {
    int32_t r = lookup(piece.substr(a, c - a));
    return r < 0 ? kNoRank : uint32_t(r);
  }
  int32_t l = lookup(piece.substr(a, b - a)), r = lookup(piece.substr(b, c - b));
  if (l < 0 || r < 0) return kNoRank;
  auto it = merge_priority_.find((uint64_t(uint32_t(l)) << 32) | uint32_t(r));
  return it == merge_priority_.end() ? kNoRank : uint32_t(it->second);
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>* out) const {
  if (piece.empty()) return;
  if (whole_piece_shortcut_) {
    int32_t id = lookup(piece);
    if (id >= 0) {
      out->push_back(id);
      return;
    }
  }
  if (piece.size() == 1) {
    out->push_back(lookup(piece));
    return;
  }
  // Words repeat: remember the merges of pieces already seen by this thread (bounded).
  struct PieceCache {
    uint64_t owner = 0;  // instance id, not the address: a new tokenizer may reuse a freed one's address
    std::unordered_map<std::string, std::vector<int32_t>, Hash, std::equal_to<>> map;
  };
  thread_local PieceCache cache;
  if (cache.owner != instance_id_ || cache.map.size() > (1u << 18)) {
    cache.map.clear();
    cache.owner = instance_id_;
  }
  if (auto hit = cache.map.find(piece); hit != cache.map.end()) {
    out->insert(out->end(), hit->second.begin(), hit->second.end());
    return;
  }
  const size_t first = out->size();
  // parts[i] = (start byte, rank of merging part i with part i+1); two sentinels at the end.
  std::vector<std::pair<size_t, uint32_t>> parts;
  parts.reserve(piece.size() + 1);
  for (size_t i = 0; i <= piece.size(); ++i) parts.push_back({i, kNoRank});
  auto rank_at = [&](size_t i) {
    return i + 2 < parts.size() ? pair_rank(piece, parts[i].first, parts[i + 1].first, parts[i + 2].first) : kNoRank;
  };
  for (size_t i = 0; i + 2 < parts.size(); ++i) parts[i].second = rank_at(i);
  for (;;) {
    uint32_t best = kNoRank;
    size_t at = 0;
    for (size_t i = 0; i + 2 < parts.size(); ++i)
      if (parts[i].second < best) {
        best = parts[i].second;
        at = i;
      }
    if (best == kNoRank) break;
    parts.erase(parts.begin() + long(at) + 1);
    parts[at].second = rank_at(at);
    if (at > 0) parts[at - 1].second = rank_at(at - 1);
  }
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    int32_t id = lookup(piece.substr(parts[i].first, parts[i + 1].first - parts[i].first));
    NB_CHECK(id >= 0, "BPE produced a part outside the vocabulary");
    out->push_back(id);
  }
  cache.map.emplace(std::string(piece), std::vector<int32_t>(out->begin() + long(first), out->end()));
}

void BpeTokenizer::encode(std::string_view text, std::vector<int32_t>* out) const {
  auto* code = static_cast<pcre2_code*>(code_);
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
  pcre2_match_context* mc = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* js = pcre2_jit_stack_create(size_t(32) << 10, size_t(4) << 20, nullptr);
  pcre2_jit_stack_assign(mc, nullptr, js);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0, covered = 0;
  while (pos < text.size()) {
    int rc = pcre2_match(code, subject, text.size(), pos, 0, md, mc);
    if (rc < 0) break;  // no further match (or a matcher limit): the rest is encoded as raw bytes below
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    size_t s = ov[0], e = ov[1];
    if (s > covered)
      encode_piece(text.substr(covered, s - covered), out);  // bytes no alternative matched (invalid UTF-8)
    encode_piece(text.substr(s, e - s), out);
    covered = e;
    pos = e > s ? e : e + 1;
  }
  if (covered < text.size()) encode_piece(text.substr(covered), out);
  pcre2_jit_stack_free(js);
  pcre2_match_context_free(mc);
  pcre2_match_data_free(md);
}

void BpeTokenizer::encode_with_specials(std::string_view text, std::vector<int32_t>* out) const {
  size_t start = 0;
  while (start < text.size()) {
    size_t best = std::string_view::npos, best_len = 0;
    int32_t best_id = -1;
    for (const auto& s : specials_) {
      size_t p = text.find(s.text, start);
      if (p != std::string_view::npos && (p < best || (p == best && s.text.size() > best_len))) {
        best = p;
        best_len = s.text.size();
        best_id = s.id;
      }
    }
    if (best == std::string_view::npos) break;
    encode(text.substr(start, best - start), out);
    out->push_back(best_id);
    start = best + best_len;
  }
  encode(text.substr(start), out);
}

Status BpeTokenizer::decode(const std::vector<int32_t>& ids, std::string* out) const {
  out->clear();
  for (int32_t id : ids) {
    if (id < 0 || id >= int32_t(id_to_bytes_.size()))
      return errorf("token id %d is outside the vocabulary of %lld tokens", id, (long long)id_to_bytes_.size());
    out->append(id_to_bytes_[size_t(id)]);
  }
  return Status::ok();
}

std::string BpeTokenizer::decode_lenient(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id >= 0 && id < int32_t(id_to_bytes_.size())) {
      out += id_to_bytes_[size_t(id)];
      continue;
    }
    out += '<';
    out += std::to_string(id);
    out += '>';
  }
  return out;
}

}  // namespace nb
