// ParamStore's Megatron-FSDP layout (params.h): parameter groups cut by rows over the ranks, the units
// that are gathered and reduced together, and loading values into the shards.
#include <algorithm>
#include <numeric>
#include "model/params.h"
#include "ops/elementwise.h"

namespace nb {

namespace {
bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}
// 0 the embedding, 1 + l layer l, layers + 1 the head.
int unit_of_name(const std::string& name, int64_t layers) {
  static const std::string kLayer = "model.layers.";
  if (name == "model.embed_tokens.weight") return 0;
  if (name.compare(0, kLayer.size(), kLayer) == 0) return 1 + std::stoi(name.substr(kLayer.size()));
  return int(layers) + 1;
}
}  // namespace

// q, k and v stay one group (the fused projection reads them as one [qd + 2 kvd, H] weight); every
// group's row chunk is a whole number of the format's block rows and of 256-byte aligned rows.
Status ParamStore::layout_fsdp(const LlamaConfig& cfg, int shard_count, int64_t row_align, int64_t no_copy_begin,
                               int64_t no_copy_end) {
  NB_TRY(layout(held_params(llama_param_list(cfg))));  // a pipeline stage's own; units keep the whole model's numbers
  groups_.clear();
  param_group_.assign(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamInfo& p = params_[i];
    const bool joins = ends_with(p.name, "self_attn.k_proj.weight") || ends_with(p.name, "self_attn.v_proj.weight");
    if (!joins) {
      Group g;
      g.cols = p.shape.size() == 2 ? p.shape[1] : 1;
      g.unit = unit_of_name(p.name, cfg.layers);
      g.stored = !(p.shape.size() == 2 && g.unit > no_copy_begin && g.unit <= no_copy_end && g.unit <= cfg.layers);
      groups_.push_back(g);
    }
    NB_CHECK((p.shape.size() == 2 ? p.shape[1] : 1) == groups_.back().cols, "internal: %s joins a group of other rows",
             p.name.c_str());
    groups_.back().rows += p.shape[0];
    param_group_[i] = int(groups_.size()) - 1;
  }
  unit_elems_.assign(size_t(cfg.layers + 2), 0);
  int64_t off = 0, local = 0;
  decayed_end_ = 0;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Group& g = groups_[gi];
    const int64_t align = std::lcm(std::max<int64_t>(row_align, 1), kAlign / std::gcd(g.cols, kAlign));
    g.rows_per_rank = ((g.rows + shard_count - 1) / shard_count + align - 1) / align * align;
    g.begin = off;
    g.local = local;
    g.unit_offset = unit_elems_[size_t(g.unit)];
    const int64_t padded = g.chunk() * shard_count;
    off += padded;
    if (!g.stored) continue;  // a place in the flat space (names, offsets), no rows in any shard or window
    unit_elems_[size_t(g.unit)] += padded;
    local += g.chunk();
  }
  // Parameters inside a group are back to back; the decayed ones come first in the list.
  std::vector<int64_t> filled(groups_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    ParamInfo& p = params_[i];
    const int gi = param_group_[i];
    p.offset = groups_[size_t(gi)].begin + filled[size_t(gi)];
    filled[size_t(gi)] += p.numel;
    if (p.decay) decayed_end_ = groups_[size_t(gi)].begin + groups_[size_t(gi)].chunk() * shard_count;
  }
  total_ = padded_total_ = bucket_len_ = off;
  shard_len_ = local;
  return Status::ok();
}

Status ParamStore::allocate_fsdp(const LlamaConfig& cfg, Device dev, int shard_rank, int shard_count,
                                 bool shard_compute, int64_t row_align, const optim::Placement& placement) {
  NB_CHECK(shard_count >= 1 && shard_rank >= 0 && shard_rank < shard_count, "internal: shard %d of %d", shard_rank,
           shard_count);
  device_ = dev;
  frozen_ = false;
  NB_TRY(layout_fsdp(cfg, shard_count, row_align));
  fsdp_ = true;
  shard_compute_ = shard_compute;
  shard_count_ = shard_count;
  shard_rank_ = shard_rank;
  unit_compute_.assign(unit_elems_.size(), nullptr);
  unit_grad_.assign(unit_elems_.size(), nullptr);
  NB_TRY(state_->allocate(device_, shard_len_, placement));
  NB_TRY(Buffer::allocate(&grad_, DType::f32, device_, {std::max<int64_t>(1, shard_len_)}));
  return Buffer::allocate(&compute_, compute_dtype(), device_,
                          {std::max<int64_t>(1, shard_compute ? shard_len_ : total_)});
}

Status ParamStore::allocate_frozen_fsdp(const LlamaConfig& cfg, Device dev, int shard_rank, int shard_count,
                                        int64_t row_align, int64_t no_copy_begin, int64_t no_copy_end) {
  NB_CHECK(shard_count >= 1 && shard_rank >= 0 && shard_rank < shard_count, "internal: shard %d of %d", shard_rank,
           shard_count);
  device_ = dev;
  frozen_ = true;
  NB_TRY(layout_fsdp(cfg, shard_count, row_align, no_copy_begin, no_copy_end));
  fsdp_ = shard_compute_ = true;
  shard_count_ = shard_count;
  shard_rank_ = shard_rank;
  unit_compute_.assign(unit_elems_.size(), nullptr);
  unit_grad_.assign(unit_elems_.size(), nullptr);
  NB_TRY(Buffer::allocate(&compute_, compute_dtype(), device_, {std::max<int64_t>(1, shard_len_)}));
  ops::fill(padded_compute(), 0.0f, nullptr);  // the chunks' padding rows stay zero
  return Status::ok();
}

int ParamStore::unit_of(const std::string& name) const { return group_of(name).unit; }

int ParamStore::group_index(const std::string& name) const {
  const auto it = index_.find(name);
  NB_CHECK(it != index_.end(), "no parameter named %s", name.c_str());
  return param_group_[size_t(it->second)];
}

const ParamStore::Group& ParamStore::group_of(const std::string& name) const {
  const auto it = index_.find(name);
  NB_CHECK(it != index_.end(), "no parameter named %s", name.c_str());
  return groups_[size_t(param_group_[size_t(it->second)])];
}

// The master shard from the host values; the compute copy cast on the device through an FP32 scratch:
// the gradient shard for this rank's chunks (optim_grads_params), else one group at a time.
Status ParamStore::set_master_fsdp(const float* host) {
  NB_TRY(set_state(optim::StateArray::master, host));
  const Tensor g = padded_grad();
  if (compute_sharded()) {
    for (const Slice& s : own_slices())
      NB_TRY(copy_bytes(range(g, s.local, s.local + (s.end - s.begin)).data, device_, host + s.begin, Device::cpu,
                        size_t(s.end - s.begin) * 4));
    ops::cast(g, padded_compute(), nullptr);
    ops::fill(g, 0.0f, nullptr);
    return Status::ok();
  }
  int64_t most = 1;
  for (const Group& gr : groups_) most = std::max(most, gr.chunk() * shard_count_);
  Buffer scratch;
  NB_TRY(Buffer::allocate(&scratch, DType::f32, device_, {most}));
  for (const Group& gr : groups_) {
    const int64_t n = gr.chunk() * shard_count_;
    NB_TRY(copy_bytes(scratch.data(), device_, host + gr.begin, Device::cpu, size_t(n) * 4));
    ops::cast(range(scratch.tensor(), 0, n), range(padded_compute(), gr.begin, gr.begin + n), nullptr);
  }
  return Status::ok();
}

}  // namespace nb
