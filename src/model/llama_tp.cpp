// LlamaModel under tensor parallelism (llama_model.h's tp_group, model/tensor_parallel.h): the staged tokens
// as this rank's embedding rows and the vocabulary-parallel loss's scratch. The pass (llama_pass.cpp) adds the
// group's all-reduces: after the embedding and the row-parallel o and down GEMMs in the forward, after the
// column-parallel qkv and gate_up GEMMs' input gradients and the LM head's in the backward.
#include "core/memory_ledger.h"
#include "model/llama_model.h"

namespace nb {

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
