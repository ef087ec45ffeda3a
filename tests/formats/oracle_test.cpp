// nibble's E4M3/E5M2 encoders against PyTorch, code for code. The oracle file comes from
// scripts/fp8_oracle.py (run it on a machine with PyTorch); without NIBBLE_FP8_ORACLE the test skips.
#include <gtest/gtest.h>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include "formats/scalar_codecs.h"
#include "io/safetensors.h"

using namespace nb;

TEST(Fp8Oracle, EncodersMatchPyTorch) {
  const char* path = std::getenv("NIBBLE_FP8_ORACLE");
  if (!path || !*path) GTEST_SKIP() << "skipped: set NIBBLE_FP8_ORACLE=<file from scripts/fp8_oracle.py>";
  SafeTensorsFile f;
  Status s = read_safetensors(path, &f);
  ASSERT_TRUE(s.is_ok()) << s.message();
  const SafeTensor& in = f.tensors.at("input");
  ASSERT_EQ(in.dtype, "F32");
  const size_t n = in.bytes.size() / 4;
  ASSERT_GT(n, 65536u);
  for (const char* name : {"e4m3", "e5m2"}) {
    const SafeTensor& codes = f.tensors.at(name);
    ASSERT_EQ(codes.bytes.size(), n) << name;
    const bool e4m3 = name[1] == '4';
    size_t mismatches = 0, nans = 0;
    for (size_t i = 0; i < n; ++i) {
      float x;
      std::memcpy(&x, &in.bytes[4 * i], 4);
      uint32_t want = codes.bytes[i];
      uint32_t got = e4m3 ? f32_to_e4m3_satfinite(x) : f32_to_e5m2_satfinite(x);
      if (std::isnan(x)) {  // PyTorch may choose another NaN payload: compare NaN-ness only
        ++nans;
        bool want_nan = e4m3 ? (want & 0x7F) == 0x7F : (want & 0x7F) > 0x7C;
        if (!want_nan) ++mismatches;
        continue;
      }
      if (got != want && mismatches++ < 10)
        ADD_FAILURE() << name << ": input " << x << " (bits 0x" << std::hex << std::bit_cast<uint32_t>(x)
                      << ") nibble 0x" << got << " torch 0x" << want << std::dec;
    }
    EXPECT_EQ(mismatches, 0u) << name << " of " << n;
    EXPECT_GT(nans, 0u) << "the oracle should include NaN inputs";
    std::printf("%s: %zu inputs compared, %zu mismatches\n", name, n, mismatches);
  }
}
