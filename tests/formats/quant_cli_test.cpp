// `nibble quant` through the binary: bad input gives one clear error line and a non-zero exit; good
// input writes a safetensors file whose codes dequantize to the printed error level.
#include <gtest/gtest.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include "common/nibble_binary.h"
#include "formats/mxfp8/mxfp8.h"
#include "io/safetensors.h"
#include "nvfp4/te_4over6_ref.h"

using namespace nb;
using nb::test::CliRun;

namespace {

CliRun nibble(const std::string& args) { return nb::test::run_nibble(args); }

std::string tmp(const std::string& name) { return ::testing::TempDir() + "nibble_quant_" + name; }

void write_tensor(const std::string& path, const std::string& name, const std::string& dtype,
                  std::vector<int64_t> shape, size_t elem_bytes, uint8_t fill = 0) {
  SafeTensorsFile f;
  size_t n = 1;
  for (int64_t d : shape) n *= size_t(d);
  f.tensors[name] = SafeTensor{dtype, shape, std::vector<uint8_t>(n * elem_bytes, fill)};
  ASSERT_TRUE(write_safetensors(path, f).is_ok());
}

// One error line on the output, naming what is wrong.
void expect_error(const CliRun& r, const std::string& needle) {
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("error: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(needle), std::string::npos) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
}

}  // namespace

TEST(QuantCli, MissingFile) {
  expect_error(nibble("quant --input " + tmp("does_not_exist.safetensors") + " --tensor w --format mxfp8 --device cpu"),
               "does_not_exist");
}

TEST(QuantCli, CorruptHeader) {
  std::string path = tmp("corrupt.safetensors");
  std::ofstream(path, std::ios::binary) << std::string("\xff\xff\xff\xff\xff\xff\xff\x7f{garbage", 16);
  expect_error(nibble("quant --input " + path + " --tensor w --format mxfp8 --device cpu"), "corrupt");
}

TEST(QuantCli, UnsupportedDtype) {
  std::string path = tmp("i32.safetensors");
  write_tensor(path, "w", "I32", {32, 32}, 4);
  expect_error(nibble("quant --input " + path + " --tensor w --format mxfp8 --device cpu"), "I32");
}

TEST(QuantCli, UnknownTensorName) {
  std::string path = tmp("named.safetensors");
  write_tensor(path, "w", "F32", {32, 32}, 4);
  CliRun r = nibble("quant --input " + path + " --tensor nope --format mxfp8 --device cpu");
  expect_error(r, "'nope'");
  EXPECT_NE(r.out.find("holds: w"), std::string::npos) << r.out;
}

TEST(QuantCli, OddShape) {
  std::string path = tmp("odd.safetensors");
  write_tensor(path, "w", "F32", {1000, 100}, 4);
  expect_error(nibble("quant --input " + path + " --tensor w --format mxfp8 --device cpu"), "1000x100");
  expect_error(nibble("quant --input " + path + " --tensor w --format fp8-block128 --device cpu"), "1000x100");
  expect_error(nibble("quant --random 64,x --format mxfp8 --device cpu"), "--random");
}

TEST(QuantCli, WritesCodesThatDequantizeToThePrintedError) {
  std::string in = tmp("good.safetensors"), out = tmp("good_out.safetensors");
  // BF16 ones (0x3F80) with one 2.0: every block is exactly representable, SQNR infinite.
  SafeTensorsFile f;
  std::vector<uint8_t> b(64 * 64 * 2);
  for (size_t i = 0; i < b.size(); i += 2) {
    b[i] = 0x80;
    b[i + 1] = 0x3F;
  }
  b[1] = 0x40;
  b[0] = 0x00;  // element 0 = 2.0
  f.tensors["w"] = SafeTensor{"BF16", {64, 64}, b};
  ASSERT_TRUE(write_safetensors(in, f).is_ok());
  CliRun r = nibble("quant --input " + in + " --tensor w --format mxfp8 --device cpu --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("inf"), std::string::npos) << r.out;  // exact: SQNR infinite
  SafeTensorsFile q;
  ASSERT_TRUE(read_safetensors(out, &q).is_ok());
  ASSERT_EQ(q.tensors.at("row_data").shape, (std::vector<int64_t>{64, 64}));
  ASSERT_EQ(q.tensors.at("row_scales").shape, (std::vector<int64_t>{64, 2}));
  ASSERT_EQ(q.tensors.at("col_scales").shape, (std::vector<int64_t>{2, 64}));
  std::vector<float> back(64 * 64);
  mxfp8::dequantize_ref(q.tensors.at("row_data").bytes.data(), q.tensors.at("row_scales").bytes.data(), 64, 64, false,
                        back.data());
  EXPECT_EQ(back[0], 2.0f);
  EXPECT_EQ(back[1], 1.0f);
  EXPECT_EQ(back[64 * 64 - 1], 1.0f);

  // Random input through every format on the CPU: success and a finite, plausible SQNR line.
  for (const char* fmt : {"mxfp8", "fp8-e4m3", "fp8-e5m2", "fp8-block128", "fp8-block128x128", "nvfp4"}) {
    CliRun rr = nibble(std::string("quant --random 256,256 --dist normal --seed 3 --device cpu --format ") + fmt +
                       " --out " + out);
    EXPECT_EQ(rr.code, 0) << fmt << ": " << rr.out;
    EXPECT_NE(rr.out.find("SQNR dB"), std::string::npos) << rr.out;
  }
}

namespace {

// F32 tensors of standard-normal values with `nans` NaN elements spread over the tensor.
SafeTensor normal_f32(int64_t rows, int64_t cols, int nans) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(size_t(rows * cols));
  for (auto& x : v) x = normal(rng);
  for (int i = 0; i < nans; ++i) v[size_t(i) * v.size() / size_t(nans)] = NAN;
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return SafeTensor{"F32", {rows, cols}, b};
}

// The SQNR column of the table line of `copy`; NAN when the line is missing or not a number.
double sqnr_of(const std::string& out, const std::string& copy) {
  size_t at = out.find("\n" + copy + " ");
  if (at == std::string::npos) return NAN;
  char* end = nullptr;
  const char* p = out.c_str() + at + 1 + copy.size();
  double v = std::strtod(p, &end);
  return end == p ? NAN : v;
}

}  // namespace

// All-NaN input: no "inf" (a perfect copy) but the count, and a failing exit unless passed through.
TEST(QuantCli, AllNanInputFailsWithTheCount) {
  std::string in = tmp("all_nan.safetensors"), out = tmp("all_nan_out.safetensors");
  write_tensor(in, "w", "F32", {64, 64}, 4, 0xFF);  // 0xFFFFFFFF = NaN
  std::remove(out.c_str());
  CliRun r = nibble("quant --input " + in + " --tensor w --format mxfp8 --device cpu --out " + out);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("4096 non-finite"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--allow-nonfinite"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(" inf "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("n/a"), std::string::npos) << r.out;
  EXPECT_FALSE(std::ifstream(out).good()) << "a refused run must not write --out";

  CliRun ok = nibble("quant --input " + in + " --tensor w --format mxfp8 --device cpu --allow-nonfinite --out " + out);
  EXPECT_EQ(ok.code, 0) << ok.out;
  EXPECT_NE(ok.out.find("non-finite inputs: 4096 of 4096"), std::string::npos) << ok.out;
  EXPECT_TRUE(std::ifstream(out).good());
}

// A few NaNs among normal values: the error is measured over the finite ones, so it stays a real,
// plausible SQNR (MXFP8 E4M3 on normal data is about 30 dB), never nan or inf.
TEST(QuantCli, SomeNansReportTheErrorOverTheFiniteValues) {
  std::string in = tmp("some_nan.safetensors");
  SafeTensorsFile f;
  f.tensors["w"] = normal_f32(64, 64, 3);
  ASSERT_TRUE(write_safetensors(in, f).is_ok());
  for (const char* fmt : {"mxfp8", "fp8-e4m3", "nvfp4"}) {
    CliRun r = nibble("quant --input " + in + " --tensor w --device cpu --format " + std::string(fmt));
    EXPECT_NE(r.code, 0) << fmt << ": " << r.out;
    EXPECT_NE(r.out.find("3 non-finite"), std::string::npos) << fmt << ": " << r.out;
    CliRun ok =
        nibble("quant --input " + in + " --tensor w --device cpu --allow-nonfinite --format " + std::string(fmt));
    EXPECT_EQ(ok.code, 0) << fmt << ": " << ok.out;
    EXPECT_NE(ok.out.find("non-finite inputs: 3 of 4096"), std::string::npos) << fmt << ": " << ok.out;
  }
  // MXFP8 scales per 32 elements, so a NaN costs only its own block; the rest is measured.
  CliRun r = nibble("quant --input " + in + " --device cpu --allow-nonfinite --format mxfp8");
  const double sqnr = sqnr_of(r.out, "row-wise 1x32");
  EXPECT_TRUE(std::isfinite(sqnr)) << r.out;
  EXPECT_GT(sqnr, 20.0) << r.out;
  EXPECT_LT(sqnr, 45.0) << r.out;
}

TEST(QuantCli, TensorMayBeLeftOutWhenTheFileHoldsOne) {
  std::string one = tmp("one.safetensors"), two = tmp("two.safetensors");
  SafeTensorsFile f;
  f.tensors["only"] = normal_f32(64, 64, 0);
  ASSERT_TRUE(write_safetensors(one, f).is_ok());
  CliRun r = nibble("quant --input " + one + " --format mxfp8 --device cpu");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(std::isfinite(sqnr_of(r.out, "row-wise 1x32"))) << r.out;

  f.tensors["other"] = normal_f32(64, 64, 0);
  ASSERT_TRUE(write_safetensors(two, f).is_ok());
  CliRun e = nibble("quant --input " + two + " --format mxfp8 --device cpu");
  expect_error(e, "--tensor");
  EXPECT_NE(e.out.find("only, other"), std::string::npos) << e.out;
}

// `nibble quant --4over6` writes TransformerEngine's 4over6 bytes (te_4over6_ref.h), the true amax and
// the rule in the metadata, for both error metrics, 1x16 and 16x16, on a lognormal BF16 tensor.
TEST(QuantCli, FourOverSixWritesTeBytesAndTheTrueAmax) {
  const int64_t rows = 64, cols = 96;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint8_t> b(size_t(rows * cols * 2));
  std::vector<float> x(size_t(rows * cols));
  for (size_t i = 0; i < x.size(); ++i) {
    const uint16_t h = f32_to_bf16(std::exp(2.0f * normal(rng)) * (i % 3 ? 1.0f : -1.0f)).bits;
    x[i] = bf16_to_f32(bf16::from_bits(h));
    std::memcpy(&b[2 * i], &h, 2);
  }
  SafeTensorsFile f;
  f.tensors["w"] = SafeTensor{"BF16", {rows, cols}, b};
  const std::string in = tmp("fos_in.safetensors"), out = tmp("fos_out.safetensors");
  ASSERT_TRUE(write_safetensors(in, f).is_ok());
  for (const char* mode : {"mae", "mse"})
    for (bool two_d : {false, true}) {
      SCOPED_TRACE(std::string(mode) + (two_d ? " 2d" : " 1d"));
      const std::string flags = std::string(" --4over6") +
                                (std::string(mode) == "mse" ? " --fp4-4over6-err-mode mse" : "") +
                                (two_d ? " --2d" : "");
      CliRun r = nibble("quant --input " + in + " --format nvfp4 --device cpu --out " + out + flags);
      ASSERT_EQ(r.code, 0) << r.out;
      SafeTensorsFile q;
      ASSERT_TRUE(read_safetensors(out, &q).is_ok());
      nvfp4::te_ref::Copy row, col;
      nvfp4::te_ref::quantize(x, rows, cols, two_d, std::string(mode) == "mse", &row, &col);
      EXPECT_TRUE(q.tensors.at("row_data").bytes == row.data);
      EXPECT_TRUE(q.tensors.at("row_scales").bytes == row.scales);
      EXPECT_TRUE(q.tensors.at("col_data").bytes == col.data);
      EXPECT_TRUE(q.tensors.at("col_scales").bytes == col.scales);
      float amax[2];
      std::memcpy(&amax[0], q.tensors.at("row_amax").bytes.data(), 4);
      std::memcpy(&amax[1], q.tensors.at("col_amax").bytes.data(), 4);
      EXPECT_EQ(amax[0], row.amax);
      EXPECT_EQ(amax[1], col.amax);
      EXPECT_EQ(q.metadata.at("nvfp4_4over6"), mode);
      EXPECT_EQ(q.metadata.at("nvfp4_e4m3_max"), "256");
    }
  expect_error(nibble("quant --random 64,64 --format nvfp4 --device cpu --fp4-4over6-err-mode mse"), "--4over6");
}
