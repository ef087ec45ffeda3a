// Text measures the evaluation needs with Python's exact semantics, since lm-evaluation-harness defines
// them in Python: whitespace is str.isspace() (also what `re`'s \s matches in str patterns), a string's
// length is its code-point count, a word count is len(re.split(r"\s+", text)). Also: a whole file read.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include "core/status.h"

namespace nb::eval {

// Bytes of trailing whitespace (Python: len(s) - len(s.rstrip()), in UTF-8 bytes).
int64_t trailing_space_bytes(std::string_view s);
// Code points of UTF-8 text (Python's len(str)); an invalid byte counts as one.
int64_t count_code_points(std::string_view s);
// len(re.split(r"\s+", s)): whitespace runs + 1, so "" is one word and leading/trailing runs count.
int64_t count_words(std::string_view s);
// The bytes of a file, or one sentence saying why not.
Status read_text_file(const std::string& path, std::string* out);

}  // namespace nb::eval
