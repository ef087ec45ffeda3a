// The trainer's view of data: micro-batches of token ids with next-token labels.
// A TokenSource walks the (shuffled, possibly blended) sample ids sequentially from a consumed-samples
// count, exactly like Megatron's pretraining sampler, so resuming needs only that count plus the
// same seed, data and seq_len. A background thread prefetches the next batches so training never waits.
// Shapes: tokens and labels are [micro_batch * seq_len] int32, row-major by sample; labels = tokens shifted by one.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include "core/status.h"
#include "data/gpt_dataset.h"

namespace nb {

struct Batch {
  std::vector<int32_t> tokens, labels;  // [micro_batch * seq_len] each
  // Packed rows (SFT): the first token of every segment (sample or padding tail) of the micro-batch,
  // then micro_batch * seq_len. Empty: every row is one sequence (pretraining).
  std::vector<int32_t> segment_starts;
  int64_t micro_batch = 0, seq_len = 0;
};

class TokenSource {
 public:
  virtual ~TokenSource();
  virtual Status next(Batch* out) = 0;  // next micro-batch
  virtual int64_t consumed_samples() const = 0;
  virtual double wait_ms_total() const = 0;           // time next() spent waiting for the prefetch thread
  virtual int64_t num_samples() const { return -1; }  // samples available before exhaustion (-1: unknown)
};

struct DataConfig {
  std::string data_path;  // blend: "prefix" or "w1 prefix1 w2 prefix2 ..."
  std::string split = "969,30,1";
  int64_t seq_length = 2048;
  uint64_t seed = 1234;
  std::array<int64_t, 3> num_samples{0, 0, 0};  // per split (train, valid, test)
  std::string cache_path;                       // "" = <first prefix's folder>/cache/nibble_indices; "none" = no cache
};
// The cache folder that cache_path means for a dataset `prefix` ("" when caching is off).
std::string index_cache_dir(const std::string& prefix, const std::string& cache_path);

// Megatron --mock-data: MockGPTLowLevelDataset under GPTDataset with the default "969,30,1" split
// (train part). eod = vocab - 1. `seed` seeds the sampling (Megatron --seed).
Status make_mock_source(int64_t vocab, int64_t seq_len, int64_t micro_batch, uint64_t seed, int64_t train_samples,
                        int64_t consumed, std::unique_ptr<TokenSource>* out);
// The same for any split (validation loss uses Split::valid).
// With dp_rank / dp_size: this rank's rows of each global micro-batch, as make_gpt_source_dp.
Status make_mock_source_split(int64_t vocab, int64_t seq_len, int64_t micro_batch, uint64_t seed, Split split,
                              int64_t samples, int64_t consumed, std::unique_ptr<TokenSource>* out, int64_t dp_rank = 0,
                              int64_t dp_size = 1);
Status make_gpt_source(const DataConfig& cfg, Split split, int64_t micro_batch, int64_t consumed,
                       std::unique_ptr<TokenSource>* out);
// Data-parallel rank `dp_rank` of `dp_size`: next() returns this rank's rows of each global
// micro-batch (mbs * dp_size samples); consumed_samples() counts global samples, as Megatron logs them.
Status make_gpt_source_dp(const DataConfig& cfg, Split split, int64_t micro_batch, int64_t dp_rank, int64_t dp_size,
                          int64_t consumed, std::unique_ptr<TokenSource>* out);

// Without the prefetch thread: the samples of a split as one indexable sequence (tests, tools).
class SampleSet {
 public:
  virtual ~SampleSet() = default;
  virtual int64_t size() const = 0;
  virtual void sample(int64_t i, std::vector<int32_t>* out) const = 0;  // seq_len + 1 tokens
};
Status make_gpt_samples(const DataConfig& cfg, Split split, std::shared_ptr<SampleSet>* out);

}  // namespace nb
