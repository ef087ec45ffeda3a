// Learning-rate schedules as Megatron defines them: linear warmup from 0, then cosine, linear,
// constant, or warmup-stable-decay (WSD: hold the peak, then decay over the last N steps).
#pragma once
#include <cstdint>
#include <string>

namespace nb {

struct LrSchedule {
  double lr = 3e-4, min_lr = 3e-5;
  int64_t warmup = 0, decay_iters = 1, wsd_decay_iters = 0;
  std::string style = "cosine";
  // LR for optimizer step `it` (0-based: the first update uses it = 0).
  double at(int64_t it) const;
};

}  // namespace nb
