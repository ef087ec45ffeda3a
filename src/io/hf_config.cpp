// HF Llama config.json: reading both transformers spellings (4.x: rope_scaling + top-level rope_theta +
// torch_dtype; 5.x: rope_parameters + dtype) and writing one file that both read.
// transformers 5.x's PreTrainedConfig.convert_rope_params_to_dict takes a non-null rope_scaling over
// rope_parameters and fills rope_theta from the top-level key when the dict has none, and keeps dtype
// over torch_dtype, so writing both spellings with the same values is read identically by both.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <nlohmann/json.hpp>
#include "io/hf_llama.h"

namespace nb {

namespace {
using nlohmann::json;

struct Fields {
  const json& j;
  const std::string& where;

  Status integer(const char* key, int64_t* out, bool required, int64_t dflt) const {
    if (!j.contains(key) || j[key].is_null()) {
      if (required) return errorf("%s has no '%s'; a Llama config.json needs it", where.c_str(), key);
      *out = dflt;
      return Status::ok();
    }
    const json& v = j[key];
    if (!v.is_number_integer() || v.get<int64_t>() <= 0)
      return errorf("%s: '%s' is %s, expected a positive integer", where.c_str(), key, v.dump().c_str());
    *out = v.get<int64_t>();
    return Status::ok();
  }
  Status number(const json& obj, const char* key, double* out, bool required, double dflt) const {
    if (!obj.contains(key) || obj[key].is_null()) {
      if (required) return errorf("%s has no '%s'; it is needed for this RoPE type", where.c_str(), key);
      *out = dflt;
      return Status::ok();
    }
    if (!obj[key].is_number())
      return errorf("%s: '%s' is %s, expected a number", where.c_str(), key, obj[key].dump().c_str());
    *out = obj[key].get<double>();
    return Status::ok();
  }
  Status flag(const char* key, bool* out) const {
    *out = false;
    if (!j.contains(key) || j[key].is_null()) return Status::ok();
    if (!j[key].is_boolean())
      return errorf("%s: '%s' is %s, expected true or false", where.c_str(), key, j[key].dump().c_str());
    *out = j[key].get<bool>();
    return Status::ok();
  }
};

// model_type, architectures, activation and biases: what nibble's Llama cannot represent is refused.
Status check_architecture(const Fields& f) {
  const json& j = f.j;
  const char* w = f.where.c_str();
  if (!j.contains("model_type") || j["model_type"] != "llama")
    return errorf("%s: model_type is %s; nibble loads only \"llama\" (LlamaForCausalLM) checkpoints", w,
                  j.contains("model_type") ? j["model_type"].dump().c_str() : "missing");
  if (j.contains("architectures") && j["architectures"].is_array()) {
    bool found = false;
    for (const auto& a : j["architectures"]) found = found || a == "LlamaForCausalLM";
    if (!found)
      return errorf("%s: architectures is %s; nibble loads only LlamaForCausalLM", w,
                    j["architectures"].dump().c_str());
  }
  if (j.contains("hidden_act") && j["hidden_act"] != "silu")
    return errorf("%s: hidden_act is %s; nibble's MLP is SwiGLU, so only \"silu\" is supported", w,
                  j["hidden_act"].dump().c_str());
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    bool b = false;
    NB_TRY(f.flag(key, &b));
    if (b) return errorf("%s: %s is true; nibble's Llama has no bias terms, so only false is supported", w, key);
  }
  if (j.contains("partial_rotary_factor") && j["partial_rotary_factor"].is_number() &&
      j["partial_rotary_factor"].get<double>() != 1.0)
    return errorf("%s: partial_rotary_factor is %s; nibble rotates the whole head (1.0)", w,
                  j["partial_rotary_factor"].dump().c_str());
  return Status::ok();
}

// rope_scaling (4.x) wins over rope_parameters (5.x) as in transformers; rope_theta comes from the dict,
// else the top level, else transformers' default 10000.
Status parse_rope(const Fields& f, LlamaConfig* c) {
  const json& j = f.j;
  const char* w = f.where.c_str();
  static const json kEmpty = json::object();
  const json* rope = &kEmpty;
  const char* field = "rope_parameters";
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    rope = &j["rope_scaling"];
    field = "rope_scaling";
  } else if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    rope = &j["rope_parameters"];
  }
  if (!rope->is_object()) return errorf("%s: %s is %s, expected an object or null", w, field, rope->dump().c_str());
  double top_theta = 10000.0;
  NB_TRY(f.number(j, "rope_theta", &top_theta, false, 10000.0));
  NB_TRY(f.number(*rope, "rope_theta", &c->rope_theta, false, top_theta));
  std::string type = "default";
  const char* type_key = rope->contains("rope_type") ? "rope_type" : "type";
  if (rope->contains(type_key) && !(*rope)[type_key].is_null()) {
    if (!(*rope)[type_key].is_string()) return errorf("%s: %s.%s is not a string", w, field, type_key);
    type = (*rope)[type_key].get<std::string>();
  }
  if (type == "default") {
    c->rope_factor = 1.0;
    return Status::ok();
  }
  if (type != "llama3")
    return errorf("%s: %s.%s is \"%s\"; nibble implements only \"default\" and \"llama3\" RoPE", w, field, type_key,
                  type.c_str());
  double orig = 0;
  NB_TRY(f.number(*rope, "factor", &c->rope_factor, true, 0));
  NB_TRY(f.number(*rope, "low_freq_factor", &c->rope_low_freq_factor, true, 0));
  NB_TRY(f.number(*rope, "high_freq_factor", &c->rope_high_freq_factor, true, 0));
  NB_TRY(f.number(*rope, "original_max_position_embeddings", &orig, true, 0));
  c->rope_original_max_pos = int64_t(orig);
  if (c->rope_factor <= 0 || c->rope_high_freq_factor <= c->rope_low_freq_factor || orig <= 0)
    return errorf(
        "%s: %s needs factor > 0, high_freq_factor > low_freq_factor and original_max_position_embeddings > 0", w,
        field);
  return Status::ok();
}

std::string folder_name(const std::string& dir) {
  std::filesystem::path p = std::filesystem::absolute(dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p.filename().string();
}

// The shortest decimal that reads back as the same float, so 1e-5f is written 1e-05, not 9.99999974e-06.
double shortest_float(float v) {
  char buf[32];
  for (int prec = 1; prec <= 9; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, double(v));
    if (std::strtof(buf, nullptr) == v) break;
  }
  return std::strtod(buf, nullptr);
}
}  // namespace

Status parse_hf_config(const std::string& text, const std::string& where, LlamaConfig* out) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) { return errorf("%s is not valid JSON (%s)", where.c_str(), e.what()); }
  if (!j.is_object()) return errorf("%s is not a JSON object", where.c_str());
  Fields f{j, where};
  NB_TRY(check_architecture(f));
  LlamaConfig c;
  NB_TRY(f.integer("hidden_size", &c.hidden, true, 0));
  NB_TRY(f.integer("intermediate_size", &c.ffn, true, 0));
  NB_TRY(f.integer("num_hidden_layers", &c.layers, true, 0));
  NB_TRY(f.integer("num_attention_heads", &c.heads, true, 0));
  NB_TRY(f.integer("num_key_value_heads", &c.kv_heads, false, c.heads));
  NB_TRY(f.integer("head_dim", &c.head_dim, false, c.hidden / c.heads));
  NB_TRY(f.integer("vocab_size", &c.vocab, true, 0));
  NB_TRY(f.integer("max_position_embeddings", &c.max_seq, false, 2048));  // transformers' default
  double eps = 1e-6;                                                      // transformers' default
  NB_TRY(f.number(j, "rms_norm_eps", &eps, false, 1e-6));
  c.norm_eps = float(eps);
  NB_TRY(f.flag("tie_word_embeddings", &c.tied_embeddings));
  NB_TRY(parse_rope(f, &c));
  *out = c;
  return Status::ok();
}

Status read_hf_config(const std::string& dir, LlamaConfig* out) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  std::ifstream in(path);
  if (!in) return errorf("cannot open %s: is %s a Hugging Face model folder?", path.c_str(), dir.c_str());
  std::stringstream ss;
  ss << in.rdbuf();
  NB_TRY(parse_hf_config(ss.str(), path, out));
  out->name = "hf:" + folder_name(dir);
  return Status::ok();
}

void read_hf_token_ids(const std::string& dir, int64_t* bos, int64_t* eos) {
  *bos = *eos = -1;
  std::ifstream in((std::filesystem::path(dir) / "config.json").string());
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return;
  if (j.contains("bos_token_id") && j["bos_token_id"].is_number_integer()) *bos = j["bos_token_id"].get<int64_t>();
  if (j.contains("eos_token_id") && j["eos_token_id"].is_number_integer()) *eos = j["eos_token_id"].get<int64_t>();
}

std::string hf_config_json(const LlamaConfig& c, const std::string& dtype_name, int64_t bos, int64_t eos) {
  nlohmann::ordered_json j;
  const bool scaled = c.rope_factor != 1.0;
  nlohmann::ordered_json scaling = nullptr;
  if (scaled)
    scaling = {{"factor", c.rope_factor},
               {"high_freq_factor", c.rope_high_freq_factor},
               {"low_freq_factor", c.rope_low_freq_factor},
               {"original_max_position_embeddings", c.rope_original_max_pos},
               {"rope_type", "llama3"}};
  nlohmann::ordered_json params = {{"rope_theta", c.rope_theta}, {"rope_type", scaled ? "llama3" : "default"}};
  if (scaled)
    for (const char* k : {"factor", "high_freq_factor", "low_freq_factor", "original_max_position_embeddings"})
      params[k] = scaling[k];
  j["architectures"] = {"LlamaForCausalLM"};
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["bos_token_id"] = bos >= 0 ? nlohmann::ordered_json(bos) : nullptr;
  j["dtype"] = dtype_name;
  j["eos_token_id"] = eos >= 0 ? nlohmann::ordered_json(eos) : nullptr;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = "silu";
  j["hidden_size"] = c.hidden;
  j["initializer_range"] = 0.02;
  j["intermediate_size"] = c.ffn;
  j["max_position_embeddings"] = c.max_seq;
  j["mlp_bias"] = false;
  j["model_type"] = "llama";
  j["num_attention_heads"] = c.heads;
  j["num_hidden_layers"] = c.layers;
  j["num_key_value_heads"] = c.kv_heads;
  j["pretraining_tp"] = 1;
  j["rms_norm_eps"] = shortest_float(c.norm_eps);
  j["rope_parameters"] = params;
  j["rope_scaling"] = scaling;
  j["rope_theta"] = c.rope_theta;
  j["tie_word_embeddings"] = c.tied_embeddings;
  j["torch_dtype"] = dtype_name;
  j["use_cache"] = true;
  j["vocab_size"] = c.vocab;
  return j.dump(2) + "\n";
}

}  // namespace nb
