// Typed reads of nlohmann::json fields that refuse a value of another type instead of converting it
// (nlohmann casts a float to an integer, which is undefined for large values: found by fuzzing).
// They throw std::invalid_argument naming the key; callers turn that into one sentence.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <nlohmann/json.hpp>

namespace nb {

inline const nlohmann::json& json_field(const nlohmann::json& j, const char* key) {
  if (!j.is_object() || !j.contains(key)) throw std::invalid_argument(std::string("no field \"") + key + "\"");
  return j[key];
}
inline int64_t json_int(const nlohmann::json& j, const char* key) {
  const nlohmann::json& v = json_field(j, key);
  if (!v.is_number_integer()) throw std::invalid_argument(std::string("\"") + key + "\" is not an integer");
  return v.get<int64_t>();
}
inline uint64_t json_uint(const nlohmann::json& j, const char* key) {
  const nlohmann::json& v = json_field(j, key);
  if (!v.is_number_unsigned()) throw std::invalid_argument(std::string("\"") + key + "\" is not a non-negative integer");
  return v.get<uint64_t>();
}
inline double json_number(const nlohmann::json& j, const char* key) {
  const nlohmann::json& v = json_field(j, key);
  if (!v.is_number()) throw std::invalid_argument(std::string("\"") + key + "\" is not a number");
  return v.get<double>();
}
inline bool json_bool(const nlohmann::json& j, const char* key) {
  const nlohmann::json& v = json_field(j, key);
  if (!v.is_boolean()) throw std::invalid_argument(std::string("\"") + key + "\" is not true or false");
  return v.get<bool>();
}
inline std::string json_string(const nlohmann::json& j, const char* key) {
  const nlohmann::json& v = json_field(j, key);
  if (!v.is_string()) throw std::invalid_argument(std::string("\"") + key + "\" is not a string");
  return v.get<std::string>();
}

}  // namespace nb
