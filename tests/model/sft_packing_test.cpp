// Packed SFT rows on the CPU reference: a row holding several samples gives the same per-sample losses
// and gradients as each sample run alone, and the answer-only loss trains exactly the answer tokens.
#include <gtest/gtest.h>
#include <cmath>
#include <random>
#include <vector>
#include "model/llama_model.h"
#include "model_test_util.h"
#include "ops/elementwise.h"

using namespace nb;
using nb::testing::fixed_batch;
using nb::testing::tiny_config;

namespace {

struct Sample {
  std::vector<int32_t> tokens, labels;  // one row position each; labels -1 on prompt positions
};

Sample random_sample(const LlamaConfig& c, int n, int prompt, std::mt19937* rng) {
  Sample s;
  for (int i = 0; i < n; ++i) {
    s.tokens.push_back(int32_t((*rng)() % uint32_t(c.vocab)));
    s.labels.push_back(i < prompt ? -1 : int32_t((*rng)() % uint32_t(c.vocab)));
  }
  return s;
}

// Runs one micro-batch (grad_scale 1: summed losses) from zeroed gradients; returns the loss sum and
// copies the whole gradient.
double run(LlamaModel& m, const std::vector<int32_t>& tok, const std::vector<int32_t>& lab,
           const std::vector<int32_t>* starts, std::vector<float>* grad) {
  ParamStore& P = m.params();
  ops::fill(P.flat_grad(), 0.f, nullptr);
  double sum = 0;
  EXPECT_TRUE(m.stage_batches(tok.data(), lab.data(), 1).is_ok());
  if (starts) { EXPECT_TRUE(m.stage_segments(starts, 1).is_ok()); }
  EXPECT_TRUE(m.forward_backward_staged(0, 1.0f).is_ok());
  EXPECT_TRUE(m.take_loss_sum(&sum).is_ok());
  grad->resize(size_t(P.total()));
  EXPECT_TRUE(P.get_flat(P.flat_grad(), grad->data()).is_ok());
  return sum;
}

// A sample alone at the start of a row of S, the rest padding that is not trained.
void alone(const Sample& s, int64_t S, std::vector<int32_t>* tok, std::vector<int32_t>* lab) {
  tok->assign(size_t(S), 0);
  lab->assign(size_t(S), -1);
  std::copy(s.tokens.begin(), s.tokens.end(), tok->begin());
  std::copy(s.labels.begin(), s.labels.end(), lab->begin());
}

}  // namespace

// Bound: every quantity is FP32 with FP64 attention; packing changes only the order of the sums over
// tokens in the weight gradients (and nothing per token), so gradients agree to FP32 rounding of those
// sums: 1e-5 relative to the largest gradient entry.
TEST(SftPackingCpu, PackedRowEqualsSamplesAlone) {
  const LlamaConfig c = tiny_config();
  const int64_t B = 2, S = 16;
  LlamaModel m;
  ASSERT_TRUE(m.init(c, Device::cpu, {B, S}, Recompute::none, 5).is_ok());
  std::mt19937 rng(9);
  // Row 0: samples of 6, 7 and 1 positions and a padding tail of 2; row 1: one sample of 16.
  const std::vector<Sample> samples{random_sample(c, 6, 2, &rng), random_sample(c, 7, 3, &rng),
                                    random_sample(c, 1, 0, &rng), random_sample(c, 16, 5, &rng)};
  std::vector<int32_t> tok(size_t(B * S), 0), lab(size_t(B * S), -1), starts{0, 6, 13, 14, 16, 32};
  const int64_t at[4] = {0, 6, 13, 16};
  for (size_t i = 0; i < samples.size(); ++i) {
    std::copy(samples[i].tokens.begin(), samples[i].tokens.end(), tok.begin() + at[i]);
    std::copy(samples[i].labels.begin(), samples[i].labels.end(), lab.begin() + at[i]);
  }
  std::vector<float> packed, sum_alone(0), g;
  const double packed_loss = run(m, tok, lab, &starts, &packed);
  // Alone: rows of one sample each (the second row of the micro-batch untrained padding).
  double alone_loss = 0;
  sum_alone.assign(packed.size(), 0.f);
  for (const Sample& s : samples) {
    std::vector<int32_t> t, l;
    alone(s, B * S, &t, &l);
    alone_loss += run(m, t, l, nullptr, &g);
    for (size_t k = 0; k < g.size(); ++k) sum_alone[k] += g[k];
  }
  EXPECT_NEAR(packed_loss, alone_loss, 1e-5 * std::fabs(alone_loss));
  float gmax = 0;
  for (float x : sum_alone) gmax = std::max(gmax, std::fabs(x));
  ASSERT_GT(gmax, 0.f);
  double worst = 0;
  for (size_t k = 0; k < packed.size(); ++k) worst = std::max(worst, double(std::fabs(packed[k] - sum_alone[k])));
  EXPECT_LE(worst, 1e-5 * gmax);
  // Without segments the samples would see each other: the gradients must then differ.
  std::vector<float> crossing;
  run(m, tok, lab, nullptr, &crossing);
  double diff = 0;
  for (size_t k = 0; k < packed.size(); ++k) diff = std::max(diff, double(std::fabs(crossing[k] - packed[k])));
  EXPECT_GT(diff, 1e-3 * gmax);
}

// Answer-only loss: the gradient is the sum of the answer positions' gradients taken one at a time, and
// the prompt positions' targets do not enter it (changing them changes nothing while they are masked).
TEST(SftPackingCpu, OnlyAnswerTokensAreTrained) {
  const LlamaConfig c = tiny_config();
  const int64_t S = 12;
  LlamaModel m;
  ASSERT_TRUE(m.init(c, Device::cpu, {1, S}, Recompute::none, 6).is_ok());
  std::mt19937 rng(4);
  Sample s = random_sample(c, int(S), 7, &rng);
  std::vector<float> all, one, sum(0);
  run(m, s.tokens, s.labels, nullptr, &all);
  sum.assign(all.size(), 0.f);
  for (int64_t p = 7; p < S; ++p) {
    std::vector<int32_t> lab(size_t(S), -1);
    lab[size_t(p)] = s.labels[size_t(p)];
    run(m, s.tokens, lab, nullptr, &one);
    for (size_t k = 0; k < one.size(); ++k) sum[k] += one[k];
  }
  float gmax = 0;
  double worst = 0;
  for (size_t k = 0; k < all.size(); ++k) {
    gmax = std::max(gmax, std::fabs(all[k]));
    worst = std::max(worst, double(std::fabs(all[k] - sum[k])));
  }
  ASSERT_GT(gmax, 0.f);
  EXPECT_LE(worst, 1e-5 * gmax);
  // A prompt target made trainable changes the gradient: the mask is what keeps it out.
  std::vector<int32_t> unmasked = s.labels;
  unmasked[3] = 1;
  std::vector<float> leaked;
  run(m, s.tokens, unmasked, nullptr, &leaked);
  double diff = 0;
  for (size_t k = 0; k < all.size(); ++k) diff = std::max(diff, double(std::fabs(leaked[k] - all[k])));
  EXPECT_GT(diff, 1e-3 * gmax);
}

TEST(SftPackingCpu, SegmentsCrossingARowAreRefused) {
  const LlamaConfig c = tiny_config();
  LlamaModel m;
  ASSERT_TRUE(m.init(c, Device::cpu, {2, 8}, Recompute::none, 6).is_ok());
  std::vector<int32_t> tok(16, 1), lab(16, 1);
  ASSERT_TRUE(m.stage_batches(tok.data(), lab.data(), 1).is_ok());
  const std::vector<int32_t> crossing{0, 4, 12, 16};
  Status st = m.stage_segments(&crossing, 1);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("crosses the end of row"), std::string::npos) << st.message();
  const std::vector<int32_t> spanning{0, 12, 16};  // starts at a row start but runs into the next row
  EXPECT_FALSE(m.stage_segments(&spanning, 1).is_ok());
  const std::vector<int32_t> short_tiling{0, 8, 12};
  EXPECT_FALSE(m.stage_segments(&short_tiling, 1).is_ok());
}
