// Megatron indexed datasets: PREFIX.bin (raw tokens, no header) + PREFIX.idx (little-endian, packed):
//   [0,9) magic "MMIDIDX\0\0" | [9,17) u64 version = 1 | [17] u8 dtype code | [18,26) u64 sequence count N
//   | [26,34) u64 document count D | int32 lengths[N] | int64 byte pointers[N] | int64 document indices[D]
// Arrays start at offset 34 and are therefore misaligned: every access goes through memcpy.
// The reader memory-maps both files and validates every field against the file sizes before use;
// the writer produces byte-identical files to Megatron's tools/preprocess_data.py.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>
#include "core/status.h"

namespace nb {

// Megatron's DType codes.
enum class IndexedDtype : uint8_t { u8 = 1, i8 = 2, i16 = 3, i32 = 4, i64 = 5, f64 = 6, f32 = 7, u16 = 8 };
int64_t indexed_dtype_size(IndexedDtype d);  // 0 for an unknown code
// Megatron's rule for token files: uint16 if vocab < 65500, else int32.
IndexedDtype token_dtype_for_vocab(int64_t vocab_size);

class IndexedDataset {
 public:
  IndexedDataset() = default;
  ~IndexedDataset();
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  // Opens PREFIX.idx and PREFIX.bin; every inconsistency is an error naming the file and field.
  static Status open(const std::string& prefix, std::unique_ptr<IndexedDataset>* out);

  int64_t sequence_count() const { return n_; }
  int64_t document_count() const { return d_; }  // number of entries in document_indices (= documents + 1)
  IndexedDtype dtype() const { return dtype_; }
  const std::string& prefix() const { return prefix_; }
  int32_t sequence_length(int64_t i) const;
  int64_t sequence_pointer(int64_t i) const;
  int64_t document_index(int64_t i) const;
  const std::vector<int32_t>& sequence_lengths() const { return lengths_; }
  // Appends `length` tokens of sequence i starting at token `offset` (length < 0: to the end).
  void read(int64_t i, int64_t offset, int64_t length, std::vector<int32_t>* out) const;
  // Smallest and largest token id in the whole .bin (one pass over the mapped file).
  void token_id_range(int64_t* min_id, int64_t* max_id) const;
  size_t bin_bytes() const { return bin_size_; }

 private:
  std::string prefix_;
  IndexedDtype dtype_ = IndexedDtype::u16;
  int64_t n_ = 0, d_ = 0;
  const uint8_t* idx_ = nullptr;
  const uint8_t* bin_ = nullptr;
  size_t idx_size_ = 0, bin_size_ = 0;
  std::vector<int32_t> lengths_;  // copied once: the samplers walk them many times
};

// Streams documents into PREFIX.bin / PREFIX.idx exactly like Megatron's IndexedDatasetBuilder
// (add_document per document, one sequence per document, then finalize).
class IndexedDatasetWriter {
 public:
  ~IndexedDatasetWriter();
  static Status create(const std::string& prefix, IndexedDtype dtype, std::unique_ptr<IndexedDatasetWriter>* out);
  Status add_document(const int32_t* tokens, int64_t count);
  // A document that produced no tokens: Megatron still records it in document_indices (repeating the
  // previous sequence count) but writes no sequence.
  void add_empty_document() { doc_indices_.push_back(static_cast<int64_t>(lengths_.size())); }
  Status finalize();  // writes the .idx and closes both files
  int64_t bytes_written() const { return bin_bytes_; }

 private:
  std::string prefix_;
  IndexedDtype dtype_ = IndexedDtype::u16;
  FILE* bin_ = nullptr;
  int64_t bin_bytes_ = 0;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> doc_indices_{0};
  std::vector<uint8_t> scratch_;
};

}  // namespace nb
