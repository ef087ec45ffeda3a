// CUDA NVFP4 quantizer: an amax pre-pass (reduction) and one fused pass that reads each BF16 tile
// once and writes the row-wise copy and the transposed column-wise copy (with optional RHT, SR, 2D
// tiles). Bit-identical to nvfp4_ref.cpp: the per-block math is the shared nvfp4_math.h.
//
// Quantize pass: a CTA owns a 64 x 128 tile (16 KiB of BF16 in shared memory, 16-byte global loads).
//   row phase : 512 row blocks (1x16), 2 per thread; 8-byte code stores, 8 threads per 64 B of a row.
//   col phase : thread = (column pair, 16-row chunk); a warp reads 32 consecutive 4-byte words of one
//               smem row (conflict-free); codes are staged in smem so each column's 32 output bytes
//               leave as full 32-byte sectors.
// Tiles at the right/bottom edge are partial (dims are multiples of 16 only): guards per 16-row
// chunk and per 8-column load; missing values read as zero and are never stored.
#include <algorithm>
#include <cfloat>
#include "core/cuda_check.h"
#include "formats/hadamard/hadamard.h"
#include "formats/nvfp4/nvfp4.h"
#include "formats/nvfp4/nvfp4_math.h"

namespace nb::nvfp4 {
namespace {

constexpr int kTileRows = 64, kTileCols = 128, kThreads = 256;
constexpr int kColStagePitchWords = 9;  // 32 code bytes per column + 4 pad bytes: fewer bank conflicts

NB_DEVICE void unpack8(const uint4& q, float* v) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
NB_UNROLL
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = bits_f32(w[i] << 16);
    v[2 * i + 1] = bits_f32(w[i] & 0xFFFF0000u);
  }
}

NB_DEVICE uint32_t warp_max(uint32_t m) {
NB_UNROLL
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  return m;
}

// ---- amax pre-pass -------------------------------------------------------------------------------
// Thread = patch of 16 rows x 8 columns (16 x 16-byte loads): the row amax over all values and, with
// RHT, the column amax over the 8 transformed, BF16-rounded 16-row chunks.
template <bool kRht>
__global__ void __launch_bounds__(256) amax_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols,
                                                   uint32_t* row_amax, uint32_t* col_amax) {
  const int64_t pcols = cols / 8, patches = (rows / 16) * pcols;
  uint32_t mr = 0, mc = 0;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < patches; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r0 = (p / pcols) * 16, c0 = (p % pcols) * 8;
    uint4 q[16];
NB_UNROLL
    for (int j = 0; j < 16; ++j) q[j] = __ldg(reinterpret_cast<const uint4*>(x + (r0 + j) * cols + c0));
NB_UNROLL
    for (int j = 0; j < 16; ++j) {
      const uint32_t w[4] = {q[j].x, q[j].y, q[j].z, q[j].w};
NB_UNROLL
      for (int i = 0; i < 4; ++i) mr = max(mr, max((w[i] << 16) & 0x7FFFFFFFu, w[i] & 0x7FFF0000u));
    }
    if constexpr (kRht) {
NB_UNROLL
      for (int c = 0; c < 8; ++c) {
        float v[16];
NB_UNROLL
        for (int j = 0; j < 16; ++j) {
          const uint32_t w = (&q[j].x)[c / 2];
          v[j] = bits_f32((c & 1) ? (w & 0xFFFF0000u) : (w << 16));
        }
        hadamard::rht16_bf16(v);
        mc = max(mc, abs_bits(block_amax16(v)));
      }
    }
  }
  __shared__ uint32_t red[2][8];
  mr = warp_max(mr);
  if constexpr (kRht) mc = warp_max(mc);
  if ((threadIdx.x & 31) == 0) { red[0][threadIdx.x / 32] = mr; red[1][threadIdx.x / 32] = mc; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < int(blockDim.x / 32); ++i) { mr = max(mr, red[0][i]); mc = max(mc, red[1][i]); }
    if (mr != 0 && row_amax) atomicMax(row_amax, mr);
    if (kRht && mc != 0 && col_amax) atomicMax(col_amax, mc);
    if (!kRht && mr != 0 && col_amax) atomicMax(col_amax, mr);
  }
}

// ---- fused quantize pass -------------------------------------------------------------------------
struct KernelArgs {
  const bf16* x;
  int64_t rows, cols;
  bool rowwise, colwise;
  RngKey rng;
  uint8_t *row_data, *row_scales, *col_data, *col_scales;
  const float *row_amax, *col_amax;
  int* nonfinite;
};

template <bool kTwoD, bool kRht, bool kSr>
__global__ void __launch_bounds__(kThreads) quantize_kernel(KernelArgs a) {
  __shared__ __align__(16) uint32_t tile[kTileRows * kTileCols / 2];  // BF16 pairs, row pitch 64 words
  __shared__ uint32_t col_stage[kTileCols * kColStagePitchWords];
  __shared__ uint8_t col_scale_stage[kTileCols * 4];
  __shared__ uint8_t tile_scale[4 * 8];  // 2D: one code per 16x16 tile

  const int t = threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * kTileRows, c0 = int64_t(blockIdx.x) * kTileCols;
  const int valid_rows = int(a.rows - r0 < kTileRows ? a.rows - r0 : kTileRows);
  const int valid_cols = int(a.cols - c0 < kTileCols ? a.cols - c0 : kTileCols);

  const float row_amax = a.row_amax ? *a.row_amax : *a.col_amax;
  const float col_amax = a.col_amax ? *a.col_amax : row_amax;
  if (blockIdx.x == 0 && blockIdx.y == 0 && t == 0 && a.nonfinite &&
      (!amax_is_finite(row_amax) || !amax_is_finite(col_amax)))
    *a.nonfinite = 1;
  const float s_enc_row = global_encode_scale(row_amax);
  const float s_enc_col = kTwoD ? s_enc_row : global_encode_scale(col_amax);

  // Load the tile: 1024 16-byte pieces, 4 per thread, all issued before the first use.
  uint4 piece[4];
NB_UNROLL
  for (int i = 0; i < 4; ++i) {
    const int idx = t + kThreads * i, row = idx / 16, q = idx % 16;
    piece[i] = make_uint4(0, 0, 0, 0);
    if (row < valid_rows && q * 8 < valid_cols)
      piece[i] = __ldg(reinterpret_cast<const uint4*>(a.x + (r0 + row) * a.cols + c0 + q * 8));
  }
NB_UNROLL
  for (int i = 0; i < 4; ++i) {
    const int idx = t + kThreads * i;
    reinterpret_cast<uint4*>(tile)[idx] = piece[i];
  }
  __syncthreads();

  if constexpr (kTwoD) {
    // 32 tiles of 16x16; 8 threads per tile, 2 rows each, reduced by shuffles within the 8 lanes.
    const int tl = t / 8, sub = t % 8, ti = tl / 8, tj = tl % 8;
    uint32_t m = 0;
NB_UNROLL
    for (int rr = 0; rr < 2; ++rr) {
      const uint4* src = reinterpret_cast<const uint4*>(tile) + (ti * 16 + sub * 2 + rr) * 16 + tj * 2;
      float v[16];
      unpack8(src[0], v);
      unpack8(src[1], v + 8);
      m = max(m, abs_bits(block_amax16(v)));
    }
NB_UNROLL
    for (int o = 4; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if (sub == 0) tile_scale[tl] = uint8_t(block_scale_code(bits_f32(m), s_enc_row));
    __syncthreads();
  }

  // Row phase.
  if (a.rowwise) {
    const int blk = t % 8;
NB_UNROLL
    for (int i = 0; i < 2; ++i) {
      const int row = t / 8 + 32 * i;
      if (row >= valid_rows || blk * 16 >= valid_cols) continue;
      const uint4* src = reinterpret_cast<const uint4*>(tile) + row * 16 + blk * 2;
      const int h = (blk >> 2) & 1;  // halves in swapped order for blocks 4..7: conflict-free 16-byte reads
      const uint4 first = src[h], second = src[h ^ 1];
      float v[16];
      unpack8(h ? second : first, v);
      unpack8(h ? first : second, v + 8);
      const uint32_t s = kTwoD ? tile_scale[(row / 16) * 8 + blk] : block_scale_code(block_amax16(v), s_enc_row);
      const float enc = block_encode_scale(s, s_enc_row);
      const int64_t grow = r0 + row, gblk = c0 / 16 + blk;
      Philox4x32 rand{};
      if constexpr (kSr) rand = philox_block(a.rng, uint64_t((grow * a.cols) / 16 + gblk));
      const uint64_t packed = encode_block16(v, enc, kSr, rand);
      *reinterpret_cast<uint2*>(a.row_data + grow * (a.cols / 2) + gblk * 8) =
          make_uint2(uint32_t(packed), uint32_t(packed >> 32));
      a.row_scales[grow * (a.cols / 16) + gblk] = uint8_t(s);
    }
  }

  // Column phase: thread = (column pair p, 16-row chunk k).
  if (a.colwise) {
    const int warp = t / 32, lane = t % 32, p = (warp % 2) * 32 + lane, k = warp / 2;
    if (k * 16 < valid_rows && p * 2 < valid_cols) {
      float v0[16], v1[16];
NB_UNROLL
      for (int j = 0; j < 16; ++j) {
        const uint32_t w = tile[(k * 16 + j) * (kTileCols / 2) + p];
        v0[j] = bits_f32(w << 16);
        v1[j] = bits_f32(w & 0xFFFF0000u);
      }
      const RngKey key = colwise_key(a.rng);
NB_UNROLL
      for (int q = 0; q < 2; ++q) {
        float* v = q ? v1 : v0;
        if constexpr (kRht) hadamard::rht16_bf16(v);
        const int col = 2 * p + q;
        const uint32_t s = kTwoD ? tile_scale[k * 8 + col / 16] : block_scale_code(block_amax16(v), s_enc_col);
        const float enc = block_encode_scale(s, s_enc_col);
        Philox4x32 rand{};
        if constexpr (kSr) rand = philox_block(key, uint64_t(((c0 + col) * a.rows + r0) / 16 + k));
        const uint64_t packed = encode_block16(v, enc, kSr, rand);
        col_stage[col * kColStagePitchWords + 2 * k] = uint32_t(packed);
        col_stage[col * kColStagePitchWords + 2 * k + 1] = uint32_t(packed >> 32);
        col_scale_stage[col * 4 + k] = uint8_t(s);
      }
    }
    __syncthreads();
    // 128 columns x 32 bytes: two threads per column, 16 bytes each (two 8-byte stores, since a
    // column's start is only 8-byte aligned when rows is an odd multiple of 16).
    const int col = t / 2, half = t % 2;
    if (col < valid_cols) {
      uint8_t* dst = a.col_data + (c0 + col) * (a.rows / 2) + r0 / 2 + half * 16;
      const uint32_t* src = col_stage + col * kColStagePitchWords + half * 4;
      if (half * 32 < valid_rows) *reinterpret_cast<uint2*>(dst) = make_uint2(src[0], src[1]);
      if (half * 32 + 16 < valid_rows) *reinterpret_cast<uint2*>(dst + 8) = make_uint2(src[2], src[3]);
      if (half == 0) {
        uint8_t* sdst = a.col_scales + (c0 + col) * (a.rows / 16) + r0 / 16;
        for (int kk = 0; kk < 4 && kk * 16 < valid_rows; ++kk) sdst[kk] = col_scale_stage[col * 4 + kk];
      }
    }
  }
}

Status check_view(const Options& opts, const QuantizedView& out) {
  NB_TRY(check_shape(out.rows, out.cols, opts));
  if (opts.rowwise && (!out.row_data || !out.row_scales || !out.row_amax))
    return errorf("NVFP4 row-wise output of a %lld x %lld tensor needs row_data, row_scales and row_amax",
                  (long long)out.rows, (long long)out.cols);
  if (opts.colwise && (!out.col_data || !out.col_scales || !out.col_amax))
    return errorf("NVFP4 column-wise output of a %lld x %lld tensor needs col_data, col_scales and col_amax",
                  (long long)out.rows, (long long)out.cols);
  return Status::ok();
}

}  // namespace

Status compute_amax_cuda(const bf16* x, int64_t rows, int64_t cols, bool rht, float* row_amax, float* col_amax,
                         Stream stream) {
  NB_TRY(check_shape(rows, cols, Options{}));
  auto s = static_cast<cudaStream_t>(stream);
  if (row_amax) CUDA_CHECK(cudaMemsetAsync(row_amax, 0, sizeof(float), s));
  if (col_amax) CUDA_CHECK(cudaMemsetAsync(col_amax, 0, sizeof(float), s));
  const int64_t patches = (rows / 16) * (cols / 8);
  int sms = 132;
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int grid = int(std::min<int64_t>((patches + 255) / 256, int64_t(sms) * 8));
  auto* ra = reinterpret_cast<uint32_t*>(row_amax);
  auto* ca = reinterpret_cast<uint32_t*>(col_amax);
  if (rht) amax_kernel<true><<<grid, 256, 0, s>>>(x, rows, cols, ra, ca);
  else amax_kernel<false><<<grid, 256, 0, s>>>(x, rows, cols, ra, ca);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status quantize_cuda_with_amax(const bf16* x, const Options& opts, const QuantizedView& out, Stream stream) {
  NB_TRY(check_view(opts, out));
  KernelArgs a{x, out.rows, out.cols, opts.rowwise, opts.colwise, opts.rng, out.row_data, out.row_scales,
               out.col_data, out.col_scales, opts.rowwise ? out.row_amax : nullptr,
               opts.colwise ? out.col_amax : nullptr, out.nonfinite};
  dim3 grid(unsigned((out.cols + kTileCols - 1) / kTileCols), unsigned((out.rows + kTileRows - 1) / kTileRows));
  auto s = static_cast<cudaStream_t>(stream);
  const bool rht = opts.rht && opts.colwise;
  if (opts.two_d) quantize_kernel<true, false, false><<<grid, kThreads, 0, s>>>(a);
  else if (rht && opts.sr) quantize_kernel<false, true, true><<<grid, kThreads, 0, s>>>(a);
  else if (rht) quantize_kernel<false, true, false><<<grid, kThreads, 0, s>>>(a);
  else if (opts.sr) quantize_kernel<false, false, true><<<grid, kThreads, 0, s>>>(a);
  else quantize_kernel<false, false, false><<<grid, kThreads, 0, s>>>(a);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status quantize_cuda(const bf16* x, const Options& opts, const QuantizedView& out, Stream stream) {
  NB_TRY(check_view(opts, out));
  NB_TRY(compute_amax_cuda(x, out.rows, out.cols, opts.rht && opts.colwise, opts.rowwise ? out.row_amax : nullptr,
                           opts.colwise ? out.col_amax : nullptr, stream));
  return quantize_cuda_with_amax(x, opts, out, stream);
}

}  // namespace nb::nvfp4
