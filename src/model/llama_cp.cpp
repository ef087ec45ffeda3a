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

Status LlamaModel::whole_rows_under_cp(int64_t n) {
  const int64_t row = shape_.seq * cp_size();  // the starts index whole rows
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<int32_t>& st = seg_host_[size_t(i)];
    // At most two segments per row, the first at its start: a sample and the padding after it. (Two samples
    // that fill a row look the same; packed SFT data is refused before step 1 by the trainer's config check.)
    std::vector<int> per_row(size_t(shape_.batch), 0);
    bool ok = true;
    for (size_t k = 0; k + 1 < st.size(); ++k) {
      const int64_t r = st[k] / row;
      ok = ok && r < shape_.batch && (per_row[size_t(r)]++ > 0 || st[k] % row == 0) && per_row[size_t(r)] <= 2;
    }
    if (!ok)
      return errorf(
          "packed rows under context parallelism are not supported yet (micro-batch %lld holds several samples "
          "in a row); train with --packed-sequence false or --context-parallel-size 1",
          (long long)i);
  }
  // One sample per row: its tokens see only earlier tokens of the row, all its own, so the row is one causal
  // sequence for every trained token (the padding's labels are -1, and nothing before it attends to it).
  seg_host_.clear();
  return Status::ok();
}

}  // namespace nb
