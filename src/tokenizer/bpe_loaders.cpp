// The tokenizer file loaders of BpeTokenizer (see bpe_tokenizer.h): tiktoken files, GPT-2 vocab.json +
// merges.txt, and Hugging Face tokenizer.json, each checked entry by entry with one sentence per fault.
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include "tokenizer/bpe_tokenizer.h"

namespace nb {

namespace {
bool base64_decode(std::string_view in, std::string* out) {
  static int8_t table[256];
  static bool init = [] {
    for (int i = 0; i < 256; ++i) table[i] = -1;
    const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int i = 0; i < 64; ++i) table[uint8_t(a[i])] = int8_t(i);
    return true;
  }();
  (void)init;
  out->clear();
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    int v = table[uint8_t(c)];  // NOLINT(bugprone-signed-char-misuse): -1 marks a non-base64 byte
    if (v < 0) return false;
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out->push_back(char((acc >> bits) & 0xFF));
    }
  }
  return true;
}

Status read_file(const std::string& path, std::string* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f)
    return errorf(
        "cannot open tokenizer file %s; check the path (scripts/setup_data.sh fetches GPT-2 and Llama 3 ones)",
        path.c_str());
  std::ostringstream ss;
  ss << f.rdbuf();
  *out = ss.str();
  return Status::ok();
}

std::vector<SpecialToken> llama3_specials() {
  std::vector<std::string> names = {"<|begin_of_text|>",
                                    "<|end_of_text|>",
                                    "<|reserved_special_token_0|>",
                                    "<|reserved_special_token_1|>",
                                    "<|finetune_right_pad_id|>",
                                    "<|reserved_special_token_2|>",
                                    "<|start_header_id|>",
                                    "<|end_header_id|>",
                                    "<|eom_id|>",
                                    "<|eot_id|>",
                                    "<|python_tag|>"};
  for (int i = 3; names.size() < 256; ++i) names.push_back("<|reserved_special_token_" + std::to_string(i) + "|>");
  std::vector<SpecialToken> out;
  for (int i = 0; i < 256; ++i) out.push_back({names[i], 128000 + i});
  return out;
}
}  // namespace

Status BpeTokenizer::from_tiktoken(const std::string& path, const std::string& pattern,
                                   std::vector<SpecialToken> specials, std::unique_ptr<BpeTokenizer>* out) {
  std::string text;
  NB_TRY(read_file(path, &text));
  auto tok = std::unique_ptr<BpeTokenizer>(new BpeTokenizer());
  std::istringstream in(text);
  std::string line, bytes;
  int64_t line_no = 0;
  const int64_t lines = int64_t(std::count(text.begin(), text.end(), '\n')) + 1, max_rank = lines + 1024;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    size_t sp = line.find(' ');
    long long rank = -1;
    if (sp != std::string::npos) rank = std::atoll(line.c_str() + sp + 1);
    if (sp == std::string::npos || rank < 0 || !base64_decode(std::string_view(line).substr(0, sp), &bytes))
      return errorf("%s line %lld: expected \"<base64 token> <rank>\"; is this a tiktoken rank file?", path.c_str(),
                    (long long)line_no);
    // Ranks are token ids, dense in real files: one far past the line count is not a rank file.
    if (rank > max_rank)
      return errorf("%s line %lld: rank %lld is far past the file's %lld lines; is this a tiktoken rank file?",
                    path.c_str(), (long long)line_no, rank, (long long)lines);
    if (rank >= int64_t(tok->id_to_bytes_.size())) tok->id_to_bytes_.resize(size_t(rank) + 1);
    tok->id_to_bytes_[size_t(rank)] = bytes;
    tok->bytes_to_id_[bytes] = int32_t(rank);
  }
  tok->pattern_ = pattern;
  tok->specials_ = std::move(specials);
  NB_TRY(tok->finish(path));
  *out = std::move(tok);
  return Status::ok();
}

Status BpeTokenizer::load(const std::string& path, const std::string& family, std::unique_ptr<BpeTokenizer>* out) {
  if (size_t comma = path.find(','); comma != std::string::npos)
    return from_vocab_merges(path.substr(0, comma), path.substr(comma + 1), out);
  if (path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0) {
    std::string text;
    NB_TRY(read_file(path, &text));
    auto j = nlohmann::json::parse(text, nullptr, false);
    if (!j.is_discarded() && j.is_object() && !j.contains("model")) {  // a bare vocab.json: find its merges.txt
      std::string dir = path.substr(0, path.find_last_of('/') + 1);
      std::string name = path.substr(dir.size());
      for (const std::string& merges : {dir + "merges.txt", dir + name.substr(0, name.size() - 10) + "merges.txt"})
        if (name.size() >= 10 && std::ifstream(merges).good()) return from_vocab_merges(path, merges, out);
      return errorf("%s looks like a vocab.json but no merges.txt was found beside it; pass \"VOCAB.json,MERGES.txt\"",
                    path.c_str());
    }
    return from_hf_json_text(text, path, out);
  }
  std::string fam = family;
  if (fam == "auto") {
    std::ifstream f(path);
    int64_t lines = 0;
    for (std::string l; std::getline(f, l);) lines += !l.empty();
    fam = lines == 50256 ? "gpt2" : lines == 128000 ? "llama3" : "";
    if (fam.empty())
      return errorf(
          "%s: %lld ranks match neither GPT-2 (50,256) nor Llama 3 (128,000); pass the family (gpt2 or llama3) "
          "explicitly",
          path.c_str(), (long long)lines);
  }
  if (fam == "gpt2") return from_tiktoken(path, kGpt2Pattern, {{"<|endoftext|>", 50256}}, out);
  if (fam == "llama3") return from_tiktoken(path, kLlama3Pattern, llama3_specials(), out);
  return errorf("unknown tokenizer family \"%s\"; use gpt2, llama3 or a tokenizer.json file", fam.c_str());
}

Status BpeTokenizer::from_vocab_merges(const std::string& vocab_path, const std::string& merges_path,
                                       std::unique_ptr<BpeTokenizer>* out) {
  using nlohmann::json;
  std::string vocab_text, merges_text;
  NB_TRY(read_file(vocab_path, &vocab_text));
  NB_TRY(read_file(merges_path, &merges_text));
  json vocab = json::parse(vocab_text, nullptr, false);
  if (vocab.is_discarded() || !vocab.is_object())
    return errorf("%s is not a JSON object of token -> id", vocab_path.c_str());
  json merges = json::array();
  std::istringstream in(merges_text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    merges.push_back(line);
  }
  json j = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}},
            {"pre_tokenizer", {{"type", "ByteLevel"}, {"use_regex", true}}},
            {"added_tokens", json::array()}};
  if (vocab.contains("<|endoftext|>"))
    j["added_tokens"].push_back({{"id", vocab["<|endoftext|>"]}, {"content", "<|endoftext|>"}, {"special", true}});
  return from_hf_json_text(j.dump(), vocab_path + " + " + merges_path, out);
}

Status BpeTokenizer::from_hf_json(const std::string& path, std::unique_ptr<BpeTokenizer>* out) {
  std::string text;
  NB_TRY(read_file(path, &text));
  return from_hf_json_text(text, path, out);
}

// nlohmann throws on a field of an unexpected type: a malformed file is input, so it becomes a Status.
Status BpeTokenizer::from_hf_json_text(const std::string& json_text, const std::string& where,
                                       std::unique_ptr<BpeTokenizer>* out) {
  try {
    return from_hf_json_parsed(json_text, where, out);
  } catch (const nlohmann::json::exception& e) {
    return errorf("%s: not a tokenizer.json this reader understands (%s)", where.c_str(), e.what());
  }
}

namespace {
using nlohmann::json;

// Checks each model.vocab entry (byte-level alphabet, an integer id in range, no id used twice), then hands its id
// and bytes to `add`.
Status read_hf_vocab(const json& vocab, const std::string& where,
                     const std::function<void(int64_t id, const std::string& bytes)>& add) {
  std::string bytes;
  std::vector<bool> seen;  // merges are keyed by id pairs, so an id shared by two tokens would merge wrongly
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!unicode_string_to_bytes(it.key(), &bytes))
      return errorf(
          "%s: vocabulary entry \"%s\" is not in the byte-level alphabet; only byte-level BPE (GPT-2 / Llama 3 style) "
          "is supported",
          where.c_str(), it.key().c_str());
    if (!it.value().is_number_integer())
      return errorf("%s: vocabulary entry \"%s\" has an id that is not an integer", where.c_str(), it.key().c_str());
    int64_t id = it.value().get<int64_t>();
    if (id < 0 || id > (1 << 24)) return errorf("%s: vocabulary id %lld out of range", where.c_str(), (long long)id);
    if (id >= int64_t(seen.size())) seen.resize(size_t(id) + 1);
    if (seen[size_t(id)])
      return errorf("%s: vocabulary id %lld belongs to two entries (one is \"%s\"); each token needs its own id",
                    where.c_str(), (long long)id, it.key().c_str());
    seen[size_t(id)] = true;
    add(id, bytes);
  }
  return Status::ok();
}

// One model.merges entry's two parts, from an "a b" string or an [a, b] pair (throws if a part is not a string).
Status merge_parts(const json& m, const std::string& where, std::string* a, std::string* b) {
  if (m.is_string()) {
    std::string s = m.get<std::string>();
    size_t sp = s.find(' ');
    if (sp == std::string::npos)
      return errorf("%s: merge \"%s\" has no space between its two parts", where.c_str(), s.c_str());
    *a = s.substr(0, sp);
    *b = s.substr(sp + 1);
  } else if (m.is_array() && m.size() == 2) {
    *a = m[0].get<std::string>();
    *b = m[1].get<std::string>();
  } else {
    return errorf("%s: model.merges entries must be \"a b\" strings or [a, b] pairs", where.c_str());
  }
  return Status::ok();
}

// model.merges in list order = merge priority, keyed by (left id << 32 | right id); both parts and their
// concatenation must be vocabulary tokens, which `lookup` finds (-1 if absent).
Status read_hf_merges(const json& merges, const std::string& where,
                      const std::function<int32_t(std::string_view)>& lookup,
                      std::unordered_map<uint64_t, int32_t>* merge_priority) {
  int32_t priority = 0;
  for (const auto& m : merges) {
    std::string a, b;
    NB_TRY(merge_parts(m, where, &a, &b));
    std::string ba, bb;
    if (!unicode_string_to_bytes(a, &ba) || !unicode_string_to_bytes(b, &bb))
      return errorf("%s: merge %d is not in the byte-level alphabet", where.c_str(), priority);
    int32_t la = lookup(ba), lb = lookup(bb);
    if (la < 0 || lb < 0 || lookup(ba + bb) < 0)
      return errorf("%s: merge %d (\"%s\" + \"%s\") uses or makes a token missing from model.vocab", where.c_str(),
                    priority, a.c_str(), b.c_str());
    merge_priority->emplace((uint64_t(uint32_t(la)) << 32) | uint32_t(lb), priority++);
  }
  return Status::ok();
}

// added_tokens become the special tokens; each needs an id and a content.
Status read_added_tokens(const json& added, const std::string& where, std::vector<SpecialToken>* specials) {
  for (const auto& t : added) {
    SpecialToken s{t.value("content", std::string()), t.value("id", -1)};
    if (s.id < 0 || s.text.empty()) return errorf("%s: added_tokens entries need an id and a content", where.c_str());
    specials->push_back(s);
  }
  return Status::ok();
}

// The pre-tokenization regex: a Split regex (Llama 3 style) or GPT-2's for ByteLevel with use_regex, searching a
// Sequence in order; the first one found wins, so a set `pattern` is kept.
void find_pre_tokenizer_regex(const json& p, std::string* pattern) {
  if (!p.is_object()) return;
  std::string type = p.value("type", std::string());
  if (type == "Sequence")
    for (const auto& q : p.value("pretokenizers", json::array())) find_pre_tokenizer_regex(q, pattern);
  if (type == "Split" && p.contains("pattern") && p["pattern"].contains("Regex") && pattern->empty())
    *pattern = p["pattern"]["Regex"].get<std::string>();
  if (type == "ByteLevel" && p.value("use_regex", true) && pattern->empty()) *pattern = kGpt2Pattern;
}

// The BOS convention from the post-processor's single-sequence template (TemplateProcessing, also inside a
// Sequence): a leading SpecialToken naming one of `specials` is the BOS, and the tokenizer adds it itself.
void find_template_bos(const json& p, const std::vector<SpecialToken>& specials, int32_t* bos, bool* adds_bos) {
  if (!p.is_object()) return;
  std::string type = p.value("type", std::string());
  if (type == "Sequence")
    for (const auto& q : p.value("processors", json::array())) find_template_bos(q, specials, bos, adds_bos);
  if (type == "TemplateProcessing" && p.contains("single") && p["single"].is_array() && !p["single"].empty() &&
      p["single"][0].contains("SpecialToken")) {
    std::string name = p["single"][0]["SpecialToken"].value("id", std::string());
    for (const auto& s : specials)
      if (s.text == name) {
        *bos = s.id;
        *adds_bos = true;
      }
  }
}
}  // namespace

Status BpeTokenizer::from_hf_json_parsed(const std::string& json_text, const std::string& where,
                                         std::unique_ptr<BpeTokenizer>* out) {
  using nlohmann::json;
  json j = json::parse(json_text, nullptr, false);
  if (j.is_discarded()) return errorf("%s is not valid JSON", where.c_str());
  const json& model = j.value("model", json::object());
  if (model.value("type", std::string("BPE")) != "BPE" || !model.contains("vocab") || !model["vocab"].is_object())
    return errorf("%s: model.type must be BPE with a model.vocab object (only byte-level BPE tokenizers are supported)",
                  where.c_str());
  auto tok = std::unique_ptr<BpeTokenizer>(new BpeTokenizer());
  auto add_token = [&](int64_t id, const std::string& bytes) {
    if (id >= int64_t(tok->id_to_bytes_.size())) tok->id_to_bytes_.resize(size_t(id) + 1);
    tok->id_to_bytes_[size_t(id)] = bytes;
    tok->bytes_to_id_[bytes] = int32_t(id);
  };
  NB_TRY(read_hf_vocab(model["vocab"], where, add_token));
  auto lookup = [&](std::string_view bytes) { return tok->lookup(bytes); };
  NB_TRY(read_hf_merges(model.value("merges", json::array()), where, lookup, &tok->merge_priority_));
  tok->whole_piece_shortcut_ = tok->merge_priority_.empty() || model.value("ignore_merges", false);
  NB_TRY(read_added_tokens(j.value("added_tokens", json::array()), where, &tok->specials_));
  if (j.contains("pre_tokenizer")) find_pre_tokenizer_regex(j["pre_tokenizer"], &tok->pattern_);
  if (tok->pattern_.empty()) tok->pattern_ = kGpt2Pattern;
  if (j.contains("post_processor")) find_template_bos(j["post_processor"], tok->specials_, &tok->bos_, &tok->adds_bos_);
  NB_TRY(tok->finish(where));
  *out = std::move(tok);
  return Status::ok();
}

}  // namespace nb
