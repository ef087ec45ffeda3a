// PEFT's adapter_config.json for nibble's LoRA adapters: writing one that PeftModel.from_pretrained
// loads (LoraConfig's fields with sort_keys and indent 2, as PeftConfigMixin.save_pretrained writes
// them; every LoraConfig field has a default, and older PEFT versions drop keys they do not know with a
// warning) and reading one, refusing every setting a fused nibble LoRA cannot represent.
#pragma once
#include <string>
#include "core/status.h"
#include "io/peft_adapter.h"

namespace nb {

// The JSON text of DIR/adapter_config.json for adapter ad (target_modules as HF module names).
std::string peft_adapter_config_json(const LoraAdapter& ad);
// Parses adapter_config.json text into spec (rank, alpha, dropout, use_rslora, targets) and the base
// model's name (empty when null); `where` names the file in error sentences.
Status parse_peft_adapter_config(const std::string& text, const std::string& where, LoraSpec* spec,
                                 std::string* base_model);

}  // namespace nb
