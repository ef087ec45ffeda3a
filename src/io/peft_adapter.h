// LoRA adapters in nibble's fused layout, and their Hugging Face PEFT form (adapter_config.json +
// adapter_model.safetensors) in and out, plus merging an adapter into HF-named FP32 weights on export.
//
// nibble adapts fused linears, named as Megatron-Bridge names them: linear_qkv ([q; k; v] rows, one
// [qd + 2 kvd, H] weight), linear_proj (o_proj), linear_fc1 ([gate; up] rows, one [2F, H] weight) and
// linear_fc2 (down_proj). One LoRA on a fused linear is one A [r, in] and one B [out, r]. PEFT adapts
// the separate HF modules, so a fused LoRA exports exactly: q_proj, k_proj and v_proj (gate_proj and
// up_proj) each get a copy of the shared A and their own rows of B, since [Bq; Bk; Bv] A = [Bq A; Bk A;
// Bv A]. Reading back needs the copies of A to be bitwise equal; an adapter trained by PEFT with
// separate A per module cannot be expressed as one fused LoRA of the same rank and is refused.
//
// Defaults are Megatron-Bridge's (megatron/bridge/peft/lora.py: dim 32, alpha 32, dropout 0, all four
// targets), not PEFT's (r 8, lora_alpha 8), because nibble's flags use Megatron-Bridge's names and a
// user switching from it expects its numbers. Scale = alpha / r (PEFT's use_rslora: alpha / sqrt(r)).
// Dropout is applied to the LoRA input (Megatron-Bridge's dropout_position "pre", PEFT's
// lora_B(lora_A(dropout(x)))). nibble's RoPE is HF's rotate-half, so q/k rows need no permutation.
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include "core/status.h"
#include "io/hf_llama.h"
#include "model/hf_layout.h"
#include "model/llama_config.h"

namespace nb {

enum class LoraTarget { linear_qkv, linear_proj, linear_fc1, linear_fc2 };
inline constexpr int kLoraTargetCount = 4;

// "linear_qkv,linear_proj,linear_fc1,linear_fc2" (any subset, any order, spaces around names ignored)
// or "all-linear" (PEFT's spelling: all four; the LM head is never adapted). The result is in the
// enum's order without repeats; an unknown, repeated or empty name is an error naming the valid ones.
Status parse_lora_targets(const std::string& csv, std::vector<LoraTarget>* out);
const char* lora_target_name(LoraTarget t);

struct LoraSpec {
  int64_t rank = 32;        // Megatron-Bridge's dim (PEFT's r)
  double alpha = 32.0;      // Megatron-Bridge's alpha (PEFT's lora_alpha)
  double dropout = 0.0;     // probability, on the LoRA input
  bool use_rslora = false;  // PEFT's rank-stabilized scale alpha / sqrt(r), read from PEFT adapters
  std::vector<LoraTarget> targets = {LoraTarget::linear_qkv, LoraTarget::linear_proj, LoraTarget::linear_fc1,
                                     LoraTarget::linear_fc2};
  double scale() const;
};
// rank >= 1, alpha finite and > 0, dropout in [0, 1), at least one target, no target twice.
Status validate(const LoraSpec& s);

// One adapted fused linear in nibble's layout: A [rank, in], B [out, rank], FP32 row-major. The
// weight's update is scale * B @ A (out x in, as the weight [out, in]).
struct LoraLinear {
  int64_t layer = 0;
  LoraTarget target = LoraTarget::linear_qkv;
  int64_t in = 0, out = 0;
  std::vector<float> a, b;
};

struct LoraAdapter {
  LoraSpec spec;
  // One per (layer, target of spec.targets), layer-major, targets in spec order (lora_allocate's order).
  std::vector<LoraLinear> linears;
  std::string base_model_name_or_path;  // written to adapter_config.json (null when empty)
};

// in/out features of a target's fused linear: qkv H -> qd + 2 kvd, proj qd -> H, fc1 H -> 2F, fc2 F -> H.
void lora_target_shape(const LlamaConfig& c, LoraTarget t, int64_t* in, int64_t* out);

// The PEFT (HF) modules a target becomes: the module path inside a layer and its rows of the fused B.
struct PeftModule {
  const char* path;  // "self_attn.q_proj", ..., "mlp.down_proj"
  int64_t row0 = 0, rows = 0;
};
std::vector<PeftModule> peft_modules(const LlamaConfig& c, LoraTarget t);

// Fills out->linears with zeroed A and B for every layer and target of spec (in the order above).
void lora_allocate(const LlamaConfig& c, const LoraSpec& spec, LoraAdapter* out);
// The linear of (layer, target), or nullptr when the adapter has none.
const LoraLinear* lora_find(const LoraAdapter& ad, int64_t layer, LoraTarget t);
// The adapter matches c and its spec: every (layer, target) once, shapes and sizes as c says.
Status check_lora_adapter(const LoraAdapter& ad, const LlamaConfig& c);

struct PeftWriteOptions {
  // fp32 (default) or bf16 (round to nearest even). FP32 is what PEFT itself saves by default: it
  // upcasts adapter weights to float32 (autocast_adapter_dtype=True) even on a BF16 base model, and
  // an adapter is small, so rounding it would throw away precision for little gain.
  std::string dtype = "fp32";
};
// Writes DIR/adapter_config.json and DIR/adapter_model.safetensors (names
// base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight, as PEFT's
// save_pretrained writes them with the adapter name removed). DIR must not exist or be empty; the files
// are staged in DIR.partial and renamed, so DIR is complete or absent.
Status write_peft_adapter(const std::string& dir, const LlamaConfig& c, const LoraAdapter& ad,
                          const PeftWriteOptions& opt = {});
// Reads a PEFT LoRA folder for a model of config c into nibble's fused layout. Refused, with the reason:
// a peft_type other than LORA, DoRA, LoRA biases, rank_pattern/alpha_pattern, layers_to_transform,
// exclude_modules, modules_to_save, initializations that change the base weights (PiSSA, OLoRA, CorDA,
// LoftQ), target modules other than the seven Llama projections or a fused group only in part (q_proj
// without k_proj, ...), a missing, misshapen or unexpected tensor, unequal lora_A across a fused group.
// use_rslora is supported (spec.use_rslora). BF16, F16 and F32 tensors are read exactly.
Status read_peft_adapter(const std::string& dir, const LlamaConfig& c, LoraAdapter* out);

// W += scale * B @ A for HF tensor t (values: its t.numel FP32 values, row-major) when t is the weight
// of an adapted module (model.layers.{i}.self_attn.q_proj.weight takes rows [0, qd) of layer i's
// linear_qkv B, ...); any other tensor is left untouched. Each element is W + scale * sum_k B A
// accumulated in FP64 and rounded once to FP32. Export calls it per tensor (see lora_merged_source).
Status lora_merge_into(const LoraAdapter& ad, const LlamaConfig& c, const HfTensor& t, float* values);
// `base` with the adapter merged into what it returns; ad must outlive the returned source.
HfTensorSource lora_merged_source(const LoraAdapter& ad, const LlamaConfig& c, HfTensorSource base);

}  // namespace nb
