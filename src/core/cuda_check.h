// CUDA_CHECK and friends for programming errors in CUDA code (always on). Recoverable CUDA failures
// such as out of memory are turned into a Status by the caller instead.
#pragma once
#include <cuda_runtime.h>
#include "core/status.h"

#define CUDA_CHECK(expr)                                                                                     \
  do {                                                                                                       \
    cudaError_t nb_e_ = (expr);                                                                              \
    NB_CHECK(nb_e_ == cudaSuccess, "CUDA error %s: %s", cudaGetErrorName(nb_e_), cudaGetErrorString(nb_e_)); \
  } while (0)

// After a kernel launch: catches bad launch configurations at once.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
