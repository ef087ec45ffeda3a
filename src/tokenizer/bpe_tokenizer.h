// Byte-level BPE tokenizer (GPT-2, Llama 3 and tokenizers trained by `nibble tokenizer train`).
// Text is split by the model's pre-tokenization regex (PCRE2, UTF + UCP, JIT); each piece's bytes are
// merged by BPE: with tiktoken rank files the adjacent pair whose concatenation has the lowest rank
// merges first (a piece that is itself a token is taken whole, as tiktoken does); with a Hugging Face
// tokenizer.json the merge list's order decides. Bytes the regex cannot match (invalid UTF-8) form
// their own pieces, so encode -> decode reproduces any byte string exactly.
// Sources: HF tokenizer.json (model.type BPE, byte-level), tiktoken rank files ("base64 rank" lines).
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>
#include "core/status.h"

namespace nb {

// Pre-tokenization regexes of the two model families (verbatim from their tokenizers).
extern const char* const kGpt2Pattern;
extern const char* const kLlama3Pattern;

struct SpecialToken {
  std::string text;
  int32_t id;
};

class BpeTokenizer {
 public:
  ~BpeTokenizer();
  // Loads a tokenizer by file: *.json = HF tokenizer.json, or a GPT-2 vocab.json with merges.txt beside
  // it (or "VOCAB.json,MERGES.txt"); otherwise a tiktoken rank file whose family
  // (gpt2 or llama3 specials and regex) is given by `family` ("auto" guesses from the rank count:
  // 50,256 -> gpt2, 128,000 -> llama3).
  static Status load(const std::string& path, const std::string& family, std::unique_ptr<BpeTokenizer>* out);
  static Status from_tiktoken(const std::string& path, const std::string& pattern, std::vector<SpecialToken> specials,
                              std::unique_ptr<BpeTokenizer>* out);
  static Status from_hf_json(const std::string& path, std::unique_ptr<BpeTokenizer>* out);
  static Status from_hf_json_text(const std::string& json_text, const std::string& where,
                                  std::unique_ptr<BpeTokenizer>* out);
  // GPT-2's original pair (Megatron's GPT2BPETokenizer files): vocab.json {token: id} + merges.txt
  // ("#version" line, then "a b" per line). "<|endoftext|>" becomes the special EOD token.
  static Status from_vocab_merges(const std::string& vocab_path, const std::string& merges_path,
                                  std::unique_ptr<BpeTokenizer>* out);

  // Ordinary text: special-token strings in `text` are encoded as plain text, like tiktoken's
  // encode_ordinary. Appends to `out`. Thread-safe.
  void encode(std::string_view text, std::vector<int32_t>* out) const;
  // Matches special-token strings in `text` first (as HF tokenizers do for added tokens).
  void encode_with_specials(std::string_view text, std::vector<int32_t>* out) const;
  // Bytes of the tokens; unknown ids are an error.
  Status decode(const std::vector<int32_t>& ids, std::string* out) const;
  // The same for display: an id the tokenizer lacks (a model vocabulary padded past it) becomes "<id>".
  std::string decode_lenient(const std::vector<int32_t>& ids) const;

  int64_t vocab_size() const { return static_cast<int64_t>(id_to_bytes_.size()); }
  int32_t bos() const { return bos_; }              // -1 if none
  int32_t eod() const { return eod_; }              // -1 if none
  bool adds_bos() const { return adds_bos_; }       // the tokenizer's own convention (HF post_processor)
  int32_t token_id(const std::string& text) const;  // special or regular token by its bytes, -1 if absent
  // The tokens generation stops at: the end-of-document token and Llama 3's end-of-text and end-of-turn
  // specials, those present (sorted).
  std::vector<int32_t> end_ids() const;
  const std::string& pattern() const { return pattern_; }
  const std::vector<SpecialToken>& specials() const { return specials_; }

 private:
  static Status from_hf_json_parsed(const std::string& json_text, const std::string& where,
                                    std::unique_ptr<BpeTokenizer>* out);  // may throw nlohmann::json::exception
  BpeTokenizer() : instance_id_(next_instance_id_++) {}
  static std::atomic<uint64_t> next_instance_id_;
  const uint64_t instance_id_;              // keys the per-thread piece cache
  Status finish(const std::string& where);  // compiles the regex, picks BOS/EOD
  void encode_piece(std::string_view piece, std::vector<int32_t>* out) const;
  int32_t lookup(std::string_view bytes) const;
  uint32_t pair_rank(std::string_view piece, size_t a, size_t b, size_t c) const;

  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8*
  std::vector<std::string> id_to_bytes_;
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, int32_t, Hash, std::equal_to<>> bytes_to_id_;  // built while loading
  // The same map as one open-addressing table over a contiguous key arena, built by finish():
  // encoding does one lookup per piece and per BPE pair, and node-based maps miss the cache there.
  struct Slot {
    uint64_t hash;
    uint32_t offset, length;
    int32_t id;  // -1 = empty
  };
  std::vector<Slot> slots_;
  std::string arena_;
  uint64_t slot_mask_ = 0;
  // Merge mode (HF merges): (left id << 32 | right id) -> merge priority. Empty = rank mode.
  std::unordered_map<uint64_t, int32_t> merge_priority_;
  bool whole_piece_shortcut_ = true;
  std::vector<SpecialToken> specials_;
  int32_t bos_ = -1, eod_ = -1;
  bool adds_bos_ = false;
};

// GPT-2's bytes <-> printable unicode alphabet used by byte-level tokenizer.json files.
std::string bytes_to_unicode_string(std::string_view bytes);
bool unicode_string_to_bytes(std::string_view s, std::string* out);

struct BpeTrainOptions {
  int64_t vocab_size = 8192;  // including the 256 byte tokens and the special tokens
  std::string pattern = kGpt2Pattern;
  std::vector<std::string> specials{"<|endoftext|>"};
  int64_t min_frequency = 2;
};
// Trains byte-level BPE on `text` and writes a HF tokenizer.json to `out_path`.
Status train_bpe(const std::vector<std::string>& texts, const BpeTrainOptions& opt, const std::string& out_path,
                 std::string* summary);

}  // namespace nb
