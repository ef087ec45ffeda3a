// CPU reference of the NVFP4 quantizer (spec §1-4): plain loops, one 16-element block at a time.
// This file is the definition the CUDA kernels are tested against bit for bit. Layouts and the SR
// random-byte rule are described in nvfp4.h; the per-block math lives in nvfp4_math.h (shared).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>
#include "formats/hadamard/hadamard.h"
#include "formats/nvfp4/nvfp4.h"
#include "formats/nvfp4/nvfp4_math.h"

namespace nb::nvfp4 {

// The origin places the tensor inside a whole tensor that could itself be quantized, on block boundaries,
// so each block of a piece is one whole block of the whole tensor's copies (nvfp4.h, SR origin).
static Status check_sr_origin(int64_t rows, int64_t cols, const SrOrigin& o) {
  const int64_t whole_rows = o.whole_rows ? o.whole_rows : rows, whole_cols = o.whole_cols ? o.whole_cols : cols;
  if (o.row0 < 0 || o.col0 < 0 || o.row0 % kBlock != 0 || o.col0 % kBlock != 0 || whole_rows < 0 || whole_cols < 0 ||
      whole_rows % kBlock != 0 || whole_cols % kBlock != 0 || o.row0 + rows > whole_rows || o.col0 + cols > whole_cols)
    return errorf(
        "NVFP4 SR origin (row0 %lld, col0 %lld) of a %lld x %lld tensor in a whole %lld x %lld tensor is invalid: row0 "
        "and col0 must be non-negative multiples of 16, the whole dims multiples of 16 (0 = this tensor's own), and "
        "row0 + rows <= whole_rows, col0 + cols <= whole_cols",
        (long long)o.row0, (long long)o.col0, (long long)rows, (long long)cols, (long long)whole_rows,
        (long long)whole_cols);
  return Status::ok();
}

// Column segments (nvfp4.h): each maps a non-empty run of whole blocks of local columns onto whole blocks of
// the whole tensor's columns, so whole_col(c) stays block-aligned and inside the whole.
static Status check_sr_col_segments(int64_t cols, const SrOrigin& o) {
  const int n = o.n_col_segments;
  if (n == 0) return Status::ok();
  const int64_t whole_cols = o.whole_cols ? o.whole_cols : cols;
  bool ok = n > 0 && n <= kMaxSrColSegments && o.col0 == 0 && o.col_segments[0].local == 0;
  std::string list;
  const int listed = std::min(n, kMaxSrColSegments);  // a count past the array is refused, never read past
  for (int i = 0; i < listed; ++i) {
    const SrColSegment& seg = o.col_segments[i];
    const int64_t end = i + 1 < listed ? o.col_segments[i + 1].local : cols;
    ok = ok && seg.local % kBlock == 0 && seg.whole % kBlock == 0 && seg.local < end && seg.whole >= 0 &&
         seg.whole + (end - seg.local) <= whole_cols;
    list += (i ? ", (" : "(") + std::to_string(seg.local) + ", " + std::to_string(seg.whole) + ")";
  }
  if (ok) return Status::ok();
  return errorf(
      "NVFP4 SR origin with %d column segments [(local, whole): %s] and col0 %lld for a %lld-column tensor in a "
      "%lld-column whole is invalid: at most %d segments, sorted by strictly increasing local with the first at "
      "local 0 and col0 0, locals and wholes multiples of 16, and every mapped column inside the whole (whole + "
      "segment width <= whole_cols)",
      n, list.c_str(), (long long)o.col0, (long long)cols, (long long)whole_cols, kMaxSrColSegments);
}

// The context-parallel row map (nvfp4.h): whole chunks of whole blocks, two distinct chunks of each sequence,
// and the rank's rows (whole_rows, else this tensor's) whole sequences' shares, few enough for sr_cp_row.
static Status check_sr_cp(int64_t rows, const SrOrigin& o) {
  const SrCpRows& m = o.cp;
  if (m.chunk == 0) return Status::ok();
  const int64_t local = o.whole_rows ? o.whole_rows : rows, chunks = m.chunk > 0 ? m.seq / m.chunk : 0;
  if (m.chunk > 0 && m.chunk % kBlock == 0 && m.seq > 0 && m.seq % (2 * m.chunk) == 0 && m.first >= 0 &&
      m.first < chunks && m.second >= 0 && m.second < chunks && m.first != m.second && local % (2 * m.chunk) == 0 &&
      local < (int64_t(1) << 31))
    return Status::ok();
  return errorf(
      "NVFP4 SR context-parallel row map (chunks of %lld tokens, chunks %lld and %lld of sequences of %lld) does not "
      "fit %lld local rows: the chunk must be a positive multiple of 16, the sequence a multiple of two chunks, the "
      "two chunk indices distinct and below sequence / chunk, and the rank's rows a multiple of two chunks below 2^31",
      (long long)m.chunk, (long long)m.first, (long long)m.second, (long long)m.seq, (long long)local);
}

Status check_shape(int64_t rows, int64_t cols, const Options& opts) {
  if (rows <= 0 || cols <= 0 || rows % kBlock != 0 || cols % kBlock != 0)
    return errorf(
        "NVFP4 cannot quantize a %lld x %lld tensor: both dimensions must be positive multiples of 16 "
        "(pad the tensor to a multiple of 16 first)",
        (long long)rows, (long long)cols);
  if (!opts.rowwise && !opts.colwise)
    return errorf("NVFP4 quantization of a %lld x %lld tensor asked for no output: enable rowwise and/or colwise",
                  (long long)rows, (long long)cols);
  if (opts.two_d && (opts.rht || opts.sr))
    return errorf(
        "NVFP4 16x16 (2D) quantization of a %lld x %lld tensor cannot use %s: 2D is for weights, "
        "whose two copies must hold identical values; disable rht/sr for weights",
        (long long)rows, (long long)cols, opts.rht ? "RHT" : "stochastic rounding");
  NB_TRY(check_sr_origin(rows, cols, opts.sr_origin));
  NB_TRY(check_sr_cp(rows, opts.sr_origin));
  return check_sr_col_segments(cols, opts.sr_origin);
}

void rht16_ref(const float* x, float* y) {
  for (int i = 0; i < kBlock; ++i) y[i] = x[i];
  hadamard::rht16_bf16(y);
}

static double crest_factor(const float* v) {
  double peak = 0, sum_sq = 0;
  for (int i = 0; i < kBlock; ++i) {
    peak = std::max(peak, std::fabs(double(v[i])));
    sum_sq += double(v[i]) * v[i];
  }
  return peak / std::sqrt(sum_sq / kBlock);
}

void add_column_block_crests(const bf16* x, int64_t rows, int64_t cols, CrestSums* sums) {
  float block[kBlock], transformed[kBlock];
  for (int64_t r0 = 0; r0 + kBlock <= rows; r0 += kBlock) {
    for (int64_t c = 0; c < cols; ++c) {
      bool any = false;
      for (int i = 0; i < kBlock; ++i) {
        block[i] = bf16_to_f32(x[size_t((r0 + i) * cols + c)]);
        any = any || block[i] != 0.f;
      }
      if (!any) continue;
      rht16_ref(block, transformed);
      const double plain = crest_factor(block), rht = crest_factor(transformed);
      if (!std::isfinite(plain) || !std::isfinite(rht)) continue;
      sums->plain += plain;
      sums->rht += rht;
      ++sums->blocks;
    }
  }
}

namespace {

// The 16 values of column c, rows r0..r0+15, optionally RHT'd (BF16-rounded).
void load_col_chunk(const bf16* x, int64_t cols, int64_t r0, int64_t c, bool rht, float* v) {
  for (int j = 0; j < kBlock; ++j) v[j] = bf16_to_f32(x[(r0 + j) * cols + c]);
  if (rht) hadamard::rht16_bf16(v);
}

void store_block(uint8_t* data, uint8_t* scales, int64_t outer, int64_t inner, int64_t blk, uint64_t packed,
                 uint32_t scale_code) {
  uint8_t* d = data + outer * (inner / 2) + blk * (kBlock / 2);
  for (int i = 0; i < 8; ++i) d[i] = uint8_t(packed >> (8 * i));
  scales[outer * (inner / kBlock) + blk] = uint8_t(scale_code);
}

// nvfp4.h's SR origin rule read literally (the CUDA kernels use nvfp4_math.h's folded SrBlocks): the whole
// tensor's index e of the first element of block blk of line `outer` of one copy.
struct SrIndex {
  SrOrigin o;
  int64_t whole_rows, whole_cols;
  bool colwise;
  int64_t whole_col(int64_t c) const {
    int64_t w = o.col0 + c;
    for (int i = 0; i < o.n_col_segments; ++i)
      if (o.col_segments[i].local <= c) w = o.col_segments[i].whole + (c - o.col_segments[i].local);
    return w;
  }
  int64_t whole_row(int64_t p) const {
    return o.cp.chunk ? sr_cp_row(p, o.cp.chunk, o.cp.seq, o.cp.first, o.cp.second) : p;
  }
  int64_t first_element(int64_t outer, int64_t blk) const {
    if (colwise) return whole_col(outer) * whole_rows + whole_row(o.row0 + blk * kBlock);
    return whole_row(o.row0 + outer) * whole_cols + whole_col(blk * kBlock);
  }
};

SrIndex sr_index(const SrOrigin& o, int64_t rows, int64_t cols, bool colwise) {
  return {o, sr_whole_rows(o, rows), o.whole_cols ? o.whole_cols : cols, colwise};
}

// One copy with 1x16 blocks: rows_out x inner values delivered by `load(outer, blk, v)`.
template <typename Load>
void quantize_copy_1d(int64_t outer_n, int64_t inner, float amax, const Options& opts, RngKey key, const SrIndex& sr_at,
                      uint8_t* data, uint8_t* scales, Load load) {
  const bool sr = opts.sr, four_over_six = opts.four_over_six;
  float s_enc = four_over_six ? global_encode_scale_4over6(amax) : global_encode_scale(amax);
  float v[kBlock];
  for (int64_t o = 0; o < outer_n; ++o) {
    for (int64_t b = 0; b < inner / kBlock; ++b) {
      load(o, b, v);
      Philox4x32 rand{};
      if (sr) rand = philox_block(key, uint64_t(sr_at.first_element(o, b) / kBlock));
      if (four_over_six) {
        uint64_t packed = 0;
        uint32_t s = quantize_block16_4over6(v, s_enc, amax, opts.err_mode, sr, rand, &packed);
        store_block(data, scales, o, inner, b, packed, s);
        continue;
      }
      uint32_t s = block_scale_code(block_amax16(v), s_enc);
      float enc = block_encode_scale(s, s_enc);
      store_block(data, scales, o, inner, b, encode_block16(v, enc, sr, rand), s);
    }
  }
}

// One scale per 16x16 tile. Plain NVFP4 gives both copies the tile's scale; 4/6 lets each copy decide
// in its own reduction order (tile_scale_4over6), which may differ where the candidates nearly tie.
void quantize_2d(const bf16* x, int64_t rows, int64_t cols, float amax, const Options& opts, const QuantizedView& out) {
  const bool fos = opts.four_over_six;
  float s_enc = fos ? global_encode_scale_4over6(amax) : global_encode_scale(amax);
  float v[kBlock];
  Philox4x32 no_rand{};
  for (int64_t tr = 0; tr < rows / kBlock; ++tr) {
    for (int64_t tc = 0; tc < cols / kBlock; ++tc) {
      uint32_t tile_max = 0;
      for (int i = 0; i < kBlock && !fos; ++i)
        for (int j = 0; j < kBlock; ++j)
          tile_max = std::max(tile_max, abs_bits(bf16_to_f32(x[(tr * 16 + i) * cols + tc * 16 + j])));
      const uint32_t plain = fos ? 0 : block_scale_code(bits_f32(tile_max), s_enc);
      const uint32_t s_row =
          fos && opts.rowwise ? tile_scale_4over6(x, cols, tr * 16, tc * 16, s_enc, amax, opts.err_mode, false) : plain;
      const uint32_t s_col =
          fos && opts.colwise ? tile_scale_4over6(x, cols, tr * 16, tc * 16, s_enc, amax, opts.err_mode, true) : plain;
      const float enc_row = block_encode_scale(s_row, s_enc), enc_col = block_encode_scale(s_col, s_enc);
      for (int i = 0; i < kBlock; ++i) {
        if (opts.rowwise) {
          for (int j = 0; j < kBlock; ++j) v[j] = bf16_to_f32(x[(tr * 16 + i) * cols + tc * 16 + j]);
          store_block(out.row_data, out.row_scales, tr * 16 + i, cols, tc, encode_block16(v, enc_row, false, no_rand),
                      s_row);
        }
        if (opts.colwise) {
          load_col_chunk(x, cols, tr * 16, tc * 16 + i, false, v);
          store_block(out.col_data, out.col_scales, tc * 16 + i, rows, tr, encode_block16(v, enc_col, false, no_rand),
                      s_col);
        }
      }
    }
  }
}

}  // namespace

void compute_amax_ref(const bf16* x, int64_t rows, int64_t cols, bool rht, float* row_amax, float* col_amax) {
  uint32_t m = 0;
  for (int64_t i = 0; i < rows * cols; ++i) m = std::max(m, abs_bits(bf16_to_f32(x[i])));
  uint32_t mc = m;
  if (rht) {
    mc = 0;
    float v[kBlock];
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
        load_col_chunk(x, cols, r0, c, true, v);
        mc = std::max(mc, abs_bits(block_amax16(v)));
      }
  }
  if (row_amax) *row_amax = amax_from_abs_bits(m);
  if (col_amax) *col_amax = amax_from_abs_bits(mc);
}

Status quantize_ref(const bf16* x, const Options& opts, const QuantizedView& out) {
  const int64_t rows = out.rows, cols = out.cols;
  NB_TRY(check_shape(rows, cols, opts));
  float row_amax = 0, col_amax = 0;
  compute_amax_ref(x, rows, cols, opts.rht && opts.colwise, &row_amax, &col_amax);
  if (out.nonfinite && (!amax_is_finite(row_amax) || !amax_is_finite(col_amax))) *out.nonfinite = 1;
  QuantizedView v = out;  // the amaxes stored where asked (the true amax, with or without 4/6, as TE stores it)
  v.row_amax = out.row_amax ? out.row_amax : &row_amax;
  v.col_amax = out.col_amax ? out.col_amax : &col_amax;
  *v.row_amax = row_amax;
  *v.col_amax = col_amax;
  return quantize_ref_with_amax(x, opts, v);
}

Status quantize_ref_with_amax(const bf16* x, const Options& opts, const QuantizedView& out) {
  const int64_t rows = out.rows, cols = out.cols;
  NB_TRY(check_shape(rows, cols, opts));
  const float row_amax = out.row_amax ? *out.row_amax : 0.f;
  const float col_amax = out.col_amax ? *out.col_amax : row_amax;
  if (opts.two_d) {
    quantize_2d(x, rows, cols, row_amax, opts, out);
    return Status::ok();
  }
  if (opts.rowwise) {
    quantize_copy_1d(rows, cols, row_amax, opts, opts.rng, sr_index(opts.sr_origin, rows, cols, false), out.row_data,
                     out.row_scales, [&](int64_t r, int64_t b, float* v) {
                       for (int j = 0; j < kBlock; ++j) v[j] = bf16_to_f32(x[r * cols + b * kBlock + j]);
                     });
  }
  if (opts.colwise) {
    quantize_copy_1d(cols, rows, col_amax, opts, colwise_key(opts.rng), sr_index(opts.sr_origin, rows, cols, true),
                     out.col_data, out.col_scales,
                     [&](int64_t c, int64_t b, float* v) { load_col_chunk(x, cols, b * kBlock, c, opts.rht, v); });
  }
  return Status::ok();
}

void dequantize_ref(const uint8_t* data, const uint8_t* scales, float amax, int64_t outer, int64_t inner, float* out,
                    bool four_over_six) {
  const float bound = e4m3_bound(four_over_six);
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i) {
      uint32_t code = (data[o * (inner / 2) + i / 2] >> (4 * (i & 1))) & 0xFu;
      out[o * inner + i] = dequant_value(code, scales[o * (inner / kBlock) + i / kBlock], amax, bound);
    }
}

const char* err_mode_name(ErrMode m) { return m == ErrMode::mse ? "mse" : "mae"; }

// ---- cuBLAS scale layout ----------------------------------------------------------------------
static int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

size_t swizzled_scale_bytes(int64_t rows, int64_t scale_cols) {
  return size_t(round_up(rows, 128) * round_up(scale_cols, 4));
}

size_t swizzled_offset(int64_t r, int64_t c, int64_t scale_cols) {
  return size_t(swizzle_offset_padded(r, c, round_up(scale_cols, 4)));
}

void swizzle_scales_ref(const uint8_t* scales, int64_t rows, int64_t scale_cols, uint8_t* out) {
  const int64_t rp = round_up(rows, 128), kp = round_up(scale_cols, 4);
  for (int64_t r = 0; r < rp; ++r)
    for (int64_t c = 0; c < kp; ++c)
      out[swizzle_offset_padded(r, c, kp)] = (r < rows && c < scale_cols) ? scales[r * scale_cols + c] : 0;
}

void unswizzle_scales_ref(const uint8_t* swizzled, int64_t rows, int64_t scale_cols, uint8_t* out) {
  const int64_t kp = round_up(scale_cols, 4);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < scale_cols; ++c) out[r * scale_cols + c] = swizzled[swizzle_offset_padded(r, c, kp)];
}

}  // namespace nb::nvfp4
