// Supervised fine-tuning rows from `nibble preprocess --sft` output (PREFIX_tokens_document and
// PREFIX_mask_document, one document per sample): samples packed into rows of --seq-length, as NeMo's
// packed_sequence does, with the labels of prompt tokens set to -1 so only answers are trained.
//
// A sample of L tokens x[0..L) with answer mask m occupies L - 1 row positions: inputs x[0..L-1),
// labels x[j+1] where m[j+1] = 1, else -1 (the model predicts the next token; prompts are not trained).
// Each sample is one segment of its row: attention stays inside it and RoPE positions restart at 0.
// A row's unused tail is padding (token pad_token, labels -1), one more segment. With a padding multiple m
// (--pad-seq-to-mult; 2C under context parallelism, as TransformerEngine needs) every sample's segment is
// padded to a multiple of m positions with the same untrained padding, so every segment splits into m chunks.
// Packing is best-fit decreasing over a split's samples (deterministic), done once when the source is
// built; the rows are then walked in a numpy RandomState(seed + epoch) order, epoch after epoch, so a
// run resumes from its consumed-rows count alone.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include "core/status.h"
#include "data/gpt_dataset.h"
#include "data/indexed_dataset.h"
#include "data/token_source.h"

namespace nb {

// The token and answer-mask datasets of one prefix, checked to describe the same samples.
class SftDataset {
 public:
  static Status open(const std::string& prefix, std::unique_ptr<SftDataset>* out);
  int64_t size() const { return tokens_->sequence_count(); }
  int32_t length(int64_t i) const { return tokens_->sequence_length(i); }
  const std::vector<int32_t>& lengths() const { return tokens_->sequence_lengths(); }
  // Sample i's tokens and mask (cleared first).
  void read(int64_t i, std::vector<int32_t>* tokens, std::vector<int32_t>* mask) const;
  const std::string& prefix() const { return prefix_; }

 private:
  std::string prefix_;
  std::unique_ptr<IndexedDataset> tokens_, mask_;
};

// Rows of samples: row r holds samples[row_begin[r] .. row_begin[r + 1]).
struct SftPacking {
  std::vector<int64_t> samples, row_begin{0};
  int64_t seq_length = 0;
  int64_t multiple = 1;     // every segment's length is a multiple of this (seq_length is too)
  int64_t real_tokens = 0;  // row positions that hold sample tokens (the rest is padding)
  int64_t cut = 0;          // samples longer than a row, cut at their end
  int64_t rows() const { return int64_t(row_begin.size()) - 1; }
  double efficiency() const { return rows() > 0 ? double(real_tokens) / double(rows() * seq_length) : 0.0; }
};

// Row positions a sample of `length` tokens takes in a row of seq_length (length - 1, at most seq_length).
int64_t sft_positions(int64_t length, int64_t seq_length);
// Packs samples ids[] (lengths[id] tokens each) into rows of seq_length positions. pack = false puts one
// sample per row. Best-fit decreasing: samples by decreasing length (ties by id), each into the fullest
// row it fits, else a new row; rows keep their samples in that order. Samples of fewer than 2 tokens
// have no prediction and are skipped. multiple (which must divide seq_length): each sample's positions are
// rounded up to a multiple of it.
void pack_sft_samples(const std::vector<int64_t>& ids, const std::vector<int32_t>& lengths, int64_t seq_length,
                      bool pack, SftPacking* out, int64_t multiple = 1);

// Writes one row: seq_length tokens and labels, and the segment starts (relative to `base`, the row's
// first position in its micro-batch) of the row's samples and its padding tail.
void fill_sft_row(const SftDataset& data, const SftPacking& packing, int64_t row, int32_t pad_token, int64_t base,
                  int32_t* tokens, int32_t* labels, std::vector<int32_t>* segment_starts);

struct SftDataConfig {
  std::string prefix;  // what `preprocess --sft --output-prefix` was given
  std::string split = "969,30,1";
  int64_t seq_length = 0;
  uint64_t seed = 1234;
  bool pack = true;
  int32_t pad_token = 0;
  int64_t pad_to_multiple = 1;  // every sample's segment padded to a multiple of this (divides seq_length)
};

// A TokenSource over the split's packed rows. Data parallelism as the pretraining sources: each global
// micro-batch is micro_batch * dp_size consecutive rows, rank r takes rows [r * mbs, (r + 1) * mbs);
// consumed counts global rows. Never exhausted: epochs repeat in new orders.
// packing_out (optional) receives the split's packing, for the efficiency report.
Status make_sft_source(const SftDataConfig& cfg, Split split, int64_t micro_batch, int64_t dp_rank, int64_t dp_size,
                       int64_t consumed, std::unique_ptr<TokenSource>* out, SftPacking* packing_out = nullptr);

}  // namespace nb
