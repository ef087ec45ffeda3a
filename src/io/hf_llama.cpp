// HF Llama weights into a ParamStore (every expected tensor checked by name and shape first, so a bad
// folder is refused before anything is loaded) and out to an HF folder, streamed one tensor at a time.
#include "io/hf_llama.h"
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <nlohmann/json.hpp>
#include "core/bf16.h"
#include "core/log.h"

namespace nb {

namespace fs = std::filesystem;

namespace {
bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Tensors transformers itself ignores when loading a LlamaForCausalLM.
bool ignorable_extra(const std::string& name, bool tied) {
  return ends_with(name, "rotary_emb.inv_freq") || (tied && name == "lm_head.weight");
}

// Shape fields of two configs; the first difference as a sentence.
Status compare_shapes(const LlamaConfig& hf, const LlamaConfig& model, const std::string& where) {
  struct F {
    const char* hf_name;
    int64_t a, b;
  };
  const F fields[] = {{"hidden_size", hf.hidden, model.hidden},
                      {"intermediate_size", hf.ffn, model.ffn},
                      {"num_hidden_layers", hf.layers, model.layers},
                      {"num_attention_heads", hf.heads, model.heads},
                      {"num_key_value_heads", hf.kv_heads, model.kv_heads},
                      {"head_dim", hf.head_dim, model.head_dim},
                      {"vocab_size", hf.vocab, model.vocab},
                      {"tie_word_embeddings", hf.tied_embeddings, model.tied_embeddings}};
  for (const F& f : fields)
    if (f.a != f.b)
      return errorf(
          "%s: %s is %lld but model '%s' has %lld; load it with a model of the same shape (or without "
          "--model, so its config.json decides)",
          where.c_str(), f.hf_name, (long long)f.a, model.name.c_str(), (long long)f.b);
  if (hf.rope_theta != model.rope_theta || hf.rope_factor != model.rope_factor || hf.norm_eps != model.norm_eps)
    NB_LOG_WARN(
        "%s: RoPE or RMSNorm settings differ from model '%s' (rope_theta %g vs %g, rope factor %g vs %g, "
        "eps %g vs %g); the weights are loaded, but the model keeps its own settings",
        where.c_str(), model.name.c_str(), hf.rope_theta, model.rope_theta, hf.rope_factor, model.rope_factor,
        double(hf.norm_eps), double(model.norm_eps));
  return Status::ok();
}
}  // namespace

std::vector<HfTensor> hf_expected_tensors(const LlamaConfig& c) {
  std::vector<HfTensor> out;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    out.push_back({name, std::move(shape), 0, n});
  };
  add("model.embed_tokens.weight", {c.vocab, c.hidden});
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "self_attn.q_proj.weight", {c.q_dim(), c.hidden});
    add(p + "self_attn.k_proj.weight", {c.kv_dim(), c.hidden});
    add(p + "self_attn.v_proj.weight", {c.kv_dim(), c.hidden});
    add(p + "self_attn.o_proj.weight", {c.hidden, c.q_dim()});
    add(p + "mlp.gate_proj.weight", {c.ffn, c.hidden});
    add(p + "mlp.up_proj.weight", {c.ffn, c.hidden});
    add(p + "mlp.down_proj.weight", {c.hidden, c.ffn});
    add(p + "input_layernorm.weight", {c.hidden});
    add(p + "post_attention_layernorm.weight", {c.hidden});
  }
  add("model.norm.weight", {c.hidden});
  if (!c.tied_embeddings) add("lm_head.weight", {c.vocab, c.hidden});
  return out;
}

Status check_hf_tensors(const HfCheckpointReader& r, const std::vector<HfTensor>& expected, bool tied) {
  std::set<std::string> wanted;
  for (const HfTensor& t : expected) {
    wanted.insert(t.name);
    if (!r.has(t.name))
      return errorf(
          "%s has no tensor '%s' (%s), which this Llama needs; the folder is incomplete or its config.json "
          "describes a different model",
          r.where().c_str(), t.name.c_str(), shape_text(t.shape).c_str());
    if (r.shape(t.name) != t.shape)
      return errorf("%s: tensor '%s' has shape %s but the config needs %s; config.json and the weights disagree",
                    r.file_of(t.name).c_str(), t.name.c_str(), shape_text(r.shape(t.name)).c_str(),
                    shape_text(t.shape).c_str());
    const std::string& dt = r.dtype(t.name);
    if (dt != "BF16" && dt != "F16" && dt != "F32")
      return errorf("%s: tensor '%s' is %s; nibble reads BF16, F16 or F32 weights (dequantize the checkpoint first)",
                    r.file_of(t.name).c_str(), t.name.c_str(), dt.c_str());
  }
  for (const std::string& name : r.names())
    if (!wanted.count(name) && !ignorable_extra(name, tied))
      return errorf(
          "%s holds tensor '%s', which a Llama of this config has no place for (another architecture, or "
          "an adapter?); remove it or convert the checkpoint",
          r.file_of(name).c_str(), name.c_str());
  return Status::ok();
}

Status read_hf_weights(const HfCheckpointReader& r, const std::vector<HfTensor>& expected, bool tied,
                       float* host_flat) {
  NB_TRY(check_hf_tensors(r, expected, tied));
  for (const HfTensor& t : expected) NB_TRY(r.read_f32(t.name, host_flat + t.flat_offset));
  return Status::ok();
}

Status load_hf_weights(const HfCheckpointReader& r, const LlamaConfig& model_cfg, ParamStore& params) {
  std::vector<float> host(size_t(params.total()), 0.0f);  // the padding between parameters stays zero
  if (params.tensor_parallel_shard().on()) {              // the whole model read, this rank's slices kept
    int64_t whole_total = 0;
    const std::vector<ParamInfo> wl = ParamStore::flat_layout(params.tensor_parallel_whole(), &whole_total);
    std::vector<float> whole(size_t(whole_total), 0.0f);
    NB_TRY(read_hf_weights(r, hf_tensors(wl), model_cfg.tied_embeddings, whole.data()));
    params.slice_whole(whole.data(), host.data());
    return params.set_master(host.data());
  }
  NB_TRY(read_hf_weights(r, hf_tensors(params), model_cfg.tied_embeddings, host.data()));
  return params.set_master(host.data());
}

Status load_hf_weights(const std::string& dir, const LlamaConfig& model_cfg, ParamStore& params) {
  LlamaConfig hf;
  NB_TRY(read_hf_config(dir, &hf));
  NB_TRY(compare_shapes(hf, model_cfg, (fs::path(dir) / "config.json").string()));
  HfCheckpointReader r;
  NB_TRY(r.open(dir));
  return load_hf_weights(r, model_cfg, params);
}

Status parse_shard_size(const std::string& s, int64_t* bytes) {
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  std::string unit = s.substr(i);
  for (char& ch : unit) ch = char(std::toupper(static_cast<unsigned char>(ch)));
  const struct {
    const char* name;
    double mult;
  } units[] = {{"", 1},     {"B", 1},        {"KB", 1e3},        {"MB", 1e6},
               {"GB", 1e9}, {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}};
  double v = 0;
  try {
    v = i ? std::stod(s.substr(0, i)) : -1;
  } catch (const std::exception&) { v = -1; }
  for (const auto& u : units)
    if (unit == u.name && v > 0) {
      *bytes = int64_t(v * u.mult);
      return Status::ok();
    }
  return errorf("--max-shard-size '%s' is not a size; write e.g. 5GB, 500MB, 2GiB or a byte count", s.c_str());
}

}  // namespace nb
