// Megatron's OptimizerParamScheduler.get_lr, written out: warmup is (it+1)/warmup of the peak.
#include "train/lr_schedule.h"
#include <algorithm>
#include <cmath>

namespace nb {

double LrSchedule::at(int64_t it) const {
  if (warmup > 0 && it < warmup) return lr * double(it + 1) / double(warmup);
  if (style == "constant") return lr;
  if (it >= decay_iters) return min_lr;
  if (style == "wsd") {
    int64_t decay_start = decay_iters - wsd_decay_iters;
    if (it < decay_start) return lr;
    double r = double(it - decay_start) / double(std::max<int64_t>(wsd_decay_iters, 1));
    return min_lr + (lr - min_lr) * (1.0 - r);
  }
  double r = double(it - warmup) / double(std::max<int64_t>(decay_iters - warmup, 1));
  double coeff = style == "linear" ? 1.0 - r : 0.5 * (std::cos(M_PI * r) + 1.0);
  return min_lr + coeff * (lr - min_lr);
}

}  // namespace nb
