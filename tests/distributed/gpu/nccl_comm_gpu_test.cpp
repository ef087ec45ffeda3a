// The NCCL communicator on one GPU as a world of one rank: every call the Trainer makes (the in-place
// all-reduce, reduce-scatter and all-gather forms, broadcast, host scalars, the bounded wait) goes through
// NCCL for real, with the rendezvous store handing out the unique id. With one rank each collective is
// the identity, so the results are known exactly; several ranks need several GPUs (docs/DISTRIBUTED.md).
#include <gtest/gtest.h>
#include <chrono>
#include <vector>
#include "common/gpu.h"
#include "core/bf16.h"
#include "distributed/communicator.h"

namespace nb::dist {
namespace {

struct OneRank {
  std::unique_ptr<TcpStore> store;
  std::unique_ptr<Communicator> comm;
};

OneRank one_rank() {
  OneRank r;
  World w;  // rank 0 of 1; port 0: the store picks a free one
  w.store_port = 0;
  const auto timeout = std::chrono::seconds(30);
  Status st = TcpStore::open(w, timeout, &r.store);
  EXPECT_TRUE(st.is_ok()) << st.message();
  st = make_communicator(w, Device::cuda, r.store.get(), timeout, &r.comm);
  EXPECT_TRUE(st.is_ok()) << st.message();
  return r;
}

std::vector<float> ramp(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = 0.25f * float(i) - 7.f;
  return v;
}

std::vector<float> download(const Buffer& b, size_t n) {
  std::vector<float> v(n);
  EXPECT_TRUE(copy_bytes(v.data(), Device::cpu, b.data(), Device::cuda, n * 4).is_ok());
  return v;
}

TEST(NcclOneRank, CollectivesTheTrainerUses) {
  NB_REQUIRE_GPU();
  OneRank r = one_rank();
  ASSERT_TRUE(r.comm);
  EXPECT_STREQ(r.comm->backend(), "nccl");
  EXPECT_EQ(r.comm->size(), 1);
  const size_t n = 1000;
  const std::vector<float> host = ramp(n);
  Buffer a;
  ASSERT_TRUE(Buffer::allocate(&a, DType::f32, Device::cuda, {int64_t(n)}).is_ok());
  ASSERT_TRUE(copy_bytes(a.data(), Device::cuda, host.data(), Device::cpu, n * 4).is_ok());
  ASSERT_TRUE(r.comm->all_reduce(a.tensor(), ReduceOp::sum, nullptr).is_ok());
  ASSERT_TRUE(r.comm->all_reduce(a.tensor(), ReduceOp::max, nullptr).is_ok());
  // In place, as the distributed optimizer calls them: the shard of rank 0 is the start of the buffer.
  ASSERT_TRUE(r.comm->reduce_scatter(a.tensor(), a.tensor(), nullptr).is_ok());
  ASSERT_TRUE(r.comm->all_gather(a.tensor(), a.tensor(), nullptr).is_ok());
  ASSERT_TRUE(r.comm->broadcast(a.tensor(), 0, nullptr).is_ok());
  ASSERT_TRUE(r.comm->wait(nullptr).is_ok());
  EXPECT_EQ(download(a, n), host);
  double scalars[3] = {1.5, -2.0, 1e300};
  ASSERT_TRUE(r.comm->all_reduce_host(scalars, 3, ReduceOp::sum).is_ok());
  EXPECT_EQ(scalars[0], 1.5);
  EXPECT_EQ(scalars[1], -2.0);
  EXPECT_EQ(scalars[2], 1e300);
  // Longer host arrays than the first scratch (MoR's statistics: four doubles per Linear role; the stages' delayed
  // scaling histories): the scratch grows, and a short array after a long one still reads its own values.
  for (const int len : {65, 5000, 7}) {
    std::vector<double> many(static_cast<size_t>(len));
    for (int i = 0; i < len; ++i) many[size_t(i)] = double(i) * 0.25 - 3.0;
    const std::vector<double> want = many;
    ASSERT_TRUE(r.comm->all_reduce_host(many.data(), len, ReduceOp::sum).is_ok()) << len;
    EXPECT_EQ(many, want) << len;
  }
}

TEST(NcclOneRank, Bf16ComputeCopiesAreGathered) {
  NB_REQUIRE_GPU();
  OneRank r = one_rank();
  ASSERT_TRUE(r.comm);
  std::vector<bf16> host(256);
  for (size_t i = 0; i < host.size(); ++i) host[i] = f32_to_bf16(float(i) - 100.f);
  Buffer b;
  ASSERT_TRUE(Buffer::allocate(&b, DType::bf16, Device::cuda, {256}).is_ok());
  ASSERT_TRUE(copy_bytes(b.data(), Device::cuda, host.data(), Device::cpu, 512).is_ok());
  ASSERT_TRUE(r.comm->all_gather(b.tensor(), b.tensor(), nullptr).is_ok());
  ASSERT_TRUE(r.comm->wait(nullptr).is_ok());
  std::vector<bf16> back(256);
  ASSERT_TRUE(copy_bytes(back.data(), Device::cpu, b.data(), Device::cuda, 512).is_ok());
  for (size_t i = 0; i < host.size(); ++i) EXPECT_EQ(back[i].bits, host[i].bits) << i;
}

TEST(NcclOneRank, MisuseIsASentence) {
  NB_REQUIRE_GPU();
  OneRank r = one_rank();
  ASSERT_TRUE(r.comm);
  Buffer ints, small, host_buf;
  ASSERT_TRUE(Buffer::allocate(&ints, DType::i32, Device::cuda, {8}).is_ok());
  ASSERT_TRUE(Buffer::allocate(&small, DType::f32, Device::cuda, {3}).is_ok());
  ASSERT_TRUE(Buffer::allocate(&host_buf, DType::f32, Device::cpu, {8}).is_ok());
  Status st = r.comm->all_reduce(ints.tensor(), ReduceOp::sum, nullptr);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("f32 or bf16"), std::string::npos) << st.message();
  st = r.comm->all_reduce(host_buf.tensor(), ReduceOp::sum, nullptr);
  EXPECT_NE(st.message().find("device tensors"), std::string::npos) << st.message();
  Buffer eight;
  ASSERT_TRUE(Buffer::allocate(&eight, DType::f32, Device::cuda, {8}).is_ok());
  st = r.comm->all_gather(eight.tensor(), small.tensor(), nullptr);
  EXPECT_NE(st.message().find("slices"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace nb::dist
