// A role's quantized copies cut by rows over ranks (internal to recipe/): each rank quantizes its chunk of
// rows with the whole tensor's amax, so every block that lies inside one chunk gets the bytes the whole
// tensor's quantization gives it; the chunks are all-gathered as bytes and assembled into the copies the
// GEMMs read. Two users: Megatron-FSDP's training-format weight gathers (linear_sharded.cpp: chunks of a
// weight's output rows) and sequence parallelism's quantized input gathers (linear_gather.cpp: chunks of an
// activation's tokens). How the gathered chunks form the whole:
//   row-chunked pieces (row data and scales; MXFP8's un-transposed column copy): the chunks back to back;
//   transposed pieces ([cols, rows] column copies and their scales): each rank's columns placed side by side
//   with one strided copy per rank (zero-padded rows of the last chunks and the scale grid's padding entries
//   left out / written as 0, as the whole tensor's quantizer writes them).
#pragma once
#include <cstddef>
#include <cstdint>
#include "recipe/linear_internal.h"

namespace nb::recipe {

// One piece of the copies: where a rank's chunk keeps it and how the gathered chunks form the whole.
struct ChunkPiece {
  size_t whole_offset = 0, whole_bytes = 0;  // the QCopies piece's offset (in its slot or window)
  size_t chunk_offset = 0, chunk_bytes = 0;  // in one rank's chunk
  bool transposed = false;
  // Transposed pieces: `height` rows; a row holds `unit_bytes` per `unit_rows` rows of the source.
  int64_t height = 0, unit_rows = 1;
  size_t unit_bytes = 1, chunk_pitch = 0, whole_pitch = 0;
  bool zero_first = false;  // the whole has padding entries
};

struct RowChunks {
  int64_t rows_per_rank = 0;  // a chunk's rows
  int ranks = 1;
  int64_t whole_rows = 0, cols = 0;  // the whole source (its last chunks may be partly padding)
  size_t chunk_bytes = 0;            // one rank's chunk: the pieces at 256-byte-aligned offsets
  ChunkPiece row_data, row_scales, col_data, col_scales;
  bool has_col = false;
};

// Lays out rc (rows_per_rank and ranks set by the caller) for the copies of c, a [whole_rows, cols] source.
// Formats: per-tensor FP8 (no scale pieces), MXFP8, NVFP4 (1D or 2D), FP8 128x128 tiles; the 1x128 FP8 blocks'
// GEMM-ready scales run along the rows with padding and are not supported (callers refuse them).
void lay_out_row_chunks(const QCopies& c, int64_t whole_rows, int64_t cols, RowChunks* rc);
// The quantizers' outputs for one chunk at `chunk` (the column ones null without a column copy).
QCopies::Outputs chunk_outputs(const RowChunks& rc, uint8_t* chunk, int* flag);
// gathered: the ranks' chunks, rank r's at gathered + r * rank_stride; whole[i]: where piece i (row data, row
// scales, column data, column scales) of the assembled copies lives.
Status assemble_row_chunks(const RowChunks& rc, const uint8_t* gathered, size_t rank_stride, uint8_t* const whole[4],
                           Device dev, Stream stream);

}  // namespace nb::recipe
