// Prefetching token sources over GPT datasets and blends (see token_source.h).
#include "data/token_source.h"

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <mutex>
#include <thread>

namespace nb {

TokenSource::~TokenSource() = default;

namespace {

class SingleSet final : public SampleSet {
 public:
  explicit SingleSet(std::unique_ptr<GptDataset> ds) : ds_(std::move(ds)) {}
  int64_t size() const override { return ds_->size(); }
  void sample(int64_t i, std::vector<int32_t>* out) const override { ds_->sample(i, out); }

 private:
  std::unique_ptr<GptDataset> ds_;
};

class BlendedSet final : public SampleSet {
 public:
  BlendedSet(std::vector<std::unique_ptr<GptDataset>> parts, const std::vector<double>& weights, int64_t size)
      : parts_(std::move(parts)) {
    build_blending_indices(weights, size, &which_, &index_);
  }
  int64_t size() const override { return static_cast<int64_t>(which_.size()); }
  void sample(int64_t i, std::vector<int32_t>* out) const override { parts_[which_[i]]->sample(index_[i], out); }

 private:
  std::vector<std::unique_ptr<GptDataset>> parts_;
  std::vector<int16_t> which_;
  std::vector<int64_t> index_;
};

// Fills a bounded queue of batches on a background thread, in sample order from `consumed`.
class PrefetchSource final : public TokenSource {
 public:
  // Data parallelism as Megatron's pretraining sampler: each global micro-batch is mbs * dp_size
  // consecutive sample ids, rank r takes rows [r * mbs, (r + 1) * mbs); consumed counts global samples.
  PrefetchSource(std::shared_ptr<SampleSet> set, int64_t seq_len, int64_t micro_batch, int64_t consumed,
                 int64_t dp_rank = 0, int64_t dp_size = 1)
      : set_(std::move(set)),
        seq_len_(seq_len),
        mbs_(micro_batch),
        global_(micro_batch * dp_size),
        offset_(dp_rank * micro_batch),
        consumed_(consumed),
        produce_at_(consumed) {
    worker_ = std::thread([this] { run(); });
  }
  ~PrefetchSource() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  Status next(Batch* out) override {
    auto t0 = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    if (consumed_ + global_ > set_->size())
      return errorf(
          "the data is exhausted: %lld samples consumed of %lld; ask for more samples (train iterations) when building "
          "the source",
          (long long)consumed_, (long long)set_->size());
    cv_.wait(lock, [this] { return !queue_.empty(); });
    *out = std::move(queue_.front());
    queue_.pop_front();
    consumed_ += global_;
    wait_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    lock.unlock();
    cv_.notify_all();
    return Status::ok();
  }
  int64_t consumed_samples() const override { return consumed_; }
  double wait_ms_total() const override { return wait_ms_; }
  int64_t num_samples() const override { return set_->size(); }

 private:
  static constexpr size_t kDepth = 4;
  void run() {
    std::vector<int32_t> text;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || queue_.size() < kDepth; });
        if (stop_ || produce_at_ + global_ > set_->size()) return;
      }
      Batch b;
      b.micro_batch = mbs_;
      b.seq_len = seq_len_;
      b.tokens.resize(static_cast<size_t>(mbs_ * seq_len_));
      b.labels.resize(static_cast<size_t>(mbs_ * seq_len_));
      for (int64_t r = 0; r < mbs_; ++r) {
        set_->sample(produce_at_ + offset_ + r, &text);
        NB_CHECK(static_cast<int64_t>(text.size()) == seq_len_ + 1, "sample of %zu tokens", text.size());
        std::copy(text.begin(), text.end() - 1, b.tokens.begin() + r * seq_len_);
        std::copy(text.begin() + 1, text.end(), b.labels.begin() + r * seq_len_);
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        queue_.push_back(std::move(b));
        produce_at_ += global_;
      }
      cv_.notify_all();
    }
  }

  std::shared_ptr<SampleSet> set_;
  int64_t seq_len_, mbs_, global_, offset_, consumed_, produce_at_;
  double wait_ms_ = 0;
  bool stop_ = false;
  std::deque<Batch> queue_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread worker_;
};

Status check_args(int64_t seq_len, int64_t micro_batch, int64_t consumed) {
  if (seq_len <= 0 || micro_batch <= 0 || consumed < 0)
    return errorf(
        "data source: seq_len (%lld) and micro_batch (%lld) must be positive and consumed samples (%lld) non-negative",
        (long long)seq_len, (long long)micro_batch, (long long)consumed);
  return Status::ok();
}
}  // namespace

Status make_mock_source_split(int64_t vocab, int64_t seq_len, int64_t micro_batch, uint64_t seed, Split split,
                              int64_t samples, int64_t consumed, std::unique_ptr<TokenSource>* out, int64_t dp_rank,
                              int64_t dp_size) {
  NB_TRY(check_args(seq_len, micro_batch, consumed));
  if (dp_size < 1 || dp_rank < 0 || dp_rank >= dp_size)
    return errorf("data-parallel rank %lld of %lld is invalid", (long long)dp_rank, (long long)dp_size);
  if (vocab < 2) return errorf("mock data needs a vocabulary of at least 2 tokens, got %lld", (long long)vocab);
  auto data = make_mock_low_level(vocab, static_cast<int32_t>(vocab - 1));
  std::array<std::pair<int64_t, int64_t>, 3> ranges;
  NB_TRY(split_ranges("969,30,1", data->size(), &ranges));
  auto r = ranges[static_cast<int>(split)];
  std::unique_ptr<GptDataset> ds;
  NB_TRY(GptDataset::create(data, r.first, r.second, seq_len, samples, static_cast<uint32_t>(seed), "",
                            split_name(split), &ds));
  *out = std::make_unique<PrefetchSource>(std::make_shared<SingleSet>(std::move(ds)), seq_len, micro_batch, consumed,
                                          dp_rank, dp_size);
  return Status::ok();
}

Status make_mock_source(int64_t vocab, int64_t seq_len, int64_t micro_batch, uint64_t seed, int64_t train_samples,
                        int64_t consumed, std::unique_ptr<TokenSource>* out) {
  return make_mock_source_split(vocab, seq_len, micro_batch, seed, Split::train, train_samples, consumed, out);
}

std::string index_cache_dir(const std::string& prefix, const std::string& cache_path) {
  if (cache_path == "none") return "";
  if (!cache_path.empty()) return cache_path;
  return (std::filesystem::path(prefix).parent_path() / "cache" / "nibble_indices").string();
}

Status make_gpt_samples(const DataConfig& cfg, Split split, std::shared_ptr<SampleSet>* out) {
  std::vector<BlendEntry> blend;
  NB_TRY(parse_blend(cfg.data_path, &blend));
  if (cfg.seed > 0xffffffffull)
    return errorf("seed %llu does not fit numpy's RandomState (0 .. 2^32-1)", (unsigned long long)cfg.seed);
  const int s = static_cast<int>(split);
  const int64_t requested = cfg.num_samples[s];
  if (requested <= 0)
    return errorf("no %s samples were requested; set the number of %s samples", split_name(split), split_name(split));
  const std::string cache = index_cache_dir(blend[0].prefix, cfg.cache_path);
  // Megatron's BlendedMegatronDatasetBuilder: one prefix without weight -> a plain GPTDataset of the
  // requested size; weights -> each component asked for ceil(ceil(S*w) * (1 + 0.005)) samples and a
  // blend of sum(ceil(S*w)) samples; several prefixes without weights -> one epoch of each, weighted
  // by their lengths, blend size min(S, sum of lengths).
  const bool weighted = blend[0].weight >= 0;
  std::vector<std::unique_ptr<GptDataset>> parts;
  std::vector<double> weights;
  int64_t blend_size = 0;
  for (const auto& e : blend) {
    std::unique_ptr<IndexedDataset> raw;
    NB_TRY(IndexedDataset::open(e.prefix, &raw));
    auto data = wrap_indexed_dataset(std::shared_ptr<IndexedDataset>(std::move(raw)));
    std::array<std::pair<int64_t, int64_t>, 3> ranges;
    NB_TRY(split_ranges(cfg.split, data->size(), &ranges));
    auto r = ranges[s];
    if (r.first == r.second)
      return errorf("%s: the %s split \"%s\" selects no sequences of %lld; change --split", e.prefix.c_str(),
                    split_name(split), cfg.split.c_str(), (long long)data->size());
    int64_t n = requested;
    if (weighted) {
      const int64_t target = static_cast<int64_t>(std::ceil(double(requested) * e.weight));
      n = static_cast<int64_t>(std::ceil(double(target) * (1.0 + 0.005)));
      blend_size += target;
    } else if (blend.size() > 1) {
      n = -1;  // one epoch
    }
    std::unique_ptr<GptDataset> ds;
    NB_TRY(GptDataset::create(data, r.first, r.second, cfg.seq_length, n, static_cast<uint32_t>(cfg.seed), cache,
                              split_name(split), &ds));
    weights.push_back(weighted ? e.weight : double(ds->size()));
    parts.push_back(std::move(ds));
  }
  if (!weighted && blend.size() == 1) {
    *out = std::make_shared<SingleSet>(std::move(parts[0]));
    return Status::ok();
  }
  if (!weighted) {
    int64_t total = 0;
    for (double w : weights) total += int64_t(w);
    blend_size = std::min(requested, total);
  }
  double sum = 0;  // BlendedDataset normalises (again), as Megatron does
  for (double w : weights) sum += w;
  for (double& w : weights) w /= sum;
  *out = std::make_shared<BlendedSet>(std::move(parts), weights, blend_size);
  return Status::ok();
}

Status make_gpt_source(const DataConfig& cfg, Split split, int64_t micro_batch, int64_t consumed,
                       std::unique_ptr<TokenSource>* out) {
  return make_gpt_source_dp(cfg, split, micro_batch, 0, 1, consumed, out);
}

Status make_gpt_source_dp(const DataConfig& cfg, Split split, int64_t micro_batch, int64_t dp_rank, int64_t dp_size,
                          int64_t consumed, std::unique_ptr<TokenSource>* out) {
  NB_TRY(check_args(cfg.seq_length, micro_batch, consumed));
  if (dp_size < 1 || dp_rank < 0 || dp_rank >= dp_size)
    return errorf("data-parallel rank %lld of %lld is invalid", (long long)dp_rank, (long long)dp_size);
  std::shared_ptr<SampleSet> set;
  NB_TRY(make_gpt_samples(cfg, split, &set));
  *out = std::make_unique<PrefetchSource>(std::move(set), cfg.seq_length, micro_batch, consumed, dp_rank, dp_size);
  return Status::ok();
}

}  // namespace nb
