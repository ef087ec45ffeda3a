// jsonl_field: nlohmann-json without exceptions (a malformed line is data, not a bug).
#include "data/jsonl.h"
#include <nlohmann/json.hpp>

namespace nb {

Status jsonl_field(const std::string& line, const std::string& key, std::string* text) {
  const auto j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded()) return errorf("not valid JSON");
  if (!j.is_object()) return errorf("not a JSON object");
  const auto it = j.find(key);
  if (it == j.end()) return errorf("no field \"%s\"", key.c_str());
  if (!it->is_string()) return errorf("field \"%s\" is not a string", key.c_str());
  *text = it->get<std::string>();
  return Status::ok();
}

}  // namespace nb
