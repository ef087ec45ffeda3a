// LlamaModel under context parallelism (llama_model.h's cp_link, ops/cp_ring.h): the ring's set-up, each
// local token's position in its row or packed sequence (for RoPE), and the selection of this rank's tokens
// from whole rows, or from every sequence of packed rows (chunks r and 2C-1-r of each, TransformerEngine's THD).
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

bool LlamaModel::one_sample_per_row(int64_t n) const {
  const int64_t row = shape_.seq * cp_size();  // the starts index whole rows
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<int32_t>& st = seg_host_[size_t(i)];
    // At most two segments per row, the first at its start: a sample and the padding after it.
    std::vector<int> per_row(size_t(shape_.batch), 0);
    for (size_t k = 0; k + 1 < st.size(); ++k) {
      const int64_t r = st[k] / row;
      if (r >= shape_.batch || (per_row[size_t(r)]++ == 0 && st[k] % row != 0) || per_row[size_t(r)] > 2) return false;
    }
  }
  return true;
}

Status LlamaModel::segments_under_cp(int64_t n, bool* rows) {
  // One sample per row: its tokens see only earlier tokens of the row, all its own, so the row is one causal
  // sequence for every trained token (the padding's labels are -1, and nothing before it attends to it).
  *rows = one_sample_per_row(n);
  if (*rows) {
    seg_host_.clear();
    return Status::ok();
  }
  const int C = cp_size(), r = cp_link->rank();
  const int64_t T = shape_.tokens(), S = shape_.seq, whole = T * C, chunks = int64_t(2) * C;
  cp_ids_.assign(size_t(n * T), 0);
  cp_labels_.assign(size_t(n * T), -1);
  for (int64_t i = 0; i < n; ++i) {
    std::vector<int32_t>& st = seg_host_[size_t(i)];
    if (st.empty())  // an unpacked micro-batch among packed ones: one segment per row
      for (int64_t b = 0; b <= shape_.batch; ++b) st.push_back(int32_t(b * S * C));
    for (size_t k = 0; k + 1 < st.size(); ++k) {
      const int64_t len = int64_t(st[k + 1]) - st[k];
      if (len <= 0 || len % chunks != 0 || st[k] / (S * C) != (st[k + 1] - 1) / (S * C))
        return errorf(
            "packed rows under --context-parallel-size %d need every sequence to be a multiple of %lld tokens inside "
            "one row (--pad-seq-to-mult); micro-batch %lld has one of %lld tokens at token %d",
            C, (long long)chunks, (long long)i, (long long)len, st[k]);
      // Each sequence is cut into 2C chunks like a row: this rank keeps chunks r and 2C-1-r of it.
      const int64_t local = len / C, at = i * T + st[k] / C;
      for (int64_t j = 0; j < local; ++j) {
        const int64_t from = i * whole + st[k] + ops::cp::global_position(j, local, r, C);
        cp_ids_[size_t(at + j)] = cp_whole_ids_[size_t(from)];
        cp_labels_[size_t(at + j)] = cp_whole_labels_[size_t(from)];
      }
    }
    for (int32_t& s0 : st) s0 /= C;  // the rank's own segment table: every sequence's share, in order
  }
  return upload_staged(cp_ids_.data(), cp_labels_.data(), n);
}

int32_t LlamaModel::segment_position(int64_t i, int64_t len) const {
  return int32_t(cp_size() > 1 ? ops::cp::global_position(i, len, cp_link->rank(), cp_size()) : i);
}

}  // namespace nb
