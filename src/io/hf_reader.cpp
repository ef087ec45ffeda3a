// HfCheckpointReader: the headers of an HF model folder's safetensors files (single file or index +
// shards), and per-tensor reads at the recorded file offsets converted to FP32 in bounded chunks, so a
// model of many GB never sits in memory whole.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <nlohmann/json.hpp>
#include "core/bf16.h"
#include "io/hf_llama.h"

namespace nb {

namespace fs = std::filesystem;

Status HfCheckpointReader::add_file(const std::string& path, const std::vector<std::string>* expected) {
  SafeTensorsHeader h;
  NB_TRY(read_safetensors_header(path, &h));
  if (expected) {
    for (const auto& name : *expected)
      if (!h.tensors.count(name))
        return errorf(
            "%s maps tensor '%s' to %s, but that file does not hold it; the folder is inconsistent "
            "(re-download or re-export it)",
            where_.c_str(), name.c_str(), path.c_str());
  }
  for (auto& [name, e] : h.tensors) {
    auto it = entries_.find(name);
    if (it != entries_.end())
      return errorf("tensor '%s' appears in both %s and %s; a checkpoint must hold each tensor once", name.c_str(),
                    it->second.file.c_str(), path.c_str());
    entries_[name] = {path, e};
  }
  return Status::ok();
}

Status HfCheckpointReader::open_file(const std::string& path) {
  entries_.clear();
  where_ = path;
  return add_file(path, nullptr);
}

Status HfCheckpointReader::open(const std::string& dir) {
  entries_.clear();
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single = fs::path(dir) / "model.safetensors";
  where_ = index.string();
  if (!fs::exists(index)) {
    if (!fs::exists(single))
      return errorf(
          "%s holds neither model.safetensors nor model.safetensors.index.json; pass a Hugging Face model "
          "folder saved with safetensors",
          dir.c_str());
    where_ = single.string();
    return add_file(single.string(), nullptr);
  }
  nlohmann::json j;
  try {
    std::ifstream in(index);
    if (!in) return errorf("cannot open %s: %s", where_.c_str(), std::strerror(errno));
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) { return errorf("%s is not valid JSON (%s)", where_.c_str(), e.what()); }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    return errorf("%s has no \"weight_map\" object mapping tensor names to shard files", where_.c_str());
  std::map<std::string, std::vector<std::string>> by_file;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it.value().is_string())
      return errorf("%s: weight_map[\"%s\"] is not a file name", where_.c_str(), it.key().c_str());
    const std::string file = it.value().get<std::string>();
    // Shards are plain names beside the index: never read outside the folder.
    if (file.empty() || file.find('/') != std::string::npos || file.find('\\') != std::string::npos || file == "..")
      return errorf("%s: weight_map[\"%s\"] names '%s', which is not a file in the folder", where_.c_str(),
                    it.key().c_str(), file.c_str());
    by_file[file].push_back(it.key());
  }
  if (by_file.empty()) return errorf("%s: weight_map is empty", where_.c_str());
  for (const auto& [file, names] : by_file) {
    const fs::path p = fs::path(dir) / file;
    if (!fs::exists(p))
      return errorf("%s names the shard %s, which does not exist; the download or export is incomplete", where_.c_str(),
                    p.string().c_str());
    NB_TRY(add_file(p.string(), &names));
  }
  return Status::ok();
}

const std::vector<int64_t>& HfCheckpointReader::shape(const std::string& name) const {
  NB_CHECK(has(name), "HfCheckpointReader: no tensor %s", name.c_str());
  return entries_.at(name).e.shape;
}
const std::string& HfCheckpointReader::dtype(const std::string& name) const {
  NB_CHECK(has(name), "HfCheckpointReader: no tensor %s", name.c_str());
  return entries_.at(name).e.dtype;
}
const std::string& HfCheckpointReader::file_of(const std::string& name) const {
  NB_CHECK(has(name), "HfCheckpointReader: no tensor %s", name.c_str());
  return entries_.at(name).file;
}
std::vector<std::string> HfCheckpointReader::names() const {
  std::vector<std::string> out;
  for (const auto& [name, e] : entries_) out.push_back(name);
  return out;
}

Status HfCheckpointReader::read_f32(const std::string& name, float* dst) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) return errorf("%s holds no tensor '%s'", where_.c_str(), name.c_str());
  const Entry& en = it->second;
  const std::string& dt = en.e.dtype;
  const int esize = safetensors_dtype_size(dt);
  if (dt != "BF16" && dt != "F16" && dt != "F32")
    return errorf("%s: tensor '%s' is %s; nibble reads BF16, F16 or F32 weights (convert the checkpoint first)",
                  en.file.c_str(), name.c_str(), dt.c_str());
  std::ifstream f(en.file, std::ios::binary);
  if (!f) return errorf("cannot open %s: %s", en.file.c_str(), std::strerror(errno));
  f.seekg(std::streamoff(en.e.file_offset));
  const uint64_t numel = en.e.nbytes / uint64_t(esize);
  constexpr uint64_t kChunk = uint64_t(1) << 24;  // elements per read: bounded staging for huge tensors
  std::vector<uint8_t> buf(size_t(std::min(numel, kChunk)) * size_t(esize));
  const bool is_bf16 = dt == "BF16";
  for (uint64_t done = 0; done < numel;) {
    const uint64_t n = std::min(kChunk, numel - done);
    f.read(reinterpret_cast<char*>(buf.data()), std::streamsize(n * uint64_t(esize)));
    if (!f) return errorf("%s: short read of tensor '%s' (file truncated?)", en.file.c_str(), name.c_str());
    float* out = dst + done;
    if (dt == "F32") {
      std::memcpy(out, buf.data(), size_t(n) * 4);
    } else {
      for (uint64_t i = 0; i < n; ++i) {
        uint16_t bits;
        std::memcpy(&bits, buf.data() + 2 * i, 2);
        out[i] = is_bf16 ? bf16_to_f32(bf16::from_bits(bits)) : f16_to_f32(f16{bits});
      }
    }
    done += n;
  }
  return Status::ok();
}

}  // namespace nb
