// Sequence parallelism all-gathers an activation's quantized copies over the T tensor-parallel ranks instead of
// gathering BF16 and quantizing again: rank r holds rows [r*R, (r+1)*R) (its tokens) quantized with the whole
// tensor's amax (the local amaxes all-reduced with MAX first), which gives exactly the bytes the whole tensor's
// quantization gives those rows. The row-wise pieces (data, per-row block scales) then follow each other in the
// gathered buffer as in the whole tensor; a transposed (column-wise) piece does not: each column's bytes are cut
// into T pieces, one per rank. interleave_column_shards lays a gathered transposed copy out as the whole one
// (TransformerEngine fixes NVFP4's column-wise layout after its gather the same way). Pure byte moves; the
// CUDA gather will do the same with one strided copy per rank.
#pragma once
#include <cstddef>
#include <cstdint>

namespace nb::dist {

// gathered: `ranks` shards back to back, each [cols, shard_bytes] (row c of shard r: its shard_bytes bytes of
// column c); whole: [cols, ranks * shard_bytes], column c = the shards' pieces of c in rank order. Used for FP8's
// data_t (shard_bytes = R), NVFP4's col_data (R/2) and col_scales (R/16).
void interleave_column_shards(const uint8_t* gathered, int ranks, int64_t cols, int64_t shard_bytes, uint8_t* whole);

}  // namespace nb::dist
