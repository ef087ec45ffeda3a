// The ParamStore's buckets and slices for the distributed optimizer: every bucket split into d equal,
// aligned slices, rank r's slices covering every element once over the ranks and stored back to back;
// set_master / set_state store exactly this rank's parts of whole arrays, and the whole compute copy.
#include <gtest/gtest.h>
#include <algorithm>
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
  // 1e9 elements: a --ddp-bucket-size beyond the model, which must give one bucket no longer than the flat space.
  for (int64_t bucket : {int64_t(0), int64_t(1000), int64_t(12345), int64_t(1'000'000'000)})
    for (int d : {1, 2, 3, 4, 7}) {
      int64_t covered = 0;
      for (int r = 0; r < d; ++r) {
        ParamStore P;
        ASSERT_TRUE(P.allocate(cfg, Device::cpu, 0, 0, r, d, bucket).is_ok());
        EXPECT_EQ(P.shard_len() % (d > 1 ? 64 : 1), 0);
        EXPECT_EQ(P.padded_total(), P.shard_len() * d);
        EXPECT_GE(P.padded_total(), total);
        EXPECT_LT(P.padded_total() - total, d > 1 ? 64 * d : 1);  // padding below one aligned unit
        if (bucket > 0) { EXPECT_EQ(P.bucket_count(), (P.padded_total() + P.bucket_len() - 1) / P.bucket_len()); }
        EXPECT_LE(P.bucket_len(), P.padded_total());
        ASSERT_TRUE(P.set_master(host.data()).is_ok());
        ASSERT_TRUE(P.set_state(optim::StateArray::m, m.data()).is_ok());
        const float* master = P.flat_master().ptr<float>();
        const float* mm = P.flat_m().ptr<float>();
        int64_t local = 0;
        for (int b = 0; b < P.bucket_count(); ++b) {
          const ParamStore::Slice s = P.own_slice(b);
          const int64_t len = (P.bucket_end(b) - P.bucket_begin(b)) / d;
          EXPECT_EQ(s.begin, P.bucket_begin(b) + r * len) << "bucket " << b;
          EXPECT_EQ(s.end - s.begin, len);
          EXPECT_EQ(s.begin % 64, 0);
          EXPECT_EQ(s.local, local) << "slices are stored back to back in bucket order";
          local += len;
          for (int64_t i = s.begin; i < std::min(s.end, total); ++i) {
            ASSERT_EQ(master[s.local + i - s.begin], host[size_t(i)]) << "d " << d << " rank " << r << " element " << i;
            ASSERT_EQ(mm[s.local + i - s.begin], m[size_t(i)]);
          }
          covered += std::max<int64_t>(0, std::min(s.end, total) - s.begin);
        }
        EXPECT_EQ(local, P.shard_len());
        // The compute copy (FP32 on the CPU backend) is whole on every rank.
        const float* compute = P.padded_compute().ptr<float>();
        for (int64_t i = 0; i < total; ++i) ASSERT_EQ(compute[i], host[size_t(i)]) << "d " << d << " element " << i;
        if (d > 1) {  // set_master used the gradient buffer as scratch and must leave it zeroed
          for (int64_t i = 0; i < P.padded_total(); ++i) ASSERT_EQ(P.padded_grad().ptr<float>()[i], 0.f);
        }
        // 4 (gradient) + 4 (compute) bytes over the padded space + 12 over the shard.
        EXPECT_EQ(P.bytes(), size_t(P.padded_total()) * 8 + size_t(P.shard_len()) * 12);
      }
      EXPECT_EQ(covered, total) << d << " shards, buckets of " << bucket;
    }
}

}  // namespace
}  // namespace nb
