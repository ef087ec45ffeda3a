// `nibble quant` through the binary: bad input gives one clear error line and a non-zero exit; good
// input writes a safetensors file whose codes dequantize to the printed error level.
#include <gtest/gtest.h>
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <sys/wait.h>
#include "formats/mxfp8/mxfp8.h"
#include "io/safetensors.h"

using namespace nb;

namespace {

struct CliRun {
  int code = -1;
  std::string out;  // stdout and stderr together
};

CliRun nibble(const std::string& args) {
  CliRun r;
  std::string cmd = std::string(NIBBLE_BINARY) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t got;
  while ((got = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), got);
  int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

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
  for (size_t i = 0; i < b.size(); i += 2) { b[i] = 0x80; b[i + 1] = 0x3F; }
  b[1] = 0x40; b[0] = 0x00;  // element 0 = 2.0
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
