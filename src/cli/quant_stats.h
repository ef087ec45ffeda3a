// The error statistics `nibble quant` prints for every copy a format makes (cmd_quant_stats.cpp): SQNR,
// relative L2, the flushed share of the non-zero inputs and the saturated (clipped) count, over the finite
// inputs (cmd_quant.cpp's header comment defines each).
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include "core/bf16.h"

namespace nb::cli {

// One quantized copy, seen in the source's [rows, cols] orientation for the statistics.
struct CopyStats {
  std::string name;
  std::vector<float> ref, x_hat;  // ref = what the copy encodes (the source, or its RHT)
  int64_t saturated = 0;
};

// Elements of [outer, inner] codes at the largest magnitude (mag: each code without its sign bit) whose input
// was beyond that value's rounding range.
int64_t count_saturated(const std::vector<float>& x, const std::vector<float>& x_hat, const std::vector<uint32_t>& mag,
                        uint32_t max_mag);
std::vector<float> transpose(const std::vector<float>& v, int64_t rows, int64_t cols);  // [rows, cols] -> [cols, rows]
// Adds a copy given its codes as bytes of 8-bit elements ([outer, inner]) and its dequantized values
// in the same layout; `transposed` copies are turned back to [rows, cols] for the statistics.
void add_fp8_copy(std::vector<CopyStats>* st, const std::string& name, const std::vector<float>& src,
                  const std::vector<uint8_t>& codes, std::vector<float> x_hat, uint32_t max_mag, bool transposed,
                  int64_t rows, int64_t cols);
// The table, one line per copy, and the copies whose finite inputs came back non-finite.
void print_stats(const std::vector<CopyStats>& st);
int64_t count_nonfinite(const std::vector<bf16>& x);

}  // namespace nb::cli
