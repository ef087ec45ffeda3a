// Shared precondition checks and element access for the ops layer (host side, no CUDA headers).
// Every op validates its views here so a wrong shape or dtype fails with one sentence naming the op.
#pragma once
#include <cstdint>
#include "core/bf16.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace nb::ops::detail {

inline void check_contiguous(const char* op, const char* name, const Tensor& t) {
  NB_CHECK(t.data != nullptr || t.numel() == 0, "%s: tensor '%s' has no data", op, name);
  NB_CHECK(t.is_contiguous(), "%s: tensor '%s' %s must be contiguous", op, name, t.shape_str().c_str());
}

inline void check_dtype(const char* op, const char* name, const Tensor& t, DType want) {
  NB_CHECK(t.dtype == want, "%s: tensor '%s' must be %s, got %s", op, name, std::string(dtype_name(want)).c_str(),
           std::string(dtype_name(t.dtype)).c_str());
}

// Activations on the CPU backend are FP32; on CUDA they are BF16 or FP32.
inline void check_float(const char* op, const char* name, const Tensor& t) {
  if (t.device == Device::cpu)
    check_dtype(op, name, t, DType::f32);
  else
    NB_CHECK(t.dtype == DType::bf16 || t.dtype == DType::f32, "%s: tensor '%s' must be bf16 or f32, got %s", op, name,
             std::string(dtype_name(t.dtype)).c_str());
}

inline void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  NB_CHECK(a.device == b.device, "%s: tensors on different devices (%s vs %s)", op, device_name(a.device),
           device_name(b.device));
}

inline void check_numel(const char* op, const char* name, const Tensor& t, int64_t want) {
  NB_CHECK(t.numel() == want, "%s: tensor '%s' %s must have %lld elements", op, name, t.shape_str().c_str(),
           (long long)want);
}

// Rows x columns of a contiguous tensor whose last dimension is the row.
inline int64_t rows_of(const Tensor& t) { return t.ndim == 0 ? 1 : t.numel() / t.shape[t.ndim - 1]; }
inline int64_t cols_of(const Tensor& t) { return t.ndim == 0 ? 1 : t.shape[t.ndim - 1]; }

// Host element access for the few host paths that accept either float type.
inline float load_host(const Tensor& t, int64_t i) {
  return t.dtype == DType::bf16 ? bf16_to_f32(t.ptr<bf16>()[i]) : t.ptr<float>()[i];
}
inline void store_host(const Tensor& t, int64_t i, float v) {
  if (t.dtype == DType::bf16)
    t.ptr<bf16>()[i] = f32_to_bf16(v);
  else
    t.ptr<float>()[i] = v;
}

[[noreturn]] inline void no_cuda(const char* op) {
  NB_CHECK(false,
           "%s: tensor is on cuda but this nibble was built without the CUDA backend; rebuild with the "
           "CUDA toolkit installed",
           op);
  __builtin_unreachable();
}

}  // namespace nb::ops::detail

// In a dispatcher: hands a cuda tensor to the CUDA launcher, or fails clearly in a CPU-only build.
#if defined(NIBBLE_HAVE_CUDA)
#define NB_OPS_CUDA(op, call) return call
#else
#define NB_OPS_CUDA(op, call) ::nb::ops::detail::no_cuda(op)
#endif
