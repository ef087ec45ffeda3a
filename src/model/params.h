// Parameter storage of a Llama model: five flat buffers (FP32 master weights, FP32 gradients, FP32
// AdamW m and v, and the compute copy: BF16 on CUDA, FP32 on the CPU backend), each parameter a
// slice at the same offset in all five. Flat storage lets zeroing, the global gradient norm and
// AdamW run as a few launches over contiguous memory. Weight-decayed (2-D) parameters come first,
// so decayed and non-decayed parameters are two contiguous ranges.
// Master-only range: the linear weights of a contiguous block of layers (those a precision recipe
// quantizes) can be left without a compute copy. Their Linears quantize from the FP32 master once per
// step (through a staging buffer the model owns), so a BF16 copy would only cost 2 bytes per weight.
// The compute buffer then skips that range: compute offsets past it shift down by its length.
// Buckets (Megatron's DDP buckets, --ddp-bucket-size): the flat space is cut into runs of bucket_len
// elements (the last may be shorter), the unit of each gradient reduction and weight gather.
// Distributed optimizer (shard_count d > 1, Megatron-Core's --use-distributed-optimizer): the flat space
// is padded so that every bucket is a multiple of kAlign x d, rank r owns slice r of every bucket, and
// this store keeps master, m and v only for its own slices, back to back in bucket order: 2 (BF16 copy)
// + 4 (gradient) + 12 / d bytes per parameter. Gradient and compute buffers stay whole (padded) so that
// collectives work on them in place. Sharding needs every parameter to have a compute copy.
// Megatron-FSDP (allocate_fsdp; --use-megatron-fsdp, distributed/fsdp.h): strategy optim_grads shards the
// gradients as well as master, m and v; optim_grads_params the compute copy too. The unit of sharding is a
// parameter group (q, k and v together, every other parameter alone), cut by rows into d equal chunks of
// rows_per_rank rows (zero rows pad its end); rank r keeps chunk r of every group, back to back in group
// order, in every sharded array: a row chunk is what a quantized format can encode alone, and a gather of
// the chunks is the whole group, rows in order. The embedding, each transformer layer and the head (final
// norm and LM head) are units: gathered and reduced together into windows that distributed/fsdp.h binds
// here while they are in use (bind_compute, bind_grad); compute() and grad() of a parameter resolve to its
// unit's window.
// Master, m and v belong to an optim::OptimizerState (optim/optimizer_state.h), which places a share of
// them in host memory with --optimizer-cpu-offload; then the flat_master/m/v views are the device part
// only, and whole-array transfers go through get_state/set_state.
#pragma once
#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>
#include "core/tensor.h"
#include "model/llama_config.h"
#include "model/tensor_parallel.h"
#include "optim/optimizer_state.h"

namespace nb {

struct ParamInfo;
// The parameters of a Llama model, in store order (decayed 2-D weights first, then the norms).
std::vector<ParamInfo> llama_param_list(const LlamaConfig& c);

struct ParamInfo {
  std::string name;            // Hugging Face name, e.g. model.layers.0.self_attn.q_proj.weight
  std::vector<int64_t> shape;  // [out, in] for linears
  int64_t offset = 0;          // element offset in every flat buffer
  int64_t numel = 0;
  bool decay = false;    // 2-D weights get weight decay; norms do not
  float init_std = 0;    // 0 = the constant init_value
  float init_value = 1;  // norm weights 1, LoRA B 0
};

// The seeded initial values of parameter p, which is parameter number `index` of its store: N(0,
// init_std) from Philox stream `index` (FP64 Box-Muller on the host), or the constant. Filled by up to
// `threads` threads in Philox-block chunks, so the values never depend on the thread count.
void initial_values(const ParamInfo& p, uint32_t index, uint64_t seed, float* dst, unsigned threads);

class ParamStore {
 public:
  static constexpr int64_t kAlign = 64;  // elements: 256-byte aligned FP32 slices, 128-byte BF16 slices
  // Linear weights of layers [master_only_begin, master_only_end) get no compute copy (empty range: all do).
  // bucket_elems: the bucket length asked for (0 = one bucket), rounded up to a multiple of kAlign x d.
  Status allocate(const LlamaConfig& cfg, Device dev, int64_t master_only_begin = 0, int64_t master_only_end = 0,
                  int shard_rank = 0, int shard_count = 1, int64_t bucket_elems = 0,
                  const optim::Placement& placement = {});
  // A store of the given parameters (LoRA adapters): every one trainable, one shard, no master-only range.
  Status allocate(std::vector<ParamInfo> params, Device dev);
  // A frozen store (a LoRA base): the compute copy only, no master, gradient or AdamW state (grad(),
  // master() and the flat views are errors). Linear weights of layers [no_copy_begin, no_copy_end) get no
  // storage here at all: their Linears hold them quantized.
  Status allocate_frozen(const LlamaConfig& cfg, Device dev, int64_t no_copy_begin, int64_t no_copy_end);
  bool frozen() const { return frozen_; }
  // Megatron-FSDP's layout over shard_count ranks (see above): gradients sharded; the compute copy too when
  // shard_compute (optim_grads_params). Every group's rows per rank are a multiple of row_align (the block
  // rows of the recipe's weight format) and keep each rank's chunk 256-byte aligned. The optimizer state
  // (this rank's master, m and v) is placed as `placement` says (a share in host memory with offload).
  Status allocate_fsdp(const LlamaConfig& cfg, Device dev, int shard_rank, int shard_count, bool shard_compute,
                       int64_t row_align, const optim::Placement& placement = {});
  // A frozen store in that layout (a LoRA base under optim_grads_params): this rank's chunk of the compute
  // copy only. The groups of the linear weights of layers [no_copy_begin, no_copy_end) keep their place in
  // the flat space and their rows per rank but no storage (stored = false): their frozen Linears hold this
  // rank's chunk quantized.
  Status allocate_frozen_fsdp(const LlamaConfig& cfg, Device dev, int shard_rank, int shard_count, int64_t row_align,
                              int64_t no_copy_begin, int64_t no_copy_end);
  struct Group {
    int64_t begin = 0, rows = 0, cols = 0, rows_per_rank = 0;  // flat start; true rows; row length; rows a rank keeps
    int unit = 0;                                              // the unit (window) it belongs to
    int64_t unit_offset = 0;                                   // its start in the unit's window (elements)
    int64_t local = 0;                                         // this rank's chunk in the sharded arrays
    bool stored = true;  // false: no compute rows here (a frozen quantized weight, allocate_frozen_fsdp)
    int64_t chunk() const { return rows_per_rank * cols; }
  };
  bool fsdp() const { return fsdp_; }
  bool compute_sharded() const { return fsdp_ && shard_compute_; }
  const std::vector<Group>& groups() const { return groups_; }
  // Units: 0 the embedding, 1 + l transformer layer l, layers + 1 the head (final norm, LM head if untied).
  int unit_count() const { return int(unit_elems_.size()); }
  int64_t unit_elems(int u) const { return unit_elems_[size_t(u)]; }
  int unit_of(const std::string& name) const;
  int group_index(const std::string& name) const;  // the group a parameter belongs to (FSDP)
  // Unit u's whole values (compute dtype) and gradients (FP32), unit_elems(u) each; nullptr unbinds.
  void bind_compute(int u, void* base) { unit_compute_[size_t(u)] = base; }
  void bind_grad(int u, float* base) { unit_grad_[size_t(u)] = base; }
  bool compute_bound(int u) const { return unit_compute_[size_t(u)] != nullptr; }
  bool grad_bound(int u) const { return unit_grad_[size_t(u)] != nullptr; }
  // Deterministic initialization from the seed: N(0, 0.02), output projections 0.02/sqrt(2L), norms 1.
  // Under tensor parallelism (set_tensor_parallel) each parameter is rank s's slice of the whole model's
  // values, so T ranks start from exactly one GPU's weights.
  Status initialize(uint64_t seed);
  // Set before initialize: this store holds rank s's part of model `whole` (model/tensor_parallel.h).
  // whole_params: the whole store's parameters when they are not the model's (LoRA's adapters of `whole`), in
  // this store's order.
  void set_tensor_parallel(const LlamaConfig& whole, tp::Shard s, std::vector<ParamInfo> whole_params = {}) {
    tp_whole_ = whole;
    tp_ = s;
    tp_whole_params_ = std::move(whole_params);
  }
  tp::Shard tensor_parallel_shard() const { return tp_; }
  // Set before allocate: pipeline parallelism. This store keeps only the parameters `held` names (a stage's layers,
  // the embedding on the first stage, the final norm and head on the last), in the whole model's order; each is
  // initialized as the whole model's (its index there picks its Philox stream). whole_layout() is then the whole
  // model's, and slice_whole() keeps this stage's parameters.
  // whole_params: the whole store's list (the model's, or its LoRA adapters'), in store order.
  void set_pipeline_stage(std::vector<ParamInfo> whole_params, std::function<bool(const std::string&)> held) {
    pp_whole_params_ = std::move(whole_params);
    pp_held_ = std::move(held);
  }
  bool pipeline_stage() const { return bool(pp_held_); }
  const LlamaConfig& tensor_parallel_whole() const { return tp_whole_; }
  // The whole store's parameters (under tensor parallelism the whole model's, or its adapters) with the offsets
  // and total a store of them lays out: checkpoints and the gathers of a save use this layout.
  std::vector<ParamInfo> whole_layout(int64_t* total) const;
  // The unsliced parameters this store keeps (a pipeline stage's), laid out in store order: what the stage's
  // tensor-parallel ranks gather into before the stages' arrays are gathered. whole_layout() without a stage.
  std::vector<ParamInfo> stage_whole_layout(int64_t* total) const;
  // Under tensor parallelism: this store's slices of a whole host array (whole_layout order).
  void slice_whole(const float* whole, float* local) const;
  // The parameters of `cfg` with the offsets and total a store of it lays out (no allocation).
  static std::vector<ParamInfo> flat_layout(const LlamaConfig& cfg, int64_t* total);
  // `params` (any list) with the offsets and total a store of them lays out.
  static std::vector<ParamInfo> laid_out(std::vector<ParamInfo> params, int64_t* total);

  const std::vector<ParamInfo>& params() const { return params_; }
  const ParamInfo& info(const std::string& name) const;
  int64_t total() const { return total_; }
  int64_t decayed_count() const { return decayed_end_; }  // elements [0, decayed_end_) are decayed
  Device device() const { return device_; }
  DType compute_dtype() const { return device_ == Device::cuda ? DType::bf16 : DType::f32; }

  // Views of one parameter (2-D or 1-D) in each buffer. compute() of a master-only parameter is an error.
  Tensor compute(const std::string& name) const;
  bool has_compute(const std::string& name) const;
  Tensor grad(const std::string& name) const;
  Tensor master(const std::string& name) const;
  // Flat views, for the optimizer and reductions. Master, m and v cover this store's slices (element 0 is
  // the first element of its slice of bucket 0; without sharding, everything); gradients cover the whole
  // flat space.
  // With an offloaded state these are its device part only (optimizer_state().resident() elements).
  Tensor flat_master() const { return state_->device_part(optim::StateArray::master); }
  Tensor flat_grad() const { return view(grad_, DType::f32, 0, fsdp_ ? shard_len_ : total_); }
  Tensor flat_m() const { return state_->device_part(optim::StateArray::m); }
  Tensor flat_v() const { return state_->device_part(optim::StateArray::v); }
  optim::OptimizerState& optimizer_state() { return *state_; }
  const optim::OptimizerState& optimizer_state() const { return *state_; }
  // Buckets and this store's slices of them (the whole bucket without sharding). A slice may reach into
  // the padding past total(); shard_len() is the sum of the slices, padded_total() = d x shard_len().
  struct Slice {
    int64_t begin, end;  // flat elements
    int64_t local;       // where the slice starts in master, m and v
  };
  int shard_count() const { return shard_count_; }
  int shard_rank() const { return shard_rank_; }
  int64_t shard_len() const { return shard_len_; }
  int64_t padded_total() const { return padded_total_; }
  int64_t bucket_len() const { return bucket_len_; }
  int bucket_count() const { return int((padded_total_ + bucket_len_ - 1) / bucket_len_); }
  int64_t bucket_begin(int b) const { return int64_t(b) * bucket_len_; }
  int64_t bucket_end(int b) const { return std::min(padded_total_, int64_t(b + 1) * bucket_len_); }
  Slice own_slice(int b) const;
  // Every slice of the flat space this store keeps master, m and v for, in flat order: its slice of each
  // bucket, or with FSDP its chunk of each group.
  std::vector<Slice> own_slices() const;
  // The gradients of slice s (from own_slices) and the compute copy the optimizer writes for it: in place in
  // the whole buffers, or in this rank's shards.
  Tensor slice_grad(const Slice& s) const;
  Tensor slice_compute(const Slice& s) const;
  Tensor padded_grad() const { return view(grad_, DType::f32, 0, fsdp_ ? shard_len_ : padded_total()); }
  Tensor padded_compute() const;  // only without a master-only range
  Tensor flat_compute() const;    // only without a master-only range
  Tensor range(const Tensor& flat, int64_t begin, int64_t end) const;
  // [begin, end) of the flat element space cut at the master-only range: each piece with its compute
  // view (data == nullptr inside the range), for the optimizer, which writes the compute copy.
  struct Piece {
    int64_t begin, end;
    Tensor compute;
  };
  std::vector<Piece> compute_pieces(int64_t begin, int64_t end) const;
  int64_t master_only_elements() const { return hole_end_ - hole_begin_; }
  // Whole-store transfers for checkpoints and imported weights (host arrays of total() FP32 elements;
  // the alignment padding between parameters is zero). set_state stores into master, m or v the part
  // this store keeps (its shard), wherever it lives; get_state needs an unsharded store (a sharded one
  // gathers first); get_flat copies a whole device buffer (the gradients). set_master also rewrites
  // the whole compute copy.
  Status get_flat(const Tensor& flat, float* host) const;
  Status get_state(optim::StateArray a, float* host) const;
  Status set_state(optim::StateArray a, const float* host);
  Status set_master(const float* host);
  size_t bytes() const;

 private:
  Tensor view(const Buffer& b, DType dt, int64_t offset, int64_t n) const;
  Tensor shaped(const Buffer& b, DType dt, const ParamInfo& p) const;
  std::vector<ParamInfo> params_;
  int64_t compute_offset(int64_t offset) const {
    return offset < hole_begin_ ? offset : offset - (hole_end_ - hole_begin_);
  }
  int64_t total_ = 0, decayed_end_ = 0;
  int64_t hole_begin_ = 0, hole_end_ = 0;  // the master-only range (elements)
  int shard_count_ = 1, shard_rank_ = 0;
  int64_t shard_len_ = 0, padded_total_ = 0, bucket_len_ = 1;
  Device device_ = Device::cpu;
  bool frozen_ = false;
  LlamaConfig tp_whole_;
  tp::Shard tp_;
  std::vector<ParamInfo> tp_whole_params_;  // set_tensor_parallel's whole_params (empty: the model's)
  std::vector<ParamInfo> pp_whole_params_;
  std::function<bool(const std::string&)> pp_held_;  // set_pipeline_stage's filter (empty: every parameter)
  std::vector<uint32_t> init_index_;                 // per parameter: its index in the whole model's list
  // The parameters this store keeps of `all` (the pipeline stage's, or all of them); sets init_index_.
  std::vector<ParamInfo> held_params(std::vector<ParamInfo> all);
  void initial_host_values(uint64_t seed, float* host) const;
  Status layout(std::vector<ParamInfo> params);
  Status set_hole(const LlamaConfig& cfg, int64_t begin_layer, int64_t end_layer);
  // params_fsdp.cpp; the linear weights of layers [no_copy_begin, no_copy_end) get groups without storage.
  Status layout_fsdp(const LlamaConfig& cfg, int shard_count, int64_t row_align, int64_t no_copy_begin = 0,
                     int64_t no_copy_end = 0);
  Status set_master_fsdp(const float* host);
  Tensor at(void* base, DType dt, const ParamInfo& p, int64_t offset) const;
  const Group& group_of(const std::string& name) const;
  bool fsdp_ = false, shard_compute_ = false;
  std::vector<Group> groups_;
  std::vector<int> param_group_;  // per parameter: its group (FSDP)
  std::vector<int64_t> unit_elems_;
  std::vector<void*> unit_compute_;
  std::vector<float*> unit_grad_;
  std::unordered_map<std::string, int> index_;  // name -> parameter
  Status allocate_buffers(int shard_rank, int shard_count, int64_t bucket_elems, const optim::Placement& placement);
  Buffer grad_, compute_;
  std::unique_ptr<optim::OptimizerState> state_ = std::make_unique<optim::OptimizerState>();  // movable store
};

}  // namespace nb
