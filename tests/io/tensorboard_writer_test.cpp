// The TensorBoard event writer (io/tensorboard_writer.h): CRC-32C and its mask against values from an
// independent implementation, the TFRecord framing byte for byte, scalars read back through the record
// format and the generated protobuf classes, and damaged files that must fail their CRC checks.
#include <gtest/gtest.h>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>
#include "common/tensorboard_events.h"
#include "io/tensorboard_event.pb.h"
#include "io/tensorboard_writer.h"
#include "io_test_util.h"

using namespace nb;
using nb::test::TbFile;

namespace {

class TensorBoardWriterTest : public nb::test::TempDirTest {
 protected:
  // Writes three steps of four scalars (zero, negative, tiny, large among them) and returns the file.
  std::string write_three_steps() {
    TensorBoardWriter w;
    Status st = w.open(path("tb"));
    EXPECT_TRUE(st.is_ok()) << st.message();
    for (int64_t step = 1; step <= 3; ++step) {
      for (const auto& [tag, v] : values(step)) EXPECT_TRUE(w.add_scalar(tag, step, v, 1.7e9 + double(step)));
      EXPECT_TRUE(w.flush());
    }
    return w.path();
  }
  static std::vector<std::pair<std::string, float>> values(int64_t step) {
    return {{"lm loss", 10.5f / float(step)},
            {"grad-norm", 0.0f},
            {"learning-rate", -1e-30f * float(step)},
            {"throughput/tokens_per_sec_per_gpu", 3.4e38f}};
  }
  static std::string read_bytes(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  static void write_bytes(const std::string& p, const std::string& s) {
    std::ofstream(p, std::ios::binary | std::ios::trunc) << s;
  }
};

}  // namespace

// The standard CRC-32C check value, and its TFRecord mask as an independent CRC-32C library computes it.
TEST(TensorBoardCrc, CheckValueAndMask) {
  const std::string check = "123456789";
  EXPECT_EQ(crc32c(check.data(), check.size()), 0xE3069283u);
  EXPECT_EQ(masked_crc32c(check.data(), check.size()), 0xC78AB0E5u);
  EXPECT_EQ(crc32c("", 0), 0u);
}

// One record holding "abc": length 3, the masked CRC of the length bytes, the data, the masked CRC of the data.
TEST(TensorBoardCrc, RecordFramingBytes) {
  const unsigned char want[] = {0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xb0, 0x99,
                                0x49, 0x0e, 0x61, 0x62, 0x63, 0x6e, 0x57, 0xf1, 0x21};
  EXPECT_EQ(tfrecord_frame("abc"), std::string(reinterpret_cast<const char*>(want), sizeof want));
}

TEST_F(TensorBoardWriterTest, ScalarsReadBackThroughTheRecordFormat) {
  const std::string file = write_three_steps();
  const std::vector<std::string> found = nb::test::event_files(path("tb"));
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0], file);
  TbFile tb;
  ASSERT_EQ(nb::test::parse_event_file(file, &tb), "");
  EXPECT_EQ(tb.file_version, "brain.Event:2");
  ASSERT_EQ(tb.scalars.size(), 12u);
  size_t i = 0;
  for (int64_t step = 1; step <= 3; ++step)
    for (const auto& [tag, v] : values(step)) {
      const nb::test::TbScalar& s = tb.scalars[i++];
      EXPECT_EQ(s.tag, tag);
      EXPECT_EQ(s.step, step);
      EXPECT_EQ(s.value, v) << tag;  // float in, float out: exact
      EXPECT_EQ(s.wall_time, 1.7e9 + double(step));
    }
}

// proto3 writes a oneof member even when it holds 0: a scalar of 0 must reach TensorBoard.
TEST(TensorBoardEvent, ZeroScalarIsSerialized) {
  tensorboard::Event e;
  e.set_step(0);
  auto* v = e.mutable_summary()->add_value();
  v->set_tag("skipped-iterations");
  v->set_simple_value(0.0f);
  tensorboard::Event back;
  ASSERT_TRUE(back.ParseFromString(e.SerializeAsString()));
  ASSERT_EQ(back.summary().value_size(), 1);
  EXPECT_EQ(back.summary().value(0).value_case(), tensorboard::Summary::Value::kSimpleValue);
}

TEST_F(TensorBoardWriterTest, CorruptedByteFailsTheCrcCheck) {
  const std::string file = write_three_steps();
  const std::string good = read_bytes(file);
  const size_t second = 12 + nb::test::tb_le(good, 0, 8) + 4;  // the second record's offset
  std::string bad = good;
  bad[second + 12 + 3] ^= 0x20;  // a data byte of the second record
  write_bytes(file, bad);
  TbFile tb;
  std::string err = nb::test::parse_event_file(file, &tb);
  EXPECT_NE(err.find("bad data CRC in the record at byte " + std::to_string(second)), std::string::npos) << err;

  bad = good;
  bad[second] ^= 0x01;  // the second record's length
  write_bytes(file, bad);
  err = nb::test::parse_event_file(file, &tb);
  EXPECT_NE(err.find("bad length CRC"), std::string::npos) << err;

  write_bytes(file, good.substr(0, good.size() - 2));  // a record cut short
  err = nb::test::parse_event_file(file, &tb);
  EXPECT_NE(err.find("truncated"), std::string::npos) << err;
  write_bytes(file, good);
  EXPECT_EQ(nb::test::parse_event_file(file, &tb), "");
}

TEST(TensorBoardEvent, FileNamePattern) {
  EXPECT_TRUE(nb::test::is_event_file_name("events.out.tfevents.1700000000.gpu-node.local.4242.nibble"));
  EXPECT_FALSE(nb::test::is_event_file_name("events.out.tfevents.170000000.host.4242.nibble"));  // 9 digits
  EXPECT_FALSE(nb::test::is_event_file_name("events.out.tfevents.1700000000.host.pid.nibble"));
  EXPECT_FALSE(nb::test::is_event_file_name("events.out.tfevents.1700000000.host.4242.nibble.tmp"));
}

TEST_F(TensorBoardWriterTest, TwoWritersInOneFolderGetTwoFiles) {
  TensorBoardWriter a, b;
  ASSERT_TRUE(a.open(path("tb")));
  ASSERT_TRUE(b.open(path("tb")));
  EXPECT_NE(a.path(), b.path());
  EXPECT_EQ(nb::test::event_files(path("tb")).size(), 2u);
}

TEST_F(TensorBoardWriterTest, RefusesAFolderItCannotCreate) {
  nb::test::write_text(path("file"), "not a folder");
  TensorBoardWriter w;
  Status st = w.open(path("file") + "/tb");
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find(path("file") + "/tb"), std::string::npos) << st.message();
  EXPECT_FALSE(w.add_scalar("lm loss", 1, 1.0f, 0.0).is_ok());
}
