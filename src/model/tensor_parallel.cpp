// Tensor parallelism's parameter split (tensor_parallel.h): the local shape and the copies between a whole
// parameter and one rank's part of it.
#include "model/tensor_parallel.h"
#include <algorithm>
#include <cstring>
#include "model/params.h"

namespace nb::tp {

int64_t padded_vocab(const LlamaConfig& whole, int size) {
  const int64_t unit = int64_t(128) * size;
  return size == 1 ? whole.vocab : (whole.vocab + unit - 1) / unit * unit;
}

LlamaConfig local_config(const LlamaConfig& whole, int size) {
  LlamaConfig c = whole;
  if (size == 1) return c;
  c.heads /= size;
  c.kv_heads /= size;
  c.ffn /= size;
  c.vocab = padded_vocab(whole, size) / size;
  return c;
}

int64_t vocab_begin(const LlamaConfig& whole, Shard s) {
  return int64_t(s.rank) * padded_vocab(whole, s.size) / s.size;
}

Split split_of(const std::string& name) {
  auto ends = [&](const char* tail) {
    const size_t n = std::strlen(tail);
    return name.size() >= n && name.compare(name.size() - n, n, tail) == 0;
  };
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return Split::vocab_rows;
  // LoRA (model/lora.h's names): the half that follows the base's split; the other is whole.
  if (ends("linear_qkv.lora_B.weight")) return Split::qkv_rows;
  if (ends("linear_fc1.lora_B.weight")) return Split::gate_up_rows;
  if (ends("linear_proj.lora_A.weight") || ends("linear_fc2.lora_A.weight")) return Split::cols;
  if (ends(".lora_A.weight") || ends(".lora_B.weight")) return Split::whole;
  if (ends("q_proj.weight") || ends("k_proj.weight") || ends("v_proj.weight")) return Split::rows;
  if (ends("gate_up_proj.weight")) return Split::gate_up_rows;
  if (ends("o_proj.weight") || ends("down_proj.weight")) return Split::cols;
  return Split::whole;
}

namespace {

// The whole row of local row i of a tensor made of parts (whole part sizes `parts`, each cut in s.size equal
// blocks of rows): [gate_r; up_r] of [gate; up], [q_r; k_r; v_r] of [q; k; v].
int64_t part_row(const std::vector<int64_t>& parts, Shard s, int64_t i) {
  int64_t whole_start = 0;
  for (const int64_t n : parts) {
    const int64_t mine = n / s.size;
    if (i < mine) return whole_start + s.rank * mine + i;
    i -= mine;
    whole_start += n;
  }
  return -1;
}

// Calls copy(whole_element, local_element, count) for every run of elements rank s holds, in local order;
// local rows past the whole tensor (vocabulary padding) get whole_element -1.
template <typename Copy>
void for_each_run(const ParamInfo& whole, const ParamInfo& local, Shard s, const LlamaConfig* cfg, Copy copy) {
  const Split k = split_of(whole.name);
  if (k == Split::whole) return copy(int64_t(0), int64_t(0), whole.numel);
  const int64_t rows = local.shape[0], cols = local.shape.size() > 1 ? local.shape[1] : 1;
  const int64_t whole_rows = whole.shape[0], whole_cols = whole.shape.size() > 1 ? whole.shape[1] : 1;
  std::vector<int64_t> parts;
  if (k == Split::gate_up_rows) parts = {whole_rows / 2, whole_rows / 2};
  if (k == Split::qkv_rows) {
    NB_CHECK(cfg && cfg->q_dim() + 2 * cfg->kv_dim() == whole_rows, "internal: %s needs its model's q and kv rows",
             whole.name.c_str());
    parts = {cfg->q_dim(), cfg->kv_dim(), cfg->kv_dim()};
  }
  for (int64_t i = 0; i < rows; ++i) {
    int64_t src_row = i, src_col = 0;
    if (k == Split::rows || k == Split::vocab_rows) src_row = s.rank * rows + i;
    if (!parts.empty()) src_row = part_row(parts, s, i);
    if (k == Split::cols) src_col = s.rank * cols;
    copy(src_row < whole_rows ? src_row * whole_cols + src_col : -1, i * cols, cols);
  }
}

}  // namespace

void slice(const ParamInfo& whole, const ParamInfo& local, Shard s, const float* src, float* dst,
           const LlamaConfig* whole_cfg) {
  for_each_run(whole, local, s, whole_cfg, [&](int64_t w, int64_t l, int64_t n) {
    if (w < 0)
      std::fill(dst + l, dst + l + n, 0.0f);
    else
      std::copy(src + w, src + w + n, dst + l);
  });
}

void place(const ParamInfo& whole, const ParamInfo& local, Shard s, const float* src, float* dst,
           const LlamaConfig* whole_cfg) {
  for_each_run(whole, local, s, whole_cfg, [&](int64_t w, int64_t l, int64_t n) {
    if (w >= 0) std::copy(src + l, src + l + n, dst + w);
  });
}

std::vector<std::pair<int64_t, int64_t>> fused_output_columns(const LlamaConfig& whole, Shard s, int linear,
                                                              int64_t* whole_cols) {
  const LlamaConfig local = local_config(whole, s.size);
  if (linear == 0) {
    *whole_cols = whole.q_dim() + 2 * whole.kv_dim();
    return {{0, s.rank * local.q_dim()},
            {local.q_dim(), whole.q_dim() + s.rank * local.kv_dim()},
            {local.q_dim() + local.kv_dim(), whole.q_dim() + whole.kv_dim() + s.rank * local.kv_dim()}};
  }
  *whole_cols = 2 * whole.ffn;
  return {{0, s.rank * local.ffn}, {local.ffn, whole.ffn + s.rank * local.ffn}};
}

int64_t collective_bytes(const LlamaConfig& whole, int64_t tokens, int64_t elem_bytes, Passes p) {
  const int64_t row = tokens * whole.hidden * elem_bytes, k = p.sequence_parallel ? 2 : 1;
  int64_t per_layer = 2 * k * row;  // forward: o and down (and the gathers of n1, n2)
  if (p.backward) {
    per_layer += 2 * k * row;                                                // qkv and gate_up (and the gathers of dy)
    if (p.full_recompute) per_layer += (p.sequence_parallel ? 3 : 1) * row;  // o again (and n1, n2)
    if (p.selective_recompute && p.sequence_parallel) per_layer += 2 * row;  // n1 and n2 gathered again
  }
  int64_t total = k * row * (p.backward ? 2 : 1) + whole.layers * per_layer + tokens * 3 * 4;
  if (p.sequence_parallel && p.quantized_layers > 0) {  // n1 and n2 of those layers: quantized instead
    const int64_t q = tokens * whole.hidden * p.bytes_per_32 / 32;
    const int64_t gathers = 1 + (p.backward && p.full_recompute ? 1 : 0);
    total += p.quantized_layers * 2 * gathers * (q - row);
    if (p.backward) total += p.quantized_layers * 2 * (q - row);  // the residual gradients before o and down
    if (p.backward && p.selective_recompute) total -= p.quantized_layers * 2 * row;
  }
  return total;
}

}  // namespace nb::tp
