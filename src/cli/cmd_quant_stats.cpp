// `nibble quant`'s error statistics (quant_stats.h).
#include "cli/quant_stats.h"
#include <cmath>
#include <cstdio>

namespace nb::cli {
namespace {

// Ratio beyond which a value at the largest code was clipped rather than rounded: (max + step/2) / max.
double clip_ratio(uint32_t max_mag) {
  if (max_mag == 0x7E) return 464.0 / 448.0;
  if (max_mag == 0x7B) return 61440.0 / 57344.0;
  return 7.0 / 6.0;  // E2M1
}

}  // namespace

// Elements of [outer, inner] codes at the largest magnitude whose input was beyond its rounding range.
int64_t count_saturated(const std::vector<float>& x, const std::vector<float>& x_hat, const std::vector<uint32_t>& mag,
                        uint32_t max_mag) {
  const double ratio = clip_ratio(max_mag);
  int64_t s = 0;
  for (size_t i = 0; i < x.size(); ++i)
    s += mag[i] == max_mag && std::fabs(double(x[i])) > std::fabs(double(x_hat[i])) * ratio;
  return s;
}

std::vector<float> transpose(const std::vector<float>& v, int64_t rows, int64_t cols) {  // [rows, cols] -> [cols, rows]
  std::vector<float> t(v.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = v[r * cols + c];
  return t;
}

// Adds a copy given its codes as bytes of 8-bit elements ([outer, inner]) and its dequantized values
// in the same layout; `transposed` copies are turned back to [rows, cols] for the statistics.
void add_fp8_copy(std::vector<CopyStats>* st, const std::string& name, const std::vector<float>& src,
                  const std::vector<uint8_t>& codes, std::vector<float> x_hat, uint32_t max_mag, bool transposed,
                  int64_t rows, int64_t cols) {
  std::vector<float> ref = transposed ? transpose(src, rows, cols) : src;
  std::vector<uint32_t> mag(codes.size());
  for (size_t i = 0; i < codes.size(); ++i) mag[i] = codes[i] & 0x7Fu;
  int64_t sat = count_saturated(ref, x_hat, mag, max_mag);
  if (transposed) {
    x_hat = transpose(x_hat, cols, rows);
    ref = src;
  }
  st->push_back({name, std::move(ref), std::move(x_hat), sat});
}

// Statistics over the finite inputs only: a NaN or Inf has no error to measure. Finite inputs whose
// copy came back non-finite (a NaN or Inf in their block, or in the tensor's amax) are counted and
// named below the table rather than turning every column into nan. "n/a" when nothing is left.
void print_stats(const std::vector<CopyStats>& st) {
  std::printf("%-34s %10s %12s %10s %12s\n", "copy", "SQNR dB", "rel L2", "flushed", "saturated");
  std::string lost_lines;
  for (const auto& c : st) {
    double sig = 0, err = 0;
    int64_t compared = 0, lost = 0, nonzero = 0, flushed = 0;
    for (size_t i = 0; i < c.ref.size(); ++i) {
      double x = c.ref[i], e = x - double(c.x_hat[i]);
      if (!std::isfinite(x)) continue;
      if (!std::isfinite(c.x_hat[i])) {
        ++lost;
        continue;
      }
      ++compared;
      sig += x * x;
      err += e * e;
      if (x != 0) {
        ++nonzero;
        flushed += c.x_hat[i] == 0.0f;
      }
    }
    if (lost)
      lost_lines += "  " + c.name + ": " + std::to_string(lost) +
                    " finite inputs came back NaN or Inf (a non-finite value shares their scale); left out above\n";
    if (compared == 0) {
      std::printf("%-34s %10s %12s %10s %12lld\n", c.name.c_str(), "n/a", "n/a", "n/a", (long long)c.saturated);
      continue;
    }
    double sqnr = err > 0 ? 10.0 * std::log10(sig / err) : INFINITY;
    std::printf("%-34s %10.2f %12.4e %9.4f%% %12lld\n", c.name.c_str(), sqnr, sig > 0 ? std::sqrt(err / sig) : 0.0,
                nonzero ? 100.0 * double(flushed) / double(nonzero) : 0.0, (long long)c.saturated);
  }
  std::printf(
      "saturated = clipped: code at the element format's largest magnitude and |x| beyond its rounding range\n");
  std::printf("%s", lost_lines.c_str());
}

int64_t count_nonfinite(const std::vector<bf16>& x) {
  int64_t n = 0;
  for (bf16 v : x) n += !std::isfinite(bf16_to_f32(v));
  return n;
}

}  // namespace nb::cli
