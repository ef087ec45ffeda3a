// One JSONL document (Megatron's preprocess_data.py input): a JSON object per line whose string field
// `key` (default "text") holds the document.
#pragma once
#include <string>
#include "core/status.h"

namespace nb {

// The string field `key` of the JSON object on `line`; an error says what the line is instead.
Status jsonl_field(const std::string& line, const std::string& key, std::string* text);

}  // namespace nb
