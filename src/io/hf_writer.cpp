// write_hf_folder: an HF Llama folder streamed one tensor at a time (memory: the largest tensor), in
// transformers' state-dict order split greedily into shards of at most max_shard_bytes (a larger
// tensor gets a shard of its own, as transformers does). Everything is written into OUT.partial and
// renamed to OUT at the end, so OUT is either complete or absent.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <tuple>
#include <nlohmann/json.hpp>
#include "core/bf16.h"
#include "io/file_util.h"
#include "io/hf_llama.h"

namespace nb {

namespace fs = std::filesystem;

namespace {
// Position in LlamaForCausalLM's state dict: embedding, layers (attention, MLP, norms), final norm, head.
std::tuple<int, int64_t, int> hf_order_key(const std::string& name) {
  static const char* kInLayer[] = {
      "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
      "self_attn.o_proj.weight", "mlp.gate_proj.weight",    "mlp.up_proj.weight",
      "mlp.down_proj.weight",    "input_layernorm.weight",  "post_attention_layernorm.weight"};
  if (name == "model.embed_tokens.weight") return {0, 0, 0};
  if (name == "model.norm.weight") return {2, 0, 0};
  if (name == "lm_head.weight") return {3, 0, 0};
  const std::string prefix = "model.layers.";
  if (name.compare(0, prefix.size(), prefix) == 0) {
    size_t dot = name.find('.', prefix.size());
    if (dot != std::string::npos) {
      const int64_t layer = std::atoll(name.c_str() + prefix.size());
      const std::string rest = name.substr(dot + 1);
      for (int i = 0; i < 9; ++i)
        if (rest == kInLayer[i]) return {1, layer, i};
      return {1, layer, 9};
    }
  }
  return {4, 0, 0};
}

struct Shard {
  std::vector<const HfTensor*> tensors;
  int64_t bytes = 0;
};

std::vector<Shard> plan_shards(const std::vector<HfTensor>& tensors, int esize, int64_t max_bytes) {
  std::vector<const HfTensor*> order;
  for (const HfTensor& t : tensors) order.push_back(&t);
  std::stable_sort(order.begin(), order.end(),
                   [](const HfTensor* a, const HfTensor* b) { return hf_order_key(a->name) < hf_order_key(b->name); });
  std::vector<Shard> shards(1);
  for (const HfTensor* t : order) {
    const int64_t b = t->numel * esize;
    if (!shards.back().tensors.empty() && shards.back().bytes + b > max_bytes) shards.emplace_back();
    shards.back().tensors.push_back(t);
    shards.back().bytes += b;
  }
  return shards;
}

// One safetensors file written as the reference writer lays it out (one dtype: tensors by name), data
// streamed from `source`.
Status write_shard(const std::string& path, std::vector<const HfTensor*> ts, bool bf16_out,
                   const HfTensorSource& source) {
  std::sort(ts.begin(), ts.end(), [](const HfTensor* a, const HfTensor* b) { return a->name < b->name; });
  const int esize = bf16_out ? 2 : 4;
  nlohmann::ordered_json j;
  j["__metadata__"] = {{"format", "pt"}};
  uint64_t pos = 0;
  for (const HfTensor* t : ts) {
    const uint64_t n = uint64_t(t->numel) * uint64_t(esize);
    j[t->name] = {{"dtype", bf16_out ? "BF16" : "F32"}, {"shape", t->shape}, {"data_offsets", {pos, pos + n}}};
    pos += n;
  }
  std::string header = j.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return errorf("cannot write %s: %s", path.c_str(), std::strerror(errno));
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(header.size()) >> (8 * i));
  f.write(reinterpret_cast<const char*>(len), 8);
  f.write(header.data(), std::streamsize(header.size()));
  std::vector<float> buf;
  std::vector<uint16_t> half;
  for (const HfTensor* t : ts) {
    buf.resize(size_t(t->numel));
    NB_TRY(source(*t, buf.data()));
    if (bf16_out) {
      half.resize(buf.size());
      for (size_t i = 0; i < buf.size(); ++i) half[i] = f32_to_bf16(buf[i]).bits;
      f.write(reinterpret_cast<const char*>(half.data()), std::streamsize(half.size() * 2));
    } else {
      f.write(reinterpret_cast<const char*>(buf.data()), std::streamsize(buf.size() * 4));
    }
  }
  f.flush();
  if (!f) return errorf("writing %s failed (disk full?)", path.c_str());
  return Status::ok();
}

Status write_files(const fs::path& stage, const LlamaConfig& c, const std::vector<HfTensor>& tensors,
                   const HfTensorSource& source, const HfExportOptions& opt) {
  const bool bf16_out = opt.dtype == "bf16";
  const std::vector<Shard> shards = plan_shards(tensors, bf16_out ? 2 : 4, opt.max_shard_bytes);
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  std::vector<std::pair<std::string, std::string>> entries;
  int64_t total = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    const std::string file = shards.size() == 1 ? "model.safetensors" : name;
    NB_TRY(write_shard((stage / file).string(), shards[s].tensors, bf16_out, source));
    for (const HfTensor* t : shards[s].tensors) entries.push_back({t->name, file});
    total += shards[s].bytes;
  }
  if (shards.size() > 1) {
    std::sort(entries.begin(), entries.end());  // transformers writes the weight_map sorted by name
    for (const auto& [n, file] : entries) weight_map[n] = file;
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = weight_map;
    std::ofstream f(stage / "model.safetensors.index.json");
    f << index.dump(2) << "\n";
    if (!f) return errorf("cannot write %s", (stage / "model.safetensors.index.json").string().c_str());
  }
  {
    std::ofstream f(stage / "config.json");
    f << hf_config_json(c, bf16_out ? "bfloat16" : "float32", opt.bos_token_id, opt.eos_token_id);
    if (!f) return errorf("cannot write %s", (stage / "config.json").string().c_str());
  }
  if (!opt.tokenizer_file.empty()) {
    std::error_code ec;
    fs::copy_file(opt.tokenizer_file, stage / "tokenizer.json", ec);
    if (ec) return errorf("cannot copy the tokenizer %s: %s", opt.tokenizer_file.c_str(), ec.message().c_str());
  }
  return Status::ok();
}
}  // namespace

Status write_hf_folder(const std::string& out_dir, const LlamaConfig& c, const std::vector<HfTensor>& tensors,
                       const HfTensorSource& source, const HfExportOptions& opt) {
  if (opt.dtype != "bf16" && opt.dtype != "fp32")
    return errorf("export dtype '%s' is not supported; choose bf16 or fp32", opt.dtype.c_str());
  if (opt.max_shard_bytes <= 0) return errorf("the maximum shard size must be positive");
  if (!opt.tokenizer_file.empty() && !fs::is_regular_file(opt.tokenizer_file))
    return errorf("the tokenizer file %s does not exist", opt.tokenizer_file.c_str());
  if (tensors.empty()) return errorf("nothing to export: the tensor list is empty");
  NB_TRY(check_new_folder(out_dir, "output"));
  fs::path final_dir = fs::path(out_dir).lexically_normal();
  if (final_dir.filename().empty()) final_dir = final_dir.parent_path();
  const fs::path stage = final_dir.string() + ".partial";
  std::error_code ec;
  fs::remove_all(stage, ec);  // a previous export that crashed; it was never a complete folder
  fs::create_directories(stage, ec);
  if (ec) return errorf("cannot create %s: %s", stage.string().c_str(), ec.message().c_str());
  Status st = write_files(stage, c, tensors, source, opt);
  if (st) {
    if (fs::exists(final_dir)) fs::remove(final_dir, ec);  // checked empty above
    fs::rename(stage, final_dir, ec);
    if (ec)
      st = errorf("cannot rename %s to %s: %s", stage.string().c_str(), final_dir.string().c_str(),
                  ec.message().c_str());
  }
  if (!st) fs::remove_all(stage, ec);
  return st;
}

Status write_hf_folder(const std::string& out_dir, const LlamaConfig& c, const std::vector<HfTensor>& tensors,
                       const float* host_flat, const HfExportOptions& opt) {
  auto source = [host_flat](const HfTensor& t, float* dst) {
    std::memcpy(dst, host_flat + t.flat_offset, size_t(t.numel) * 4);
    return Status::ok();
  };
  return write_hf_folder(out_dir, c, tensors, source, opt);
}

}  // namespace nb
