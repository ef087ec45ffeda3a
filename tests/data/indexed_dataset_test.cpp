// Megatron .bin/.idx: a file built by hand from the published byte layout, writer/reader round trip,
// and one corrupt-file case per validation rule (each must fail with a message naming the field).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include "data/data_test_util.h"
#include "data/indexed_dataset.h"

using namespace nb;

namespace {
std::filesystem::path temp_dir() {
  auto d = unique_temp("nibble_idx_test");
  std::filesystem::create_directories(d);
  return d;
}
void write_bytes(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}
std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}
template <typename T>
void put(std::vector<uint8_t>* b, T v) {
  uint8_t tmp[sizeof(T)];
  std::memcpy(tmp, &v, sizeof(T));
  b->insert(b->end(), tmp, tmp + sizeof(T));
}
// Two documents [7, 8, 9] and [65000, 1] as uint16, laid out byte by byte from the Megatron format table.
std::vector<uint8_t> hand_idx() {
  std::vector<uint8_t> b = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
  put<uint64_t>(&b, 1);  // version
  b.push_back(8);        // dtype code uint16
  put<uint64_t>(&b, 2);  // sequence count
  put<uint64_t>(&b, 3);  // document count
  put<int32_t>(&b, 3);
  put<int32_t>(&b, 2);  // lengths
  put<int64_t>(&b, 0);
  put<int64_t>(&b, 6);  // byte pointers
  put<int64_t>(&b, 0);
  put<int64_t>(&b, 1);
  put<int64_t>(&b, 2);  // document indices
  return b;
}
std::vector<uint8_t> hand_bin() {
  std::vector<uint8_t> b;
  for (uint16_t v : {7, 8, 9, 65000, 1}) put<uint16_t>(&b, v);
  return b;
}
}  // namespace

TEST(IndexedDataset, ReadsHandBuiltFile) {
  auto dir = temp_dir();
  std::string prefix = (dir / "hand").string();
  write_bytes(prefix + ".idx", hand_idx());
  write_bytes(prefix + ".bin", hand_bin());
  std::unique_ptr<IndexedDataset> ds;
  Status st = IndexedDataset::open(prefix, &ds);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(ds->sequence_count(), 2);
  EXPECT_EQ(ds->document_count(), 3);
  EXPECT_EQ(ds->dtype(), IndexedDtype::u16);
  std::vector<int32_t> t;
  ds->read(1, 0, -1, &t);
  EXPECT_EQ(t, (std::vector<int32_t>{65000, 1}));
  t.clear();
  ds->read(0, 1, 2, &t);
  EXPECT_EQ(t, (std::vector<int32_t>{8, 9}));
  std::filesystem::remove_all(dir);
}

TEST(IndexedDataset, WriterIsByteIdenticalToTheLayoutAndRoundTrips) {
  auto dir = temp_dir();
  std::string prefix = (dir / "w").string();
  std::unique_ptr<IndexedDatasetWriter> w;
  ASSERT_TRUE(IndexedDatasetWriter::create(prefix, token_dtype_for_vocab(50257), &w).is_ok());
  int32_t d0[] = {7, 8, 9}, d1[] = {65000, 1};
  ASSERT_TRUE(w->add_document(d0, 3).is_ok());
  ASSERT_TRUE(w->add_document(d1, 2).is_ok());
  ASSERT_TRUE(w->finalize().is_ok());
  EXPECT_EQ(read_bytes(prefix + ".idx"), hand_idx());
  EXPECT_EQ(read_bytes(prefix + ".bin"), hand_bin());
  // int32 for large vocabularies (Llama 3), read back exactly.
  std::string p32 = (dir / "w32").string();
  ASSERT_EQ(token_dtype_for_vocab(128256), IndexedDtype::i32);
  ASSERT_TRUE(IndexedDatasetWriter::create(p32, IndexedDtype::i32, &w).is_ok());
  int32_t big[] = {128000, 9906, 1917, 0, 128001};
  ASSERT_TRUE(w->add_document(big, 5).is_ok());
  ASSERT_TRUE(w->add_document(big, 0).is_ok());  // empty documents are legal
  ASSERT_TRUE(w->finalize().is_ok());
  std::unique_ptr<IndexedDataset> ds;
  ASSERT_TRUE(IndexedDataset::open(p32, &ds).is_ok());
  std::vector<int32_t> t;
  ds->read(0, 0, -1, &t);
  EXPECT_EQ(t, (std::vector<int32_t>(big, big + 5)));
  EXPECT_EQ(ds->sequence_length(1), 0);
  std::filesystem::remove_all(dir);
}

namespace {
// Writes the hand-built pair after `mutate` and expects open() to fail mentioning `field`.
void expect_rejected(const std::function<void(std::vector<uint8_t>*, std::vector<uint8_t>*)>& mutate,
                     const std::string& field) {
  auto dir = temp_dir();
  std::string prefix = (dir / "bad").string();
  auto idx = hand_idx(), bin = hand_bin();
  mutate(&idx, &bin);
  write_bytes(prefix + ".idx", idx);
  write_bytes(prefix + ".bin", bin);
  std::unique_ptr<IndexedDataset> ds;
  Status st = IndexedDataset::open(prefix, &ds);
  EXPECT_FALSE(st.is_ok()) << "accepted a file with a bad " << field;
  EXPECT_NE(st.message().find(field), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("bad."), std::string::npos) << "the message must name the file: " << st.message();
  std::filesystem::remove_all(dir);
}
}  // namespace

TEST(IndexedDatasetCorrupt, TruncatedHeader) {
  expect_rejected([](auto* i, auto*) { i->resize(20); }, "header truncated");
}
TEST(IndexedDatasetCorrupt, BadMagic) {
  expect_rejected([](auto* i, auto*) { (*i)[0] = 'X'; }, "magic");
}
TEST(IndexedDatasetCorrupt, BadVersion) {
  expect_rejected([](auto* i, auto*) { (*i)[9] = 2; }, "version");
}
TEST(IndexedDatasetCorrupt, UnknownDtype) {
  expect_rejected([](auto* i, auto*) { (*i)[17] = 9; }, "dtype");
}
TEST(IndexedDatasetCorrupt, FloatDtype) {
  expect_rejected([](auto* i, auto*) { (*i)[17] = 7; }, "dtype");
}
TEST(IndexedDatasetCorrupt, HugeCounts) {
  expect_rejected([](auto* i, auto*) { (*i)[25] = 0x7f; }, "sequence_count");
}
TEST(IndexedDatasetCorrupt, TooManyDocuments) {
  expect_rejected([](auto* i, auto*) { (*i)[26] = 4; }, "document_count");
}
TEST(IndexedDatasetCorrupt, TruncatedArrays) {
  expect_rejected([](auto* i, auto*) { i->pop_back(); }, "file size");
}
TEST(IndexedDatasetCorrupt, NegativeLength) {
  expect_rejected(
      [](auto* i, auto*) {
        int32_t v = -1;
        std::memcpy(i->data() + 34, &v, 4);
      },
      "sequence_lengths[0]");
}
TEST(IndexedDatasetCorrupt, WrongPointer) {
  expect_rejected([](auto* i, auto*) { (*i)[34 + 8 + 8] = 5; }, "sequence_pointers[1]");
}
TEST(IndexedDatasetCorrupt, BinTruncated) {
  expect_rejected([](auto*, auto* b) { b->pop_back(); }, "bad.bin");
}
TEST(IndexedDatasetCorrupt, BinMismatched) {
  expect_rejected(
      [](auto*, auto* b) {
        b->push_back(0);
        b->push_back(0);
      },
      "mismatched");
}
TEST(IndexedDatasetCorrupt, DocumentIndexNotStartingAtZero) {
  expect_rejected([](auto* i, auto*) { (*i)[34 + 24] = 1; }, "document_indices[0]");
}
TEST(IndexedDatasetCorrupt, DocumentIndexDecreasing) {
  expect_rejected([](auto* i, auto*) { (*i)[34 + 24 + 8] = 3; }, "document_indices[2]");
}
TEST(IndexedDatasetCorrupt, DocumentIndexLastNotCount) {
  expect_rejected([](auto* i, auto*) { (*i)[34 + 24 + 16] = 1; }, "document_indices[2]");
}
TEST(IndexedDatasetCorrupt, MissingBin) {
  auto dir = temp_dir();
  std::string prefix = (dir / "nobin").string();
  write_bytes(prefix + ".idx", hand_idx());
  std::unique_ptr<IndexedDataset> ds;
  Status st = IndexedDataset::open(prefix, &ds);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("nobin.bin"), std::string::npos) << st.message();
  std::filesystem::remove_all(dir);
}
