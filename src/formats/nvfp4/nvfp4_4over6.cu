// CUDA 4/6 adaptive block scaling for NVFP4 (Options::four_over_six; the rule is in nvfp4_math.h):
// bit-identical to quantize_ref, deliberately simple and separate from the fused quantizer of
// nvfp4_quantize.cu so that kernel stays as tuned. One thread per 16-element block of one copy (per
// 16x16 tile with two_d), loading straight from global memory; the per-block math is the shared
// quantize_block16_4over6 / tile_scale_4over6, the RHT the reference's hadamard::rht16_bf16, the SR
// key and origin rule nvfp4.h's. On an H100 it takes about 4x the fused pass's time (8192 x 8192).
// Order on the stream: the caller's amax pre-pass, one launch per copy (both read the tensor amaxes, which
// stay in their slots: 4/6 stores the true amax), then a one-thread kernel that raises the non-finite flag.
#include <algorithm>
#include "core/cuda_check.h"
#include "core/device_info.h"
#include "formats/hadamard/hadamard.h"
#include "formats/nvfp4/nvfp4.h"
#include "formats/nvfp4/nvfp4_math.h"

namespace nb::nvfp4 {
namespace {

constexpr int kThreads = 256;

struct CopyArgs {
  const bf16* x;
  int64_t rows, cols;
  bool colwise;  // the transposed copy [cols, rows] instead of the row copy [rows, cols]
  bool rht, sr;
  ErrMode mode;
  RngKey key;
  const float* amax;  // the tensor amax of this copy
  uint8_t *data, *scales;
};

NB_DEVICE void store_block(uint8_t* data, uint8_t* scales, int64_t flat_block, uint64_t packed, uint32_t s) {
  // inner is a multiple of 16, so block flat_block starts 8 * flat_block bytes in: 8-byte aligned.
  *reinterpret_cast<uint2*>(data + flat_block * 8) = make_uint2(uint32_t(packed), uint32_t(packed >> 32));
  scales[flat_block] = uint8_t(s);
}

// Column copy: thread t takes column t % cols, 16-row chunk t / cols, so a warp reads 32 neighbouring
// columns of one row at a time (coalesced); its block is (outer = column, blk = chunk). The SR origin's
// counters (sr_blocks) come as a parameter of their own: inside CopyArgs they take it past 128 bytes, and
// ptxas then gives the kernel 64 registers instead of 48 (4 CTAs per SM instead of 5), about 9% slower on
// an H100. kCp: a context-parallel row map, in an instance of its own (its shift cost the default 2% on an H100).
template <bool kCp>
__global__ void __launch_bounds__(kThreads) quantize_4over6_1d_kernel(CopyArgs a, SrBlocks sr_at) {
  const float amax = *a.amax;
  const float s_enc = global_encode_scale_4over6(amax);
  const int64_t blocks = a.rows * a.cols / 16, inner = a.colwise ? a.rows : a.cols;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < blocks; t += int64_t(gridDim.x) * blockDim.x) {
    float v[16];
    int64_t outer = 0, blk = 0;
    if (a.colwise) {
      outer = t % a.cols;
      blk = t / a.cols;
      for (int j = 0; j < 16; ++j) v[j] = bf16_to_f32(a.x[(blk * 16 + j) * a.cols + outer]);
      if (a.rht) hadamard::rht16_bf16(v);
    } else {
      outer = t / (a.cols / 16);
      blk = t % (a.cols / 16);
      for (int j = 0; j < 16; ++j) v[j] = bf16_to_f32(a.x[outer * a.cols + blk * 16 + j]);
    }
    const int64_t flat = outer * (inner / 16) + blk;
    Philox4x32 rand{};
    if (a.sr) rand = philox_block(a.key, uint64_t(sr_block_index<kCp>(sr_at, outer, blk)));
    uint64_t packed = 0;
    const uint32_t s = quantize_block16_4over6(v, s_enc, amax, a.mode, a.sr, rand, &packed);
    store_block(a.data, a.scales, flat, packed, s);
  }
}

struct TileArgs {
  const bf16* x;
  int64_t rows, cols;
  ErrMode mode;
  const float* amax;                                       // the one amax of a 2D tensor
  uint8_t *row_data, *row_scales, *col_data, *col_scales;  // null for a disabled copy
};

// 2D weights (RNE only): thread = one 16x16 tile; one 4/6 decision per enabled copy (each in that copy's
// reduction order, as the reference), then its 16 row blocks and 16 column blocks with their scales.
__global__ void __launch_bounds__(kThreads) quantize_4over6_2d_kernel(TileArgs a) {
  const float amax = *a.amax;
  const float s_enc = global_encode_scale_4over6(amax);
  const int64_t tiles_x = a.cols / 16, tiles = (a.rows / 16) * tiles_x;
  const Philox4x32 no_rand{};
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < tiles; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t tr = t / tiles_x, tc = t % tiles_x;
    const uint32_t s_row =
        a.row_data ? tile_scale_4over6(a.x, a.cols, tr * 16, tc * 16, s_enc, amax, a.mode, false) : 0;
    const uint32_t s_col = a.col_data ? tile_scale_4over6(a.x, a.cols, tr * 16, tc * 16, s_enc, amax, a.mode, true) : 0;
    const float enc_row = block_encode_scale(s_row, s_enc), enc_col = block_encode_scale(s_col, s_enc);
    for (int i = 0; i < 16; ++i) {
      float v[16];
      if (a.row_data) {
        for (int j = 0; j < 16; ++j) v[j] = bf16_to_f32(a.x[(tr * 16 + i) * a.cols + tc * 16 + j]);
        store_block(a.row_data, a.row_scales, (tr * 16 + i) * tiles_x + tc, encode_block16(v, enc_row, false, no_rand),
                    s_row);
      }
      if (a.col_data) {
        for (int j = 0; j < 16; ++j) v[j] = bf16_to_f32(a.x[(tr * 16 + j) * a.cols + tc * 16 + i]);
        store_block(a.col_data, a.col_scales, (tc * 16 + i) * (a.rows / 16) + tr,
                    encode_block16(v, enc_col, false, no_rand), s_col);
      }
    }
  }
}

// A non-finite amax of an enabled copy (non-finite input) sets the flag, as quantize_ref does. Null
// pointers: disabled copies.
__global__ void flag_nonfinite_amax_kernel(const float* row_amax, const float* col_amax, int* nonfinite) {
  if ((row_amax && !amax_is_finite(*row_amax)) || (col_amax && !amax_is_finite(*col_amax))) *nonfinite = 1;
}

int grid_for(int64_t items) {
  return int(std::min<int64_t>((items + kThreads - 1) / kThreads, int64_t(current_device_sm_count()) * 16));
}

// One copy with 1x16 blocks: the row map's instance only where SR has a map.
void launch_1d(const CopyArgs& a, const SrBlocks& at, int grid, cudaStream_t s) {
  if (a.sr && sr_blocks_have_map(at))
    quantize_4over6_1d_kernel<true><<<grid, kThreads, 0, s>>>(a, at);
  else
    quantize_4over6_1d_kernel<false><<<grid, kThreads, 0, s>>>(a, at);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

Status quantize_4over6_cuda_with_amax(const bf16* x, const Options& opts, const QuantizedView& out, Stream stream) {
  NB_TRY(check_shape(out.rows, out.cols, opts));
  auto s = static_cast<cudaStream_t>(stream);
  float* row_amax = opts.rowwise ? out.row_amax : nullptr;
  float* col_amax = opts.colwise ? out.col_amax : nullptr;
  if (opts.two_d) {
    // As the fused kernel: the row amax, or the column slot (same value without RHT) when row-wise is off.
    TileArgs a{x,
               out.rows,
               out.cols,
               opts.err_mode,
               row_amax ? row_amax : col_amax,
               opts.rowwise ? out.row_data : nullptr,
               out.row_scales,
               opts.colwise ? out.col_data : nullptr,
               out.col_scales};
    quantize_4over6_2d_kernel<<<grid_for((out.rows / 16) * (out.cols / 16)), kThreads, 0, s>>>(a);
    CUDA_CHECK_LAUNCH();
  } else {
    const int grid = grid_for(out.rows * out.cols / 16);
    if (opts.rowwise) {
      const SrBlocks at = sr_blocks(opts.sr_origin, out.rows, out.cols, false);
      const CopyArgs a{x,        out.rows, out.cols,     false,         false, opts.sr, opts.err_mode,
                       opts.rng, row_amax, out.row_data, out.row_scales};
      launch_1d(a, at, grid, s);
    }
    if (opts.colwise) {
      const RngKey key = colwise_key(opts.rng);
      const SrBlocks at = sr_blocks(opts.sr_origin, out.rows, out.cols, true);
      const CopyArgs a{x,   out.rows, out.cols,     true,          opts.rht, opts.sr, opts.err_mode,
                       key, col_amax, out.col_data, out.col_scales};
      launch_1d(a, at, grid, s);
    }
  }
  if (out.nonfinite) {
    flag_nonfinite_amax_kernel<<<1, 1, 0, s>>>(row_amax, col_amax, out.nonfinite);
    CUDA_CHECK_LAUNCH();
  }
  return Status::ok();
}

}  // namespace nb::nvfp4
