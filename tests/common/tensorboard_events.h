// Reads a TensorBoard event file the way TensorBoard does, without Python: each record's length, both
// masked CRC-32Cs (length and data), then the Event protobuf through the classes generated from
// src/io/tensorboard_event.proto. The framing is parsed here by hand, not with io's read_tfrecords, so
// the writer's tests do not check the writer's framing with its own reader.
#pragma once
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>
#include "io/tensorboard_event.pb.h"
#include "io/tensorboard_writer.h"

namespace nb::test {

struct TbScalar {
  std::string tag;
  int64_t step = 0;
  float value = 0;
  double wall_time = 0;
};

struct TbFile {
  std::string file_version;  // from the first record
  std::vector<TbScalar> scalars;
};

inline uint64_t tb_le(const std::string& s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + size_t(i)]);
  return v;
}

// Parses `path` into `out`; returns "" or what was wrong, with the record's byte offset.
inline std::string parse_event_file(const std::string& path, TbFile* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "cannot open " + path;
  const std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  *out = TbFile{};
  size_t at = 0;
  for (int record = 0; at < s.size(); ++record) {
    const std::string where = " in the record at byte " + std::to_string(at);
    if (s.size() - at < 16) return "truncated header" + where;
    const uint64_t len = tb_le(s, at, 8);
    if (tb_le(s, at + 8, 4) != nb::masked_crc32c(s.data() + at, 8)) return "bad length CRC" + where;
    if (len > s.size() - at - 16) return "truncated data" + where;
    const std::string data = s.substr(at + 12, len);
    if (tb_le(s, at + 12 + len, 4) != nb::masked_crc32c(data.data(), data.size())) return "bad data CRC" + where;
    nb::tensorboard::Event e;
    if (!e.ParseFromString(data)) return "not an Event protobuf" + where;
    if (record == 0) {
      if (e.what_case() != nb::tensorboard::Event::kFileVersion) return "the first record has no file_version";
      out->file_version = e.file_version();
    } else {
      if (e.what_case() != nb::tensorboard::Event::kSummary) return "an Event without a summary" + where;
      for (const auto& v : e.summary().value()) {
        if (v.value_case() != nb::tensorboard::Summary::Value::kSimpleValue)
          return "a value without simple_value" + where;
        out->scalars.push_back({v.tag(), e.step(), v.simple_value(), e.wall_time()});
      }
    }
    at += 12 + len + 4;
  }
  return "";
}

// True for events.out.tfevents.<10-digit unix time>.<host>.<pid>.nibble, the name TensorBoard's reader
// and nibble's writer use (checked by hand: GCC 12's <regex> warns under the sanitizer build).
inline bool is_event_file_name(const std::string& n) {
  const std::string head = "events.out.tfevents.", tail = ".nibble";
  if (n.size() < head.size() + 10 + 5 + tail.size() || n.rfind(head, 0) != 0) return false;
  if (n.compare(n.size() - tail.size(), tail.size(), tail) != 0) return false;
  const auto digits = [](const std::string& s) { return !s.empty() && s.find_first_not_of("0123456789") == s.npos; };
  const std::string rest = n.substr(head.size(), n.size() - head.size() - tail.size());  // time.host.pid
  const size_t first = rest.find('.'), last = rest.rfind('.');
  return first == 10 && last > first + 1 && digits(rest.substr(0, 10)) && digits(rest.substr(last + 1));
}

// The event files in `dir`.
inline std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (is_event_file_name(e.path().filename().string())) out.push_back(e.path().string());
  return out;
}

}  // namespace nb::test
