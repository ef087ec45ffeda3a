// Megatron-compatible GPT sampling over a low-level dataset of token sequences.
// For a split (contiguous range of sequence ids), seq_len S_len, num_samples and seed it builds:
//   document_index: the split's ids repeated E epochs, shuffled by numpy RandomState(seed)
//                   (the last epoch shuffled separately when it supplies < 80 % of an epoch);
//   sample_index:   (S+1) x 2 int64 (position in document_index, token offset); a sample is
//                   seq_len + 1 tokens that may span sequences (Megatron helpers.cpp build_sample_idx);
//   shuffle_index:  permutation of [0, S) from the same RandomState (two parts when separated).
// Sample i = tokens from sample_index[shuffle_index[i]] to sample_index[shuffle_index[i] + 1] (+1 token).
// Blends follow Megatron's BlendedDataset: per-component ceil(ceil(S*w)*1.005) samples and the
// deterministic "largest w_d*max(k,1) - count_d" interleaving.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include "core/status.h"
#include "data/indexed_dataset.h"

namespace nb {

enum class Split { train = 0, valid = 1, test = 2 };
const char* split_name(Split s);

// A source of token sequences (a Megatron .bin/.idx pair, or the mock generator).
class LowLevelDataset {
 public:
  virtual ~LowLevelDataset() = default;
  virtual int64_t size() const = 0;
  virtual const std::vector<int32_t>& lengths() const = 0;
  // Appends `length` tokens of sequence i from `offset` (length < 0: to the end).
  virtual void read(int64_t i, int64_t offset, int64_t length, std::vector<int32_t>* out) const = 0;
  virtual std::string describe() const = 0;  // what determines the contents (for the index cache key)
};

std::shared_ptr<LowLevelDataset> wrap_indexed_dataset(std::shared_ptr<IndexedDataset> ds);
// Megatron's MockGPTLowLevelDataset: 100,000 sequences, lengths default_rng(0).integers(1, 4096, int32),
// sequence i = (1, 2, ..., len-1) mod vocab followed by eod.
std::shared_ptr<LowLevelDataset> make_mock_low_level(int64_t vocab, int32_t eod);

// "969,30,1" -> normalised fractions -> [begin, end) sequence ranges with Python round() (half to even).
// A zero-width split gives begin == end.
Status split_ranges(const std::string& split, int64_t num_sequences, std::array<std::pair<int64_t, int64_t>, 3>* out);

struct GptIndices {
  std::vector<int32_t> document_index;
  std::vector<int64_t> sample_index;   // 2*(S+1)
  std::vector<int64_t> shuffle_index;  // S
  int64_t num_epochs = 0;
  bool separate_final_epoch = false;
};

// Megatron GPTDataset._build_document_sample_shuffle_indices (add_extra_token = 1, drop last partial).
// num_samples < 0 means "one epoch" (Megatron's None).
Status build_gpt_indices(const std::vector<int32_t>& lengths, int64_t begin, int64_t end, int64_t seq_length,
                         int64_t num_samples, uint32_t seed, GptIndices* out);

class GptDataset {
 public:
  // cache_dir empty: no on-disk cache. Otherwise indices are stored there under nibble's own
  // FNV-1a-64 key of everything that determines them (not Megatron's md5 cache: the files differ).
  static Status create(std::shared_ptr<LowLevelDataset> data, int64_t begin, int64_t end, int64_t seq_length,
                       int64_t num_samples, uint32_t seed, const std::string& cache_dir, const std::string& split_label,
                       std::unique_ptr<GptDataset>* out);
  int64_t size() const { return static_cast<int64_t>(idx_.shuffle_index.size()); }
  // seq_length + 1 tokens of sample i (0 <= i < size()).
  void sample(int64_t i, std::vector<int32_t>* out) const;
  const GptIndices& indices() const { return idx_; }

 private:
  std::shared_ptr<LowLevelDataset> data_;
  int64_t seq_length_ = 0;
  GptIndices idx_;
};

// Megatron helpers.cpp build_blending_indices.
void build_blending_indices(const std::vector<double>& weights, int64_t size, std::vector<int16_t>* dataset_index,
                            std::vector<int64_t>* dataset_sample_index);

struct BlendEntry {
  double weight;
  std::string prefix;
};
// "prefix" | "w1 p1 w2 p2 ..." | "p1 p2 ..." (weights then come from the dataset sizes: weight < 0 here).
Status parse_blend(const std::string& data_path, std::vector<BlendEntry>* out);

}  // namespace nb
