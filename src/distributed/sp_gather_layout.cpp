// The gathered column-wise copies of sequence parallelism in the whole tensor's layout (sp_gather_layout.h).
#include "distributed/sp_gather_layout.h"
#include <cstring>

namespace nb::dist {

void interleave_column_shards(const uint8_t* gathered, int ranks, int64_t cols, int64_t shard_bytes, uint8_t* whole) {
  const int64_t whole_row = int64_t(ranks) * shard_bytes;
  for (int r = 0; r < ranks; ++r) {
    const uint8_t* shard = gathered + int64_t(r) * cols * shard_bytes;
    for (int64_t c = 0; c < cols; ++c)
      std::memcpy(whole + c * whole_row + r * shard_bytes, shard + c * shard_bytes, size_t(shard_bytes));
  }
}

}  // namespace nb::dist
