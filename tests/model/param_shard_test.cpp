// The ParamStore's shards for the distributed optimizer: equal, aligned, covering every parameter once;
// set_master / set_flat store exactly this shard's part of whole arrays and the whole compute copy.
#include <gtest/gtest.h>
#include <vector>
#include "model/llama_config.h"
#include "model/params.h"

namespace nb {
namespace {

TEST(ParamShards, TileTheFlatSpaceAndHoldTheirSlice) {
  LlamaConfig cfg;
  ASSERT_TRUE(llama_preset("tiny", &cfg).is_ok());
  ParamStore whole;
  ASSERT_TRUE(whole.allocate(cfg, Device::cpu).is_ok());
  const int64_t total = whole.total();
  std::vector<float> host(static_cast<size_t>(total)), m(static_cast<size_t>(total));
  for (int64_t i = 0; i < total; ++i) {
    host[size_t(i)] = 0.001f * float(i % 9973) - 3.f;
    m[size_t(i)] = float(i);
  }
  for (int d : {1, 2, 3, 4, 7}) {
    int64_t covered = 0;
    for (int r = 0; r < d; ++r) {
      ParamStore P;
      ASSERT_TRUE(P.allocate(cfg, Device::cpu, 0, 0, r, d).is_ok());
      EXPECT_EQ(P.shard_len() % (d > 1 ? 64 : 1), 0);
      EXPECT_EQ(P.shard_begin(), r * P.shard_len());
      EXPECT_GE(P.padded_total(), total);
      EXPECT_LT(P.padded_total() - total, d > 1 ? 64 * d : 1);  // padding below one aligned unit
      covered += std::max<int64_t>(0, P.shard_end() - P.shard_begin());
      ASSERT_TRUE(P.set_master(host.data()).is_ok());
      ASSERT_TRUE(P.set_flat(P.flat_m(), m.data()).is_ok());
      const float* master = P.flat_master().ptr<float>();
      const float* mm = P.flat_m().ptr<float>();
      for (int64_t i = P.shard_begin(); i < P.shard_end(); ++i) {
        ASSERT_EQ(master[i - P.shard_begin()], host[size_t(i)]) << "d " << d << " rank " << r << " element " << i;
        ASSERT_EQ(mm[i - P.shard_begin()], m[size_t(i)]);
      }
      // The compute copy (FP32 on the CPU backend) is whole on every rank.
      const float* compute = P.padded_compute().ptr<float>();
      for (int64_t i = 0; i < total; ++i) ASSERT_EQ(compute[i], host[size_t(i)]) << "d " << d << " element " << i;
      if (d > 1) {  // set_master used the gradient buffer as scratch and must leave it zeroed
        for (int64_t i = 0; i < P.padded_total(); ++i) ASSERT_EQ(P.padded_grad().ptr<float>()[i], 0.f);
      }
      // 4 (gradient) + 4 (compute) bytes over the padded space + 12 over the shard.
      EXPECT_EQ(P.bytes(), size_t(P.padded_total()) * 8 + size_t(P.shard_len()) * 12);
    }
    EXPECT_EQ(covered, total) << d << " shards";
  }
}

}  // namespace
}  // namespace nb
