// Refuses data whose token ids do not fit the model's vocabulary before the first step: an id past the
// vocabulary would abort the CPU embedding after a step or two and, on CUDA, be read as a zero row and
// a dropped target, a run that looks healthy and learns the wrong thing. One pass over each .bin of the
// blend finds its id range; the result is cached beside the index cache under the file's size and
// modification time, so a dataset is scanned once.
#pragma once
#include <cstdint>
#include <string>
#include "core/status.h"

namespace nb {

struct TokenRange {
  int64_t min_id = 0, max_id = -1;  // max < min: no tokens
  bool cached = false;              // read from the cache (no scan)
  double scan_ms = 0;
};

// The id range of PREFIX.bin; cache_dir "" or "none" disables the cache.
Status dataset_token_range(const std::string& prefix, const std::string& cache_dir, TokenRange* out);
// Every dataset of the blend `data_path` against [0, vocab): one sentence naming the file, the
// offending id and the vocabulary, and what to do. cache_path as DataConfig::cache_path.
Status check_dataset_vocab(const std::string& data_path, const std::string& cache_path, int64_t vocab,
                           const std::string& model_name);

}  // namespace nb
