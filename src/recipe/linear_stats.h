// Optional quantization statistics of a Linear's operands (set_collect_stats): per role, over the
// row-wise copy of every quantization since the last take_health:
//   flushed   share of non-zero source elements that dequantize to 0 (underflow)
//   saturated share of elements stored at the format's largest magnitude code (clipped or at the top
//             of the range: e4m3 448, e5m2 57344, e2m1 6 times the block/tensor scale)
//   sqnr_db   10 log10(sum x^2 / sum (x - x_hat)^2) with x the BF16 source, x_hat the dequantized copy
// The report is the worst role (largest flushed/saturated, smallest SQNR). Computed on the host from
// copies of the device data (a synchronizing diagnostic, not for every step).
#pragma once
#include <cstdint>
#include "core/bf16.h"
#include "core/status.h"
#include "core/stream.h"
#include "recipe/linear.h"

namespace nb::recipe {

struct QCopies;

class StatsAccumulator {
 public:
  // src: the BF16 source the copies were made from (device memory when c.dev is cuda).
  Status add(const QCopies& c, const bf16* src, Stream stream);
  void take(LinearHealth* out);  // fills flushed/saturated/sqnr_db/has_stats, then resets

 private:
  struct Sums {
    double sig = 0, err = 0;
    int64_t n = 0, nonzero = 0, flushed = 0, saturated = 0;
  };
  Sums roles_[3];
};

}  // namespace nb::recipe
