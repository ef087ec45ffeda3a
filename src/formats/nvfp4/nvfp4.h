// NVFP4 quantization (E2M1 elements in blocks of 16, one E4M3 scale per block, one FP32 amax per
// tensor copy), as defined in the precision spec §1-4. The CPU reference (`*_ref`) is the spec;
// the CUDA functions produce the same bytes bit for bit.
//
// Source: a rows x cols BF16 tensor, row-major. Two copies, each optional:
//   row-wise    : blocks of 16 along cols.  data [rows, cols/2] bytes, scales [rows, cols/16]
//   column-wise : the transposed tensor [cols, rows], blocks of 16 along rows (the token dim).
//                 data [cols, rows/2], scales [cols, rows/16]
// Packing: element 2i in the low nibble, 2i+1 in the high nibble. Scales are raw E4M3 bytes in this
// plain (unswizzled) layout; swizzle_scales_* produces cuBLAS's 128x4 tiled layout.
//
// Options: two_d = 16x16 weight tiles (one scale per tile, repeated into both copies so both hold
// bit-identical values; with 4/6 see below); rht = random Hadamard transform on the column-wise copy only (result
// rounded to BF16, amax taken after the transform); sr = stochastic rounding of the elements of both copies. SR random
// byte of element e (flat row-major index inside its copy's [outer, inner] layout):
//   philox_byte(philox_block(key, e / 16), e % 16), key = opts.rng for the row-wise copy and
//   opts.rng with stream ^= 1 for the column-wise copy.
// SR origin (opts.sr_origin): tensor and sequence parallelism quantize a piece of a whole [W_r, W_c]
// tensor on each rank (a block of rows or of columns), and a piece must round exactly as the whole
// would. With an origin the tensor is the sub-block at (row0, col0) of the whole and e is the whole
// tensor's index: row-wise e = (row0 + r) * W_c + (col0 + c), column-wise e = (col0 + c) * W_r + (row0 + r).
// A piece quantized with the whole tensor's amaxes (quantize_*_with_amax) and its origin then gets
// exactly the whole tensor's bytes for its elements. The default origin is the tensor itself. The
// origin is checked always (check_shape) but only used with sr: RNE bytes do not depend on position.
// Column segments: a tensor-parallel rank's shard of a fused projection's output holds several column
// ranges of the whole (fused qkv's dY [M, q + 2kv]: rank r of T holds q columns [r*q/T, (r+1)*q/T), then k
// columns q + [r*kv/T, ...), then v columns q + kv + [r*kv/T, ...); fused gate_up: gate then up). With
// n_col_segments > 0 the segments replace col0 (which must be 0): local column c is whole column
// whole_col(c) = s.whole + (c - s.local) for the last segment s with s.local <= c, and the rule above
// reads whole_col(c) for col0 + c. No segments: whole_col(c) = col0 + c, the one-segment case {0, col0}.
// Context-parallel rows (sr_origin.cp): under context parallelism a rank holds, of every sequence of S tokens
// cut into chunks of c, the two chunks cp.first and cp.second (r and 2C-1-r of 2C), so its rows are 2c tokens
// per sequence, sequence after sequence. With cp.chunk = c > 0 the rule reads whole_row(row0 + r) for row0 + r
// (row0 stays an offset in the rank's rows, as sequence parallelism cuts them): local row p is whole row
// (p / 2c) * S + k * c + p % c, k = cp.first where p % 2c < c, else cp.second; whole_rows is then the rank's
// row count (0: this tensor's) and the whole tensor has W_r = whole_rows / 2c * S rows. No map: whole_row(p) = p.
//
// Non-finite input: amax is the largest |x| by BF16 bit pattern, so a NaN anywhere makes amax NaN
// (stored as the quiet NaN 0x7FC00000) and an Inf makes it Inf. Such an amax sets *nonfinite = 1
// (never cleared here, so one flag can collect a whole step) and uses S_enc = 1; the quantizer still
// finishes with defined bytes (NaN elements get code 7, a NaN block gets scale byte 0x7F), identical
// on CPU and CUDA.
//
// 4/6 adaptive block scaling (four_over_six): TransformerEngine's NVFP4 "4over6" (its reference
// NVFP4QuantizerRef with nvfp4_use_4over6, E4M3 bound 256; "Four Over Six", arXiv 2512.02010). S_enc uses
// the E4M3 bound 256 instead of 448 (S_enc = 6*256 / amax); each 1x16 block (each 16x16 tile with two_d)
// tries base = (block_amax / 6) * S_enc ("map to 6") and base * 1.5 ("map to 4"), both E4M3 satfinite,
// and keeps map to 4 only when its error (err_mode: summed absolute or squared error) is strictly lower
// (nvfp4_math.h has the rule). The amax slots hold the TRUE tensor amax, as TE stores it; a 4/6 copy
// therefore decodes with amax / (6*256) (e4m3_bound(true) in nvfp4_math.h), and every reader must know
// it (dequantize_*'s four_over_six, gemm::QOperand::nvfp4_4over6). With two_d each copy decides per tile
// in TE's reduction order for that copy (row copy: per-row sums, column copy: per-column sums), so the
// two copies of a 4/6 tile can differ where the two candidates' errors are within rounding.
#pragma once
#include <cstddef>
#include <cstdint>
#include "core/bf16.h"
#include "core/philox.h"
#include "core/status.h"
#include "core/stream.h"

namespace nb::nvfp4 {

constexpr int kBlock = 16;
constexpr float kE2M1MaxValue = 6.0f;
constexpr float kScaleMax = 6.0f * 448.0f;  // E2M1 max * E4M3 max
// RHT sign vector s (spec §3): bit i set where s_i = -1.
constexpr uint32_t kRhtSignMask = 0xD7E8u;

// 4/6's error metric per candidate: TE's NVTE_NVFP4_4OVER6_ERR_MODE (MAE is TE's default).
enum class ErrMode : uint8_t { mae, mse };
const char* err_mode_name(ErrMode m);  // "mae" | "mse"

// Where a tensor sits in a whole tensor whose SR bytes it must reproduce (header comment). row0 and col0
// are non-negative multiples of 16; whole_rows / whole_cols 0 mean this tensor's own rows / cols.
// col_segments[0, n_col_segments): local columns from `local` on (to the next segment's local, or the end)
// are the whole tensor's columns from `whole` on; sorted by local, the first at 0, all multiples of 16.
struct SrColSegment {
  int64_t local = 0, whole = 0;
};
constexpr int kMaxSrColSegments = 4;  // fused qkv needs 3, gate_up 2
// Context parallelism's row map (header comment), in tokens: chunk 0 is no map (the other fields unused).
struct SrCpRows {
  int64_t chunk = 0;              // c, a multiple of 16
  int64_t seq = 0;                // S, a multiple of 2c
  int64_t first = 0, second = 0;  // the rank's two chunks of the S / c
};
struct SrOrigin {
  int64_t row0 = 0, col0 = 0;
  int64_t whole_rows = 0, whole_cols = 0;
  int n_col_segments = 0;  // 0: whole_col(c) = col0 + c
  SrColSegment col_segments[kMaxSrColSegments] = {};
  SrCpRows cp{};  // context parallelism: the rank's rows in the whole sequences
};

struct Options {
  bool rowwise = true;
  bool colwise = true;
  bool two_d = false;  // 16x16 weight tiles; cannot be combined with rht or sr
  bool rht = false;    // column-wise copy only
  bool sr = false;     // stochastic rounding of elements (scales stay RNE)
  // 4/6 adaptive block scaling of every copy written (the column copy is the RHT'd one with rht; a 2D
  // tile decides once per copy for its 256 elements). Combines with rht, sr or two_d as plain NVFP4 does
  // (TE's 4over6 has neither RHT nor SR; nibble encodes both candidates with the same RHT'd values and
  // random bytes).
  bool four_over_six = false;
  ErrMode err_mode = ErrMode::mae;  // four_over_six only
  RngKey rng{};
  SrOrigin sr_origin{};  // the whole tensor's element indices for SR (tensor / sequence parallel pieces)
};

// Output pointers: host memory for *_ref, device memory for *_cuda. Pointers of a disabled copy are
// ignored (may be null).
struct QuantizedView {
  int64_t rows = 0, cols = 0;
  uint8_t* row_data = nullptr;    // [rows, cols/2]
  uint8_t* row_scales = nullptr;  // [rows, cols/16]
  uint8_t* col_data = nullptr;    // [cols, rows/2]
  uint8_t* col_scales = nullptr;  // [cols, rows/16]
  float* row_amax = nullptr;      // 1 float: amax of the source
  float* col_amax = nullptr;      // 1 float: same, or of the RHT'd source with rht
  int* nonfinite = nullptr;       // set to 1 when an amax is NaN/Inf; may be null
};

// OK when rows and cols are positive multiples of 16, the options are compatible and opts.sr_origin
// places the tensor inside a whole tensor of multiple-of-16 dims (column segments and the context-parallel
// row map too); otherwise one sentence naming the values and the rule.
Status check_shape(int64_t rows, int64_t cols, const Options& opts);

// ---- CPU reference (the spec) --------------------------------------------------------------
Status quantize_ref(const bf16* x, const Options& opts, const QuantizedView& out);
// quantize_ref with the amaxes already in *out.row_amax and *out.col_amax (left as they are), as
// quantize_cuda_with_amax: a 16-aligned block of rows or columns of a tensor (or its 16-aligned column
// ranges side by side) quantized with the whole tensor's amaxes gets the bytes the whole tensor's
// quantization gives its elements (2D tiles too; with SR when opts.sr_origin places the piece in the whole).
Status quantize_ref_with_amax(const bf16* x, const Options& opts, const QuantizedView& out);
// Amaxes as quantize_ref computes them (col_amax only meaningful with rht; else equals row_amax).
void compute_amax_ref(const bf16* x, int64_t rows, int64_t cols, bool rht, float* row_amax, float* col_amax);
// RHT of one 16-element chunk: y = round_bf16((1/4) * (x o s) * H16), fixed butterfly order.
void rht16_ref(const float* x, float* y);
// Crest factors max|x| / rms(x) of the column-wise blocks of x [rows, cols] (16 consecutive rows of one
// column: the blocks of the column-wise copy, 16 tokens of one feature) and of the same blocks after
// rht16_ref, summed over the blocks that are neither all zero nor non-finite; rows past the last whole 16
// are ignored. The RHT raises the FP4 error of blocks whose crest factor it lowers and lowers the error
// where it raises it (tests/nvfp4/rht_study_test.cpp).
struct CrestSums {
  double plain = 0, rht = 0;
  int64_t blocks = 0;
};
void add_column_block_crests(const bf16* x, int64_t rows, int64_t cols, CrestSums* sums);
// x_hat = e2m1(q) * float(s_b) * amax / (6*448), or / (6*256) for a four_over_six copy; data
// [outer, inner/2], scales [outer, inner/16].
void dequantize_ref(const uint8_t* data, const uint8_t* scales, float amax, int64_t outer, int64_t inner, float* out,
                    bool four_over_six = false);

// cuBLAS block-scale layout: scales padded to 128 rows x 4 columns (zeros), each 128x4 tile 512
// contiguous bytes; (r, c) -> ((r/128)*(Kp/4) + c/4)*512 + (r%32)*16 + ((r%128)/32)*4 + c%4.
size_t swizzled_scale_bytes(int64_t rows, int64_t scale_cols);
size_t swizzled_offset(int64_t r, int64_t c, int64_t scale_cols);
void swizzle_scales_ref(const uint8_t* scales, int64_t rows, int64_t scale_cols, uint8_t* out);
void unswizzle_scales_ref(const uint8_t* swizzled, int64_t rows, int64_t scale_cols, uint8_t* out);

// ---- CUDA (device pointers; bit-identical to the reference) ---------------------------------
// Pre-pass: amax of the source into *row_amax and (when rht) of the transformed source into
// *col_amax (without rht, *col_amax gets the source amax too; either pointer may be null).
Status compute_amax_cuda(const bf16* x, int64_t rows, int64_t cols, bool rht, float* row_amax, float* col_amax,
                         Stream stream);
// One fused pass writing both copies, reading the amaxes already stored in out.row_amax/out.col_amax.
// With opts.four_over_six it runs quantize_4over6_cuda_with_amax instead.
Status quantize_cuda_with_amax(const bf16* x, const Options& opts, const QuantizedView& out, Stream stream);
// The 4/6 quantizer (nvfp4_4over6.cu: a simple kernel, one thread per block or 2D tile, separate from
// the fused pass): reads the tensor amaxes from the slots of the enabled copies and leaves them as they are.
Status quantize_4over6_cuda_with_amax(const bf16* x, const Options& opts, const QuantizedView& out, Stream stream);
// compute_amax_cuda + quantize_cuda_with_amax.
Status quantize_cuda(const bf16* x, const Options& opts, const QuantizedView& out, Stream stream);
// amax is a device pointer (as produced by the quantizer).
Status dequantize_cuda(const uint8_t* data, const uint8_t* scales, const float* amax, int64_t outer, int64_t inner,
                       float* out, Stream stream, bool four_over_six = false);
Status swizzle_scales_cuda(const uint8_t* scales, int64_t rows, int64_t scale_cols, uint8_t* out, Stream stream);
Status unswizzle_scales_cuda(const uint8_t* swizzled, int64_t rows, int64_t scale_cols, uint8_t* out, Stream stream);

}  // namespace nb::nvfp4
