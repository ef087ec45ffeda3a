// ParamStore: layout, allocation and seeded initialization of the model's parameters.
#include "model/params.h"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include "core/philox.h"
#include "ops/elementwise.h"

namespace nb {

std::vector<ParamInfo> llama_param_list(const LlamaConfig& c) {
  std::vector<ParamInfo> decayed, flat;
  const float std_in = 0.02f, std_out = 0.02f / std::sqrt(2.0f * float(c.layers));
  decayed.push_back({"model.embed_tokens.weight", {c.vocab, c.hidden}, 0, 0, true, std_in});
  for (int64_t l = 0; l < c.layers; ++l) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    decayed.push_back({p + "self_attn.q_proj.weight", {c.q_dim(), c.hidden}, 0, 0, true, std_in});
    decayed.push_back({p + "self_attn.k_proj.weight", {c.kv_dim(), c.hidden}, 0, 0, true, std_in});
    decayed.push_back({p + "self_attn.v_proj.weight", {c.kv_dim(), c.hidden}, 0, 0, true, std_in});
    decayed.push_back({p + "self_attn.o_proj.weight", {c.hidden, c.q_dim()}, 0, 0, true, std_out});
    // gate and up fused into one [2F, H] weight: rows [0, F) gate, [F, 2F) up (split on export).
    decayed.push_back({p + "mlp.gate_up_proj.weight", {2 * c.ffn, c.hidden}, 0, 0, true, std_in});
    decayed.push_back({p + "mlp.down_proj.weight", {c.hidden, c.ffn}, 0, 0, true, std_out});
    flat.push_back({p + "input_layernorm.weight", {c.hidden}, 0, 0, false, 0});
    flat.push_back({p + "post_attention_layernorm.weight", {c.hidden}, 0, 0, false, 0});
  }
  if (!c.tied_embeddings) decayed.push_back({"lm_head.weight", {c.vocab, c.hidden}, 0, 0, true, std_in});
  flat.push_back({"model.norm.weight", {c.hidden}, 0, 0, false, 0});
  decayed.insert(decayed.end(), flat.begin(), flat.end());
  return decayed;
}

namespace {
// Standard normal pairs by Box-Muller from two 32-bit uniforms (FP64 on the host: init only), for
// elements [begin, end) of a stream; begin is a multiple of 4 (one Philox block gives 4 uniforms).
void normal_fill(float* out, int64_t begin, int64_t end, uint64_t seed, uint32_t stream, float stddev) {
  RngKey key{seed, 0, stream};
  for (int64_t i = begin; i < end; i += 4) {
    Philox4x32 r = philox_block(key, uint64_t(i / 4));
    for (int j = 0; j < 4 && i + j < end; j += 2) {
      double u1 = (double(r.v[j]) + 1.0) / 4294967296.0, u2 = double(r.v[j + 1]) / 4294967296.0;
      double rad = std::sqrt(-2.0 * std::log(u1));
      out[i + j] = float(rad * std::cos(2.0 * M_PI * u2)) * stddev;
      if (i + j + 1 < end) out[i + j + 1] = float(rad * std::sin(2.0 * M_PI * u2)) * stddev;
    }
  }
}
}  // namespace

void initial_values(const ParamInfo& p, uint32_t index, uint64_t seed, float* dst, unsigned threads) {
  if (p.init_std == 0) {
    std::fill(dst, dst + p.numel, p.init_value);
    return;
  }
  constexpr int64_t kChunk = int64_t(1) << 22;  // elements per task, a multiple of 4
  const int64_t chunks = (p.numel + kChunk - 1) / kChunk;
  threads = unsigned(std::clamp<int64_t>(std::min<int64_t>(threads, chunks), 1, 64));
  auto work = [&](unsigned t) {
    for (int64_t c = t; c < chunks; c += threads)
      normal_fill(dst, c * kChunk, std::min(p.numel, (c + 1) * kChunk), seed, index, p.init_std);
  };
  if (threads == 1) return work(0);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) pool.emplace_back(work, t);
  for (auto& th : pool) th.join();
}

namespace {
// Offsets of consecutive parameters, each slice padded to kAlign elements; returns the total and sets the end
// of the decayed range.
int64_t assign_offsets(std::vector<ParamInfo>& params, int64_t align, int64_t* decayed_end) {
  int64_t off = 0;
  *decayed_end = 0;
  for (auto& p : params) {
    p.numel = 1;
    for (int64_t d : p.shape) p.numel *= d;
    p.offset = off;
    off += (p.numel + align - 1) / align * align;
    if (p.decay) *decayed_end = off;
  }
  return off;
}
}  // namespace

std::vector<ParamInfo> ParamStore::flat_layout(const LlamaConfig& cfg, int64_t* total) {
  return laid_out(llama_param_list(cfg), total);
}

std::vector<ParamInfo> ParamStore::laid_out(std::vector<ParamInfo> params, int64_t* total) {
  int64_t decayed_end = 0;
  *total = assign_offsets(params, kAlign, &decayed_end);
  return params;
}

std::vector<ParamInfo> ParamStore::held_params(std::vector<ParamInfo> all) {
  std::vector<ParamInfo> kept;
  init_index_.clear();
  if (!pp_held_) return all;
  for (size_t i = 0; i < all.size(); ++i)
    if (!pp_held_ || pp_held_(all[i].name)) {
      kept.push_back(all[i]);
      init_index_.push_back(uint32_t(i));
    }
  return kept;
}

std::vector<ParamInfo> ParamStore::whole_layout(int64_t* total) const {
  if (pp_held_) return laid_out(pp_whole_params_, total);  // (under tensor parallelism too: the unsliced list)
  if (!tp_.on()) {
    *total = total_;
    return params_;
  }
  return tp_whole_params_.empty() ? flat_layout(tp_whole_, total) : laid_out(tp_whole_params_, total);
}

std::vector<ParamInfo> ParamStore::stage_whole_layout(int64_t* total) const {
  if (!pp_held_) return whole_layout(total);
  std::vector<ParamInfo> held;
  for (const ParamInfo& p : pp_whole_params_)
    if (pp_held_(p.name)) held.push_back(p);
  return laid_out(std::move(held), total);
}

Status ParamStore::layout(std::vector<ParamInfo> params) {
  params_ = std::move(params);
  fsdp_ = shard_compute_ = false;
  index_.clear();
  for (size_t i = 0; i < params_.size(); ++i) index_[params_[i].name] = int(i);
  total_ = assign_offsets(params_, kAlign, &decayed_end_);
  hole_begin_ = hole_end_ = 0;
  return Status::ok();
}

// Per layer the six linear weights are consecutive (q, k, v, o, gate_up, down); norms live elsewhere.
Status ParamStore::set_hole(const LlamaConfig& cfg, int64_t begin_layer, int64_t end_layer) {
  if (begin_layer >= end_layer) return Status::ok();
  NB_CHECK(begin_layer >= 0 && end_layer <= cfg.layers, "master-only layers [%lld, %lld) out of range",
           (long long)begin_layer, (long long)end_layer);
  const ParamInfo& first = info("model.layers." + std::to_string(begin_layer) + ".self_attn.q_proj.weight");
  const ParamInfo& last = info("model.layers." + std::to_string(end_layer - 1) + ".mlp.down_proj.weight");
  hole_begin_ = first.offset;
  hole_end_ = last.offset + (last.numel + kAlign - 1) / kAlign * kAlign;
  return Status::ok();
}

Status ParamStore::allocate_buffers(int shard_rank, int shard_count, int64_t bucket_elems,
                                    const optim::Placement& placement) {
  NB_CHECK(shard_count >= 1 && shard_rank >= 0 && shard_rank < shard_count, "internal: shard %d of %d", shard_rank,
           shard_count);
  NB_CHECK(shard_count == 1 || hole_end_ == hole_begin_, "internal: a sharded store needs every compute copy");
  NB_CHECK(bucket_elems >= 0, "internal: bucket of %lld elements", (long long)bucket_elems);
  shard_count_ = shard_count;
  shard_rank_ = shard_rank;
  // Buckets of a multiple of kAlign x d elements, so that every rank's slice of every bucket starts aligned.
  const int64_t unit = kAlign * shard_count;
  padded_total_ = shard_count == 1 ? total_ : (total_ + unit - 1) / unit * unit;
  // A bucket never exceeds the flat space: its BF16 reduction scratch (train/grad_sync.h) is bucket_len long.
  const int64_t whole = std::max<int64_t>(padded_total_, 1);
  bucket_len_ = bucket_elems > 0 ? std::min(whole, (bucket_elems + unit - 1) / unit * unit) : whole;
  shard_len_ = padded_total_ / shard_count;
  if (!frozen_) {
    NB_TRY(state_->allocate(device_, shard_len_, placement));
    NB_TRY(Buffer::allocate(&grad_, DType::f32, device_, {padded_total()}));
  }
  const int64_t compute_n = shard_count > 1 ? padded_total() : total_ - (hole_end_ - hole_begin_);
  return Buffer::allocate(&compute_, compute_dtype(), device_, {std::max<int64_t>(1, compute_n)});
}

Status ParamStore::allocate(const LlamaConfig& cfg, Device dev, int64_t master_only_begin, int64_t master_only_end,
                            int shard_rank, int shard_count, int64_t bucket_elems, const optim::Placement& placement) {
  device_ = dev;
  frozen_ = false;
  NB_CHECK(placement.offload_fraction <= 0 || master_only_begin == master_only_end,
           "internal: an offloaded optimizer state needs every compute copy");
  NB_TRY(layout(held_params(llama_param_list(cfg))));
  NB_TRY(set_hole(cfg, master_only_begin, master_only_end));
  return allocate_buffers(shard_rank, shard_count, bucket_elems, placement);
}

Status ParamStore::allocate(std::vector<ParamInfo> params, Device dev) {
  device_ = dev;
  frozen_ = false;
  NB_TRY(layout(held_params(std::move(params))));
  return allocate_buffers(0, 1, 0, {});
}

Status ParamStore::allocate_frozen(const LlamaConfig& cfg, Device dev, int64_t no_copy_begin, int64_t no_copy_end) {
  device_ = dev;
  frozen_ = true;
  NB_TRY(layout(held_params(llama_param_list(cfg))));
  NB_TRY(set_hole(cfg, no_copy_begin, no_copy_end));
  return allocate_buffers(0, 1, 0, {});
}

Status ParamStore::initialize(uint64_t seed) {
  NB_CHECK(!frozen_, "internal: initialize() of a frozen store (its owner streams the values in)");
  std::vector<float> host(size_t(total_), 0.0f);
  initial_host_values(seed, host.data());
  NB_TRY(state_->fill_zero());  // a shard's padding past the last parameter stays zero
  if (shard_count_ > 1) ops::fill(padded_compute(), 0.0f, nullptr);
  NB_TRY(set_master(host.data()));
  ops::fill(padded_grad(), 0.0f, nullptr);
  return Status::ok();
}

// Each parameter gets its own Philox stream (its index), so values do not depend on thread count. Under tensor
// parallelism the whole parameter is drawn (same index: the local list has the whole one's names and order) and
// this rank's part kept.
void ParamStore::initial_host_values(uint64_t seed, float* host) const {
  const unsigned nthreads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  if (tp_.on()) {
    int64_t whole_total = 0;
    const std::vector<ParamInfo> whole = whole_layout(&whole_total);
    std::vector<float> values;
    for (size_t i = 0; i < params_.size(); ++i) {
      const uint32_t j = init_index_.empty() ? uint32_t(i) : init_index_[i];  // its index in the whole list
      NB_CHECK(j < whole.size() && whole[j].name == params_[i].name,
               "internal: the tensor-parallel store lists other parameters");
      values.resize(size_t(whole[j].numel));
      initial_values(whole[j], j, seed, values.data(), nthreads);
      tp::slice(whole[j], params_[i], tp_, values.data(), host + params_[i].offset, &tp_whole_);
    }
    return;
  }
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < nthreads; ++t) {
    pool.emplace_back([&, t] {
      for (size_t i = t; i < params_.size(); i += nthreads)
        initial_values(params_[i], init_index_.empty() ? uint32_t(i) : init_index_[i], seed, host + params_[i].offset,
                       1);
    });
  }
  for (auto& th : pool) th.join();
}

void ParamStore::slice_whole(const float* whole, float* local) const {
  int64_t whole_total = 0;
  const std::vector<ParamInfo> wl = whole_layout(&whole_total);
  std::fill(local, local + total_, 0.0f);
  if (pp_held_) {  // this stage's parameters, by name (under tensor parallelism this rank's slices of them)
    for (const ParamInfo& w : wl)
      if (auto it = index_.find(w.name); it != index_.end()) {
        const ParamInfo& p = params_[size_t(it->second)];
        tp::slice(w, p, tp_, whole + w.offset, local + p.offset, &tp_whole_);
      }
    return;
  }
  for (size_t i = 0; i < wl.size(); ++i)
    tp::slice(wl[i], params_[i], tp_, whole + wl[i].offset, local + params_[i].offset, &tp_whole_);
}

Status ParamStore::get_flat(const Tensor& flat, float* host) const {
  NB_CHECK(flat.numel() >= total_, "internal: get_flat of a sharded buffer (gather it first)");
  return copy_bytes(host, Device::cpu, flat.data, device_, size_t(total_) * 4);
}
ParamStore::Slice ParamStore::own_slice(int b) const {
  const int64_t begin = bucket_begin(b), len = (bucket_end(b) - begin) / shard_count_;
  return {begin + len * shard_rank_, begin + len * (shard_rank_ + 1), begin / shard_count_};
}
std::vector<ParamStore::Slice> ParamStore::own_slices() const {
  std::vector<Slice> out;
  if (fsdp_) {
    for (const Group& g : groups_)
      out.push_back({g.begin + shard_rank_ * g.chunk(), g.begin + (shard_rank_ + 1) * g.chunk(), g.local});
    return out;
  }
  for (int b = 0; b < bucket_count(); ++b) out.push_back(own_slice(b));
  return out;
}
Tensor ParamStore::slice_grad(const Slice& s) const {
  return fsdp_ ? view(grad_, DType::f32, s.local, s.end - s.begin) : range(padded_grad(), s.begin, s.end);
}
Tensor ParamStore::slice_compute(const Slice& s) const {
  return compute_sharded() ? view(compute_, compute_dtype(), s.local, s.end - s.begin)
                           : range(padded_compute(), s.begin, s.end);
}
// Master, m and v hold this store's slices of the flat space (all of it without sharding); a slice's
// part in the padding past total() stays as it is (zero).
Status ParamStore::set_state(optim::StateArray a, const float* host) {
  for (const Slice& s : own_slices()) {
    const int64_t end = std::min(s.end, total_);
    if (end > s.begin) NB_TRY(state_->write(a, s.local, host + s.begin, end - s.begin));
  }
  return Status::ok();
}
Status ParamStore::get_state(optim::StateArray a, float* host) const {
  NB_CHECK(shard_count_ == 1, "internal: get_state of a sharded store (gather it first)");
  return state_->read(a, 0, host, total_);
}
// The compute copy is cast on the device from the full FP32 values: from the master itself when this
// store holds all of it, else from the gradient buffer used as scratch (only at start or load).
Status ParamStore::set_master(const float* host) {
  if (fsdp_) return set_master_fsdp(host);
  NB_TRY(set_state(optim::StateArray::master, host));
  if (shard_count_ == 1 && !state_->offloaded()) {
    for (const Piece& p : compute_pieces(0, total_))
      if (p.compute.data) ops::cast(range(flat_master(), p.begin, p.end), p.compute, nullptr);
    return Status::ok();
  }
  NB_TRY(copy_bytes(grad_.data(), device_, host, Device::cpu, size_t(total_) * 4));
  ops::cast(flat_grad(), view(compute_, compute_dtype(), 0, total_), nullptr);
  ops::fill(padded_grad(), 0.0f, nullptr);
  return Status::ok();
}
Tensor ParamStore::padded_compute() const {
  NB_CHECK(hole_end_ == hole_begin_, "internal: padded_compute with a master-only range");
  if (fsdp_) return view(compute_, compute_dtype(), 0, compute_sharded() ? shard_len_ : total_);
  return view(compute_, compute_dtype(), 0, shard_count_ > 1 ? padded_total() : total_);
}

const ParamInfo& ParamStore::info(const std::string& name) const {
  const auto it = index_.find(name);
  NB_CHECK(it != index_.end(), "no parameter named %s", name.c_str());
  return params_[size_t(it->second)];
}

Tensor ParamStore::view(const Buffer& b, DType dt, int64_t offset, int64_t n) const {
  return Tensor::make(static_cast<uint8_t*>(b.data()) + dtype_bytes(dt, offset), dt, device_, {n});
}
Tensor ParamStore::shaped(const Buffer& b, DType dt, const ParamInfo& p) const { return at(b.data(), dt, p, p.offset); }
Tensor ParamStore::at(void* base, DType dt, const ParamInfo& p, int64_t offset) const {
  void* first = static_cast<uint8_t*>(base) + dtype_bytes(dt, offset);
  if (p.shape.size() == 1) return Tensor::make(first, dt, device_, {p.shape[0]});
  return Tensor::make(first, dt, device_, {p.shape[0], p.shape[1]});
}
Tensor ParamStore::range(const Tensor& flat, int64_t begin, int64_t end) const {
  return Tensor::make(static_cast<uint8_t*>(flat.data) + dtype_bytes(flat.dtype, begin), flat.dtype, device_,
                      {end - begin});
}
bool ParamStore::has_compute(const std::string& n) const {
  if (fsdp_) return group_of(n).stored;
  const ParamInfo& p = info(n);
  return p.offset < hole_begin_ || p.offset >= hole_end_;
}
Tensor ParamStore::compute(const std::string& n) const {
  NB_CHECK(has_compute(n), "internal: %s has no compute copy (its layer reads the FP32 master)", n.c_str());
  if (compute_sharded()) {
    const Group& g = group_of(n);
    void* base = unit_compute_[size_t(g.unit)];
    NB_CHECK(base, "internal: %s read while its unit is not gathered", n.c_str());
    return at(base, compute_dtype(), info(n), g.unit_offset + info(n).offset - g.begin);
  }
  ParamInfo p = info(n);
  p.offset = compute_offset(p.offset);
  return shaped(compute_, compute_dtype(), p);
}
Tensor ParamStore::flat_compute() const {
  NB_CHECK(hole_end_ == hole_begin_, "internal: flat_compute with a master-only range; use compute_pieces");
  return view(compute_, compute_dtype(), 0, total_);
}
std::vector<ParamStore::Piece> ParamStore::compute_pieces(int64_t begin, int64_t end) const {
  std::vector<Piece> out;
  const int64_t cuts[4] = {begin, std::clamp(hole_begin_, begin, end), std::clamp(hole_end_, begin, end), end};
  for (int i = 0; i < 3; ++i) {
    if (cuts[i + 1] <= cuts[i]) continue;
    Piece p{cuts[i], cuts[i + 1], Tensor{}};
    const bool inside = cuts[i] >= hole_begin_ && cuts[i + 1] <= hole_end_ && hole_end_ > hole_begin_;
    if (!inside) p.compute = view(compute_, compute_dtype(), compute_offset(cuts[i]), cuts[i + 1] - cuts[i]);
    out.push_back(p);
  }
  return out;
}
Tensor ParamStore::grad(const std::string& n) const {
  NB_CHECK(!frozen_, "internal: %s is frozen (no gradient)", n.c_str());
  if (fsdp_) {
    const Group& g = group_of(n);
    float* base = unit_grad_[size_t(g.unit)];
    NB_CHECK(base, "internal: gradient of %s written while its unit has no gradient window", n.c_str());
    return at(base, DType::f32, info(n), g.unit_offset + info(n).offset - g.begin);
  }
  return shaped(grad_, DType::f32, info(n));
}
Tensor ParamStore::master(const std::string& n) const {
  NB_CHECK(!frozen_, "internal: %s is frozen (no FP32 master)", n.c_str());
  NB_CHECK(shard_count_ == 1 && !state_->offloaded(),
           "internal: per-parameter master views of a sharded or "
           "offloaded store");
  const ParamInfo& p = info(n);
  const Tensor flat = flat_master();
  return p.shape.size() == 1
             ? Tensor::make(flat.ptr<float>() + p.offset, DType::f32, device_, {p.shape[0]})
             : Tensor::make(flat.ptr<float>() + p.offset, DType::f32, device_, {p.shape[0], p.shape[1]});
}
size_t ParamStore::bytes() const {
  if (fsdp_ && frozen_) return size_t(shard_len_) * size_t(dtype_bits(compute_dtype()) / 8);
  if (fsdp_)
    return size_t(shard_len_) * 4 + state_->device_bytes() +
           size_t(padded_compute().numel()) * size_t(dtype_bits(compute_dtype()) / 8);
  const int64_t compute_n = shard_count_ > 1 ? padded_total() : total_ - (hole_end_ - hole_begin_);
  if (frozen_) return size_t(compute_n) * size_t(dtype_bits(compute_dtype()) / 8);
  return size_t(padded_total()) * 4 + state_->device_bytes() +
         size_t(compute_n) * size_t(dtype_bits(compute_dtype()) / 8);
}

}  // namespace nb
