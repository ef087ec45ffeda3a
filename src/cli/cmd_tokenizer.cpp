// `nibble tokenizer train|encode|decode`: train a byte-level BPE tokenizer (writes HF tokenizer.json)
// for users who have none, and inspect how a tokenizer splits text.
#include <memory>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include "cli/commands.h"
#include "tokenizer/bpe_tokenizer.h"

namespace nb::cli {

namespace {
struct TokenizerArgs {
  std::vector<std::string> inputs;
  std::string out, tokenizer, family = "auto", text, ids, pattern = "gpt2", json_key = "text";
  int64_t vocab_size = 8192, min_frequency = 2;
  bool specials = false;
};

int fail(const Status& st) {
  std::fprintf(stderr, "error: %s\n", st.message().c_str());
  return 1;
}

Status read_texts(const TokenizerArgs& a, std::vector<std::string>* texts) {
  for (const auto& path : a.inputs) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return errorf("cannot open %s", path.c_str());
    bool jsonl = path.size() > 6 && (path.rfind(".jsonl") == path.size() - 6 || path.rfind(".json") == path.size() - 5);
    if (!jsonl) {
      texts->emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      continue;
    }
    std::string line;
    for (int64_t n = 1; std::getline(in, line); ++n) {
      if (line.empty()) continue;
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.is_object() || !j.contains(a.json_key) || !j[a.json_key].is_string())
        return errorf("%s line %lld: expected a JSON object with a string field \"%s\"", path.c_str(), (long long)n,
                      a.json_key.c_str());
      texts->push_back(j[a.json_key].get<std::string>());
    }
  }
  return Status::ok();
}

int run_tokenizer_train(const TokenizerArgs& a) {
  std::vector<std::string> texts;
  if (Status st = read_texts(a, &texts); !st) return fail(st);
  BpeTrainOptions opt;
  opt.vocab_size = a.vocab_size;
  opt.min_frequency = a.min_frequency;
  opt.pattern = a.pattern == "llama3" ? kLlama3Pattern : kGpt2Pattern;
  std::string summary;
  if (Status st = train_bpe(texts, opt, a.out, &summary); !st) return fail(st);
  std::printf("wrote %s: %s\n", a.out.c_str(), summary.c_str());
  return 0;
}

int run_encode(const TokenizerArgs& a) {
  std::unique_ptr<BpeTokenizer> tok;
  if (Status st = BpeTokenizer::load(a.tokenizer, a.family, &tok); !st) return fail(st);
  std::string text = a.text;
  if (!a.inputs.empty()) {
    std::ifstream in(a.inputs[0], std::ios::binary);
    if (!in) return fail(errorf("cannot open %s", a.inputs[0].c_str()));
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::vector<int32_t> ids;
  if (a.specials)
    tok->encode_with_specials(text, &ids);
  else
    tok->encode(text, &ids);
  for (size_t i = 0; i < ids.size(); ++i) std::printf(i ? " %d" : "%d", ids[i]);
  std::printf("\n");
  std::fprintf(stderr, "%zu tokens, %zu bytes, vocab %lld, bos %d, eod %d\n", ids.size(), text.size(),
               (long long)tok->vocab_size(), tok->bos(), tok->eod());
  return 0;
}

int run_decode(const TokenizerArgs& a) {
  std::unique_ptr<BpeTokenizer> tok;
  if (Status st = BpeTokenizer::load(a.tokenizer, a.family, &tok); !st) return fail(st);
  std::vector<int32_t> ids;
  std::string ids_text = a.ids;
  for (char& c : ids_text)
    if (c == ',') c = ' ';
  std::istringstream in(ids_text);
  for (long long v; in >> v;) ids.push_back(int32_t(v));
  if (!in.eof()) return fail(errorf("--ids must be integers separated by spaces or commas"));
  std::string text;
  if (Status st = tok->decode(ids, &text); !st) return fail(st);
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::printf("\n");
  return 0;
}
}  // namespace

void add_tokenizer_command(CLI::App& app) {
  // Shared with the callbacks, which the app keeps: CLI11 binds options to these fields by reference.
  auto a = std::make_shared<TokenizerArgs>();
  auto* cmd = app.add_subcommand("tokenizer", "Train a byte-level BPE tokenizer, or encode/decode with one");
  cmd->require_subcommand(1);
  auto* train =
      cmd->add_subcommand("train", "Train byte-level BPE on text/JSONL files and write a Hugging Face tokenizer.json");
  train->add_option("--input,-i", a->inputs, "Training files: plain text (one text each) or *.jsonl")->required();
  train->add_option("--vocab-size", a->vocab_size, "Vocabulary size including 256 bytes and <|endoftext|>")
      ->capture_default_str();
  train->add_option("--out,-o", a->out, "Output tokenizer.json")->required();
  train->add_option("--pattern", a->pattern, "Pre-tokenization regex family")
      ->check(CLI::IsMember({"gpt2", "llama3"}))
      ->capture_default_str();
  train->add_option("--min-frequency", a->min_frequency, "Stop when the best pair occurs fewer times")
      ->capture_default_str();
  train->add_option("--json-key", a->json_key, "JSONL field holding the text")->capture_default_str();
  train->callback([a] { exit_code() = run_tokenizer_train(*a); });
  auto* encode = cmd->add_subcommand("encode", "Print the token ids of a text");
  encode->add_option("--tokenizer,-t", a->tokenizer, "tokenizer.json or tiktoken rank file")->required();
  encode->add_option("--tokenizer-family", a->family, "For tiktoken files: gpt2, llama3 or auto")
      ->capture_default_str();
  auto* text_opt = encode->add_option("--text", a->text, "Text to encode");
  encode->add_option("--input,-i", a->inputs, "File to encode instead of --text")->excludes(text_opt);
  encode->add_flag("--specials", a->specials, "Recognise special-token strings such as <|endoftext|> in the text");
  encode->callback([a] { exit_code() = run_encode(*a); });
  auto* decode = cmd->add_subcommand("decode", "Print the text of token ids");
  decode->add_option("--tokenizer,-t", a->tokenizer, "tokenizer.json or tiktoken rank file")->required();
  decode->add_option("--tokenizer-family", a->family, "For tiktoken files: gpt2, llama3 or auto")
      ->capture_default_str();
  decode->add_option("--ids", a->ids, "Token ids separated by spaces or commas")->required();
  decode->callback([a] { exit_code() = run_decode(*a); });
}

}  // namespace nb::cli
