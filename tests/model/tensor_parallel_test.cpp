// Tensor parallelism's parameter split (model/tensor_parallel.h): a rank's shapes, the fused gate/up's rows
// (gate rows r then up rows r, so SwiGLU's [gate; up] layout holds on every rank), vocabulary padding, and that
// placing every rank's slice rebuilds each whole parameter exactly (what whole-tensor checkpoints rely on), for
// LoRA's adapters too.
#include <gtest/gtest.h>
#include <numeric>
#include <vector>
#include "model/llama_model.h"
#include "model/model_test_util.h"
#include "model/params.h"
#include "model/tensor_parallel.h"
#include "recipe/recipe.h"

namespace nb {
namespace {

LlamaConfig small_model() {
  LlamaConfig c;
  c.hidden = 8, c.ffn = 12, c.layers = 1, c.heads = 4, c.kv_heads = 4, c.head_dim = 2, c.vocab = 300;
  return c;
}

TEST(TensorParallelSplit, LocalShapesDivideHeadsFfnAndThePaddedVocabulary) {
  const LlamaConfig w = small_model();
  const LlamaConfig l = tp::local_config(w, 2);
  EXPECT_EQ(l.heads, 2);
  EXPECT_EQ(l.kv_heads, 2);
  EXPECT_EQ(l.ffn, 6);
  EXPECT_EQ(l.hidden, 8);
  EXPECT_EQ(tp::padded_vocab(w, 2), 512);  // 300 up to a multiple of 128 x 2
  EXPECT_EQ(l.vocab, 256);
  EXPECT_EQ(tp::vocab_begin(w, {1, 2}), 256);
  EXPECT_EQ(tp::local_config(w, 1).vocab, 300);
}

TEST(TensorParallelSplit, GateUpKeepsGateThenUpRowsOfTheRank) {
  const LlamaConfig w = small_model();
  int64_t wt = 0, lt = 0;
  const auto whole = ParamStore::flat_layout(w, &wt), local = ParamStore::flat_layout(tp::local_config(w, 2), &lt);
  size_t gu = 0;
  while (whole[gu].name.find("gate_up") == std::string::npos) ++gu;
  std::vector<float> src(size_t(whole[gu].numel)), dst(size_t(local[gu].numel));
  std::iota(src.begin(), src.end(), 0.0f);
  tp::slice(whole[gu], local[gu], {1, 2}, src.data(), dst.data());
  const int64_t H = w.hidden;
  EXPECT_EQ(dst[0], float(6 * H));               // gate row 6 (rank 1's first FFN column)
  EXPECT_EQ(dst[size_t(6 * H)], float(18 * H));  // up row F + 6
  EXPECT_EQ(dst.back(), float(24 * H - 1));      // up's last row
}

TEST(TensorParallelSplit, SlicesPlacedBackAreTheWholeParameters) {
  const LlamaConfig w = small_model();
  for (int T : {2, 4}) {
    int64_t wt = 0, lt = 0;
    const auto whole = ParamStore::flat_layout(w, &wt), local = ParamStore::flat_layout(tp::local_config(w, T), &lt);
    ASSERT_EQ(whole.size(), local.size());
    for (size_t i = 0; i < whole.size(); ++i) {
      std::vector<float> src(size_t(whole[i].numel)), back(src.size(), -1.0f), part(size_t(local[i].numel));
      std::iota(src.begin(), src.end(), 1.0f);
      for (int r = 0; r < T; ++r) {
        tp::slice(whole[i], local[i], {r, T}, src.data(), part.data());
        tp::place(whole[i], local[i], {r, T}, part.data(), back.data());
      }
      EXPECT_EQ(back, src) << whole[i].name << " at T" << T;
    }
  }
}

// LoRA (Megatron's split): A of qkv and fc1 and B of proj and fc2 whole; B of qkv its q, k and v rows, B of fc1
// its gate and up rows, A of proj and fc2 its input columns; every rank's slices placed back give the whole.
TEST(TensorParallelSplit, LoraAdaptersFollowTheirBases) {
  LlamaConfig w = small_model();
  w.kv_heads = 2;  // q and kv parts of different sizes
  LoraSpec spec;
  spec.rank = 3;
  const int T = 2;
  const LlamaConfig l = tp::local_config(w, T);
  const auto whole = lora_param_list(w, spec), local = lora_param_list(l, spec);
  ASSERT_EQ(whole.size(), local.size());
  for (size_t i = 0; i < whole.size(); ++i) {
    ParamInfo a = whole[i], b = local[i];
    a.numel = a.shape[0] * a.shape[1], b.numel = b.shape[0] * b.shape[1];
    const tp::Split k = tp::split_of(a.name);
    const bool split = a.numel != b.numel;
    EXPECT_EQ(split, k != tp::Split::whole) << a.name;
    std::vector<float> src(size_t(a.numel)), back(src.size(), -1.0f), part(size_t(b.numel));
    std::iota(src.begin(), src.end(), 1.0f);
    for (int r = 0; r < T; ++r) {
      tp::slice(a, b, {r, T}, src.data(), part.data(), &w);
      tp::place(a, b, {r, T}, part.data(), back.data(), &w);
      if (k == tp::Split::qkv_rows && r == 1) {  // rank 1's first q row, first k row, first v row
        const int64_t R = spec.rank;
        EXPECT_EQ(part[0], src[size_t(l.q_dim() * R)]);
        EXPECT_EQ(part[size_t(l.q_dim() * R)], src[size_t((w.q_dim() + l.kv_dim()) * R)]);
        EXPECT_EQ(part[size_t((l.q_dim() + l.kv_dim()) * R)], src[size_t((w.q_dim() + w.kv_dim() + l.kv_dim()) * R)]);
      }
    }
    EXPECT_EQ(back, src) << a.name;
  }
  EXPECT_EQ(tp::split_of(lora_param_name(0, LoraTarget::linear_qkv, true)), tp::Split::whole);
  EXPECT_EQ(tp::split_of(lora_param_name(0, LoraTarget::linear_fc1, false)), tp::Split::gate_up_rows);
  EXPECT_EQ(tp::split_of(lora_param_name(0, LoraTarget::linear_proj, true)), tp::Split::cols);
  EXPECT_EQ(tp::split_of(lora_param_name(0, LoraTarget::linear_fc2, false)), tp::Split::whole);
}

TEST(TensorParallelSplit, VocabularyPaddingRowsAreZero) {
  const LlamaConfig w = small_model();
  int64_t wt = 0, lt = 0;
  const auto whole = ParamStore::flat_layout(w, &wt), local = ParamStore::flat_layout(tp::local_config(w, 2), &lt);
  std::vector<float> src(size_t(whole[0].numel), 7.0f), part(size_t(local[0].numel), -1.0f);
  tp::slice(whole[0], local[0], {1, 2}, src.data(), part.data());  // ids 256..511: 44 real rows, then padding
  EXPECT_EQ(part[size_t(43 * w.hidden)], 7.0f);
  EXPECT_EQ(part[size_t(44 * w.hidden)], 0.0f);
  EXPECT_EQ(part.back(), 0.0f);
}

// Counts the bytes a rank puts into the group's reductions; reduces nothing (the values are this rank's alone,
// enough to count what a pass sends).
class CountingGroup : public ops::tp::ReduceGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  Status max(const Tensor& t, Stream) override { return count(t); }
  Status sum(const Tensor& t, Stream) override { return count(t); }
  Status reduce_scatter(const Tensor& in, const Tensor&, Stream) override { return count(in); }
  Status all_gather(const Tensor&, const Tensor& out, Stream) override { return count(out); }
  int64_t bytes = 0;

 private:
  Status count(const Tensor& t) {
    bytes += t.bytes();
    return Status::ok();
  }
};

TEST(TensorParallelTraffic, CollectivesCarryTheFormulasBytes) {
  const LlamaConfig c = testing::tiny_config();
  const MicroBatchShape s{2, 16};
  std::vector<int32_t> tok, lab;
  testing::fixed_batch(c, s, 3, &tok, &lab);
  for (bool sp : {false, true})
    for (Recompute rc : {Recompute::none, Recompute::selective, Recompute::full}) {
      CountingGroup group;
      LlamaModel m;
      m.tp_group = &group;
      m.sequence_parallel = sp;
      ASSERT_TRUE(m.init(c, Device::cpu, s, rc, 7).is_ok());
      double sum = 0;
      ASSERT_TRUE(m.forward_loss(tok.data(), lab.data(), &sum).is_ok());
      tp::Passes p{false, false, false, sp};
      EXPECT_EQ(group.bytes, tp::collective_bytes(c, s.tokens(), 4, p)) << "sp " << sp;
      group.bytes = 0;
      ASSERT_TRUE(m.forward_backward(tok.data(), lab.data(), 1.0f / float(tok.size()), &sum).is_ok());
      p = {true, rc == Recompute::full, rc == Recompute::selective, sp};
      EXPECT_EQ(group.bytes, tp::collective_bytes(c, s.tokens(), 4, p)) << "sp " << sp << ", recompute " << int(rc);
    }
}

// Sequence parallelism with NVFP4 and FP8 layers: their n1, n2 and residual-gradient gathers move the quantized
// copies (36 and 64 bytes per 32 elements instead of 4 x 32 on the CPU); a BF16 layer's stay whole.
TEST(TensorParallelTraffic, QuantizedGathersCarryTheFormulasBytes) {
  const LlamaConfig c = testing::tiny_config();
  const MicroBatchShape s{2, 64};  // 64 tokens per rank: each piece of a chunk a whole 256 bytes
  std::vector<int32_t> tok, lab;
  testing::fixed_batch(c, s, 3, &tok, &lab);
  struct Case {
    const char* recipe;
    int bf16_layers;
    int64_t bytes_per_32;
  };
  for (const Case& k : {Case{"bf16_with_nvfp4_mixed", 1, 36}, Case{"bf16_with_fp8_current_scaling_mixed", 0, 64}})
    for (Recompute rc : {Recompute::none, Recompute::selective, Recompute::full}) {
      recipe::Recipe r;
      ASSERT_TRUE(recipe::recipe_preset(k.recipe, &r).is_ok());
      r.bf16_layers_at_start = k.bf16_layers;  // layer 0 in BF16: its inputs are gathered in BF16
      r.bf16_layers_at_end = 0;
      CountingGroup group;
      LlamaModel m;
      m.tp_group = &group;
      m.sequence_parallel = true;
      ASSERT_TRUE(m.init(c, Device::cpu, s, rc, 7, r).is_ok());
      int of = 0;
      const int gathers = m.quantized_input_gathers(&of);
      ASSERT_EQ(gathers, 2 * (int(c.layers) - k.bf16_layers)) << k.recipe;
      ASSERT_EQ(m.quantized_grad_gathers(), gathers) << k.recipe;
      double sum = 0;
      ASSERT_TRUE(m.forward_backward(tok.data(), lab.data(), 1.0f / float(tok.size()), &sum).is_ok());
      tp::Passes p{true, rc == Recompute::full, rc == Recompute::selective, true, gathers / 2, k.bytes_per_32};
      EXPECT_EQ(group.bytes, tp::collective_bytes(c, s.tokens(), 4, p)) << k.recipe << ", recompute " << int(rc);
    }
}

}  // namespace
}  // namespace nb
