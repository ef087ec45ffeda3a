// Helpers for the CUDA ops tests: device tensors filled from host FP32 vectors (stored as BF16 or
// FP32), read back as FP32, and BF16 rounding of host data so the CPU reference sees the same inputs.
#pragma once
#include <gtest/gtest.h>
#include <cstring>
#include <vector>
#include "core/bf16.h"
#include "core/tensor.h"

namespace nb::ops::testing {

struct DeviceTensor {
  Buffer buf;
  const Tensor& t() const { return buf.tensor(); }
};

inline DeviceTensor upload(const std::vector<float>& host, DType dt, std::initializer_list<int64_t> dims) {
  DeviceTensor d;
  Status st = Buffer::allocate(&d.buf, dt, Device::cuda, dims);
  NB_CHECK(st.is_ok(), "%s", st.message().c_str());
  NB_CHECK(int64_t(host.size()) == d.t().numel(), "upload: size mismatch");
  if (dt == DType::bf16) {
    std::vector<bf16> tmp(host.size());
    for (size_t i = 0; i < host.size(); ++i) tmp[i] = f32_to_bf16(host[i]);
    NB_CHECK(copy_bytes(d.buf.data(), Device::cuda, tmp.data(), Device::cpu, tmp.size() * 2).is_ok());
  } else {
    NB_CHECK(copy_bytes(d.buf.data(), Device::cuda, host.data(), Device::cpu, host.size() * 4).is_ok());
  }
  return d;
}

inline DeviceTensor upload_i32(const std::vector<int32_t>& host, std::initializer_list<int64_t> dims) {
  DeviceTensor d;
  NB_CHECK(Buffer::allocate(&d.buf, DType::i32, Device::cuda, dims).is_ok());
  NB_CHECK(copy_bytes(d.buf.data(), Device::cuda, host.data(), Device::cpu, host.size() * 4).is_ok());
  return d;
}

// Copies a device tensor back (synchronous with the default stream) and widens BF16 to FP32.
inline std::vector<float> download(const Tensor& t) {
  std::vector<float> out(size_t(t.numel()));
  if (t.dtype == DType::bf16) {
    std::vector<bf16> tmp(out.size());
    NB_CHECK(copy_bytes(tmp.data(), Device::cpu, t.data, Device::cuda, tmp.size() * 2).is_ok());
    for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_to_f32(tmp[i]);
  } else {
    NB_CHECK(t.dtype == DType::f32);
    NB_CHECK(copy_bytes(out.data(), Device::cpu, t.data, Device::cuda, out.size() * 4).is_ok());
  }
  return out;
}

inline std::vector<float> rounded(std::vector<float> v, DType dt) {
  if (dt == DType::bf16)
    for (float& x : v) x = round_to_bf16(x);
  return v;
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// Counts elements with |got - want| > rel * |want| + abs_tol[i]; reports the first few.
inline int64_t count_bad(const std::vector<float>& got, const std::vector<float>& want, double rel,
                         const std::vector<double>& abs_tol, const char* what) {
  int64_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    double tol = rel * std::fabs(double(want[i])) + abs_tol[abs_tol.size() == 1 ? 0 : i];
    if (!(std::fabs(double(got[i]) - double(want[i])) <= tol)) {
      if (bad < 5) ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << " want " << want[i] << " tol " << tol;
      ++bad;
    }
  }
  return bad;
}

// Single rounding of an FP32 result to BF16 is off by at most 2^-9 relative; 2^-8 leaves room for the
// few-ulp FP32 differences between the CUDA and CPU math (expf, reduction order).
constexpr double kBf16Rel = 0x1p-8;

}  // namespace nb::ops::testing
