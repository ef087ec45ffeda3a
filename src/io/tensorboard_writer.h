// TensorBoard event files: the TFRecord framing TensorBoard reads, around serialized tensorflow.Event
// protobufs (io/tensorboard_event.proto). A file is named events.out.tfevents.<unix-time>.<host>.<pid>.nibble
// and holds records of
//   uint64 length (little endian) | uint32 masked CRC-32C of those 8 bytes | data | uint32 masked CRC-32C of data
// where mask(c) = ((c >> 15) | (c << 17)) + 0xa282ead8. The first record is an Event with file_version
// "brain.Event:2"; each scalar is then one Event {wall_time, step, summary {value {tag, simple_value}}}.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include "core/status.h"

namespace nb {

// CRC-32C (Castagnoli, reflected, as iSCSI and TFRecord use it): crc32c("123456789") = 0xE3069283.
uint32_t crc32c(const void* data, size_t bytes);
// The masked form TFRecord stores: a CRC of data that itself holds CRCs is not a CRC of zero.
uint32_t masked_crc32c(const void* data, size_t bytes);
// One framed record holding `data`.
std::string tfrecord_frame(std::string_view data);

class TensorBoardWriter {
 public:
  TensorBoardWriter() = default;
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  ~TensorBoardWriter();
  // Creates `dir` (with its parents) and a new event file in it, which starts with the file_version record.
  Status open(const std::string& dir);
  // One Event holding one scalar; it reaches the file at the latest at flush().
  Status add_scalar(const std::string& tag, int64_t step, float value, double wall_time);
  // Hands everything written so far to the operating system: a crash of this process loses none of it.
  Status flush();
  void close();
  bool is_open() const { return f_ != nullptr; }
  const std::string& path() const { return path_; }

 private:
  Status write_record(const std::string& data);
  std::FILE* f_ = nullptr;
  std::string path_;
};

}  // namespace nb
