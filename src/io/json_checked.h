// Typed reads of nlohmann::json fields that refuse a value of another type instead of converting it
// (nlohmann casts a float to an integer, which is undefined for large values: found by fuzzing).
// They throw std::invalid_argument naming the key; callers turn that into one sentence.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <nlohmann/json.hpp>

namespace nb {

inline const nlohmann::json& json_field(const nlohmann::json& j, const char* key) {
  if (!j.is_object() || !j.contains(key)) throw std::invalid_argument(std::string("no field \"") + key + "\"");
  return j[key];
}
// The field `key` after checking its type with `is` (nlohmann's is_number_integer, is_string, ...).
inline const nlohmann::json& json_typed(const nlohmann::json& j, const char* key,
                                        bool (nlohmann::json::*is)() const noexcept, const char* what) {
  const nlohmann::json& v = json_field(j, key);
  if (!(v.*is)()) throw std::invalid_argument(std::string("\"") + key + "\" is not " + what);
  return v;
}
inline int64_t json_int(const nlohmann::json& j, const char* key) {
  return json_typed(j, key, &nlohmann::json::is_number_integer, "an integer").get<int64_t>();
}
inline uint64_t json_uint(const nlohmann::json& j, const char* key) {
  return json_typed(j, key, &nlohmann::json::is_number_unsigned, "a non-negative integer").get<uint64_t>();
}
inline double json_number(const nlohmann::json& j, const char* key) {
  return json_typed(j, key, &nlohmann::json::is_number, "a number").get<double>();
}
// A float field: a number within float's range (converting a larger double to float is undefined), or
// null, which is how nlohmann writes a non-finite float, read back as NaN.
inline float json_float_value(const nlohmann::json& v, const char* key) {
  if (v.is_null()) return std::numeric_limits<float>::quiet_NaN();
  if (!v.is_number()) throw std::invalid_argument(std::string("\"") + key + "\" holds a value that is not a number");
  const double d = v.get<double>();
  if (std::fabs(d) > double(std::numeric_limits<float>::max()))
    throw std::invalid_argument(std::string("\"") + key + "\" holds " + std::to_string(d) + ", outside float's range");
  return float(d);
}
inline float json_float(const nlohmann::json& j, const char* key) { return json_float_value(json_field(j, key), key); }
inline bool json_bool(const nlohmann::json& j, const char* key) {
  return json_typed(j, key, &nlohmann::json::is_boolean, "true or false").get<bool>();
}
inline std::string json_string(const nlohmann::json& j, const char* key) {
  return json_typed(j, key, &nlohmann::json::is_string, "a string").get<std::string>();
}

}  // namespace nb
