// FP8 sub-channel CUDA quantizer: one block of 256 threads per 128x128 BF16 tile. Output: the row copy
// and the transposed copy with their FP32 scale_inv in the GEMM-ready layout of fp8_block.h. vec128: one
// scale per 128-element row (row copy) or column (transposed copy) of the tile; blk128x128: one scale per
// tile, shared by both copies.
//
// Steps:
//   1. Every thread loads 8 16-byte chunks (chunk it: row tid/16 + 16*it, columns 8*(tid%16) .. +7) into
//      registers, copies them to shared memory (raw BF16, 33 KB) and takes its partial amax from the
//      registers, on |x| as packed BF16 pairs: max.bf16x2 ignores a NaN as fmaxf does, and a max of BF16
//      values is exact, so every amax equals the reference's FP32 fmax.
//        blk128x128: thread -> warp (shuffles) -> tile (shared memory, after the block barrier).
//        vec128:     a row's 128 columns are the chunks of 16 consecutive lanes: 4 shuffles within the
//                    half-warp give its amax (two rows per shuffled word), one lane computes its scale.
//                    A column's amax: the thread's 8 rows, the other half-warp's 8 (one shuffle), then
//                    the 8 warps' through shared memory after the barrier, where each lane of warp w
//                    computes the scale of one of the 16 columns that w encodes.
//      No warp reduction per row or column: each scale is computed once, and shuffled to the lanes that
//      encode with it.
//   2. One block barrier (it also ORs the non-finite flags), then the row copy from each thread's own
//      chunks in shared memory (8 bytes per lane, 16 lanes per row) and the transposed copy from column
//      pairs (one 32-bit read gives two columns' values; 4 bytes of each per lane).
// The chunks' registers are free from the barrier on, so the kernel fits 40 registers (6 blocks per SM,
// the shared-memory limit).
//
// The E4M3 encode is the hardware's RNE satfinite conversion (two values per instruction) in tiles whose
// inputs are all finite (every product is then finite or +-Inf, where the hardware byte equals
// f32_to_e4m3_satfinite's); a tile holding Inf or NaN takes the software encode.
#include "core/cuda_check.h"
#include "core/macros.h"
#include "formats/fp8/fp8_block.h"
#include "formats/fp8/fp8_convert.cuh"

namespace nb::fp8 {
namespace {

constexpr int kT = kSubBlock;  // 128
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChunks = kT * kT / 8 / kThreads;      // 16-byte chunks per thread: 8
constexpr int kLanesPerRow = kT / 8;                 // a tile row is the chunks of 16 consecutive lanes
constexpr int kRowStride = kThreads / kLanesPerRow;  // tile rows between a thread's chunks: 16
// 32-bit words (BF16 pairs) per shared tile row: 64 + 1, so a column's consecutive rows lie in
// consecutive banks (65 = 1 mod 32).
constexpr int kPitchWords = kT / 2 + 1;
constexpr int kColsPerWarp = kT / kWarps;  // the transposed copy: warp w encodes columns 16w .. 16w+15
constexpr uint32_t kAbs2 = 0x7FFF7FFFu;    // clears the signs of a BF16 pair
constexpr uint32_t kFull = 0xffffffffu;

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// Packed BF16 pair maxima. max2 returns the non-NaN input where one is NaN (fmaxf's rule); max2_nan
// returns NaN then (to detect NaN).
__device__ __forceinline__ uint32_t max2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t max2_nan(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint4 max2(uint4 a, uint4 b) {
  return make_uint4(max2(a.x, b.x), max2(a.y, b.y), max2(a.z, b.z), max2(a.w, b.w));
}
__device__ __forceinline__ uint4 abs2(uint4 w) {
  return make_uint4(w.x & kAbs2, w.y & kAbs2, w.z & kAbs2, w.w & kAbs2);
}
// The low or high BF16 of a pair as FP32 (exact).
__device__ __forceinline__ float lo_f32(uint32_t w) { return bits_f32(w << 16); }
__device__ __forceinline__ float hi_f32(uint32_t w) { return bits_f32(w & 0xFFFF0000u); }
__device__ __forceinline__ float half_f32(uint32_t w, bool high) { return high ? hi_f32(w) : lo_f32(w); }

__device__ __forceinline__ uint32_t encode4_exact(const float* v, float scale) {
  uint32_t q = 0;
  for (int j = 0; j < 4; ++j) q |= f32_to_e4m3_satfinite(v[j] * scale) << (8 * j);
  return q;
}

// Four values to E4M3 bytes (v[0] in the low byte); `finite`: all four are finite.
__device__ __forceinline__ uint32_t encode4(const float* v, float scale, bool finite) {
  if (!finite) return encode4_exact(v, scale);
  return cvt_fp8x2<Format::e4m3>(v[0] * scale, v[1] * scale) |
         (cvt_fp8x2<Format::e4m3>(v[2] * scale, v[3] * scale) << 16);
}

// Eight BF16 values (a 16-byte chunk, first value in the low half of w.x) to eight E4M3 bytes.
__device__ __forceinline__ uint2 encode8(uint4 w, float scale, bool finite) {
  const float v[8] = {lo_f32(w.x), hi_f32(w.x), lo_f32(w.y), hi_f32(w.y),
                      lo_f32(w.z), hi_f32(w.z), lo_f32(w.w), hi_f32(w.w)};
  return make_uint2(encode4(v, scale, finite), encode4(v + 4, scale, finite));
}

// Shared-memory word of word p (columns 2p, 2p+1) of a tile row: words 32..63 swap the two halves of
// each 4-word chunk (bit 1), so the 16 lanes storing a row's chunks hit 16 distinct banks (lanes l and
// l+8 are 32 words apart: the same bank unswizzled).
__device__ __forceinline__ int swizzle(int p) { return p ^ ((p >> 4) & 2); }

// The loads are issued together as far as the register budget allows (the compiler issues the last ones
// once the first chunks are stored).
__device__ __forceinline__ void load_chunks(const bf16* __restrict__ x, int64_t cols, int64_t r0, int64_t c0,
                                            uint4 (&chunk)[kChunks]) {
  const bf16* src = x + (r0 + threadIdx.x / kLanesPerRow) * cols + c0 + 8 * (threadIdx.x % kLanesPerRow);
  NB_UNROLL
  for (int it = 0; it < kChunks; ++it) chunk[it] = *reinterpret_cast<const uint4*>(src + kRowStride * it * cols);
}

__device__ __forceinline__ void store_tile(const uint4 (&chunk)[kChunks], uint32_t* tile) {
  const int r = threadIdx.x / kLanesPerRow, p = 4 * (threadIdx.x % kLanesPerRow);
  uint32_t* row = tile + r * kPitchWords;
  NB_UNROLL
  for (int it = 0; it < kChunks; ++it) {
    uint32_t* dst = row + kRowStride * kPitchWords * it;
    dst[swizzle(p + 0)] = chunk[it].x;
    dst[swizzle(p + 1)] = chunk[it].y;
    dst[swizzle(p + 2)] = chunk[it].z;
    dst[swizzle(p + 3)] = chunk[it].w;
  }
}

// Max |x| of a chunk's even columns (low half) and odd columns (high half), from a = abs2(chunk):
// chunk_amax ignores NaN (the scale's amax), chunk_amax_nan keeps it (to detect non-finite values).
__device__ __forceinline__ uint32_t chunk_amax(uint4 a) { return max2(max2(a.x, a.y), max2(a.z, a.w)); }
__device__ __forceinline__ uint32_t chunk_amax_nan(uint4 a) { return max2_nan(max2_nan(a.x, a.y), max2_nan(a.z, a.w)); }
// Whether a pair of NaN-propagating maxima of |x| holds Inf (0x7F80) or NaN (above).
__device__ __forceinline__ bool nonfinite2(uint32_t m) { return (m & 0xFFFFu) >= 0x7F80u || (m >> 16) >= 0x7F80u; }

__device__ __forceinline__ void store8(uint8_t* dst, uint2 q) { *reinterpret_cast<uint2*>(dst) = q; }

// Row copy after the block barrier, from this thread's own chunks in shared memory (their registers are
// free by then): chunk it is row tid/16 + 16*it, 8 bytes per lane, 16 lanes per row. kRowScale (vec128):
// chunk it's scale is `scale` of lane it of the half-warp (row_scale), else `scale` is the tile's.
template <bool kRowScale>
__device__ __forceinline__ void encode_rows(const uint32_t* tile, float scale, bool finite, uint8_t* row_data,
                                            int64_t cols, int64_t r0, int64_t c0) {
  const int r = threadIdx.x / kLanesPerRow, p = 4 * (threadIdx.x % kLanesPerRow);
  uint8_t* dst = row_data + (r0 + r) * cols + c0 + 2 * p;
  NB_UNROLL
  for (int it = 0; it < kChunks; ++it) {
    const uint32_t* src = tile + (r + kRowStride * it) * kPitchWords;
    const uint4 w = make_uint4(src[swizzle(p)], src[swizzle(p + 1)], src[swizzle(p + 2)], src[swizzle(p + 3)]);
    const float s = kRowScale ? __shfl_sync(kFull, scale, it, kLanesPerRow) : scale;
    store8(dst + kRowStride * it * cols, encode8(w, s, finite));
  }
}

// The transposed copy's column pairs (word p: columns 2p, 2p+1) of warp w: k = 0..3 -> 4w + k, k = 4..7 ->
// 32 + 4w + k - 4, so that the swizzle of each is known at compile time: col_pair(w, k) = 4w + its offset
// below, swizzle(col_pair(w, k)) = 4w + pair_word(k).
__device__ __forceinline__ int col_pair(int warp, int k) { return k / 4 * 32 + 4 * warp + k % 4; }
constexpr int pair_word(int k) { return k / 4 * 32 + (k % 4 ^ k / 4 * 2); }

// Transposed copy: warp w encodes its 8 column pairs; lane: rows 4*lane .. +3 -> 4 bytes of each of a
// pair's two transposed rows. Lane groups of 8 read their 4 rows in rotated order (row
// 4*lane + ((j + g) & 3) at step j) so the 32 lanes hit 32 distinct banks; each encoded word is rotated
// back into row order (bytes are encoded independently). kColScale (vec128): `scale` of lane 2k (2k+1)
// is column 2*col_pair(w, k) (+1)'s (col_scale), else `scale` is the tile's.
template <bool kColScale>
__device__ __forceinline__ void encode_cols(const uint32_t* tile, float scale, bool finite, uint8_t* col_data,
                                            int64_t rows, int64_t r0, int64_t c0) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 8;
  const uint32_t* src[4];
  NB_UNROLL
  for (int j = 0; j < 4; ++j) src[j] = tile + (4 * lane + ((j + g) & 3)) * kPitchWords + 4 * warp;
  NB_UNROLL
  for (int k = 0; k < kColsPerWarp / 2; ++k) {
    float lo[4], hi[4];
    NB_UNROLL
    for (int j = 0; j < 4; ++j) {
      const uint32_t w = src[j][pair_word(k)];
      lo[j] = lo_f32(w);
      hi[j] = hi_f32(w);
    }
    const float s0 = kColScale ? __shfl_sync(kFull, scale, 2 * k) : scale;
    const float s1 = kColScale ? __shfl_sync(kFull, scale, 2 * k + 1) : scale;
    const uint32_t q0 = encode4(lo, s0, finite), q1 = encode4(hi, s1, finite);
    uint8_t* dst = col_data + (c0 + 2 * col_pair(warp, k)) * rows + r0 + 4 * lane;
    *reinterpret_cast<uint32_t*>(dst) = __funnelshift_l(q0, q0, 8 * g);
    *reinterpret_cast<uint32_t*>(dst + rows) = __funnelshift_l(q1, q1, 8 * g);
  }
}

// ---- blk128x128 ----

__device__ __forceinline__ void quantize_tile_blk(const uint4 (&chunk)[kChunks], const uint32_t* tile, float* warp_amax,
                                                  bool pow2, bool rowwise, bool colwise, int64_t rows, int64_t cols,
                                                  int64_t r0, int64_t c0, uint8_t* row_data, float* row_scale_inv,
                                                  uint8_t* col_data, float* col_scale_inv, int32_t* nonfinite) {
  uint32_t m = 0, n = 0;
  NB_UNROLL
  for (int it = 0; it < kChunks; ++it) {
    const uint4 a = abs2(chunk[it]);
    m = max2(m, chunk_amax(a));
    n = max2_nan(n, chunk_amax_nan(a));
  }
  const float a = warp_max(fmaxf(lo_f32(m), hi_f32(m)));
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = a;
  const bool finite_tile = !__syncthreads_or(nonfinite2(n));
  if (!finite_tile && threadIdx.x == 0 && nonfinite) atomicOr(nonfinite, 1);
  float tile_amax = 0.0f;
  for (int w = 0; w < kWarps; ++w) tile_amax = fmaxf(tile_amax, warp_amax[w]);
  const float scale = scale_from_amax(tile_amax, kE4M3Max, pow2);
  if (threadIdx.x == 0) {
    const float inv = 1.0f / scale;
    if (rowwise) row_scale_inv[(r0 / kT) * round4(cols / kT) + c0 / kT] = inv;
    if (colwise) col_scale_inv[(c0 / kT) * round4(rows / kT) + r0 / kT] = inv;
  }
  if (rowwise) encode_rows<false>(tile, scale, finite_tile, row_data, cols, r0, c0);
  if (colwise) encode_cols<false>(tile, scale, finite_tile, col_data, rows, r0, c0);
}

// ---- vec128 ----

// The thread's partial maxima of |x| in one pass over its chunks (each |x| is used at once, not kept).
struct VecAmax {
  // Rows: row[k] holds chunk 2k's max (low half: row tid/16 + 32k) and chunk 2k+1's (high half: row
  // tid/16 + 32k + 16), over this lane's 8 columns.
  uint32_t row[kChunks / 2];
  uint4 col;       // columns: per column pair of the chunks, over the thread's 8 rows
  bool nonfinite;  // an Inf or NaN among the 64 values
};
__device__ __forceinline__ VecAmax vec_amax(const uint4 (&chunk)[kChunks]) {
  VecAmax t;
  t.col = make_uint4(0, 0, 0, 0);
  uint32_t n = 0;
  NB_UNROLL
  for (int k = 0; k < kChunks / 2; ++k) {
    const uint4 a = abs2(chunk[2 * k]), b = abs2(chunk[2 * k + 1]);
    t.col = max2(t.col, max2(a, b));
    n = max2_nan(n, max2_nan(chunk_amax_nan(a), chunk_amax_nan(b)));
    const uint32_t ra = chunk_amax(a), rb = chunk_amax(b);                      // even columns low, odd columns high
    t.row[k] = max2(__byte_perm(ra, rb, 0x5410), __byte_perm(ra, rb, 0x7632));  // (ra.lo, rb.lo) vs (.hi, .hi)
  }
  t.nonfinite = nonfinite2(n);
  return t;
}

// Row scales: each pair of t.row is reduced over the 16 lanes that hold its rows (xor 8, 4, 2, 1 stays
// within the half-warp). Lane l of a half-warp returns the scale of chunk l%8's row (lanes l and l+8
// alike), so each scale is computed once per half-warp; lanes 0..7 write its scale_inv.
__device__ __forceinline__ float row_scale(const VecAmax& t, bool pow2, int64_t rows, int64_t r0, int64_t c0,
                                           float* row_scale_inv) {
  uint32_t m[kChunks / 2];
  NB_UNROLL
  for (int k = 0; k < kChunks / 2; ++k) {
    m[k] = t.row[k];
    NB_UNROLL
    for (int o = kLanesPerRow / 2; o > 0; o >>= 1) m[k] = max2(m[k], __shfl_xor_sync(kFull, m[k], o));
  }
  const int l = threadIdx.x % kLanesPerRow, it = l % kChunks;
  const uint32_t pair = it < 4 ? (it < 2 ? m[0] : m[1]) : (it < 6 ? m[2] : m[3]);
  const float scale = scale_from_amax(half_f32(pair, it & 1), kE4M3Max, pow2);
  if (l < kChunks)
    row_scale_inv[(c0 / kT) * round4(rows) + r0 + threadIdx.x / kLanesPerRow + kRowStride * it] = 1.0f / scale;
  return scale;
}

// The two half-warps hold the same columns (rows tid/16 and tid/16 xor 1): one shuffle combines their
// maxima, then lanes 0..15 store the warp's maxima of columns 8*lane .. +7.
// col_amax[w][p]: max |x| of columns 2p (low half), 2p+1 (high half) over warp w's 16 rows.
struct VecScratch {
  alignas(16) uint32_t col_amax[kWarps][kT / 2];
};
__device__ __forceinline__ void store_col_amax(uint4 c, VecScratch& s) {
  const uint4 m = max2(c, make_uint4(__shfl_xor_sync(kFull, c.x, 16), __shfl_xor_sync(kFull, c.y, 16),
                                     __shfl_xor_sync(kFull, c.z, 16), __shfl_xor_sync(kFull, c.w, 16)));
  const int lane = threadIdx.x % 32;
  if (lane < kLanesPerRow) *reinterpret_cast<uint4*>(&s.col_amax[threadIdx.x / 32][4 * lane]) = m;
}

// After the barrier: lane l of warp w returns the scale of column 2*col_pair(w, l%16 / 2) + l%2, the
// order encode_cols takes them in (lanes l and l+16 alike); lanes 0..15 write its scale_inv.
__device__ __forceinline__ float col_scale(const VecScratch& s, bool pow2, int64_t cols, int64_t r0, int64_t c0,
                                           float* col_scale_inv) {
  const int lane = threadIdx.x % 32, i = lane % kColsPerWarp, p = col_pair(threadIdx.x / 32, i / 2);
  uint32_t m = 0;
  NB_UNROLL
  for (int w = 0; w < kWarps; ++w) m = max2(m, s.col_amax[w][p]);
  const float scale = scale_from_amax(half_f32(m, i & 1), kE4M3Max, pow2);
  if (lane < kColsPerWarp) col_scale_inv[(r0 / kT) * round4(cols) + c0 + 2 * p + (i & 1)] = 1.0f / scale;
  return scale;
}

__device__ __forceinline__ void quantize_tile_vec(const uint4 (&chunk)[kChunks], const uint32_t* tile, VecScratch& s,
                                                  bool pow2, bool rowwise, bool colwise, int64_t rows, int64_t cols,
                                                  int64_t r0, int64_t c0, uint8_t* row_data, float* row_scale_inv,
                                                  uint8_t* col_data, float* col_scale_inv, int32_t* nonfinite) {
  const VecAmax t = vec_amax(chunk);
  store_col_amax(t.col, s);
  const float scale = rowwise ? row_scale(t, pow2, rows, r0, c0, row_scale_inv) : 1.0f;
  const bool finite_tile = !__syncthreads_or(t.nonfinite);
  if (!finite_tile && threadIdx.x == 0 && nonfinite) atomicOr(nonfinite, 1);
  if (rowwise) encode_rows<true>(tile, scale, finite_tile, row_data, cols, r0, c0);
  if (colwise)
    encode_cols<true>(tile, col_scale(s, pow2, cols, r0, c0, col_scale_inv), finite_tile, col_data, rows, r0, c0);
}

template <bool kTileScale>
struct Scratch : VecScratch {};
template <>
struct Scratch<true> {
  float warp_amax[kWarps];
};

// kTileScale: blk128x128 (one scale per tile), else vec128. 6 blocks per SM: 40 registers.
template <bool kTileScale>
__global__ void __launch_bounds__(kThreads, 6)
    block_quantize_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, bool pow2, bool rowwise, bool colwise,
                          uint8_t* row_data, float* row_scale_inv, uint8_t* col_data, float* col_scale_inv,
                          int32_t* nonfinite) {
  __shared__ uint32_t tile[kT * kPitchWords];
  __shared__ Scratch<kTileScale> s;
  const int64_t r0 = int64_t(blockIdx.y) * kT, c0 = int64_t(blockIdx.x) * kT;
  uint4 chunk[kChunks];
  load_chunks(x, cols, r0, c0, chunk);
  store_tile(chunk, tile);
  if constexpr (kTileScale)
    quantize_tile_blk(chunk, tile, s.warp_amax, pow2, rowwise, colwise, rows, cols, r0, c0, row_data, row_scale_inv,
                      col_data, col_scale_inv, nonfinite);
  else
    quantize_tile_vec(chunk, tile, s, pow2, rowwise, colwise, rows, cols, r0, c0, row_data, row_scale_inv, col_data,
                      col_scale_inv, nonfinite);
}

}  // namespace

Status quantize_block_cuda(const bf16* x, const BlockOptions& opt, const BlockView& out, Stream stream) {
  NB_TRY(check_block_shape(opt.kind, out.rows, out.cols));
  if (out.rows / kT > 65535)
    return errorf("FP8 quantize_block_cuda: %lld rows is too many for one launch (at most %d)", (long long)out.rows,
                  65535 * kT);
  auto s = static_cast<cudaStream_t>(stream);
  if (out.nonfinite) CUDA_CHECK(cudaMemsetAsync(out.nonfinite, 0, sizeof(int32_t), s));
  // Padding entries of the scale tensors are defined as 0.
  if (opt.rowwise)
    CUDA_CHECK(cudaMemsetAsync(out.row_scale_inv, 0,
                               sizeof(float) * block_scale_count(opt.kind, out.rows, out.cols, false), s));
  if (opt.colwise)
    CUDA_CHECK(cudaMemsetAsync(out.col_scale_inv, 0,
                               sizeof(float) * block_scale_count(opt.kind, out.rows, out.cols, true), s));
  dim3 grid(unsigned(out.cols / kT), unsigned(out.rows / kT));
  auto kernel = opt.kind == BlockKind::blk128x128 ? block_quantize_kernel<true> : block_quantize_kernel<false>;
  kernel<<<grid, kThreads, 0, s>>>(x, out.rows, out.cols, opt.pow2_scales, opt.rowwise, opt.colwise, out.row_data,
                                   out.row_scale_inv, out.col_data, out.col_scale_inv, out.nonfinite);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace nb::fp8
