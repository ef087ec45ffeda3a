// Benchmark of the CUDA NVFP4 quantizer on random non-zero BF16 input (CUDA events, warm-up,
// median over iterations). bytes_min = source read once + every enabled output written once
// (codes, scales, amaxes); GB/s = bytes_min / time. ms_copy times a device-to-device cudaMemcpy of
// bytes_min / 2 bytes (it reads and writes them: bytes_min moved), the bandwidth yardstick.
#pragma once
#include <cstdint>
#include "formats/nvfp4/nvfp4.h"

namespace nb::nvfp4 {

struct BenchResult {
  double ms_quantize = 0;  // the fused quantize pass alone (amax given)
  double ms_amax = 0;      // the amax pre-pass alone
  double ms_total = 0;     // amax pre-pass + quantize pass
  double ms_copy = 0;      // cudaMemcpy device-to-device of bytes_min / 2 bytes
  double bytes_min = 0;
};

Status bench_nvfp4_cuda(int64_t rows, int64_t cols, const Options& opts, int iters, BenchResult* result);

}  // namespace nb::nvfp4
