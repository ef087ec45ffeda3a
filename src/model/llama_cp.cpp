// LlamaModel under context parallelism (llama_model.h's cp_link, ops/cp_ring.h): the ring's set-up, each
// local token's position in its row (for RoPE), and the selection of this rank's tokens from whole rows.
// Everything else in the model runs per token and needs nothing: norms, Linears, the MLP, the LM head and
// the loss see this rank's B x S/C tokens; the trainer sums gradients and losses over the ranks.
#include <cmath>
#include "core/memory_ledger.h"
#include "model/llama_model.h"

namespace nb {

Status LlamaModel::init_context_parallel() {
  const int C = cp_size();
  if (C == 1) return Status::ok();
  const int r = cp_link->rank();
  const int64_t B = shape_.batch, S = shape_.seq;
  if (S % 2 != 0)
    return errorf("context parallelism over %d ranks: %lld tokens per rank and row do not split into two chunks", C,
                  (long long)S);
  std::vector<int32_t> pos(size_t(B * S));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < S; ++i) pos[size_t(b * S + i)] = int32_t(ops::cp::global_position(i, S, r, C));
  {
    MemoryScope scope(MemPart::step_inputs);
    NB_TRY(Buffer::allocate(&cp_positions_, DType::i32, dev_, {B * S}));
    NB_TRY(copy_bytes(cp_positions_.data(), dev_, pos.data(), Device::cpu, pos.size() * 4));
  }
  const ops::AttentionShape local{
      B, S, cfg_.heads, cfg_.kv_heads, cfg_.head_dim, float(1.0 / std::sqrt(double(cfg_.head_dim)))};
  return cp_ring_.init(local, dev_, params_.compute_dtype(), cp_link);
}

void LlamaModel::keep_local_tokens(const int32_t* whole, int64_t n, std::vector<int32_t>* local) const {
  const int C = cp_size(), r = cp_link->rank();
  const int64_t B = shape_.batch, S = shape_.seq, row = S * C;
  local->resize(size_t(n * B * S));
  for (int64_t m = 0; m < n * B; ++m)  // every row of every micro-batch
    for (int64_t i = 0; i < S; ++i) (*local)[size_t(m * S + i)] = whole[m * row + ops::cp::global_position(i, S, r, C)];
}

}  // namespace nb
