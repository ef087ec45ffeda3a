// Python's str.isspace() over UTF-8, and the counts built on it (see text_stats.h).
#include "eval/text_stats.h"
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace nb::eval {
namespace {

// Python's str.isspace(): the Unicode White_Space characters plus the ASCII separators 0x1c-0x1f,
// which Python counts as whitespace (bidirectional class B/S).
bool py_space(uint32_t c) {
  if (c <= 0x20) return c == 0x20 || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f);
  return c == 0x85 || c == 0xa0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
         c == 0x202f || c == 0x205f || c == 0x3000;
}

// The code point starting at s[i] and its byte length; an invalid or truncated sequence is one byte
// that is not whitespace.
uint32_t decode_at(std::string_view s, size_t i, size_t* len) {
  const auto b = static_cast<unsigned char>(s[i]);
  size_t n = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xe ? 3 : (b >> 3) == 0x1e ? 4 : 0;
  if (n == 0 || i + n > s.size()) {
    *len = 1;
    return 0xfffd;
  }
  uint32_t c = n == 1 ? b : n == 2 ? (b & 0x1f) : n == 3 ? (b & 0x0f) : (b & 0x07);
  for (size_t k = 1; k < n; ++k) {
    const auto t = static_cast<unsigned char>(s[i + k]);
    if ((t >> 6) != 0x2) {
      *len = 1;
      return 0xfffd;
    }
    c = (c << 6) | (t & 0x3f);
  }
  *len = n;
  return c;
}

}  // namespace

int64_t trailing_space_bytes(std::string_view s) {
  size_t i = 0, end_of_text = 0;  // the byte after the last non-space code point
  while (i < s.size()) {
    size_t len = 1;
    const uint32_t c = decode_at(s, i, &len);
    i += len;
    if (!py_space(c)) end_of_text = i;
  }
  return int64_t(s.size() - end_of_text);
}

int64_t count_code_points(std::string_view s) {
  int64_t n = 0;
  for (size_t i = 0, len = 1; i < s.size(); i += len, ++n) decode_at(s, i, &len);
  return n;
}

int64_t count_words(std::string_view s) {
  int64_t runs = 0;
  bool in_run = false;
  for (size_t i = 0, len = 1; i < s.size(); i += len) {
    const bool sp = py_space(decode_at(s, i, &len));
    if (sp && !in_run) ++runs;
    in_run = sp;
  }
  return runs + 1;
}

Status read_text_file(const std::string& path, std::string* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return errorf("cannot open %s: %s", path.c_str(), std::strerror(errno));
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) return errorf("cannot read %s: %s", path.c_str(), std::strerror(errno));
  *out = std::move(ss).str();
  return Status::ok();
}

}  // namespace nb::eval
