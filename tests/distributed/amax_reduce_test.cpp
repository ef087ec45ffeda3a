// FP8 delayed scaling under data parallelism (train/amax_reduce.h): the ranks' step amaxes are reduced
// with MAX before begin_step() records them, so every rank keeps the same amax histories and scales.
//
// In process: two ranks as two threads (each its own tiny model, Gloo communicator and data), three steps
// without weight updates. After each step's reduction both ranks hold exactly max(rank 0's, rank 1's)
// local amax for every role, and after the last roll both ranks' histories and scales are equal bit for bit
// and hold those maxima. The same run without the reduction must differ between the ranks: the check
// is sensitive to the bug it guards against.
// A NaN step amax crosses the MAX as +Inf and comes back NaN (recipe/amax_gather.h).
//
// Through the CLI (the trainer's wiring): 2 ranks against 1 rank with the same global batch. Step 1's
// loss and gradient norm agree to 1e-6 relative and later losses to 1e-2, the bounds ddp_test.cpp derives
// for quantized recipes. Step 1 reads identical weights and rows on both runs, so every per-row value
// (activations, output gradients) is identical and the step's amax over the global batch is the same
// number: the reduced step-1 amaxes in the 2-rank checkpoint equal the 1-rank run's to 1e-6 relative (in
// fact bit for bit), whereas without the reduction rank 0 records the max over its half of the rows only.
#include <gtest/gtest.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>
#include "distributed/communicator.h"
#include "distributed/ddp_util.h"
#include "distributed/tcp_store.h"
#include "formats/fp8/fp8.h"
#include "model/llama_model.h"
#include "model/model_test_util.h"
#include "recipe/amax_gather.h"
#include "train/amax_reduce.h"

namespace nb {
namespace {

using namespace std::chrono_literals;

constexpr int kSteps = 3;
const char* const kDelayed = "bf16_with_fp8_delayed_scaling_mixed";

// What one rank saw: per step its step amaxes before and after the reduction (step_amax_views order),
// and every Linear's scaling state after the last step's amaxes were rolled into the histories.
struct RankRun {
  std::vector<std::vector<float>> local, reduced;
  std::vector<LlamaModel::LinearScaling> state;
};

std::vector<float> read_amaxes(const LlamaModel& m) {
  std::vector<Tensor> views;
  m.step_amax_views(&views);
  std::vector<float> out;
  for (const Tensor& t : views) out.push_back(*t.ptr<float>());  // the CPU backend: host memory
  return out;
}

dist::World world_of(int rank, int port) {
  dist::World w;
  w.rank = w.local_rank = rank;
  w.size = w.local_size = 2;
  w.store_port = port;
  return w;
}

// One rank: tiny model (same seed on both ranks, so equal weights), all layers FP8 with delayed scaling,
// a batch of its own each step (so the ranks' activation and gradient amaxes differ).
Status run_rank(int rank, dist::TcpStore* store, bool reduce, RankRun* out) {
  std::unique_ptr<dist::Communicator> comm;
  NB_TRY(dist::make_gloo_communicator(world_of(rank, store->port()), store, 60s, &comm));
  recipe::Recipe r;
  NB_TRY(recipe::recipe_preset(kDelayed, &r));
  r.bf16_layers_at_start = r.bf16_layers_at_end = 0;
  const LlamaConfig c = testing::tiny_config();
  const MicroBatchShape shape{2, 64};
  LlamaModel m;
  NB_TRY(m.init(c, Device::cpu, shape, Recompute::none, 11, r));
  Buffer scratch;
  for (int s = 1; s <= kSteps; ++s) {
    m.begin_step(uint32_t(s), uint32_t(rank), 2);
    std::vector<int32_t> tok, lab;
    testing::fixed_batch(c, shape, uint32_t(100 * s + rank), &tok, &lab);
    double loss = 0;
    NB_TRY(m.forward_backward(tok.data(), lab.data(), 1.0f / float(2 * shape.tokens()), &loss));
    out->local.push_back(read_amaxes(m));
    if (reduce) NB_TRY(all_reduce_step_amaxes(m, *comm, &scratch));
    out->reduced.push_back(read_amaxes(m));
  }
  m.begin_step(uint32_t(kSteps + 1), uint32_t(rank), 2);  // rolls the last step's amaxes in
  return m.scaling_states(&out->state);
}

void run_two_ranks(bool reduce, RankRun runs[2]) {
  std::unique_ptr<dist::TcpStore> stores[2];
  ASSERT_TRUE(dist::TcpStore::open(world_of(0, 0), 60s, &stores[0]));
  const int port = stores[0]->port();
  std::string errors[2];
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      Status s = r == 0 ? Status::ok() : dist::TcpStore::open(world_of(1, port), 60s, &stores[1]);
      if (s) s = run_rank(r, stores[r].get(), reduce, &runs[r]);
      errors[r] = s.message();
    });
  for (auto& t : threads) t.join();
  stores[1].reset();
  stores[0].reset();
  for (int r = 0; r < 2; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
}

// "" when both ranks hold the same histories and scales bit for bit, else the first difference.
std::string state_difference(const RankRun& a, const RankRun& b) {
  if (a.state.size() != b.state.size()) return "different numbers of linears";
  for (size_t l = 0; l < a.state.size(); ++l)
    for (size_t k = 0; k < a.state[l].roles.size(); ++k) {
      const recipe::ScalingState &x = a.state[l].roles[k], &y = b.state[l].roles[k];
      if (x.history != y.history || x.scale != y.scale || x.has_history != y.has_history)
        return a.state[l].linear + " role " + std::to_string(x.role);
    }
  return "";
}

TEST(AmaxReduceCpu, TwoRanksKeepTheMaxOfTheirAmaxes) {
  RankRun runs[2];
  run_two_ranks(true, runs);
  ASSERT_EQ(runs[0].local.size(), size_t(kSteps));
  ASSERT_EQ(runs[1].local.size(), size_t(kSteps));
  const size_t n = runs[0].local[0].size();
  ASSERT_EQ(n, size_t(runs[0].state.size() * 3));  // every layer's 4 Linears, 3 roles each
  bool ranks_differed = false;
  for (int s = 0; s < kSteps; ++s)
    for (size_t i = 0; i < n; ++i) {
      const float a = runs[0].local[s][i], b = runs[1].local[s][i];
      ranks_differed |= a != b;
      EXPECT_EQ(runs[0].reduced[s][i], std::max(a, b)) << "step " << s + 1 << " amax " << i;
      EXPECT_EQ(runs[1].reduced[s][i], std::max(a, b)) << "step " << s + 1 << " amax " << i;
    }
  EXPECT_TRUE(ranks_differed) << "the ranks saw the same amaxes: the test would prove nothing";
  EXPECT_EQ(state_difference(runs[0], runs[1]), "");
  // The histories end with the reduced amaxes of steps 1..kSteps; the scale is TE's from their max.
  for (size_t l = 0; l < runs[0].state.size(); ++l)
    for (const recipe::ScalingState& st : runs[0].state[l].roles) {
      const size_t i = l * 3 + size_t(st.role), len = st.history.size();
      float amax = 0;
      for (int s = 0; s < kSteps; ++s) {
        EXPECT_EQ(st.history[len - kSteps + size_t(s)], runs[0].reduced[s][i]) << runs[0].state[l].linear;
        amax = std::max(amax, runs[0].reduced[s][i]);
      }
      const fp8::Format f = st.role == 2 ? fp8::Format::e5m2 : fp8::Format::e4m3;  // HYBRID
      EXPECT_EQ(st.scale, fp8::format_max(f) / amax) << runs[0].state[l].linear << " role " << st.role;
    }
}

// Without the reduction (the trainer before this change) the ranks' histories drift apart.
TEST(AmaxReduceCpu, WithoutTheReductionTheRanksDiffer) {
  RankRun runs[2];
  run_two_ranks(false, runs);
  EXPECT_NE(state_difference(runs[0], runs[1]), "");
}

// A NaN step amax (a non-finite input) travels as +Inf, which any backend's MAX keeps, and comes back NaN.
TEST(AmaxReduceCpu, GatherCarriesNanAsInfinity) {
  float amax[3] = {0.5f, NAN, 0.f}, buf[3] = {};
  std::vector<Tensor> views;
  for (float& a : amax) views.push_back(Tensor::make(&a, DType::f32, Device::cpu, {1}));
  const Tensor t = Tensor::make(buf, DType::f32, Device::cpu, {3});
  ASSERT_TRUE(recipe::gather_amaxes(views, t, nullptr));
  EXPECT_EQ(buf[0], 0.5f);
  EXPECT_EQ(buf[1], INFINITY);
  EXPECT_EQ(buf[2], 0.f);
  buf[0] = INFINITY;  // another rank's NaN won the MAX
  ASSERT_TRUE(recipe::scatter_amaxes(t, views, nullptr));
  EXPECT_TRUE(std::isnan(amax[0]) && std::isnan(amax[1]));
  EXPECT_EQ(amax[2], 0.f);
  EXPECT_FALSE(recipe::gather_amaxes(views, Tensor::make(buf, DType::f32, Device::cpu, {2}), nullptr));
}

nlohmann::json delayed_state(const std::string& save, int iteration) {
  char it[64];
  std::snprintf(it, sizeof(it), "/iter_%07d/trainer_state.json", iteration);
  std::ifstream in(save + it);
  EXPECT_TRUE(in.good()) << save + it;
  return nlohmann::json::parse(in, nullptr, false)["fp8_delayed_scaling"];
}

TEST(AmaxReduceCpu, TwoRanksTrackOneRankThroughTheCli) {
  const std::string dir = test::temp_folder("amax_reduce");
  const std::string one = train(dir, kDelayed, 1, kSteps), two = train(dir, kDelayed, 2, kSteps);
  const auto ref = read_metrics(one), got = read_metrics(two);
  ASSERT_EQ(ref.size(), size_t(kSteps));
  ASSERT_EQ(got.size(), ref.size());
  EXPECT_NEAR(got[0].loss, ref[0].loss, 1e-6 * ref[0].loss);
  EXPECT_NEAR(got[0].grad_norm, ref[0].grad_norm, 1e-6 * ref[0].grad_norm);
  for (size_t i = 1; i < ref.size(); ++i) EXPECT_NEAR(got[i].loss, ref[i].loss, 1e-2 * ref[i].loss) << "step " << i + 1;
  // Rolled at the starts of steps 2 and 3, step 1's amax sits second to last in each history.
  const nlohmann::json a = delayed_state(one, kSteps), b = delayed_state(two, kSteps);
  ASSERT_TRUE(a.is_array() && !a.empty());
  ASSERT_EQ(a.size(), b.size());
  int roles = 0;
  for (size_t l = 0; l < a.size(); ++l)
    for (size_t k = 0; k < a[l]["roles"].size(); ++k) {
      const auto& ha = a[l]["roles"][k]["history"];
      const auto& hb = b[l]["roles"][k]["history"];
      ASSERT_EQ(ha.size(), hb.size());
      const double x = ha[ha.size() - 2].get<double>(), y = hb[hb.size() - 2].get<double>();
      EXPECT_GT(x, 0.0);
      EXPECT_NEAR(y, x, 1e-6 * x) << a[l]["linear"] << " role " << k << ": step 1's amax";
      ++roles;
    }
  EXPECT_EQ(roles, int(a.size()) * 3);
}

}  // namespace
}  // namespace nb
