// Helpers for GPU tests: skip with a visible reason when no GPU is usable.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <string>
#include "core/tensor.h"

#define NB_REQUIRE_GPU()                                                                \
  do {                                                                                  \
    std::string nb_why_;                                                                \
    if (!::nb::cuda_device_available(&nb_why_)) GTEST_SKIP() << "skipped: " << nb_why_; \
  } while (0)

namespace nb::test {
// The CUDA devices this process sees (0 when they cannot be counted): multi-GPU tests skip below their need.
inline int visible_gpus() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}
}  // namespace nb::test
