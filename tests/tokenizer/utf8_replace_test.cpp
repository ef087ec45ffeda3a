// valid_utf8: ill-formed UTF-8 replaced by U+FFFD per maximal subpart. Every expected string below is what
// Python 3 prints for bytes.decode("utf-8", "replace") on the same input (computed once and written in).
#include <gtest/gtest.h>
#include <string>
#include "tokenizer/utf8.h"

using namespace nb;

namespace {
const std::string kFffd = "\xEF\xBF\xBD";

std::string fffd(int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += kFffd;
  return s;
}
}  // namespace

TEST(ValidUtf8, ValidTextIsUnchanged) {
  const std::string text = "h\xC3\xA9llo \xE2\x86\x92 \xF0\x9F\x98\x80 \xE6\x97\xA5\xE6\x9C\xAC";  // héllo → 😀 日本
  EXPECT_EQ(valid_utf8(text), text);
  EXPECT_EQ(valid_utf8(""), "");
  const std::string with_nul("a\0b", 3);  // a NUL byte is valid UTF-8 and stays
  EXPECT_EQ(valid_utf8(with_nul), with_nul);
  // The extremes of each length: U+0080, U+07FF, U+0800, U+D7FF, U+E000, U+FFFF, U+10000, U+10FFFF.
  const std::string edges =
      "\xC2\x80\xDF\xBF\xE0\xA0\x80\xED\x9F\xBF\xEE\x80\x80\xEF\xBF\xBF\xF0\x90\x80\x80\xF4\x8F\xBF\xBF";
  EXPECT_EQ(valid_utf8(edges), edges);
}

TEST(ValidUtf8, TruncatedSequencesAtTheEndBecomeOneReplacement) {
  EXPECT_EQ(valid_utf8("ab\xC3"), "ab" + kFffd);                  // 2-byte, 1 of 2
  EXPECT_EQ(valid_utf8("ab\xE2"), "ab" + kFffd);                  // 3-byte, 1 of 3
  EXPECT_EQ(valid_utf8("ab\xE2\x82"), "ab" + kFffd);              // 3-byte, 2 of 3
  EXPECT_EQ(valid_utf8("ab\xF0"), "ab" + kFffd);                  // 4-byte, 1 of 4
  EXPECT_EQ(valid_utf8("ab\xF0\x9F"), "ab" + kFffd);              // 4-byte, 2 of 4
  EXPECT_EQ(valid_utf8("ab\xF0\x9F\x98"), "ab" + kFffd);          // 4-byte, 3 of 4
  EXPECT_EQ(valid_utf8("\xC3\xA9\xF0\x9F"), "\xC3\xA9" + kFffd);  // é then 😀 cut after two bytes
}

TEST(ValidUtf8, TruncatedSequenceInsideTheTextEndsAtTheByteThatBreaksIt) {
  EXPECT_EQ(valid_utf8("\xE2\x82x"), kFffd + "x");
  EXPECT_EQ(valid_utf8("\xE2\x82\xE2\x82\xAC"), kFffd + "\xE2\x82\xAC");  // a cut one, then a whole €
}

TEST(ValidUtf8, LoneContinuationBytesAreReplacedOneEach) {
  EXPECT_EQ(valid_utf8("a\x80z"), "a" + kFffd + "z");
  EXPECT_EQ(valid_utf8("\x80\xBF"), fffd(2));
}

TEST(ValidUtf8, OverlongFormsAreReplacedBytePerByte) {
  EXPECT_EQ(valid_utf8(std::string("\xC0\x80", 2)), fffd(2));  // overlong NUL
  EXPECT_EQ(valid_utf8("\xE0\x80\xAF"), fffd(3));              // overlong '/'
  EXPECT_EQ(valid_utf8("\xF0\x80\x80\xAF"), fffd(4));
}

TEST(ValidUtf8, SurrogatesAndCodePointsAboveTheMaximumAreReplaced) {
  EXPECT_EQ(valid_utf8("\xED\xA0\x80"), fffd(3));      // U+D800
  EXPECT_EQ(valid_utf8("\xF4\x90\x80\x80"), fffd(4));  // U+110000
  EXPECT_EQ(valid_utf8("\xF5\x80"), fffd(2));          // F5 starts nothing
  EXPECT_EQ(valid_utf8("\xFF"), fffd(1));
}
