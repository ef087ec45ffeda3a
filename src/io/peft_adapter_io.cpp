// write_peft_adapter and read_peft_adapter: a PEFT LoRA folder (adapter_config.json +
// adapter_model.safetensors) out of and into nibble's fused layout. Writing streams the tensors into a
// safetensors file laid out as the reference writer does (one dtype, sorted by name), durably (fsync),
// inside DIR.partial, renamed to DIR when complete. Reading checks every name and shape before reading
// any data, then rebuilds each fused A from its modules' copies, which must be bitwise equal.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <nlohmann/json.hpp>
#include "core/bf16.h"
#include "io/file_util.h"
#include "io/peft_adapter.h"
#include "io/peft_config.h"

namespace nb {

namespace fs = std::filesystem;

namespace {
constexpr const char* kConfigFile = "adapter_config.json";
constexpr const char* kWeightsFile = "adapter_model.safetensors";

// PEFT's saved key: the PeftModel prefix base_model.model., the HF module, lora_A/B without the adapter name.
std::string peft_tensor_name(int64_t layer, const char* path, char a_or_b) {
  return "base_model.model.model.layers." + std::to_string(layer) + "." + path + ".lora_" + a_or_b + ".weight";
}

struct OutTensor {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;  // shape's product of contiguous values
};

// Every module's A (the fused A, copied) and B (its rows of the fused B), sorted by name.
std::vector<OutTensor> export_tensors(const LlamaConfig& c, const LoraAdapter& ad) {
  const int64_t r = ad.spec.rank;
  std::vector<OutTensor> out;
  for (const LoraLinear& L : ad.linears)
    for (const PeftModule& m : peft_modules(c, L.target)) {
      out.push_back({peft_tensor_name(L.layer, m.path, 'A'), {r, L.in}, L.a.data()});
      out.push_back({peft_tensor_name(L.layer, m.path, 'B'), {m.rows, r}, L.b.data() + m.row0 * r});
    }
  std::sort(out.begin(), out.end(), [](const OutTensor& a, const OutTensor& b) { return a.name < b.name; });
  return out;
}

Status write_weights(const std::string& path, const std::vector<OutTensor>& ts, bool bf16_out) {
  const uint64_t esize = bf16_out ? 2 : 4;
  nlohmann::ordered_json j;
  j["__metadata__"] = {{"format", "pt"}};
  uint64_t pos = 0;
  for (const OutTensor& t : ts) {
    const uint64_t n = uint64_t(t.shape[0] * t.shape[1]) * esize;
    j[t.name] = {{"dtype", bf16_out ? "BF16" : "F32"}, {"shape", t.shape}, {"data_offsets", {pos, pos + n}}};
    pos += n;
  }
  std::string header = j.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(header.size()) >> (8 * i));
  DurableFile f;
  NB_TRY(f.open(path));
  NB_TRY(f.write(len, 8));
  NB_TRY(f.write(header.data(), header.size()));
  std::vector<uint16_t> half;
  for (const OutTensor& t : ts) {
    const size_t n = size_t(t.shape[0] * t.shape[1]);
    if (!bf16_out) {
      NB_TRY(f.write(t.data, n * 4));  // little-endian hosts only, as the rest of nibble's I/O
      continue;
    }
    half.resize(n);
    for (size_t i = 0; i < n; ++i) half[i] = f32_to_bf16(t.data[i]).bits;
    NB_TRY(f.write(half.data(), n * 2));
  }
  return f.finish();
}

Status write_text(const std::string& path, const std::string& text) {
  DurableFile f;
  NB_TRY(f.open(path));
  NB_TRY(f.write(text.data(), text.size()));
  return f.finish();
}

// DIR.partial's files renamed to DIR, with the folders synced so the rename survives a power loss.
Status publish(const fs::path& stage, const fs::path& final_dir) {
  NB_TRY(sync_folder(stage.string()));
  std::error_code ec;
  if (fs::exists(final_dir)) fs::remove(final_dir, ec);  // checked empty before staging
  fs::rename(stage, final_dir, ec);
  if (ec)
    return errorf("cannot rename %s to %s: %s", stage.string().c_str(), final_dir.string().c_str(),
                  ec.message().c_str());
  const fs::path parent = final_dir.has_parent_path() ? final_dir.parent_path() : fs::path(".");
  return sync_folder(parent.string());
}
}  // namespace

Status write_peft_adapter(const std::string& dir, const LlamaConfig& c, const LoraAdapter& ad,
                          const PeftWriteOptions& opt) {
  if (opt.dtype != "fp32" && opt.dtype != "bf16")
    return errorf("adapter dtype '%s' is not supported; choose fp32 (PEFT's default) or bf16", opt.dtype.c_str());
  NB_TRY(check_lora_adapter(ad, c));
  NB_TRY(check_new_folder(dir, "adapter"));
  fs::path final_dir = fs::path(dir).lexically_normal();
  if (final_dir.filename().empty()) final_dir = final_dir.parent_path();
  const fs::path stage = final_dir.string() + ".partial";
  std::error_code ec;
  fs::remove_all(stage, ec);  // left by a write that crashed; it was never a complete adapter
  fs::create_directories(stage, ec);
  if (ec) return errorf("cannot create %s: %s", stage.string().c_str(), ec.message().c_str());
  Status st = write_weights((stage / kWeightsFile).string(), export_tensors(c, ad), opt.dtype == "bf16");
  if (st) st = write_text((stage / kConfigFile).string(), peft_adapter_config_json(ad));
  if (st) st = publish(stage, final_dir);
  if (!st) fs::remove_all(stage, ec);
  return st;
}

namespace {
// Every tensor the spec needs is present with its shape, and nothing else is there.
Status check_peft_tensors(const HfCheckpointReader& r, const LlamaConfig& c, const LoraSpec& spec) {
  std::map<std::string, std::vector<int64_t>> expected;
  for (int64_t l = 0; l < c.layers; ++l)
    for (LoraTarget t : spec.targets) {
      int64_t in = 0, out = 0;
      lora_target_shape(c, t, &in, &out);
      for (const PeftModule& m : peft_modules(c, t)) {
        expected[peft_tensor_name(l, m.path, 'A')] = {spec.rank, in};
        expected[peft_tensor_name(l, m.path, 'B')] = {m.rows, spec.rank};
      }
    }
  for (const auto& [name, shape] : expected) {
    if (!r.has(name))
      return errorf(
          "%s has no tensor '%s' %s, which a rank-%lld LoRA on the targets of its adapter_config.json needs "
          "for model '%s'; the adapter is incomplete or for another model",
          r.where().c_str(), name.c_str(), shape_text(shape).c_str(), (long long)spec.rank, c.name.c_str());
    if (r.shape(name) != shape)
      return errorf(
          "%s: tensor '%s' is %s but a rank-%lld LoRA of model '%s' needs %s; the adapter is for another "
          "model or its r does not match its tensors",
          r.where().c_str(), name.c_str(), shape_text(r.shape(name)).c_str(), (long long)spec.rank, c.name.c_str(),
          shape_text(shape).c_str());
  }
  for (const std::string& name : r.names())
    if (!expected.count(name))
      return errorf(
          "%s holds tensor '%s', which nibble does not expect for model '%s' (only lora_A/lora_B of the "
          "targeted projections of its %lld layers); it is not a plain LoRA adapter of this model",
          r.where().c_str(), name.c_str(), c.name.c_str(), (long long)c.layers);
  return Status::ok();
}

// One fused linear from its PEFT modules: A from the first module (the others' A must equal it bitwise),
// B's rows from each module.
Status read_linear(const HfCheckpointReader& r, const LlamaConfig& c, int64_t rank, LoraLinear* L) {
  const std::vector<PeftModule> mods = peft_modules(c, L->target);
  std::vector<float> other(L->a.size());
  for (size_t i = 0; i < mods.size(); ++i) {
    const std::string a_name = peft_tensor_name(L->layer, mods[i].path, 'A');
    NB_TRY(r.read_f32(a_name, i == 0 ? L->a.data() : other.data()));
    size_t e = 0;  // the first element whose bits differ (-0 and +0 differ: the copies are exact)
    while (i > 0 && e < other.size() && f32_bits(other[e]) == f32_bits(L->a[e])) ++e;
    if (i > 0 && e < other.size())
      return errorf(
          "%s: '%s' differs from the lora_A of %s (first at [%lld, %lld]: %.9g vs %.9g); nibble adapts %s as one fused "
          "linear (%s), so their lora_A must be equal, as in adapters nibble writes; %s",
          r.where().c_str(), a_name.c_str(), mods[0].path, (long long)(int64_t(e) / L->in),
          (long long)(int64_t(e) % L->in), double(other[e]), double(L->a[e]),
          L->target == LoraTarget::linear_qkv ? "q_proj, k_proj and v_proj" : "gate_proj and up_proj",
          lora_target_name(L->target),
          "an adapter trained with separate lora_A per module can be merged with PEFT's merge_and_unload instead");
    NB_TRY(r.read_f32(peft_tensor_name(L->layer, mods[i].path, 'B'), L->b.data() + mods[i].row0 * rank));
  }
  return Status::ok();
}
}  // namespace

Status read_peft_adapter(const std::string& dir, const LlamaConfig& c, LoraAdapter* out) {
  const fs::path config = fs::path(dir) / kConfigFile, weights = fs::path(dir) / kWeightsFile;
  std::ifstream in(config);
  if (!in)
    return errorf("%s has no readable %s; pass a LoRA adapter folder saved by PEFT's save_pretrained or by nibble",
                  dir.c_str(), kConfigFile);
  std::stringstream text;
  text << in.rdbuf();
  LoraAdapter ad;
  NB_TRY(parse_peft_adapter_config(text.str(), config.string(), &ad.spec, &ad.base_model_name_or_path));
  if (!fs::exists(weights))
    return errorf(
        "%s has no %s%s; nibble reads adapters saved with safetensors (PEFT's default, "
        "safe_serialization=True)",
        dir.c_str(), kWeightsFile, fs::exists(fs::path(dir) / "adapter_model.bin") ? ", only adapter_model.bin" : "");
  HfCheckpointReader r;
  NB_TRY(r.open_file(weights.string()));
  NB_TRY(check_peft_tensors(r, c, ad.spec));
  LoraAdapter filled;
  lora_allocate(c, ad.spec, &filled);
  filled.base_model_name_or_path = ad.base_model_name_or_path;
  for (LoraLinear& L : filled.linears) NB_TRY(read_linear(r, c, filled.spec.rank, &L));
  *out = std::move(filled);
  return Status::ok();
}

}  // namespace nb
