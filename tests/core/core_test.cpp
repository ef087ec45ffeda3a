// Core: dtype list, BF16 rounding, Philox known-answer vectors, arena accounting.
#include <gtest/gtest.h>
#include <cmath>
#include "core/arena.h"
#include "core/bf16.h"
#include "core/dtype.h"
#include "core/philox.h"

using namespace nb;

TEST(DType, NamesSizesRoundTrip) {
  EXPECT_EQ(dtype_bits(DType::bf16), 16);
  EXPECT_EQ(dtype_bits(DType::e2m1), 4);
  EXPECT_EQ(dtype_bytes(DType::e2m1, 3), 2);
  EXPECT_EQ(dtype_safetensors_name(DType::e4m3), "F8_E4M3");
  DType t;
  ASSERT_TRUE(dtype_from_name("e5m2", &t));
  EXPECT_EQ(t, DType::e5m2);
  EXPECT_FALSE(dtype_from_name("fp7", &t));
}

TEST(BF16, RoundNearestEven) {
  // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f).bits, 0x3F80);
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f).bits, 0x3F81);
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * 0x1p-8f).bits, 0x3F82);  // tie, odd below -> up
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  EXPECT_EQ(f32_to_bf16(INFINITY).bits, 0x7F80);
  EXPECT_EQ(f16_to_f32(f16{0x3C00}), 1.0f);
  EXPECT_EQ(f16_to_f32(f16{0x0001}), 0x1p-24f);
  EXPECT_EQ(f16_to_f32(f16{0xFBFF}), -65504.0f);
}

// Known-answer vectors from the Random123 distribution (kat_vectors, philox4x32_10).
TEST(Philox, KnownAnswers) {
  Philox4x32 r = philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(r.v[0], 0x6627e8d5u);
  EXPECT_EQ(r.v[1], 0xe169c58du);
  EXPECT_EQ(r.v[2], 0xbc57ac4cu);
  EXPECT_EQ(r.v[3], 0x9b00dbd8u);
  r = philox4x32_10(0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff);
  EXPECT_EQ(r.v[0], 0x408f276du);
  EXPECT_EQ(r.v[1], 0x41c83b0eu);
  EXPECT_EQ(r.v[2], 0xa20bc7c6u);
  EXPECT_EQ(r.v[3], 0x6d5451fdu);
  r = philox4x32_10(0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0);
  EXPECT_EQ(r.v[0], 0xd16cfe09u);
  EXPECT_EQ(r.v[1], 0x94fdccebu);
  EXPECT_EQ(r.v[2], 0x5001e420u);
  EXPECT_EQ(r.v[3], 0x24126ea1u);
}

TEST(Philox, BytesAreRoughlyUniform) {
  RngKey key{1234, 7, 3};
  int hist[256] = {};
  for (uint64_t b = 0; b < 4096; ++b) {
    Philox4x32 r = philox_block(key, b);
    for (int j = 0; j < 16; ++j) hist[philox_byte(r, j)]++;
  }
  for (int i = 0; i < 256; ++i) {
    EXPECT_GT(hist[i], 256 - 80);
    EXPECT_LT(hist[i], 256 + 80);
  }
}

TEST(Arena, TracksPeakAndReleases) {
  Arena a;
  ASSERT_TRUE(a.reserve(Device::cpu, 4096).is_ok());
  Status st;
  size_t m = a.mark();
  void* p = a.alloc(1000, &st);
  ASSERT_NE(p, nullptr);
  void* q = a.alloc(1000, &st);
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(a.used(), 2048u);
  a.release(m);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.peak(), 2048u);
  EXPECT_EQ(a.alloc(5000, &st), nullptr);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("full"), std::string::npos);
}
