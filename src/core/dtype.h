// The one list of element types. Names, sizes, safetensors names and dispatch are generated from
// NB_DTYPES so that adding a type touches one line.
//   X(enum, bits, name, safetensors name)
// e2m1 is packed: two elements per byte, element 2i in the low nibble.
// ue4m3 is E4M3 used as an unsigned block scale (NVFP4); e8m0 is a power-of-two scale (MXFP8).
#pragma once
#include <cstdint>
#include <string_view>

namespace nb {

#define NB_DTYPES(X)              \
  X(bf16, 16, "bf16", "BF16")     \
  X(f16, 16, "f16", "F16")        \
  X(f32, 32, "f32", "F32")        \
  X(e4m3, 8, "e4m3", "F8_E4M3")   \
  X(e5m2, 8, "e5m2", "F8_E5M2")   \
  X(e2m1, 4, "e2m1", "U8")        \
  X(ue4m3, 8, "ue4m3", "F8_E4M3") \
  X(e8m0, 8, "e8m0", "F8_E8M0")   \
  X(u8, 8, "u8", "U8")            \
  X(i32, 32, "i32", "I32")        \
  X(i64, 64, "i64", "I64")

enum class DType : uint8_t {
#define NB_X(e, bits, name, st) e,
  NB_DTYPES(NB_X)
#undef NB_X
};

constexpr int dtype_bits(DType t) {
  switch (t) {
#define NB_X(e, bits, name, st) \
  case DType::e: return bits;
    NB_DTYPES(NB_X)
#undef NB_X
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
#define NB_X(e, bits, name, st) \
  case DType::e: return name;
    NB_DTYPES(NB_X)
#undef NB_X
  }
  return "?";
}

constexpr std::string_view dtype_safetensors_name(DType t) {
  switch (t) {
#define NB_X(e, bits, name, st) \
  case DType::e: return st;
    NB_DTYPES(NB_X)
#undef NB_X
  }
  return "?";
}

// Bytes for n elements (packed types round up to whole bytes).
constexpr int64_t dtype_bytes(DType t, int64_t n) { return (n * dtype_bits(t) + 7) / 8; }

// Parses a name as printed by dtype_name; false if unknown.
bool dtype_from_name(std::string_view name, DType* out);

}  // namespace nb
