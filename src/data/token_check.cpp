// Token-id range of Megatron datasets (scan + cache) and the vocabulary checks built on it.
#include "data/token_check.h"
#include <unistd.h>
#include <sys/stat.h>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include "core/log.h"
#include "data/gpt_dataset.h"
#include "data/indexed_dataset.h"
#include "data/token_source.h"

namespace nb {

namespace {

// The cache file of one .bin: its name carries the file's size and modification time.
std::string cache_file(const std::string& prefix, const std::string& dir) {
  struct stat st {};
  if (dir.empty() || ::stat((prefix + ".bin").c_str(), &st) != 0) return "";
  return dir + "/" + std::filesystem::path(prefix).filename().string() + "-" + std::to_string(st.st_size) + "-" +
         std::to_string(int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec) + ".token_range";
}

}  // namespace

Status dataset_token_range(const std::string& prefix, const std::string& cache_dir, TokenRange* out) {
  const std::string cache = cache_file(prefix, cache_dir);
  if (!cache.empty()) {
    std::ifstream in(cache);
    if (in >> out->min_id >> out->max_id) {
      out->cached = true;
      return Status::ok();
    }
  }
  std::unique_ptr<IndexedDataset> ds;
  NB_TRY(IndexedDataset::open(prefix, &ds));
  const auto t0 = std::chrono::steady_clock::now();
  ds->token_id_range(&out->min_id, &out->max_id);
  out->scan_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  out->cached = false;
  if (!cache.empty()) {  // best effort: an unwritable cache only costs the scan next time
    std::error_code ec;
    std::filesystem::create_directories(cache_dir, ec);
    const std::string tmp = cache + ".tmp" + std::to_string(::getpid());  // ranks may scan at once
    if (std::ofstream(tmp) << out->min_id << " " << out->max_id << "\n") std::filesystem::rename(tmp, cache, ec);
  }
  return Status::ok();
}

Status check_dataset_vocab(const std::string& data_path, const std::string& cache_path, int64_t vocab,
                           const std::string& model_name) {
  std::vector<BlendEntry> blend;
  NB_TRY(parse_blend(data_path, &blend));
  for (const BlendEntry& e : blend) {
    TokenRange r;
    NB_TRY(dataset_token_range(e.prefix, index_cache_dir(e.prefix, cache_path), &r));
    if (!r.cached)
      NB_LOG_INFO("token ids of %s.bin: %lld..%lld (scanned in %.1f ms; cached for the next run)", e.prefix.c_str(),
                  (long long)r.min_id, (long long)r.max_id, r.scan_ms);
    if (r.max_id < r.min_id) continue;  // no tokens
    if (r.min_id < 0)
      return errorf(
          "dataset %s.bin holds the negative token id %lld: the file is damaged or was written with "
          "another dtype; preprocess the data again",
          e.prefix.c_str(), (long long)r.min_id);
    if (r.max_id >= vocab)
      return errorf(
          "dataset %s.bin holds token id %lld but model %s has a vocabulary of %lld, so the data was made "
          "with a larger tokenizer; pass --vocab-size %lld or more, a preset with a larger vocabulary, or "
          "preprocess the data with the model's tokenizer (pass it as --tokenizer)",
          e.prefix.c_str(), (long long)r.max_id, model_name.c_str(), (long long)vocab, (long long)(r.max_id + 1));
  }
  return Status::ok();
}

}  // namespace nb
