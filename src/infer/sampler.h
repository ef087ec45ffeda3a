// Choosing the next token from FP32 logits: greedy (temperature 0) or sampling with temperature, top-k and
// top-p (nucleus), applied in transformers' order: logits / temperature, keep the k largest, keep the
// smallest set of the most likely tokens whose probability reaches top_p, renormalize, draw.
// Reproducible: the uniform draw of sequence `row` at decode step `step` is Philox4x32-10 keyed by
// (seed, step, row) (core/philox.h), and candidates are ordered by (logit descending, id ascending), so
// the same seed and the same logits give the same token on any thread count or batch split.
#pragma once
#include <cstdint>
#include "core/status.h"

namespace nb::infer {

struct SamplingParams {
  float temperature = 0.f;  // 0: greedy
  int64_t top_k = 0;        // 0: no top-k
  float top_p = 1.f;        // 1: no top-p
  uint64_t seed = 0;
  bool greedy() const { return temperature == 0.f; }
};

// temperature >= 0 and finite, top_k >= 0, 0 < top_p <= 1; one sentence naming the flag otherwise.
Status validate(const SamplingParams& p);

// The next token of one sequence from its logits [V].
int32_t sample_token(const float* logits, int64_t V, const SamplingParams& p, uint32_t step, uint32_t row);

}  // namespace nb::infer
