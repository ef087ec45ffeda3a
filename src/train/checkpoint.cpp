// Checkpoint folders: durable writes (temporary folder, fsync, rename, tracker), retention, lookup,
// verification (CRC-32 per file) and streaming reads of the safetensors files.
#include "train/checkpoint.h"
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include "io/file_util.h"
#include "io/hf_llama.h"
#include "io/json_checked.h"
#include "io/safetensors.h"

namespace nb {

namespace fs = std::filesystem;

namespace {

constexpr const char* kTracker = "latest_checkpointed_iteration.txt";

// One group of tensors: every layout tensor under "<name><suffix>", read from a host flat array.
struct TensorGroup {
  std::string suffix;
  const float* host_flat;
};

// safetensors header for F32 tensors written group by group in `layout` order, padded to 8 bytes.
std::string safetensors_header(const std::vector<HfTensor>& layout, const std::vector<TensorGroup>& groups) {
  nlohmann::json h;
  h["__metadata__"] = {{"format", "pt"}};
  uint64_t off = 0;
  for (const TensorGroup& g : groups)
    for (const HfTensor& t : layout) {
      const uint64_t bytes = uint64_t(t.numel) * 4;
      h[t.name + g.suffix] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {off, off + bytes}}};
      off += bytes;
    }
  std::string s = h.dump();
  s.append((8 - s.size() % 8) % 8, ' ');
  return s;
}

Status write_tensor_file(const std::string& path, const std::vector<HfTensor>& layout,
                         const std::vector<TensorGroup>& groups, nlohmann::json* entry) {
  const std::string header = safetensors_header(layout, groups);
  const uint64_t n = header.size();
  DurableFile f;
  NB_TRY(f.open(path));
  NB_TRY(f.write(&n, 8));  // little-endian hosts only (x86-64, aarch64)
  NB_TRY(f.write(header.data(), header.size()));
  for (const TensorGroup& g : groups)
    for (const HfTensor& t : layout) NB_TRY(f.write(g.host_flat + t.flat_offset, size_t(t.numel) * 4));
  NB_TRY(f.finish());
  *entry = {{"bytes", f.size()}, {"crc32", f.crc32()}};
  return Status::ok();
}

// CRC-32 of the state's canonical dump without the field itself.
Status checksum_failure(const CheckpointRef& ref, const std::string& name, uint64_t size, uint32_t crc,
                        uint64_t want_size, uint64_t want_crc) {
  return errorf(
      "%s/%s fails its checksum (%llu bytes, CRC-32 %08x; trainer_state.json records %llu bytes, %08llx): "
      "the file is damaged or truncated; load an older checkpoint with --ckpt-step N",
      ref.dir.c_str(), name.c_str(), (unsigned long long)size, crc, (unsigned long long)want_size,
      (unsigned long long)want_crc);
}

// A byte range of a checkpoint file and where it goes.
struct FileCopy {
  uint64_t offset, bytes;
  char* dst;
};

// The copies that fill `targets` from a safetensors header, sorted by file offset; every tensor must be F32
// in its layout shape.
Status plan_copies(const std::string& path, const SafeTensorsHeader& h, const std::vector<HfTensor>& layout,
                   const std::vector<CheckpointTarget>& targets, std::vector<FileCopy>* out) {
  for (const CheckpointTarget& t : targets)
    for (const HfTensor& x : layout) {
      const std::string name = x.name + t.suffix;
      auto it = h.tensors.find(name);
      if (it == h.tensors.end()) return errorf("%s has no tensor %s", path.c_str(), name.c_str());
      if (it->second.dtype != "F32" || it->second.shape != x.shape)
        return errorf("%s: tensor %s is %s %s, expected F32 %s", path.c_str(), name.c_str(), it->second.dtype.c_str(),
                      nlohmann::json(it->second.shape).dump().c_str(), nlohmann::json(x.shape).dump().c_str());
      out->push_back({it->second.file_offset, it->second.nbytes, reinterpret_cast<char*>(t.host_flat + x.flat_offset)});
    }
  std::sort(out->begin(), out->end(), [](const FileCopy& a, const FileCopy& b) { return a.offset < b.offset; });
  return Status::ok();
}

// The file's bytes [offset, offset + bytes) as they pass (file_crc32's visitor): each copy's part of them.
// Copies are sorted by offset and disjoint (safetensors spans tile the buffer).
void copy_out_block(const std::vector<FileCopy>& copies, size_t* next, const char* data, size_t bytes,
                    uint64_t offset) {
  const uint64_t end = offset + bytes;
  while (*next < copies.size() && copies[*next].offset + copies[*next].bytes <= offset) ++*next;
  for (size_t i = *next; i < copies.size() && copies[i].offset < end; ++i) {
    const uint64_t a = std::max(offset, copies[i].offset), b = std::min(end, copies[i].offset + copies[i].bytes);
    if (b > a) std::memcpy(copies[i].dst + (a - copies[i].offset), data + (a - offset), size_t(b - a));
  }
}

uint32_t state_crc(nlohmann::json state) {
  state.erase("state_crc32");
  const std::string s = state.dump();
  return crc32_of(s.data(), s.size());
}

Status remove_tree(const fs::path& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
  if (ec) return errorf("cannot remove %s: %s", p.c_str(), ec.message().c_str());
  return Status::ok();
}

// Deletes every iter_* folder (complete or left by a killed save) but the newest `keep` complete ones;
// the tracker's folder is always kept.
Status prune(const std::string& save_dir, int64_t keep, int64_t tracked) {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(save_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("iter_", 0) != 0 || !e.is_directory()) continue;
    const bool tmp = name.find(".tmp") != std::string::npos || name.find(".old") != std::string::npos;
    int64_t it = -1;
    if (!tmp && std::sscanf(name.c_str(), "iter_%ld", &it) != 1) continue;
    found.push_back({tmp ? -1 : it, e.path()});
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  int64_t kept = 1;  // the tracker's checkpoint
  for (const auto& [it, path] : found) {
    if (it >= tracked) continue;  // the tracked one, or newer (another timeline's): left alone
    if (it >= 0 && kept < keep) {
      ++kept;
      continue;
    }
    NB_TRY(remove_tree(path));  // older than the newest `keep`, or a killed save's .tmp/.old
  }
  return Status::ok();
}

}  // namespace

std::string checkpoint_folder_name(int64_t iteration) { return strprintf("iter_%07lld", (long long)iteration); }

Status write_checkpoint(const std::string& save_dir, const CheckpointData& data, int64_t keep,
                        CheckpointWriteStats* stats) {
  const auto t0 = std::chrono::steady_clock::now();
  const fs::path final_dir = fs::path(save_dir) / checkpoint_folder_name(data.iteration);
  const fs::path tmp_dir = final_dir.string() + ".tmp";
  NB_TRY(remove_tree(tmp_dir));  // a killed save of the same iteration
  std::error_code ec;
  fs::create_directories(tmp_dir, ec);
  if (ec) return errorf("cannot create checkpoint folder %s: %s", tmp_dir.c_str(), ec.message().c_str());
  nlohmann::json state = data.state, files;
  Status st = write_tensor_file((tmp_dir / "model.safetensors").string(), data.layout, {{"", data.master}},
                                &files["model.safetensors"]);
  if (st)
    st = write_tensor_file((tmp_dir / "optimizer.safetensors").string(), data.layout,
                           {{".exp_avg", data.exp_avg}, {".exp_avg_sq", data.exp_avg_sq}},
                           &files["optimizer.safetensors"]);
  if (st) {
    state["files"] = files;
    state["state_crc32"] = state_crc(state);
    DurableFile f;
    const std::string text = state.dump(1);
    st = f.open((tmp_dir / "trainer_state.json").string());
    if (st) st = f.write(text.data(), text.size());
    if (st) st = f.finish();
  }
  if (st) st = sync_folder(tmp_dir.string());
  if (st && fs::exists(final_dir)) {  // the same iteration saved again (a resume that stops at once)
    const fs::path old = final_dir.string() + ".old";
    NB_TRY(remove_tree(old));
    fs::rename(final_dir, old, ec);
    if (ec) st = errorf("cannot move aside %s: %s", final_dir.c_str(), ec.message().c_str());
  }
  if (st) {
    fs::rename(tmp_dir, final_dir, ec);
    if (ec) st = errorf("cannot rename %s to %s: %s", tmp_dir.c_str(), final_dir.c_str(), ec.message().c_str());
  }
  if (st) st = sync_folder(save_dir);
  if (!st) {
    (void)remove_tree(tmp_dir);  // free the space; the tracker still names the previous checkpoint
    return st;
  }
  NB_TRY(replace_file_atomically((fs::path(save_dir) / kTracker).string(), std::to_string(data.iteration) + "\n"));
  (void)remove_tree(final_dir.string() + ".old");
  if (keep > 0) NB_TRY(prune(save_dir, keep, data.iteration));
  if (stats) {
    stats->bytes = 0;
    for (const auto& [name, e] : files.items()) stats->bytes += e["bytes"].get<uint64_t>();
    stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return Status::ok();
}

Status find_checkpoint(const std::string& load_dir, int64_t step, CheckpointRef* out, bool* found) {
  if (found) *found = true;
  if (step < 0) {
    std::ifstream in(fs::path(load_dir) / kTracker);
    if (!in) {
      if (found) {
        *found = false;
        return Status::ok();
      }
      return errorf("no checkpoint in %s: it has no %s (pass the --save folder of an earlier run)", load_dir.c_str(),
                    kTracker);
    }
    std::string text;
    in >> text;
    char* end = nullptr;
    step = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || step < 0)
      return errorf("%s/%s holds '%s', not an iteration number; pass --ckpt-step N to pick a checkpoint",
                    load_dir.c_str(), kTracker, text.c_str());
  }
  out->iteration = step;
  out->dir = (fs::path(load_dir) / checkpoint_folder_name(step)).string();
  if (!fs::is_directory(out->dir))
    return errorf("checkpoint folder %s does not exist (iteration %lld)", out->dir.c_str(), (long long)step);
  return Status::ok();
}

Status read_checkpoint_state(const CheckpointRef& ref, nlohmann::json* state, FileCheck check) {
  const std::string path = ref.dir + "/trainer_state.json";
  std::ifstream in(path);
  if (!in) return errorf("checkpoint %s is incomplete: %s is missing", ref.dir.c_str(), path.c_str());
  try {
    *state = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    return errorf(
        "%s fails its checksum: it is not valid JSON (%s); the file is damaged, load an older checkpoint "
        "with --ckpt-step N",
        path.c_str(), e.what());
  }
  if (!state->contains("state_crc32") || !(*state)["state_crc32"].is_number_unsigned() ||
      (*state)["state_crc32"].get<uint32_t>() != state_crc(*state))
    return errorf("%s fails its checksum: the file is damaged; load an older checkpoint with --ckpt-step N",
                  path.c_str());
  if (!state->contains("files") || !(*state)["files"].is_object())
    return errorf("%s lists no files; the checkpoint is damaged, load an older one with --ckpt-step N", path.c_str());
  for (const auto& [name, e] : (*state)["files"].items()) {
    uint64_t want_size = 0, want_crc = 0;
    try {
      want_size = json_uint(e, "bytes");
      want_crc = json_uint(e, "crc32");
    } catch (const std::exception& ex) {
      return errorf("%s: the entry of %s is damaged (%s); load an older checkpoint with --ckpt-step N", path.c_str(),
                    name.c_str(), ex.what());
    }
    if (name.find('/') != std::string::npos || name.find("..") != std::string::npos)
      return errorf("%s names the file '%s' outside its folder; the checkpoint is damaged", path.c_str(), name.c_str());
    uint32_t crc = uint32_t(want_crc);
    uint64_t size = 0;
    if (check == FileCheck::crc) {
      NB_TRY(file_crc32(ref.dir + "/" + name, &crc, &size).context("checkpoint " + ref.dir));
    } else {
      std::error_code ec;
      size = fs::file_size(ref.dir + "/" + name, ec);
      if (ec) return errorf("checkpoint %s: cannot read %s: %s", ref.dir.c_str(), name.c_str(), ec.message().c_str());
    }
    if (size != want_size || crc != want_crc) return checksum_failure(ref, name, size, crc, want_size, want_crc);
  }
  return Status::ok();
}

nlohmann::json model_config_json(const LlamaConfig& c) {
  return {{"name", c.name},
          {"hidden", c.hidden},
          {"ffn", c.ffn},
          {"layers", c.layers},
          {"heads", c.heads},
          {"kv_heads", c.kv_heads},
          {"head_dim", c.head_dim},
          {"vocab", c.vocab},
          {"rope_theta", c.rope_theta},
          {"rope_factor", c.rope_factor},
          {"rope_low_freq_factor", c.rope_low_freq_factor},
          {"rope_high_freq_factor", c.rope_high_freq_factor},
          {"rope_original_max_pos", c.rope_original_max_pos},
          {"norm_eps", c.norm_eps},
          {"tied_embeddings", c.tied_embeddings},
          {"max_seq", c.max_seq}};
}

Status model_config_from_json(const nlohmann::json& j, const std::string& where, LlamaConfig* out) {
  try {
    LlamaConfig c;
    c.name = json_string(j, "name");
    c.hidden = json_int(j, "hidden");
    c.ffn = json_int(j, "ffn");
    c.layers = json_int(j, "layers");
    c.heads = json_int(j, "heads");
    c.kv_heads = json_int(j, "kv_heads");
    c.head_dim = json_int(j, "head_dim");
    c.vocab = json_int(j, "vocab");
    c.rope_theta = json_number(j, "rope_theta");
    c.rope_factor = json_number(j, "rope_factor");
    c.rope_low_freq_factor = json_number(j, "rope_low_freq_factor");
    c.rope_high_freq_factor = json_number(j, "rope_high_freq_factor");
    c.rope_original_max_pos = json_int(j, "rope_original_max_pos");
    c.norm_eps = float(json_number(j, "norm_eps"));
    c.tied_embeddings = json_bool(j, "tied_embeddings");
    c.max_seq = json_int(j, "max_seq");
    *out = c;
  } catch (const std::exception& e) {
    return errorf("%s: the model description is incomplete (%s)", where.c_str(), e.what());
  }
  return validate(*out).context(where);
}

Status checkpoint_config(const CheckpointRef& ref, TrainConfig* cfg, LlamaConfig* model) {
  nlohmann::json state;
  NB_TRY(read_checkpoint_state(ref, &state));
  return checkpoint_config_of(state, ref.dir + "/trainer_state.json", cfg, model);
}

Status checkpoint_config_of(const nlohmann::json& state, const std::string& where, TrainConfig* cfg,
                            LlamaConfig* model) {
  if (!state.contains("config") || !state["config"].is_string() || !state.contains("model"))
    return errorf("%s has no configuration; it was not written by nibble", where.c_str());
  *cfg = TrainConfig{};
  NB_TRY(apply_config_text(state["config"].get<std::string>(), where, *cfg));
  return model_config_from_json(state["model"], where, model);
}

AsyncCheckpointWriter::~AsyncCheckpointWriter() { (void)wait(); }

Status AsyncCheckpointWriter::start(CheckpointData data) {
  NB_TRY(wait());
  done_ = false;
  thread_ = std::thread([this, d = std::move(data)] {
    CheckpointWriteStats stats;
    Status st = write_checkpoint(save_dir_, d, keep_, &stats)
                    .context("saving the checkpoint of iteration " + std::to_string(d.iteration));
    std::lock_guard<std::mutex> lock(mu_);
    result_ = st;
    stats_ = stats;
    done_ = true;
  });
  return Status::ok();
}

Status AsyncCheckpointWriter::wait(CheckpointWriteStats* last) {
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  if (last) *last = stats_;
  Status st = result_;
  result_ = Status::ok();
  return st;
}

bool AsyncCheckpointWriter::failed() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_ && !result_.is_ok();
}

Status read_checkpoint_file(const CheckpointRef& ref, const nlohmann::json& state, const std::string& name,
                            const std::vector<HfTensor>& layout, const std::vector<CheckpointTarget>& targets) {
  const std::string path = ref.dir + "/" + name;
  uint64_t want_size = 0, want_crc = 0;
  try {
    const auto& e = json_field(json_field(state, "files"), name.c_str());
    want_size = json_uint(e, "bytes");
    want_crc = json_uint(e, "crc32");
  } catch (const std::exception& ex) {
    return errorf("%s/trainer_state.json: no valid entry for %s (%s); load an older checkpoint with --ckpt-step N",
                  ref.dir.c_str(), name.c_str(), ex.what());
  }
  SafeTensorsHeader h;
  std::vector<FileCopy> copies;
  Status st = read_safetensors_header(path, &h);
  if (st) st = plan_copies(path, h, layout, targets, &copies);
  uint32_t crc = 0;
  uint64_t size = 0;
  if (!st) {  // a damaged header reads as what it is: a file that fails its checksum
    NB_TRY(file_crc32(path, &crc, &size));
    return size != want_size || crc != want_crc ? checksum_failure(ref, name, size, crc, want_size, want_crc) : st;
  }
  size_t next = 0;  // one pass: the CRC of every byte, and the tensors copied out as they pass
  NB_TRY(file_crc32(path, &crc, &size, [&](const char* data, size_t bytes, uint64_t offset) {
    copy_out_block(copies, &next, data, bytes, offset);
  }));
  if (size != want_size || crc != want_crc) return checksum_failure(ref, name, size, crc, want_size, want_crc);
  return Status::ok();
}

}  // namespace nb
