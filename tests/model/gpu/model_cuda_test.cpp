// The tiny Llama on CUDA against the CPU reference: loss and every parameter gradient, and
// run-to-run determinism of the CUDA path; the out-of-memory message of the trainer.
#include <gtest/gtest.h>
#include <cmath>
#include <random>
#include <vector>
#include "common/gpu.h"
#include "core/bf16.h"
#include "model/llama_model.h"
#include "ops/elementwise.h"
#include "train/trainer.h"

using namespace nb;

namespace {
void batch(int64_t vocab, int64_t n, std::vector<int32_t>* tok, std::vector<int32_t>* lab) {
  std::mt19937 rng(17);
  std::vector<int32_t> seq(size_t(n + 1));
  for (auto& t : seq) t = int32_t(rng() % uint32_t(vocab));
  tok->assign(seq.begin(), seq.end() - 1);
  lab->assign(seq.begin() + 1, seq.end());
}
std::vector<float> to_host(const Tensor& t) {
  std::vector<float> out(size_t(t.numel()));
  EXPECT_TRUE(copy_bytes(out.data(), Device::cpu, t.data, t.device, out.size() * 4).is_ok());
  return out;
}
}  // namespace

// BF16 weights and activations on CUDA versus FP32 on the CPU with the same BF16-rounded weights:
// per-tensor relative L2 error of gradients below 5e-2 (a few BF16 roundings, 2^-8 each, compound
// through two layers, attention and the loss) and the loss within 1e-2 relative.
TEST(TinyLlamaCuda, MatchesCpuReference) {
  NB_REQUIRE_GPU();
  LlamaConfig c;
  ASSERT_TRUE(llama_preset("tiny", &c).is_ok());
  MicroBatchShape s{2, 64};
  LlamaModel cpu, gpu;
  ASSERT_TRUE(cpu.init(c, Device::cpu, s, Recompute::none, 5).is_ok());
  ASSERT_TRUE(gpu.init(c, Device::cuda, s, Recompute::none, 5).is_ok());
  Tensor wc = cpu.params().flat_compute();
  for (int64_t i = 0; i < wc.numel(); ++i) wc.ptr<float>()[i] = round_to_bf16(wc.ptr<float>()[i]);
  std::vector<int32_t> tok, lab;
  batch(c.vocab, s.tokens(), &tok, &lab);
  double lc = 0, lg = 0;
  ops::fill(cpu.params().flat_grad(), 0.f, nullptr);
  ops::fill(gpu.params().flat_grad(), 0.f, nullptr);
  ASSERT_TRUE(cpu.forward_backward(tok.data(), lab.data(), 1.0f / float(tok.size()), &lc).is_ok());
  ASSERT_TRUE(gpu.forward_backward(tok.data(), lab.data(), 1.0f / float(tok.size()), &lg).is_ok());
  EXPECT_NEAR(lg / lc, 1.0, 1e-2);
  for (const auto& p : cpu.params().params()) {
    std::vector<float> gc(cpu.params().grad(p.name).ptr<float>(), cpu.params().grad(p.name).ptr<float>() + p.numel);
    std::vector<float> gg = to_host(gpu.params().grad(p.name));
    double num = 0, den = 0;
    for (size_t i = 0; i < gc.size(); ++i) {
      num += (gc[i] - gg[i]) * double(gc[i] - gg[i]);
      den += double(gc[i]) * gc[i];
    }
    EXPECT_LT(std::sqrt(num / std::max(den, 1e-30)), 5e-2) << p.name;
  }
}

TEST(TinyLlamaCuda, SameSeedSameLossSequence) {
  NB_REQUIRE_GPU();
  auto run = [] {
    TrainConfig c;
    c.device = "cuda";
    c.model = "tiny";
    c.train_iters = 8;
    c.micro_batch_size = 2;
    c.global_batch_size = 4;
    c.seq_length = 64;
    c.lr = 3e-3;
    c.log_interval = 100;
    TrainSummary s;
    EXPECT_TRUE(run_training(c, &s).is_ok());
    return s.losses;
  };
  std::vector<double> a = run(), b = run();
  ASSERT_EQ(a.size(), 8u);
  EXPECT_EQ(a, b);
  EXPECT_LT(a.back(), a.front());
}

TEST(Trainer, OutOfMemoryNamesTheKnobs) {
  NB_REQUIRE_GPU();
  TrainConfig c;
  c.device = "cuda";
  c.model = "llama3.1-70b";
  c.micro_batch_size = 4;
  c.seq_length = 8192;
  TrainSummary s;
  Status st = run_training(c, &s);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("--micro-batch-size"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("--recompute"), std::string::npos);
  EXPECT_NE(st.message().find("--seq-length"), std::string::npos);
}
