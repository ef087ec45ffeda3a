// Shared by the NVFP4 GPU tests: device storage that frees itself, and a quantizer view of such buffers.
#pragma once
#include <gtest/gtest.h>
#include <cuda_runtime.h>
#include <cstddef>
#include <cstdint>
#include <vector>
#include "formats/nvfp4/nvfp4.h"
#include "nvfp4/nvfp4_test_util.h"

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

// quantize_cuda_with_amax of x [rows, cols] with the amaxes amax[0] (row) and amax[1] (column) already in
// their slots, every output copied back.
// The device copies and the two amax slots (row, column) of a quantization into h.
inline void read_back(const DeviceBytes& rd, const DeviceBytes& rs, const DeviceBytes& cd, const DeviceBytes& cs,
                      const DeviceBytes& amax, HostQuantized* h) {
  rd.to_host(h->row_data.data());
  rs.to_host(h->row_scales.data());
  cd.to_host(h->col_data.data());
  cs.to_host(h->col_scales.data());
  float back[2];
  amax.to_host(back);
  h->row_amax = back[0];
  h->col_amax = back[1];
}

inline HostQuantized quantize_with_amax_on_gpu(const std::vector<bf16>& x, int64_t rows, int64_t cols,
                                               const Options& opts, const float amax[2]) {
  HostQuantized h{rows, cols};
  DeviceBytes dx(x.size() * sizeof(bf16), x.data());
  DeviceBytes rd(h.row_data.size()), rs(h.row_scales.size()), cd(h.col_data.size()), cs(h.col_scales.size());
  DeviceBytes damax(2 * sizeof(float), amax), flag(sizeof(int));
  QuantizedView v = view_of(rows, cols, rd, rs, cd, cs, damax, flag);
  const Status st = quantize_cuda_with_amax(dx.as<bf16>(), opts, v, nullptr);
  EXPECT_TRUE(st) << st.message();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  read_back(rd, rs, cd, cs, damax, &h);
  return h;
}

}  // namespace nb::nvfp4::testing
