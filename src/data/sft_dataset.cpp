// Packed SFT rows (see sft_dataset.h).
#include "data/sft_dataset.h"

#include <algorithm>
#include <array>
#include <map>
#include <numeric>
#include "data/numpy_random.h"

namespace nb {

Status SftDataset::open(const std::string& prefix, std::unique_ptr<SftDataset>* out) {
  auto d = std::make_unique<SftDataset>();
  d->prefix_ = prefix;
  NB_TRY(IndexedDataset::open(prefix + "_tokens_document", &d->tokens_)
             .context("SFT data " + prefix + " (made by nibble preprocess --sft)"));
  NB_TRY(IndexedDataset::open(prefix + "_mask_document", &d->mask_)
             .context("SFT data " + prefix + " (made by nibble preprocess --sft)"));
  if (d->mask_->dtype() != IndexedDtype::u8)
    return errorf("%s_mask_document holds dtype code %d, not uint8; it was not written by nibble preprocess --sft",
                  prefix.c_str(), int(d->mask_->dtype()));
  if (d->mask_->sequence_lengths() != d->tokens_->sequence_lengths())
    return errorf(
        "%s_tokens_document and %s_mask_document describe different samples (counts %lld and %lld, or lengths "
        "differ); write both again with one nibble preprocess --sft run",
        prefix.c_str(), prefix.c_str(), (long long)d->tokens_->sequence_count(), (long long)d->mask_->sequence_count());
  if (d->size() == 0) return errorf("SFT data %s holds no samples", prefix.c_str());
  *out = std::move(d);
  return Status::ok();
}

void SftDataset::read(int64_t i, std::vector<int32_t>* tokens, std::vector<int32_t>* mask) const {
  tokens->clear();
  mask->clear();
  tokens_->read(i, 0, -1, tokens);
  mask_->read(i, 0, -1, mask);
}

int64_t sft_positions(int64_t length, int64_t seq_length) {
  return std::min(std::max<int64_t>(length - 1, 0), seq_length);
}

void pack_sft_samples(const std::vector<int64_t>& ids, const std::vector<int32_t>& lengths, int64_t seq_length,
                      bool pack, SftPacking* out, int64_t multiple) {
  NB_CHECK(multiple >= 1 && seq_length % multiple == 0, "SFT padding multiple %lld does not divide the row of %lld",
           (long long)multiple, (long long)seq_length);
  *out = SftPacking{};
  out->seq_length = seq_length;
  out->multiple = multiple;
  std::vector<int64_t> order;
  for (int64_t id : ids)
    if (lengths[size_t(id)] >= 2) order.push_back(id);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return lengths[size_t(a)] > lengths[size_t(b)]; });
  std::vector<std::vector<int64_t>> rows;
  std::multimap<int64_t, size_t> free_space;  // room left -> row, for rows that still have room
  for (int64_t id : order) {
    const int64_t real = sft_positions(lengths[size_t(id)], seq_length);
    const int64_t n = (real + multiple - 1) / multiple * multiple;  // <= seq_length: multiple divides it
    if (lengths[size_t(id)] - 1 > seq_length) out->cut++;
    out->real_tokens += real;
    auto fit = pack ? free_space.lower_bound(n) : free_space.end();  // the fullest row with room for n
    size_t row = rows.size();
    int64_t room = seq_length;
    if (fit != free_space.end()) {
      row = fit->second;
      room = fit->first;
      free_space.erase(fit);
    } else {
      rows.emplace_back();
    }
    rows[row].push_back(id);
    if (room - n > 0 && pack) free_space.emplace(room - n, row);
  }
  for (const auto& r : rows) {
    out->samples.insert(out->samples.end(), r.begin(), r.end());
    out->row_begin.push_back(int64_t(out->samples.size()));
  }
}

void fill_sft_row(const SftDataset& data, const SftPacking& packing, int64_t row, int32_t pad_token, int64_t base,
                  int32_t* tokens, int32_t* labels, std::vector<int32_t>* segment_starts) {
  const int64_t S = packing.seq_length;
  std::vector<int32_t> x, m;
  int64_t used = 0;
  for (int64_t k = packing.row_begin[size_t(row)]; k < packing.row_begin[size_t(row) + 1]; ++k) {
    data.read(packing.samples[size_t(k)], &x, &m);
    const int64_t n = sft_positions(int64_t(x.size()), S);
    const int64_t padded = (n + packing.multiple - 1) / packing.multiple * packing.multiple;
    segment_starts->push_back(int32_t(base + used));
    for (int64_t j = 0; j < n; ++j) {
      tokens[used + j] = x[size_t(j)];
      labels[used + j] = m[size_t(j) + 1] ? x[size_t(j) + 1] : -1;
    }
    std::fill(tokens + used + n, tokens + used + padded, pad_token);  // the sample's own padding: never trained
    std::fill(labels + used + n, labels + used + padded, -1);
    used += padded;
  }
  if (used < S) segment_starts->push_back(int32_t(base + used));
  std::fill(tokens + used, tokens + S, pad_token);
  std::fill(labels + used, labels + S, -1);
}

namespace {

// Rows in epoch order: epoch e walks the rows in numpy RandomState(seed + e).permutation(rows) order.
class SftSource final : public TokenSource {
 public:
  SftSource(std::unique_ptr<SftDataset> data, SftPacking packing, const SftDataConfig& cfg, int64_t micro_batch,
            int64_t dp_rank, int64_t dp_size, int64_t consumed)
      : data_(std::move(data)),
        packing_(std::move(packing)),
        cfg_(cfg),
        mbs_(micro_batch),
        global_(micro_batch * dp_size),
        offset_(dp_rank * micro_batch),
        consumed_(consumed) {}

  Status next(Batch* out) override {
    const int64_t S = cfg_.seq_length;
    out->micro_batch = mbs_;
    out->seq_len = S;
    out->tokens.resize(size_t(mbs_ * S));  // fill_sft_row writes every position, padding included
    out->labels.resize(size_t(mbs_ * S));
    out->segment_starts.clear();
    for (int64_t r = 0; r < mbs_; ++r)
      fill_sft_row(*data_, packing_, row_at(consumed_ + offset_ + r), cfg_.pad_token, r * S, out->tokens.data() + r * S,
                   out->labels.data() + r * S, &out->segment_starts);
    out->segment_starts.push_back(int32_t(mbs_ * S));
    consumed_ += global_;
    return Status::ok();
  }
  int64_t consumed_samples() const override { return consumed_; }
  double wait_ms_total() const override { return 0.0; }  // rows are built on the calling thread
  int64_t num_samples() const override { return packing_.rows(); }

 private:
  int64_t row_at(int64_t global_row) {
    const int64_t rows = packing_.rows(), epoch = global_row / rows;
    if (epoch != order_epoch_) {
      order_.resize(size_t(rows));
      std::iota(order_.begin(), order_.end(), int64_t{0});
      LegacyRandomState rng(uint32_t((cfg_.seed + uint64_t(epoch)) & 0xffffffffu));
      rng.shuffle(order_);
      order_epoch_ = epoch;
    }
    return order_[size_t(global_row % rows)];
  }

  std::unique_ptr<SftDataset> data_;
  SftPacking packing_;
  SftDataConfig cfg_;
  int64_t mbs_, global_, offset_, consumed_;
  std::vector<int64_t> order_;
  int64_t order_epoch_ = -1;
};

}  // namespace

Status make_sft_source(const SftDataConfig& cfg, Split split, int64_t micro_batch, int64_t dp_rank, int64_t dp_size,
                       int64_t consumed, std::unique_ptr<TokenSource>* out, SftPacking* packing_out) {
  if (cfg.seq_length <= 0 || micro_batch <= 0 || consumed < 0)
    return errorf("SFT data: seq_length (%lld) and micro_batch (%lld) must be positive", (long long)cfg.seq_length,
                  (long long)micro_batch);
  if (cfg.pad_to_multiple < 1 || cfg.seq_length % cfg.pad_to_multiple != 0)
    return errorf("SFT data: the padding multiple %lld must divide --seq-length %lld", (long long)cfg.pad_to_multiple,
                  (long long)cfg.seq_length);
  if (dp_size < 1 || dp_rank < 0 || dp_rank >= dp_size)
    return errorf("data-parallel rank %lld of %lld is invalid", (long long)dp_rank, (long long)dp_size);
  if (cfg.prefix.find(' ') != std::string::npos)
    return errorf("SFT data takes one prefix, not a blend (\"%s\"); concatenate the JSONL files before preprocessing",
                  cfg.prefix.c_str());
  std::unique_ptr<SftDataset> data;
  NB_TRY(SftDataset::open(cfg.prefix, &data));
  std::array<std::pair<int64_t, int64_t>, 3> ranges;
  NB_TRY(split_ranges(cfg.split, data->size(), &ranges));
  const auto [begin, end] = ranges[size_t(split)];
  std::vector<int64_t> ids(size_t(end - begin));
  std::iota(ids.begin(), ids.end(), begin);
  SftPacking packing;
  pack_sft_samples(ids, data->lengths(), cfg.seq_length, cfg.pack, &packing, cfg.pad_to_multiple);
  if (packing.rows() == 0)
    return errorf("%s: the %s split \"%s\" selects no SFT samples of %lld (with at least 2 tokens); change --split",
                  cfg.prefix.c_str(), split_name(split), cfg.split.c_str(), (long long)data->size());
  if (packing_out) *packing_out = packing;
  *out = std::make_unique<SftSource>(std::move(data), std::move(packing), cfg, micro_batch, dp_rank, dp_size, consumed);
  return Status::ok();
}

}  // namespace nb
