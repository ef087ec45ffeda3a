// The inputs of `nibble generate` besides the weights (see generate_inputs.h).
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include "cli/generate_inputs.h"
#include "train/checkpoint.h"

namespace nb::cli {
namespace fs = std::filesystem;

std::string find_tokenizer(const std::string& flag, const std::string& load_hf, const std::string& load,
                           int64_t ckpt_step, std::string* origin) {
  if (!flag.empty()) {
    *origin = "--tokenizer";
    return flag;
  }
  if (!load_hf.empty()) {
    *origin = "the tokenizer.json of --load-hf " + load_hf;
    const fs::path p = fs::path(load_hf) / "tokenizer.json";
    return fs::exists(p) ? p.string() : "";
  }
  *origin = "the --tokenizer of the run that wrote --load " + load;
  CheckpointRef ref;
  bool found = false;
  TrainConfig tc;
  LlamaConfig mc;
  if (!load.empty() && find_checkpoint(load, ckpt_step, &ref, &found) && found && checkpoint_config(ref, &tc, &mc))
    return tc.tokenizer;
  return "";
}

Status load_tokenizer(const std::string& path, const std::string& origin, const LlamaConfig& cfg,
                      std::unique_ptr<BpeTokenizer>* out) {
  NB_TRY(BpeTokenizer::load(path, "auto", out).context(origin));
  if ((*out)->vocab_size() > cfg.vocab)
    return errorf(
        "the tokenizer %s (%s) has %lld tokens but the model's vocabulary has %lld; it is not this "
        "model's tokenizer: pass the right one with --tokenizer FILE",
        path.c_str(), origin.c_str(), (long long)(*out)->vocab_size(), (long long)cfg.vocab);
  return Status::ok();
}

namespace {

Status encode(const std::string& text, const BpeTokenizer* tok, const std::string& no_tok_why, PromptInput* p) {
  if (!tok)
    return errorf(
        "a text prompt needs a tokenizer, and %s; pass --tokenizer FILE (tokenizer.json or .tiktoken), "
        "or give prompts as token ids ({\"ids\": [...]} lines in --prompts)",
        no_tok_why.c_str());
  p->text = text;
  p->has_text = true;
  if (tok->adds_bos() && tok->bos() >= 0) p->ids.push_back(tok->bos());
  tok->encode_with_specials(text, &p->ids);
  return Status::ok();
}

// One line of --prompts: {"prompt": TEXT} (or "text") or {"ids": [int, ...]}.
Status parse_line(const std::string& line, const std::string& where, const BpeTokenizer* tok,
                  const std::string& no_tok_why, PromptInput* p) {
  const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return errorf("%s is not a JSON object", where.c_str());
  if (j.contains("ids")) {
    if (!j["ids"].is_array()) return errorf("%s: \"ids\" must be a list of token ids", where.c_str());
    for (const auto& v : j["ids"]) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX)
        return errorf("%s: \"ids\" holds %s, not a token id", where.c_str(), v.dump().c_str());
      p->ids.push_back(v.get<int32_t>());
    }
    return Status::ok();
  }
  for (const char* key : {"prompt", "text"})
    if (j.contains(key) && j[key].is_string())
      return encode(j[key].get<std::string>(), tok, no_tok_why, p).context(where);
  return errorf("%s has neither a \"prompt\" string nor an \"ids\" list", where.c_str());
}

}  // namespace

Status read_prompts(const std::string& prompt, const std::string& file, const BpeTokenizer* tok,
                    const std::string& no_tok_why, std::vector<PromptInput>* out) {
  out->clear();
  if (prompt.empty() == file.empty())
    return errorf("pass exactly one of --prompt TEXT or --prompts FILE.jsonl (one {\"prompt\": TEXT} per line)");
  if (!prompt.empty()) {
    out->emplace_back();
    return encode(prompt, tok, no_tok_why, &out->back());
  }
  std::ifstream in(file);
  if (!in) return errorf("cannot open --prompts %s", file.c_str());
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    out->emplace_back();
    NB_TRY(parse_line(line, strprintf("--prompts %s line %lld", file.c_str(), (long long)n), tok, no_tok_why,
                      &out->back()));
  }
  if (out->empty()) return errorf("--prompts %s holds no prompt", file.c_str());
  return Status::ok();
}

namespace {
void add_eos_field(const fs::path& file, std::vector<int32_t>* ids) {
  std::ifstream in(file);
  if (!in) return;
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("eos_token_id")) return;
  const nlohmann::json& e = j["eos_token_id"];
  if (e.is_number_integer()) ids->push_back(e.get<int32_t>());
  if (e.is_array())
    for (const auto& v : e)
      if (v.is_number_integer()) ids->push_back(v.get<int32_t>());
}
}  // namespace

std::vector<int32_t> end_token_ids(const BpeTokenizer* tok, const std::string& load_hf) {
  std::vector<int32_t> ids;
  if (tok) ids = tok->end_ids();
  if (!load_hf.empty()) {
    add_eos_field(fs::path(load_hf) / "config.json", &ids);
    add_eos_field(fs::path(load_hf) / "generation_config.json", &ids);
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

}  // namespace nb::cli
