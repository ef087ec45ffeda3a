// Row chunks of a role's quantized copies (row_chunks.h): their layout in a chunk and their assembly.
#include "recipe/row_chunks.h"

#include <algorithm>
#include <cstring>
#include "formats/fp8/fp8_block.h"
#include "recipe/linear_device.h"

namespace nb::recipe {

namespace {

// [cols, rows] column copies: one row per feature, the source's rows along it.
void set_transposed(ChunkPiece* p, int64_t height, int64_t unit_rows, size_t unit_bytes, size_t chunk_pitch,
                    size_t whole_pitch) {
  p->transposed = true;
  p->whole_bytes = size_t(height) * whole_pitch;
  p->height = height;
  p->unit_rows = unit_rows;
  p->unit_bytes = unit_bytes;
  p->chunk_pitch = chunk_pitch;
  p->whole_pitch = whole_pitch;
}

Status zero_bytes(uint8_t* p, size_t n, Device dev, Stream stream) {
  if (dev == Device::cuda) return detail::memset_cuda(p, 0, n, stream);
  std::memset(p, 0, n);
  return Status::ok();
}

}  // namespace

void lay_out_row_chunks(const QCopies& c, int64_t whole_rows, int64_t cols, RowChunks* rc) {
  const int64_t n = rc->rows_per_rank, rows = whole_rows;
  rc->whole_rows = whole_rows;
  rc->cols = cols;
  const Fmt f = c.spec.fmt;
  const size_t data = size_t(f == Fmt::nvfp4 ? n * cols / 2 : n * cols);
  size_t row_sc = 0, col_sc = 0;
  if (f == Fmt::fp8_block128 || f == Fmt::fp8_block128x128) {
    const auto kind = f == Fmt::fp8_block128 ? fp8::BlockKind::vec128 : fp8::BlockKind::blk128x128;
    row_sc = 4 * size_t(fp8::block_scale_count(kind, n, cols, false));
    col_sc = 4 * size_t(fp8::block_scale_count(kind, n, cols, true));
  } else if (f == Fmt::mxfp8) {
    row_sc = col_sc = size_t(n * cols / 32);
  } else if (f == Fmt::nvfp4) {
    row_sc = col_sc = size_t(n * cols / 16);
  }
  size_t off = 0;
  auto place = [&](ChunkPiece* p, const QCopies::Piece& whole, size_t bytes) {
    *p = ChunkPiece{};
    p->chunk_offset = off;
    p->chunk_bytes = bytes;
    p->whole_offset = whole.offset;
    off += align256(bytes);
  };
  place(&rc->row_data, c.row_data, data);
  place(&rc->row_scales, c.row_scales, row_sc);
  rc->has_col = !c.col_is_row && !c.row_only;
  if (rc->has_col) {
    place(&rc->col_data, c.col_data, data);
    place(&rc->col_scales, c.col_scales, col_sc);
  }
  rc->chunk_bytes = std::max<size_t>(off, 256);
  if (!rc->has_col || f == Fmt::mxfp8) return;  // MXFP8's column copy is un-transposed
  if (f == Fmt::nvfp4) {
    set_transposed(&rc->col_data, cols, 2, 1, size_t(n / 2), size_t(rows / 2));
    set_transposed(&rc->col_scales, cols, 16, 1, size_t(n / 16), size_t(rows / 16));
    return;
  }
  set_transposed(&rc->col_data, cols, 1, 1, size_t(n), size_t(rows));
  if (col_sc == 0) return;  // per-tensor FP8: one scale, in the state block
  set_transposed(&rc->col_scales, cols / 128, 128, 4, size_t(4 * fp8::round4(n / 128)),
                 size_t(4 * fp8::round4(rows / 128)));
  rc->col_scales.zero_first = true;  // the grid's padding entries
}

QCopies::Outputs chunk_outputs(const RowChunks& rc, uint8_t* chunk, int* flag) {
  return {rc.has_col,
          chunk + rc.row_data.chunk_offset,
          chunk + rc.row_scales.chunk_offset,
          rc.has_col ? chunk + rc.col_data.chunk_offset : nullptr,
          rc.has_col ? chunk + rc.col_scales.chunk_offset : nullptr,
          flag};
}

Status assemble_row_chunks(const RowChunks& rc, const uint8_t* gathered, size_t rank_stride, uint8_t* const whole[4],
                           Device dev, Stream stream) {
  const ChunkPiece* pieces[4] = {&rc.row_data, &rc.row_scales, &rc.col_data, &rc.col_scales};
  for (int i = 0; i < (rc.has_col ? 4 : 2); ++i) {
    const ChunkPiece& p = *pieces[i];
    uint8_t* dst = whole[i];
    if (p.chunk_bytes == 0) continue;
    if (!p.transposed) {
      NB_TRY(copy_2d_async(dst, p.chunk_bytes, gathered + p.chunk_offset, rank_stride, p.chunk_bytes, size_t(rc.ranks),
                           dev, stream));
      continue;
    }
    if (p.zero_first) NB_TRY(zero_bytes(dst, p.whole_bytes, dev, stream));
    const size_t rank_width = size_t(rc.rows_per_rank / p.unit_rows) * p.unit_bytes;
    for (int r = 0; r < rc.ranks; ++r) {
      const int64_t valid = std::clamp<int64_t>(rc.whole_rows - r * rc.rows_per_rank, 0, rc.rows_per_rank);
      if (valid == 0) break;
      NB_TRY(copy_2d_async(dst + size_t(r) * rank_width, p.whole_pitch,
                           gathered + size_t(r) * rank_stride + p.chunk_offset, p.chunk_pitch,
                           size_t(valid / p.unit_rows) * p.unit_bytes, size_t(p.height), dev, stream));
    }
  }
  return Status::ok();
}

}  // namespace nb::recipe
