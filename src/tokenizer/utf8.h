// Text for display from token bytes: a token boundary can fall inside a multi-byte UTF-8 character (a
// continuation cut off by --max-new-tokens, or a model that emits a lone continuation byte), and a byte
// string printed as it is would then be invalid UTF-8.
#pragma once
#include <string>
#include <string_view>

namespace nb {

// `bytes` as valid UTF-8: every ill-formed sequence is replaced by U+FFFD, one per maximal subpart (the
// Unicode Standard's recommended practice, section 3.9), which is what Python's
// bytes.decode("utf-8", "replace") and Rust's String::from_utf8_lossy produce, and so what Hugging Face
// tokenizer.decode prints. Valid input comes back unchanged.
std::string valid_utf8(std::string_view bytes);

}  // namespace nb
