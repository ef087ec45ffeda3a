// GPT sampling indices, blends and the on-disk index cache (see gpt_dataset.h).
#include "data/gpt_dataset.h"
#include <unistd.h>

#include <cfenv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <regex>
#include <sstream>
#include "data/numpy_random.h"

namespace nb {

const char* split_name(Split s) {
  switch (s) {
    case Split::train: return "train";
    case Split::valid: return "valid";
    case Split::test: return "test";
  }
  return "?";
}

// ------------------------------------------------------------------ low-level datasets
namespace {
class IndexedLowLevel final : public LowLevelDataset {
 public:
  explicit IndexedLowLevel(std::shared_ptr<IndexedDataset> ds) : ds_(std::move(ds)) {}
  int64_t size() const override { return ds_->sequence_count(); }
  const std::vector<int32_t>& lengths() const override { return ds_->sequence_lengths(); }
  void read(int64_t i, int64_t offset, int64_t length, std::vector<int32_t>* out) const override {
    ds_->read(i, offset, length, out);
  }
  std::string describe() const override {
    std::error_code ec;
    auto abs = std::filesystem::absolute(ds_->prefix(), ec).string();
    auto bin_size = std::filesystem::file_size(ds_->prefix() + ".bin", ec);
    return strprintf("indexed %s sequences=%lld documents=%lld dtype=%u bin_bytes=%llu", abs.c_str(),
                     (long long)ds_->sequence_count(), (long long)ds_->document_count(), unsigned(ds_->dtype()),
                     (unsigned long long)bin_size);
  }

 private:
  std::shared_ptr<IndexedDataset> ds_;
};

class MockLowLevel final : public LowLevelDataset {
 public:
  MockLowLevel(int64_t vocab, int32_t eod) : vocab_(vocab), eod_(eod) {
    lengths_ = Pcg64Generator(0).integers_int32(1, 4096, 100000);
  }
  int64_t size() const override { return static_cast<int64_t>(lengths_.size()); }
  const std::vector<int32_t>& lengths() const override { return lengths_; }
  void read(int64_t i, int64_t offset, int64_t length, std::vector<int32_t>* out) const override {
    const int64_t len = lengths_[static_cast<size_t>(i)];
    if (length < 0) length = len - offset;
    NB_CHECK(offset >= 0 && offset + length <= len, "mock read outside sequence");
    for (int64_t k = offset; k < offset + length; ++k)
      out->push_back(k == len - 1 ? eod_ : static_cast<int32_t>((k + 1) % vocab_));
  }
  std::string describe() const override { return strprintf("mock vocab=%lld eod=%d", (long long)vocab_, eod_); }

 private:
  int64_t vocab_;
  int32_t eod_;
  std::vector<int32_t> lengths_;
};
}  // namespace

std::shared_ptr<LowLevelDataset> wrap_indexed_dataset(std::shared_ptr<IndexedDataset> ds) {
  return std::make_shared<IndexedLowLevel>(std::move(ds));
}
std::shared_ptr<LowLevelDataset> make_mock_low_level(int64_t vocab, int32_t eod) {
  return std::make_shared<MockLowLevel>(vocab, eod);
}

// ------------------------------------------------------------------ splits
Status split_ranges(const std::string& split, int64_t num_sequences, std::array<std::pair<int64_t, int64_t>, 3>* out) {
  static const std::regex number("[.0-9]+");
  std::vector<double> w;
  for (auto it = std::sregex_iterator(split.begin(), split.end(), number); it != std::sregex_iterator(); ++it) {
    char* end = nullptr;
    std::string tok = it->str();
    double v = std::strtod(tok.c_str(), &end);
    if (end == tok.c_str())
      return errorf("split \"%s\": \"%s\" is not a number; use e.g. \"969,30,1\"", split.c_str(), tok.c_str());
    w.push_back(v);
  }
  if (w.size() > 3)
    return errorf("split \"%s\" has %zu parts; give at most 3 (train,valid,test)", split.c_str(), w.size());
  while (w.size() < 3) w.push_back(0.0);
  double sum = w[0] + w[1] + w[2];
  if (!(sum > 0)) return errorf("split \"%s\" sums to zero; use e.g. \"969,30,1\"", split.c_str());
  double bound = 0.0;
  std::fesetround(FE_TONEAREST);  // Python's round(): half to even
  int64_t prev = 0;
  for (int i = 0; i < 3; ++i) {
    double next_bound = bound + w[i] / sum;
    int64_t b = static_cast<int64_t>(std::nearbyint(bound * double(num_sequences)));
    int64_t e = static_cast<int64_t>(std::nearbyint(next_bound * double(num_sequences)));
    if (w[i] == 0.0) b = e = prev;
    (*out)[i] = {b, e};
    prev = e;
    bound = next_bound;
  }
  return Status::ok();
}

// ------------------------------------------------------------------ indices
namespace {
void build_document_index(const std::vector<int32_t>& docs, int64_t epochs, LegacyRandomState* rs,
                          bool separate_final_epoch, std::vector<int32_t>* out) {
  if (!separate_final_epoch || epochs == 1) {
    size_t base = out->size();
    for (int64_t e = 0; e < epochs; ++e) out->insert(out->end(), docs.begin(), docs.end());
    rs->shuffle(out->data() + base, static_cast<int64_t>(out->size() - base));
    return;
  }
  build_document_index(docs, epochs - 1, rs, false, out);
  build_document_index(docs, 1, rs, false, out);
}

void build_shuffle_index(int64_t num_samples, int64_t total_size, LegacyRandomState* rs, std::vector<int64_t>* out) {
  out->resize(static_cast<size_t>(total_size));
  for (int64_t i = 0; i < total_size; ++i) (*out)[i] = i;
  rs->shuffle(out->data(), num_samples);
  if (num_samples < total_size) rs->shuffle(out->data() + num_samples, total_size - num_samples);
}
}  // namespace

Status build_gpt_indices(const std::vector<int32_t>& lengths, int64_t begin, int64_t end, int64_t seq_length,
                         int64_t num_samples, uint32_t seed, GptIndices* out) {
  constexpr int64_t kExtra = 1;  // add_extra_token_to_sequence
  if (seq_length <= 0) return errorf("seq_length must be positive, got %lld", (long long)seq_length);
  std::vector<int32_t> docs;
  int64_t tokens_per_epoch = 0;
  for (int64_t i = begin; i < end; ++i) {
    docs.push_back(static_cast<int32_t>(i));
    tokens_per_epoch += lengths[static_cast<size_t>(i)];
  }
  if (tokens_per_epoch <= kExtra)
    return errorf(
        "the split [%lld, %lld) holds %lld tokens, too few for one sample of %lld; use more data or another --split",
        (long long)begin, (long long)end, (long long)tokens_per_epoch, (long long)seq_length + 1);
  int64_t epochs = 1;
  if (num_samples >= 0) {
    int64_t tokens = tokens_per_epoch;
    const int64_t requested = num_samples * seq_length + kExtra;
    while (tokens < requested) {
      ++epochs;
      tokens += tokens_per_epoch;
    }
  }
  bool separate = false;
  int64_t samples_sans_final = 0;
  if (epochs > 1) {
    samples_sans_final = ((epochs - 1) * tokens_per_epoch - kExtra) / seq_length;
    const int64_t from_final = num_samples - samples_sans_final;
    const int64_t per_epoch = (tokens_per_epoch - kExtra) / seq_length;
    NB_CHECK(from_final >= 0 && from_final <= per_epoch + 1, "epoch arithmetic");
    separate = from_final < static_cast<int64_t>(0.80 * double(per_epoch));  // Python int() truncates
  }
  LegacyRandomState rs(seed);
  out->document_index.clear();
  build_document_index(docs, epochs, &rs, separate, &out->document_index);
  // helpers.cpp build_sample_idx
  const int64_t S = (epochs * tokens_per_epoch - kExtra) / seq_length;
  auto& si = out->sample_index;
  si.assign(static_cast<size_t>(2 * (S + 1)), 0);
  int64_t doc_pos = 0, doc_offset = 0;
  for (int64_t s = 1; s <= S; ++s) {
    int64_t remaining = seq_length + kExtra;
    while (remaining != 0) {
      const int64_t doc_len =
          lengths[static_cast<size_t>(out->document_index[static_cast<size_t>(doc_pos)])] - doc_offset;
      remaining -= doc_len;
      if (remaining <= 0) {
        doc_offset += remaining + doc_len - kExtra;
        remaining = 0;
      } else {
        ++doc_pos;
        doc_offset = 0;
      }
    }
    si[2 * s] = doc_pos;
    si[2 * s + 1] = doc_offset;
  }
  build_shuffle_index(separate ? samples_sans_final : S, S, &rs, &out->shuffle_index);
  out->num_epochs = epochs;
  out->separate_final_epoch = separate;
  return Status::ok();
}

// ------------------------------------------------------------------ cache
namespace {
uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}
constexpr char kCacheMagic[8] = {'N', 'B', 'G', 'P', 'T', 'I', 'X', '1'};

template <typename T>
bool read_vec(FILE* f, std::vector<T>* v, int64_t n) {
  v->resize(static_cast<size_t>(n));
  return n == 0 || std::fread(v->data(), sizeof(T), v->size(), f) == v->size();
}

bool load_cache(const std::string& path, GptIndices* idx) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return false;
  char magic[8];
  int64_t h[5];
  bool ok = std::fread(magic, 1, 8, f) == 8 && std::memcmp(magic, kCacheMagic, 8) == 0 && std::fread(h, 8, 5, f) == 5 &&
            h[0] >= 0 && h[1] >= 2 && h[2] >= 0 && read_vec(f, &idx->document_index, h[0]) &&
            read_vec(f, &idx->sample_index, h[1]) && read_vec(f, &idx->shuffle_index, h[2]);
  std::fclose(f);
  idx->num_epochs = h[3];
  idx->separate_final_epoch = h[4] != 0;
  return ok;
}

void save_cache(const std::string& dir, const std::string& path, const std::string& description,
                const GptIndices& idx) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  // One temporary name per process: data-parallel ranks may build the same cache at once, and each
  // rename replaces the file atomically with identical content.
  std::string tmp = path + ".tmp" + std::to_string(::getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) return;  // a read-only data folder only costs the rebuild next time
  int64_t h[5] = {int64_t(idx.document_index.size()), int64_t(idx.sample_index.size()),
                  int64_t(idx.shuffle_index.size()), idx.num_epochs, idx.separate_final_epoch ? 1 : 0};
  bool ok = std::fwrite(kCacheMagic, 1, 8, f) == 8 && std::fwrite(h, 8, 5, f) == 5;
  ok = ok && std::fwrite(idx.document_index.data(), 4, idx.document_index.size(), f) == idx.document_index.size();
  ok = ok && std::fwrite(idx.sample_index.data(), 8, idx.sample_index.size(), f) == idx.sample_index.size();
  ok = ok && std::fwrite(idx.shuffle_index.data(), 8, idx.shuffle_index.size(), f) == idx.shuffle_index.size();
  ok = (std::fclose(f) == 0) && ok;
  if (ok) {
    std::filesystem::rename(tmp, path, ec);
    if (FILE* d = std::fopen((path + ".txt").c_str(), "wb")) {
      std::fputs(description.c_str(), d);
      std::fclose(d);
    }
  } else {
    std::filesystem::remove(tmp, ec);
  }
}

// A cache file is only trusted if every index it holds stays inside the data (a truncated or foreign
// file is rebuilt instead of read out of bounds).
bool indices_consistent(const GptIndices& idx, int64_t begin, int64_t end, const std::vector<int32_t>& lengths) {
  const int64_t S = static_cast<int64_t>(idx.shuffle_index.size());
  if (static_cast<int64_t>(idx.sample_index.size()) != 2 * (S + 1) || idx.document_index.empty()) return false;
  for (int32_t d : idx.document_index)
    if (d < begin || d >= end) return false;
  for (int64_t v : idx.shuffle_index)
    if (v < 0 || v >= S) return false;
  const int64_t docs = static_cast<int64_t>(idx.document_index.size());
  for (int64_t k = 0; k <= S; ++k) {
    const int64_t pos = idx.sample_index[2 * k], off = idx.sample_index[2 * k + 1];
    if (pos < 0 || pos >= docs || off < 0 ||
        off >= std::max<int64_t>(1, lengths[size_t(idx.document_index[size_t(pos)])]))
      return false;
    if (k > 0 && pos < idx.sample_index[2 * k - 2]) return false;
  }
  return true;
}
}  // namespace

Status GptDataset::create(std::shared_ptr<LowLevelDataset> data, int64_t begin, int64_t end, int64_t seq_length,
                          int64_t num_samples, uint32_t seed, const std::string& cache_dir,
                          const std::string& split_label, std::unique_ptr<GptDataset>* out) {
  auto ds = std::unique_ptr<GptDataset>(new GptDataset());
  ds->data_ = std::move(data);
  ds->seq_length_ = seq_length;
  std::string path, description;
  if (!cache_dir.empty()) {
    description = strprintf(
        "nibble GPT sampling indices v1 (nibble's own cache, not Megatron's)\n%s\nsplit=%s [%lld,%lld)\n"
        "seq_length=%lld\nnum_samples=%lld\nseed=%u\nadd_extra_token=1\n",
        ds->data_->describe().c_str(), split_label.c_str(), (long long)begin, (long long)end, (long long)seq_length,
        (long long)num_samples, seed);
    path = strprintf("%s/%016llx-GPTDataset-%s.nbidx", cache_dir.c_str(), (unsigned long long)fnv1a64(description),
                     split_label.c_str());
  }
  if (path.empty() || !load_cache(path, &ds->idx_) || !indices_consistent(ds->idx_, begin, end, ds->data_->lengths())) {
    NB_TRY(build_gpt_indices(ds->data_->lengths(), begin, end, seq_length, num_samples, seed, &ds->idx_));
    if (!path.empty()) save_cache(cache_dir, path, description, ds->idx_);
  }
  *out = std::move(ds);
  return Status::ok();
}

void GptDataset::sample(int64_t i, std::vector<int32_t>* out) const {
  out->clear();
  const int64_t j = idx_.shuffle_index[static_cast<size_t>(i)];
  const auto& si = idx_.sample_index;
  const int64_t b = si[2 * j], bo = si[2 * j + 1], e = si[2 * j + 2], eo = si[2 * j + 3];
  const auto& doc = idx_.document_index;
  if (b == e) {
    data_->read(doc[b], bo, eo - bo + 1, out);
  } else {
    for (int64_t k = b; k <= e; ++k) data_->read(doc[k], k > b ? 0 : bo, k < e ? -1 : eo + 1, out);
  }
}

// ------------------------------------------------------------------ blends
void build_blending_indices(const std::vector<double>& weights, int64_t size, std::vector<int16_t>* dataset_index,
                            std::vector<int64_t>* dataset_sample_index) {
  std::vector<int64_t> current(weights.size(), 0);
  dataset_index->resize(static_cast<size_t>(size));
  dataset_sample_index->resize(static_cast<size_t>(size));
  for (int64_t k = 0; k < size; ++k) {
    const double kd = std::max(static_cast<double>(k), 1.0);
    size_t best = 0;
    double best_err = weights[0] * kd - static_cast<double>(current[0]);
    for (size_t d = 1; d < weights.size(); ++d) {
      double err = weights[d] * kd - static_cast<double>(current[d]);
      if (err > best_err) {
        best_err = err;
        best = d;
      }
    }
    (*dataset_index)[k] = static_cast<int16_t>(best);
    (*dataset_sample_index)[k] = current[best]++;
  }
}

Status parse_blend(const std::string& data_path, std::vector<BlendEntry>* out) {
  std::istringstream in(data_path);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  out->clear();
  if (words.empty())
    return errorf("the data path is empty; give a prefix (PATH/name_text_document) or \"w1 prefix1 w2 prefix2 ...\"");
  auto as_number = [](const std::string& s, double* v) {
    char* end = nullptr;
    *v = std::strtod(s.c_str(), &end);
    return end && *end == 0;
  };
  double first;
  if (words.size() % 2 == 0 && as_number(words[0], &first)) {
    for (size_t i = 0; i < words.size(); i += 2) {
      double w;
      if (!as_number(words[i], &w) || w < 0)
        return errorf(
            "data path blend: \"%s\" in position %zu should be a non-negative weight (format: w1 prefix1 w2 prefix2 "
            "...)",
            words[i].c_str(), i + 1);
      out->push_back({w, words[i + 1]});
    }
    double sum = 0;
    for (auto& e : *out) sum += e.weight;
    if (!(sum > 0)) return errorf("data path blend: the weights sum to zero");
    for (auto& e : *out) e.weight /= sum;
    return Status::ok();
  }
  for (auto& w : words) out->push_back({-1.0, w});
  return Status::ok();
}

}  // namespace nb
