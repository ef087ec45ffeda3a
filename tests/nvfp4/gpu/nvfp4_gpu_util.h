// Shared by the NVFP4 GPU tests: device storage that frees itself, and a quantizer view of such buffers.
#pragma once
#include <gtest/gtest.h>
#include <cuda_runtime.h>
#include <cstddef>
#include <cstdint>
#include "formats/nvfp4/nvfp4.h"

namespace nb::nvfp4::testing {

// Device storage (zero-filled, or a copy of src), freed on scope exit.
struct DeviceBytes {
  void* p = nullptr;
  size_t n = 0;
  explicit DeviceBytes(size_t bytes, const void* src = nullptr) : n(bytes) {
    EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    if (src)
      EXPECT_EQ(cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    else
      EXPECT_EQ(cudaMemset(p, 0, bytes), cudaSuccess);
  }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  ~DeviceBytes() { cudaFree(p); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
  void to_host(void* dst) const { EXPECT_EQ(cudaMemcpy(dst, p, n, cudaMemcpyDeviceToHost), cudaSuccess); }
};

inline  // Both copies, the two amax slots (amax[0] row, amax[1] column) and the flag, in device buffers.
    QuantizedView
    view_of(int64_t rows, int64_t cols, const DeviceBytes& rd, const DeviceBytes& rs, const DeviceBytes& cd,
            const DeviceBytes& cs, const DeviceBytes& amax, const DeviceBytes& flag) {
  QuantizedView v;
  v.rows = rows;
  v.cols = cols;
  v.row_data = rd.as<uint8_t>();
  v.row_scales = rs.as<uint8_t>();
  v.col_data = cd.as<uint8_t>();
  v.col_scales = cs.as<uint8_t>();
  v.row_amax = amax.as<float>();
  v.col_amax = amax.as<float>() + 1;
  v.nonfinite = flag.as<int>();
  return v;
}

}  // namespace nb::nvfp4::testing
