// LlamaModel under tensor parallelism (llama_model.h's tp_group, model/tensor_parallel.h): the staged tokens
// as this rank's embedding rows and the vocabulary-parallel loss's scratch. The pass (llama_pass.cpp) adds the
// group's all-reduces: after the embedding and the row-parallel o and down GEMMs in the forward, after the
// column-parallel qkv and gate_up GEMMs' input gradients and the LM head's in the backward; sequence
// parallelism's quantized input gathers go through tp_byte_group().
#include "core/memory_ledger.h"
#include "model/llama_model.h"

namespace nb {

namespace {
// tp_group's all-gather of plain bytes (u8 tensors on the model's device).
class TpByteGroup : public recipe::ByteGroup {
 public:
  TpByteGroup(ops::tp::ReduceGroup* group, Device dev) : group_(group), dev_(dev) {}
  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }
  Status all_gather(const uint8_t* local, size_t bytes, uint8_t* gathered, Stream stream) override {
    const int64_t n = int64_t(bytes);
    return group_->all_gather(Tensor::make(const_cast<uint8_t*>(local), DType::u8, dev_, {n}),
                              Tensor::make(gathered, DType::u8, dev_, {n * group_->size()}), stream);
  }

 private:
  ops::tp::ReduceGroup* group_;
  Device dev_;
};
}  // namespace

int LlamaModel::quantized_input_gathers(int* of) const {
  int n = 0;
  int held = 0;
  for (const auto& layer : linears_) {
    if (layer.empty()) continue;  // another pipeline stage's layer
    held++;
    for (int i : {0, 2}) n += layer[size_t(i)].gathers_quantized_input() ? 1 : 0;
  }
  if (of) *of = held * 2;
  return n;
}

int LlamaModel::quantized_grad_gathers() const {
  int n = 0;
  for (const auto& layer : linears_)  // (another pipeline stage's layers are empty)
    for (size_t i = 1; i < layer.size(); i += 2) n += layer[i].gathers_quantized_grad() ? 1 : 0;
  return n;
}

recipe::ByteGroup* LlamaModel::tp_byte_group() {
  if (!tp_bytes_) tp_bytes_ = std::make_unique<TpByteGroup>(tp_group, dev_);
  return tp_bytes_.get();
}

Status LlamaModel::init_tensor_parallel() {
  if (tp_size() == 1) return Status::ok();
  if (tp_comm_overlap) {
    NB_TRY(tp_stream_.create(dev_, /*high_priority=*/true));  // its NCCL kernels start before the Wgrad's blocks
    NB_TRY(tp_ready_.create(dev_));
    NB_TRY(tp_done_.create(dev_));
  }
  MemoryScope scope(MemPart::step_inputs);
  return Buffer::allocate(&tp_ce_scratch_, DType::f32, dev_, {3, lm_chunk_tokens_});
}

// The embedding holds vocabulary ids [begin, begin + V/T): a token of another rank's rows becomes -1, a zero
// row here (ops/embedding.h), and the group's sum of the ranks' rows is its embedding.
const int32_t* LlamaModel::local_vocab_ids(const int32_t* ids, int64_t n) {
  if (tp_size() == 1) return ids;
  const int64_t begin = tp::vocab_begin(whole_cfg_, tp_shard()), end = begin + cfg_.vocab;
  tp_ids_.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) tp_ids_[size_t(i)] = ids[i] >= begin && ids[i] < end ? int32_t(ids[i] - begin) : -1;
  return tp_ids_.data();
}

}  // namespace nb
