// adapter_config.json out (the fields PEFT's LoraConfig saves, sorted, indent 2) and in (every field
// that changes which tensors exist or how they apply is checked; what a fused LoRA cannot hold is
// refused with the reason and what to do instead).
#include "io/peft_config.h"
#include <cmath>
#include <stdexcept>
#include <nlohmann/json.hpp>
#include "io/json_checked.h"

namespace nb {

namespace {
using nlohmann::json;

// PEFT's module names of the seven Llama projections, in the targets' order.
struct ModuleName {
  const char* name;  // as target_modules lists it
  const char* path;  // inside a layer
  LoraTarget target;
};
constexpr ModuleName kModules[] = {
    {"q_proj", "self_attn.q_proj", LoraTarget::linear_qkv}, {"k_proj", "self_attn.k_proj", LoraTarget::linear_qkv},
    {"v_proj", "self_attn.v_proj", LoraTarget::linear_qkv}, {"o_proj", "self_attn.o_proj", LoraTarget::linear_proj},
    {"gate_proj", "mlp.gate_proj", LoraTarget::linear_fc1}, {"up_proj", "mlp.up_proj", LoraTarget::linear_fc1},
    {"down_proj", "mlp.down_proj", LoraTarget::linear_fc2}};
constexpr int kModuleCount = 7;

const char* const kMergeInstead =
    "merge it into its base model with PEFT (merge_and_unload) and load that model instead";

// Keys whose non-default value a fused nibble LoRA cannot represent, each with the reason.
struct Refused {
  const char* key;
  const char* why;
};
constexpr Refused kRefused[] = {
    {"use_dora", "DoRA (use_dora) rescales each weight column by a learned magnitude, which nibble's LoRA lacks"},
    {"lora_bias", "it trains a bias on lora_B (lora_bias), and nibble's Llama linears have no biases"},
    {"rank_pattern", "it gives some modules another rank (rank_pattern), and nibble uses one rank throughout"},
    {"alpha_pattern", "it gives some modules another alpha (alpha_pattern), and nibble uses one alpha throughout"},
    {"layers_to_transform", "it adapts only some layers (layers_to_transform), and nibble adapts every layer"},
    {"exclude_modules", "it excludes modules (exclude_modules), and nibble adapts a target in every layer"},
    {"modules_to_save", "it trains full copies of other modules (modules_to_save), which nibble's LoRA cannot hold"},
    {"trainable_token_indices", "it trains embedding rows (trainable_token_indices), which nibble's LoRA cannot hold"},
    {"target_parameters", "it adapts parameters (target_parameters), not the linear modules nibble adapts"},
    {"layer_replication", "it replicates layers (layer_replication), which changes the model's depth"}};

// Missing, null, false, {} and [] are PEFT's defaults for the refused keys.
bool is_unset(const json& j, const char* key) {
  if (!j.contains(key)) return true;
  const json& v = j[key];
  return v.is_null() || (v.is_boolean() && !v.get<bool>()) || ((v.is_object() || v.is_array()) && v.empty());
}

Status check_refused(const json& j, const std::string& where) {
  for (const Refused& r : kRefused)
    if (!is_unset(j, r.key))
      return errorf("%s: %s is %s: %s; %s", where.c_str(), r.key, j[r.key].dump().c_str(), r.why, kMergeInstead);
  if (j.contains("init_lora_weights") && j["init_lora_weights"].is_string()) {
    const std::string init = j["init_lora_weights"].get<std::string>();
    for (const char* changes_base : {"pissa", "olora", "corda", "loftq"})
      if (init.rfind(changes_base, 0) == 0)
        return errorf(
            "%s: init_lora_weights is \"%s\", which changes the base model's weights, so the adapter only "
            "fits that changed base; %s",
            where.c_str(), init.c_str(), kMergeInstead);
  }
  return Status::ok();
}

// target_modules: "all-linear" or a list of module names (q_proj or self_attn.q_proj, ...); fused groups
// must be complete.
Status parse_target_modules(const json& j, const std::string& where, std::vector<LoraTarget>* out) {
  const json& tm = json_field(j, "target_modules");
  bool used[kModuleCount] = {};
  if (tm.is_string()) {
    if (tm.get<std::string>() != "all-linear")
      return errorf(
          "%s: target_modules is the pattern %s; nibble reads \"all-linear\" or a list of module names "
          "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)",
          where.c_str(), tm.dump().c_str());
    for (bool& u : used) u = true;
  } else if (tm.is_array()) {
    for (const json& v : tm) {
      int found = -1;
      for (int i = 0; i < kModuleCount; ++i)
        if (v.is_string() && (v == kModules[i].name || v == kModules[i].path)) found = i;
      if (found < 0)
        return errorf(
            "%s: target_modules names %s, which nibble does not adapt; nibble adapts q_proj, k_proj, "
            "v_proj, o_proj, gate_proj, up_proj and down_proj",
            where.c_str(), v.dump().c_str());
      used[found] = true;
    }
  } else {
    return errorf("%s: target_modules is %s; expected a list of module names or \"all-linear\"", where.c_str(),
                  tm.dump().c_str());
  }
  out->clear();
  for (LoraTarget t :
       {LoraTarget::linear_qkv, LoraTarget::linear_proj, LoraTarget::linear_fc1, LoraTarget::linear_fc2}) {
    std::string have, missing;
    for (int i = 0; i < kModuleCount; ++i) {
      if (kModules[i].target != t) continue;
      std::string& list = used[i] ? have : missing;
      list += (list.empty() ? "" : ", ") + std::string(kModules[i].name);
    }
    if (!have.empty() && !missing.empty())
      return errorf(
          "%s: target_modules has %s but not %s; nibble adapts them as one fused linear (%s), so an adapter "
          "must target all of them or none; %s",
          where.c_str(), have.c_str(), missing.c_str(), lora_target_name(t), kMergeInstead);
    if (!have.empty()) out->push_back(t);
  }
  if (out->empty()) return errorf("%s: target_modules is empty; the adapter adapts nothing", where.c_str());
  return Status::ok();
}

Status parse_fields(const json& j, const std::string& where, LoraSpec* spec, std::string* base_model) {
  const std::string type = json_string(j, "peft_type");
  if (type != "LORA")
    return errorf("%s: peft_type is \"%s\"; nibble reads only LoRA adapters (peft_type \"LORA\")", where.c_str(),
                  type.c_str());
  spec->rank = json_int(j, "r");
  spec->alpha = json_number(j, "lora_alpha");
  spec->dropout = is_unset(j, "lora_dropout") ? 0.0 : json_number(j, "lora_dropout");
  spec->use_rslora = is_unset(j, "use_rslora") ? false : json_bool(j, "use_rslora");
  NB_TRY(check_refused(j, where));
  NB_TRY(parse_target_modules(j, where, &spec->targets));
  base_model->clear();
  if (!is_unset(j, "base_model_name_or_path")) *base_model = json_string(j, "base_model_name_or_path");
  return Status::ok();
}
}  // namespace

std::string peft_adapter_config_json(const LoraAdapter& ad) {
  const LoraSpec& s = ad.spec;
  json target_modules = json::array();
  for (const ModuleName& m : kModules)
    for (LoraTarget t : s.targets)
      if (m.target == t) target_modules.push_back(m.name);
  json j;  // an object with sorted keys, as PEFT's json.dumps(sort_keys=True) writes them
  j["alpha_pattern"] = json::object();
  j["auto_mapping"] = nullptr;
  j["base_model_name_or_path"] = ad.base_model_name_or_path.empty() ? json(nullptr) : json(ad.base_model_name_or_path);
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["inference_mode"] = true;  // PeftModel.save_pretrained saves with inference_mode set
  j["init_lora_weights"] = true;
  j["layer_replication"] = nullptr;
  j["layers_pattern"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["loftq_config"] = json::object();
  // An integral alpha is written as an integer, as LoraConfig's int field is usually saved.
  const bool integral = s.alpha == std::floor(s.alpha) && std::fabs(s.alpha) < 9e15;
  j["lora_alpha"] = integral ? json(int64_t(s.alpha)) : json(s.alpha);
  j["lora_dropout"] = s.dropout;
  j["megatron_config"] = nullptr;
  j["megatron_core"] = "megatron.core";
  j["modules_to_save"] = nullptr;
  j["peft_type"] = "LORA";
  j["r"] = s.rank;
  j["rank_pattern"] = json::object();
  j["revision"] = nullptr;
  j["target_modules"] = target_modules;
  j["task_type"] = "CAUSAL_LM";
  j["use_dora"] = false;
  j["use_rslora"] = s.use_rslora;
  return j.dump(2) + "\n";
}

Status parse_peft_adapter_config(const std::string& text, const std::string& where, LoraSpec* spec,
                                 std::string* base_model) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) { return errorf("%s is not valid JSON (%s)", where.c_str(), e.what()); }
  if (!j.is_object())
    return errorf("%s does not hold a JSON object; it is not a PEFT adapter_config.json", where.c_str());
  try {
    NB_TRY(parse_fields(j, where, spec, base_model));
  } catch (const std::invalid_argument& e) {
    return errorf("%s: %s; a PEFT LoRA adapter_config.json has it as PEFT's save_pretrained writes it", where.c_str(),
                  e.what());
  }
  Status st = validate(*spec);
  return st.context(where);
}

}  // namespace nb
