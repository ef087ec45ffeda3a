// Helpers of the context-parallel SR tests (CPU and GPU): a rank's rows of whole sequences, as context
// parallelism holds them (chunks r and 2C-1-r of every sequence of S tokens cut into 2C), and the whole tensor's
// quantized bytes at those rows. Written from the layout's definition, independently of nvfp4_math.h's map.
#pragma once
#include <cstdint>
#include <vector>
#include "core/bf16.h"
#include "formats/nvfp4/nvfp4.h"

namespace nb::nvfp4::testing {

// A context-parallel layout: `batch` sequences of `seq` tokens over `ranks` ranks; `rank` is this one.
struct CpLayout {
  int64_t batch, seq, ranks, rank;
  int64_t chunk() const { return seq / (2 * ranks); }
  int64_t local_rows() const { return batch * 2 * chunk(); }
  // The whole tensor's row of local row p: sequence p / 2c, then the first or the second chunk.
  int64_t whole_row(int64_t p) const {
    const int64_t c = chunk(), j = p % (2 * c), k = j < c ? rank : 2 * ranks - 1 - rank;
    return (p / (2 * c)) * seq + k * c + j % c;
  }
  SrCpRows map() const { return SrCpRows{chunk(), seq, rank, 2 * ranks - 1 - rank}; }
};

// Runs of the whole tensor's columns [start, start + width) that a tensor-parallel shard holds side by side.
struct Cols {
  int64_t start, width;
};

// Local rows [row0, row0 + rows) of the layout, columns `cols` of the whole [batch * seq, whole_cols] tensor x.
inline std::vector<bf16> cp_piece(const std::vector<bf16>& x, int64_t whole_cols, const CpLayout& l, int64_t row0,
                                  int64_t rows, const std::vector<Cols>& cols) {
  std::vector<bf16> out;
  for (int64_t p = row0; p < row0 + rows; ++p)
    for (const Cols& g : cols) {
      const auto at = x.begin() + l.whole_row(p) * whole_cols + g.start;
      out.insert(out.end(), at, at + g.width);
    }
  return out;
}

// The whole's row-copy bytes (a: [W_r, whole_cols / per_byte]; per_byte columns per byte, 2 for codes, 16 for
// scales) of the piece's rows and columns, in the piece's order.
inline std::vector<uint8_t> cp_row_bytes(const std::vector<uint8_t>& a, int64_t whole_cols, int per_byte,
                                         const CpLayout& l, int64_t row0, int64_t rows, const std::vector<Cols>& cols) {
  std::vector<uint8_t> out;
  for (int64_t p = row0; p < row0 + rows; ++p)
    for (const Cols& g : cols) {
      const auto at = a.begin() + (l.whole_row(p) * whole_cols + g.start) / per_byte;
      out.insert(out.end(), at, at + g.width / per_byte);
    }
  return out;
}

// The whole's column-copy bytes (a: [whole_cols, W_r / per_byte]; per_byte rows per byte) of the piece's columns
// and rows (whole blocks of 16, so each byte lies inside one chunk).
inline std::vector<uint8_t> cp_col_bytes(const std::vector<uint8_t>& a, int64_t whole_rows, int per_byte,
                                         const CpLayout& l, int64_t row0, int64_t rows, const std::vector<Cols>& cols) {
  std::vector<uint8_t> out;
  for (const Cols& g : cols)
    for (int64_t c = g.start; c < g.start + g.width; ++c)
      for (int64_t p = row0; p < row0 + rows; p += per_byte)
        out.push_back(a[size_t(c * (whole_rows / per_byte) + l.whole_row(p) / per_byte)]);
  return out;
}

// The SR origin of such a piece: row0 in the rank's rows, the layout's map, and one run as col0 or several as
// column segments.
inline SrOrigin cp_origin(const CpLayout& l, int64_t whole_cols, int64_t row0, const std::vector<Cols>& cols) {
  SrOrigin o;
  o.row0 = row0;
  o.whole_rows = l.local_rows();
  o.whole_cols = whole_cols;
  o.cp = l.map();
  if (cols.size() == 1) o.col0 = cols[0].start;
  int64_t local = 0;
  for (size_t i = 0; cols.size() > 1 && i < cols.size(); ++i) {
    o.col_segments[o.n_col_segments++] = SrColSegment{local, cols[i].start};
    local += cols[i].width;
  }
  return o;
}

}  // namespace nb::nvfp4::testing
