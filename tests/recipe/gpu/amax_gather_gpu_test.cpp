// recipe/amax_gather.h on CUDA: 300 one-float amaxes (two kernel chunks of 256) gathered into one
// buffer and scattered back equal the CPU reference's rule exactly: values as they are, NaN as +Inf on
// the way in, +Inf as NaN on the way out.
#include <gtest/gtest.h>
#include <cmath>
#include <vector>
#include "common/gpu.h"
#include "recipe/amax_gather.h"

namespace nb {
namespace {

TEST(AmaxGatherGpu, GatherAndScatterMatchTheCpuRule) {
  NB_REQUIRE_GPU();
  const int n = 300;
  std::vector<Buffer> cells(n);
  std::vector<Tensor> views;
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(Buffer::allocate(&cells[size_t(i)], DType::f32, Device::cuda, {1}).is_ok());
    const float v = i == 7 ? NAN : 0.5f * float(i) + 0.25f;
    ASSERT_TRUE(copy_bytes(cells[size_t(i)].data(), Device::cuda, &v, Device::cpu, 4).is_ok());
    views.push_back(cells[size_t(i)].tensor());
  }
  Buffer all;
  ASSERT_TRUE(Buffer::allocate(&all, DType::f32, Device::cuda, {n}).is_ok());
  ASSERT_TRUE(recipe::gather_amaxes(views, all.tensor(), nullptr).is_ok());
  std::vector<float> host(n);
  ASSERT_TRUE(copy_bytes(host.data(), Device::cpu, all.data(), Device::cuda, 4 * n).is_ok());
  for (int i = 0; i < n; ++i) EXPECT_EQ(host[size_t(i)], i == 7 ? INFINITY : 0.5f * float(i) + 0.25f) << i;

  for (int i = 0; i < n; ++i) host[size_t(i)] = i == 11 ? INFINITY : float(3 * i);
  ASSERT_TRUE(copy_bytes(all.data(), Device::cuda, host.data(), Device::cpu, 4 * n).is_ok());
  ASSERT_TRUE(recipe::scatter_amaxes(all.tensor(), views, nullptr).is_ok());
  for (int i = 0; i < n; ++i) {
    float v = 0;
    ASSERT_TRUE(copy_bytes(&v, Device::cpu, cells[size_t(i)].data(), Device::cuda, 4).is_ok());
    if (i == 11)
      EXPECT_TRUE(std::isnan(v));
    else
      EXPECT_EQ(v, float(3 * i)) << i;
  }
}

}  // namespace
}  // namespace nb
