// Benchmark of the CUDA MXFP8, FP8 per-tensor (current scaling) and FP8 sub-channel quantizers on a
// random BF16 input, with a device-to-device copy of the same input buffer timed in the same run as
// the bandwidth yardstick. Times are medians over `iters` runs (CUDA events, after a warm-up).
// bytes = source read once + every output written once (codes of both copies, scales, amax).
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include "core/status.h"

namespace nb::fp8 {

struct QuantTiming {
  std::string name;
  double ms = 0;
  double bytes = 0;
};

struct FormatsBenchResult {
  double ms_copy = 0;                   // cudaMemcpy D2D of the BF16 input (rows*cols*2 bytes)
  double copy_bytes = 0;                // bytes moved by the copy: read + write
  std::vector<QuantTiming> quantizers;  // MXFP8 row+col, FP8 current e4m3 (amax + quantize), FP8 1x128, FP8 128x128
};

Status bench_formats_cuda(int64_t rows, int64_t cols, int iters, FormatsBenchResult* result);

}  // namespace nb::fp8
