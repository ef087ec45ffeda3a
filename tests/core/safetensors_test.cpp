// safetensors: round trip, header layout, and every validation rule on corrupt files.
#include <gtest/gtest.h>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include "io/safetensors.h"

using namespace nb;

namespace {
std::string tmp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("nibble_st_" + std::to_string(::getpid()) + "_" + name)).string();
}
void write_raw(const std::string& path, const std::string& header, size_t buffer_bytes) {
  std::ofstream f(path, std::ios::binary);
  uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f.write(header.data(), std::streamsize(n));
  std::string buf(buffer_bytes, '\x01');
  f.write(buf.data(), std::streamsize(buf.size()));
}
}  // namespace

TEST(SafeTensors, RoundTrip) {
  SafeTensorsFile f;
  f.tensors["b"] = {"BF16", {2, 3}, std::vector<uint8_t>(12, 7)};
  f.tensors["a"] = {"F32", {4}, std::vector<uint8_t>(16, 9)};
  f.metadata["note"] = "x";
  std::string p = tmp_path("rt.safetensors");
  ASSERT_TRUE(write_safetensors(p, f).is_ok());
  // Header length is a multiple of 8 (padding with spaces).
  std::ifstream in(p, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
  SafeTensorsFile g;
  Status st = read_safetensors(p, &g);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(g.tensors["b"].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(g.tensors["a"].bytes, f.tensors["a"].bytes);
  EXPECT_EQ(g.metadata["format"], "pt");
  EXPECT_EQ(g.metadata["note"], "x");
  std::remove(p.c_str());
}

TEST(SafeTensors, RejectsCorruptFiles) {
  SafeTensorsFile g;
  EXPECT_NE(read_safetensors("/nonexistent/x.safetensors", &g).message().find("cannot open"), std::string::npos);
  std::string p = tmp_path("bad.safetensors");
  struct Case {
    std::string header;
    size_t buf;
    const char* expect;
  };
  Case cases[] = {
      {"{not json", 0, "invalid JSON"},
      {R"({"t":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}})", 1, "unknown dtype"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4, "outside"},
      {R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, "need"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8, "tile"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8, "buffer holds"},
      {R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4, "negative"},
  };
  for (const auto& c : cases) {
    write_raw(p, c.header, c.buf);
    Status st = read_safetensors(p, &g);
    ASSERT_FALSE(st.is_ok()) << c.header;
    EXPECT_NE(st.message().find(c.expect), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(p), std::string::npos) << "error must name the file: " << st.message();
  }
  // Header length larger than the file.
  {
    std::ofstream f(p, std::ios::binary);
    uint64_t n = 1000;
    f.write(reinterpret_cast<const char*>(&n), 8);
  }
  EXPECT_NE(read_safetensors(p, &g).message().find("exceeds"), std::string::npos);
  std::remove(p.c_str());
}
