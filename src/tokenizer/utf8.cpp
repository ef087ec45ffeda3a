// valid_utf8 (see utf8.h): a decoder that follows the Unicode Standard's table of well-formed byte
// sequences (Table 3-7), so overlong forms, surrogates and code points above U+10FFFF are refused at
// the first byte that rules them out, as Python's and Rust's decoders refuse them.
#include "tokenizer/utf8.h"

namespace nb {

namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// The continuation bytes a lead byte needs and the range its first continuation may take (E0 excludes
// overlong forms, ED surrogates, F0 overlong forms, F4 code points above U+10FFFF); 0 = not a lead byte.
int continuations(unsigned char lead, unsigned char* lo, unsigned char* hi) {
  *lo = 0x80;
  *hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) return 1;
  if (lead >= 0xE0 && lead <= 0xEF) {
    if (lead == 0xE0) *lo = 0xA0;
    if (lead == 0xED) *hi = 0x9F;
    return 2;
  }
  if (lead >= 0xF0 && lead <= 0xF4) {
    if (lead == 0xF0) *lo = 0x90;
    if (lead == 0xF4) *hi = 0x8F;
    return 3;
  }
  return 0;  // 80..C1 (a continuation, or an overlong two-byte lead) and F5..FF start no character
}

}  // namespace

std::string valid_utf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    const unsigned char lead = static_cast<unsigned char>(bytes[i]);
    if (lead < 0x80) {
      out += char(lead);
      ++i;
      continue;
    }
    unsigned char lo, hi;
    const int need = continuations(lead, &lo, &hi);
    // The maximal subpart: the lead byte and the continuations that fit, up to the first byte that does not
    // (which starts the next sequence) or the end of the input.
    int got = 0;
    while (got < need && i + 1 + size_t(got) < bytes.size()) {
      const unsigned char b = static_cast<unsigned char>(bytes[i + 1 + size_t(got)]);
      if (b < lo || b > hi) break;
      lo = 0x80, hi = 0xBF;
      ++got;
    }
    if (need > 0 && got == need)
      out.append(bytes.substr(i, size_t(need) + 1));
    else
      out.append(kReplacement);
    i += size_t(got) + 1;
  }
  return out;
}

}  // namespace nb
