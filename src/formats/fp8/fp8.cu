// FP8 per-tensor CUDA quantizers. Current scaling = an amax pass (16-byte loads, BF16-pair max), then
// one quantize pass that reads a BF16 tile once and writes the row copy and the transposed copy
// (128x128 tiles encoded once into an FP8 shared tile whose bytes are transposed, when rows and cols
// are multiples of 8; else 64x64 tiles element by element). The scale is derived from the
// device-side amax inside each block with the same NB_HD formula as the CPU reference, so no host
// round trip is needed and every block uses the identical FP32 scale.
#include <algorithm>
#include <cuda_bf16.h>
#include "core/cuda_check.h"
#include "core/device_info.h"
#include "formats/fp8/fp8.h"
#include "formats/fp8/fp8_convert.cuh"
#include "formats/mor/mor_stat.cuh"

namespace nb::fp8 {
namespace {

constexpr int kTile = 64;
constexpr int kThreads = 256;

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Two values to FP8 (a in the low byte) with the hardware's round-to-nearest-even satfinite
// conversion (sm_89+), about 20x fewer instructions than the software encode(). Finite values and
// +-Inf give encode()'s bytes; NaN, where the hardware's NaN byte may differ, takes encode()'s.
__device__ __forceinline__ uint32_t encode2(float a, float b, Format fmt) {
  uint32_t q = fmt == Format::e4m3 ? cvt_fp8x2<Format::e4m3>(a, b) : cvt_fp8x2<Format::e5m2>(a, b);
  if (a != a) q = (q & 0xFF00u) | encode(a, fmt);
  if (b != b) q = (q & 0x00FFu) | (encode(b, fmt) << 8);
  return q;
}

// Block-wide max of non-negative floats, folded into *amax with an integer atomicMax (the bit
// patterns of non-negative floats, +Inf included, order like the values).
__device__ void block_amax_to_global(float v, float* amax) {
  __shared__ float partial[kThreads / 32];
  v = warp_max(v);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float w = threadIdx.x < kThreads / 32 ? partial[threadIdx.x] : 0.0f;
    w = warp_max(w);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(amax), f32_bits(w));
  }
}

// Bit 15 (low half) or 31 (high half) is set iff that BF16 has an all-ones exponent (Inf or NaN):
// (e & 0x7F80) + 0x80 reaches 0x8000 only for e = 0x7F80, and never carries into the high half.
__device__ __forceinline__ uint32_t nonfinite_bits(uint32_t u) { return (u & 0x7F807F80u) + 0x00800080u; }
constexpr uint32_t kNonfiniteMask = 0x80008000u;

// x: n BF16 values -> *amax (pre-zeroed), *nonfinite (pre-zeroed). Grid-stride over slabs of
// kAmaxLoads x kThreads 16-byte chunks (cudaMalloc'd pointers are 256-byte aligned): each thread
// issues its kAmaxLoads loads before using any, so 64 bytes per thread are in flight. The max is
// taken on BF16 pairs (|x| by clearing the sign bits; the BF16 max drops a NaN operand like fmaxf,
// and BF16 -> FP32 is exact and monotone, so it equals the reference's FP32 fmax); Inf/NaN are
// detected on the exponent bits. Then the tail element by element and one atomic per block.
constexpr int kAmaxLoads = 4;
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const bf16* __restrict__ x, int64_t n, float* amax, int32_t* nonfinite) {
  const bool aligned = (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
  const int64_t nvec = aligned ? n / 8 : 0;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  __nv_bfloat162 m2 = __floats2bfloat162_rn(0.0f, 0.0f);
  uint32_t bad_bits = 0;
  for (int64_t base = int64_t(blockIdx.x) * kThreads * kAmaxLoads; base < nvec;
       base += int64_t(gridDim.x) * kThreads * kAmaxLoads) {
    uint4 w[kAmaxLoads];
    NB_UNROLL for (int j = 0; j < kAmaxLoads; ++j) {
      const int64_t i = base + j * kThreads + threadIdx.x;
      w[j] = i < nvec ? xv[i] : make_uint4(0, 0, 0, 0);
    }
    NB_UNROLL for (int j = 0; j < kAmaxLoads; ++j) {
      const uint32_t u[4] = {w[j].x, w[j].y, w[j].z, w[j].w};
      NB_UNROLL for (int i = 0; i < 4; ++i) {
        bad_bits |= nonfinite_bits(u[i]);
        const uint32_t mag = u[i] & 0x7FFF7FFFu;
        m2 = __hmax2(m2, *reinterpret_cast<const __nv_bfloat162*>(&mag));
      }
    }
  }
  float m = fmaxf(__low2float(m2), __high2float(m2));
  bool bad = (bad_bits & kNonfiniteMask) != 0;
  for (int64_t i = nvec * 8 + int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads) {
    float v = bf16_to_f32(x[i]);
    m = fmaxf(m, fabsf(v));
    bad |= !isfinite(v);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0 && nonfinite) atomicOr(nonfinite, 1);
  block_amax_to_global(m, amax);
}

// x [rows, cols] -> data [rows, cols], data_t [cols, rows]. The scale is *scale, or computed from
// *amax_in when from_amax. record_amax: also fold this tile's amax into *amax_out.
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, Format fmt, const float* scale_ptr,
                    bool from_amax, bool pow2, const float* amax_in, bool record_amax, float* amax_out,
                    int32_t* nonfinite, uint8_t* data, uint8_t* data_t, float* scale_inv) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  const float scale = from_amax ? scale_from_amax(*amax_in, format_max(fmt), pow2) : *scale_ptr;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && scale_inv) *scale_inv = 1.0f / scale;

  float m = 0.0f;
  bool bad = false;
  for (int i = threadIdx.x; i < kTile * kTile; i += kThreads) {
    int r = i / kTile, c = i % kTile;
    float v = 0.0f;
    if (r0 + r < rows && c0 + c < cols) {
      v = bf16_to_f32(x[(r0 + r) * cols + c0 + c]);
      m = fmaxf(m, fabsf(v));
      bad |= !isfinite(v);
      if (data) data[(r0 + r) * cols + c0 + c] = uint8_t(encode(v * scale, fmt));
    }
    tile[r][c] = v;
  }
  if (record_amax) {
    if (__syncthreads_or(bad) && threadIdx.x == 0 && nonfinite) atomicOr(nonfinite, 1);
    block_amax_to_global(m, amax_out);
  }
  __syncthreads();
  if (!data_t) return;
  for (int i = threadIdx.x; i < kTile * kTile; i += kThreads) {
    int tr = i / kTile, tc = i % kTile;  // transposed tile coordinates: column tr, row tc of x
    if (c0 + tr < cols && r0 + tc < rows)
      data_t[(c0 + tr) * rows + r0 + tc] = uint8_t(encode(tile[tc][tr] * scale, fmt));
  }
}

// Fast path for rows and cols multiples of 8: one 128x128 tile per 256-thread block.
// Load phase: each thread issues its eight 16-byte loads first (128 bytes in flight per thread),
// encodes each 8-element chunk once with the hardware conversion, stores the 8 row-copy bytes
// (a warp writes two 128-byte row segments) and puts the same bytes into an FP8 shared tile.
// Transposed phase: each thread reads a 16-row x 4-column byte block of the tile (16 conflict-free
// 32-bit loads), transposes it with byte permutes and writes 16 consecutive rows of each of the 4
// columns with one 16-byte store (8 lanes = one 128-byte line of data_t). Encoding once and
// transposing bytes keeps the per-element work to a few instructions, so the pass is memory-bound.
constexpr int kQT = 128;                                    // tile rows = tile cols
constexpr int kChunksPerThread = kQT * kQT / 8 / kThreads;  // 16-byte input chunks per thread
constexpr int kTileWords = kQT / 4;                         // 32-bit words per tile row of FP8 codes

// The word column of tile row r is XORed with 4 * (r / 16): the 8 row groups a warp reads in the
// transposed phase land in 8 different bank quadruples, while a 16-byte chunk's two words stay adjacent.
__device__ __forceinline__ int tile_word(int r, int word_col) {
  return r * kTileWords + (word_col ^ (((r >> 4) & 7) << 2));
}

// The 8 values of a chunk with encode2's NaN handling; out of line so the common path keeps its registers.
template <Format F>
__device__ __noinline__ uint2 encode_chunk_exact(uint4 w, float scale) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
  uint32_t q[2];
  NB_UNROLL for (int i = 0; i < 2; ++i) {
    const uint32_t lo = u[2 * i], hi = u[2 * i + 1];
    q[i] = encode2(bits_f32(lo << 16) * scale, bits_f32(lo & 0xFFFF0000u) * scale, F) |
           encode2(bits_f32(hi << 16) * scale, bits_f32(hi & 0xFFFF0000u) * scale, F) << 16;
  }
  return make_uint2(q[0], q[1]);
}

// kStat (MoR): each element's error against its code is added into *stat while the chunk is in registers, so the
// statistic costs no second read of x and the codes (mor_stat.cuh; equal to add_fp8_stat_host bit for bit).
template <Format F, bool kRecordAmax, bool kStat>
__global__ void __launch_bounds__(kThreads, 4)
    quantize_tile_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, const float* scale_ptr, bool pow2,
                         float* amax, int32_t* nonfinite, uint8_t* __restrict__ data, uint8_t* __restrict__ data_t,
                         float* scale_inv, bool wide_t, mor::StatCell* stat) {
  __shared__ uint32_t tile[kQT * kTileWords];
  const int64_t r0 = int64_t(blockIdx.y) * kQT, c0 = int64_t(blockIdx.x) * kQT;
  // Delayed scaling (kRecordAmax): the given scale, and this pass records amax. Current scaling:
  // the scale from the amax pass's result.
  const float scale = kRecordAmax ? *scale_ptr : scale_from_amax(*amax, format_max(F), pow2);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && scale_inv) *scale_inv = 1.0f / scale;
  // A zero, infinite or NaN scale can turn a finite input into a NaN product: every chunk takes the exact path.
  const bool exact_all = !(fabsf(scale) <= FLT_MAX) || scale == 0.0f;
  const float stat_scale_inv = 1.0f / scale;  // the value stored in *scale_inv, which the GEMM multiplies by
  mor::device::Sums sums;

  // Chunk j of this thread: tile row r_first + 16 j, tile columns c .. c+7 (a warp reads two whole rows).
  const int r_first = threadIdx.x / (kQT / 8), c = 8 * (threadIdx.x % (kQT / 8));
  const bool col_in = c0 + c < cols;
  const int64_t row_step = int64_t(kThreads / (kQT / 8)) * cols;  // 16 rows
  const bf16* src = x + (r0 + r_first) * cols + c0 + c;
  uint4 w[kChunksPerThread];
  NB_UNROLL for (int j = 0; j < kChunksPerThread; ++j) {
    w[j] = make_uint4(0, 0, 0, 0);
    if (col_in && r0 + r_first + 16 * j < rows) w[j] = *reinterpret_cast<const uint4*>(src + j * row_step);
  }
  float m = 0.0f;
  uint32_t bad = 0;
  NB_UNROLL for (int j = 0; j < kChunksPerThread; ++j) {
    const int r = r_first + 16 * j;
    const uint32_t u[4] = {w[j].x, w[j].y, w[j].z, w[j].w};
    float v[8];
    NB_UNROLL for (int i = 0; i < 4; ++i) {
      v[2 * i] = bits_f32(u[i] << 16);
      v[2 * i + 1] = bits_f32(u[i] & 0xFFFF0000u);
    }
    const uint32_t chunk_bad =
        (nonfinite_bits(u[0]) | nonfinite_bits(u[1]) | nonfinite_bits(u[2]) | nonfinite_bits(u[3])) & kNonfiniteMask;
    uint32_t q[2];
    NB_UNROLL for (int i = 0; i < 2; ++i) q[i] = cvt_fp8x2<F>(v[4 * i] * scale, v[4 * i + 1] * scale) |
                                                 cvt_fp8x2<F>(v[4 * i + 2] * scale, v[4 * i + 3] * scale) << 16;
    if (chunk_bad || exact_all) {  // rare: a NaN product needs the reference's NaN byte
      const uint2 e = encode_chunk_exact<F>(w[j], scale);
      q[0] = e.x;
      q[1] = e.y;
    }
    if (kStat) {  // padding chunks (outside the tensor) are zeros, which add nothing
      if (chunk_bad) {
        NB_UNROLL for (int i = 0; i < 8; ++i)
            sums.add(v[i], (q[i / 4] >> (8 * (i % 4))) & 0xFFu, stat_scale_inv, F == Format::e5m2);
      } else {
        NB_UNROLL for (int i = 0; i < 8; ++i)
            sums.add<false>(v[i], (q[i / 4] >> (8 * (i % 4))) & 0xFFu, stat_scale_inv, F == Format::e5m2);
      }
    }
    if (kRecordAmax) {
      bad |= chunk_bad;
      NB_UNROLL for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(v[i]));  // fmaxf drops NaN like the reference
    }
    if (col_in && r0 + r < rows && data)
      *reinterpret_cast<uint2*>(data + (r0 + r_first) * cols + c0 + c + j * row_step) = make_uint2(q[0], q[1]);
    if (data_t) *reinterpret_cast<uint2*>(&tile[tile_word(r, c / 4)]) = make_uint2(q[0], q[1]);
  }
  if (kRecordAmax) {
    if (__syncthreads_or(bad != 0) && threadIdx.x == 0 && nonfinite) atomicOr(nonfinite, 1);
    block_amax_to_global(m, amax);
  }
  if (kStat) mor::device::add_block<kThreads>(sums, stat);  // every thread of the block calls it
  if (!data_t) return;
  __syncthreads();

  const int lane = threadIdx.x % 32, g = lane % 8;         // tile rows 16g .. 16g+15
  const int word_col = (threadIdx.x / 32) * 4 + lane / 8;  // tile columns 4*word_col .. +3
  uint32_t b[16];
  NB_UNROLL for (int i = 0; i < 16; ++i) b[i] = tile[tile_word(16 * g + i, word_col)];
  // 4x4 byte transposes: out[j][t] = byte j of b[4t .. 4t+3] (rows 4t..4t+3 of column j).
  uint32_t out[4][4];
  NB_UNROLL for (int t = 0; t < 4; ++t) {
    const uint32_t ab01 = __byte_perm(b[4 * t], b[4 * t + 1], 0x5140),
                   ab23 = __byte_perm(b[4 * t], b[4 * t + 1], 0x7362);
    const uint32_t cd01 = __byte_perm(b[4 * t + 2], b[4 * t + 3], 0x5140),
                   cd23 = __byte_perm(b[4 * t + 2], b[4 * t + 3], 0x7362);
    out[0][t] = __byte_perm(ab01, cd01, 0x5410);
    out[1][t] = __byte_perm(ab01, cd01, 0x7632);
    out[2][t] = __byte_perm(ab23, cd23, 0x5410);
    out[3][t] = __byte_perm(ab23, cd23, 0x7632);
  }
  const int64_t row = r0 + 16 * g;  // rows % 8 == 0: rows row..row+7 are all in or all out
  if (row >= rows) return;
  NB_UNROLL for (int j = 0; j < 4; ++j) {
    const int64_t col = c0 + 4 * word_col + j;  // cols % 8 == 0: the 4 columns are all in or all out
    if (col >= cols) continue;
    uint8_t* dst = data_t + col * rows + row;
    if (wide_t) {  // rows % 16 == 0: 16 rows in range, 16-byte aligned
      *reinterpret_cast<uint4*>(dst) = make_uint4(out[j][0], out[j][1], out[j][2], out[j][3]);
    } else {
      *reinterpret_cast<uint2*>(dst) = make_uint2(out[j][0], out[j][1]);
      if (row + 8 < rows) *reinterpret_cast<uint2*>(dst + 8) = make_uint2(out[j][2], out[j][3]);
    }
  }
}

template <bool kRecordAmax, bool kStat>
void launch_tile(dim3 grid, cudaStream_t s, const bf16* x, Format fmt, const float* scale, bool pow2,
                 const TensorView& out, bool wide_t) {
  auto kernel = fmt == Format::e4m3 ? quantize_tile_kernel<Format::e4m3, kRecordAmax, kStat>
                                    : quantize_tile_kernel<Format::e5m2, kRecordAmax, kStat>;
  kernel<<<grid, kThreads, 0, s>>>(x, out.rows, out.cols, scale, pow2, out.amax, out.nonfinite, out.data, out.data_t,
                                   out.scale_inv, wide_t, out.mor_stat);
}

Status launch_quantize(const bf16* x, Format fmt, const float* scale, bool from_amax, bool pow2, const TensorView& out,
                       cudaStream_t s) {
  NB_TRY(check_shape(out.rows, out.cols));
  if (!out.amax) return errorf("FP8 quantize_cuda: the amax output pointer is required");
  if (out.mor_stat && (!out.data || !out.scale_inv))
    return errorf("FP8 quantize_cuda: the MoR statistic reads the row-wise codes and scale_inv; both are required");
  auto aligned = [](const void* p, unsigned a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; };
  const bool vec =
      out.rows % 8 == 0 && out.cols % 8 == 0 && aligned(x, 16) && aligned(out.data, 8) && aligned(out.data_t, 8);
  if (vec) {
    const int64_t grid_y = (out.rows + kQT - 1) / kQT, grid_x = (out.cols + kQT - 1) / kQT;
    if (grid_y > 65535)
      return errorf("FP8 quantize_cuda: %lld rows is too many for one launch (at most %d)", (long long)out.rows,
                    65535 * kQT);
    const bool wide_t = out.rows % 16 == 0 && aligned(out.data_t, 16);
    const dim3 grid{unsigned(grid_x), unsigned(grid_y)};
    const bool stat = out.mor_stat != nullptr;
    if (from_amax)
      (stat ? launch_tile<false, true> : launch_tile<false, false>)(grid, s, x, fmt, nullptr, pow2, out, wide_t);
    else
      (stat ? launch_tile<true, true> : launch_tile<true, false>)(grid, s, x, fmt, scale, false, out, wide_t);
    CUDA_CHECK_LAUNCH();
    return Status::ok();
  }
  const int64_t grid_y = (out.rows + kTile - 1) / kTile, grid_x = (out.cols + kTile - 1) / kTile;
  if (grid_y > 65535)
    return errorf("FP8 quantize_cuda: %lld rows is too many for one launch (at most %d)", (long long)out.rows,
                  65535 * kTile);
  quantize_kernel<<<dim3(unsigned(grid_x), unsigned(grid_y)), kThreads, 0, s>>>(
      x, out.rows, out.cols, fmt, scale, from_amax, pow2, out.amax, !from_amax, out.amax, out.nonfinite, out.data,
      out.data_t, out.scale_inv);
  CUDA_CHECK_LAUNCH();
  if (out.mor_stat)  // shapes off the tiled path: the statistic's own pass over x and the codes
    return mor::add_fp8_stat_cuda(x, out.data, out.scale_inv, out.rows * out.cols, fmt, out.mor_stat, s);
  return Status::ok();
}

}  // namespace

Status quantize_current_cuda(const bf16* x, Format fmt, bool pow2_scales, const TensorView& out, Stream stream) {
  NB_TRY(check_shape(out.rows, out.cols));
  if (!out.amax) return errorf("FP8 quantize_current_cuda: the amax output pointer is required");
  auto s = static_cast<cudaStream_t>(stream);
  CUDA_CHECK(cudaMemsetAsync(out.amax, 0, sizeof(float), s));
  if (out.nonfinite) CUDA_CHECK(cudaMemsetAsync(out.nonfinite, 0, sizeof(int32_t), s));
  const int64_t n = out.rows * out.cols;
  // Enough blocks to fill every SM (8 resident blocks of 256 threads each), no more: each then strides.
  const int sms = current_device_sm_count();
  int64_t blocks = (n / 8 + kThreads * kAmaxLoads - 1) / (kThreads * kAmaxLoads);
  blocks = std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(sms) * (2048 / kThreads)));
  amax_kernel<<<unsigned(blocks), kThreads, 0, s>>>(x, n, out.amax, out.nonfinite);
  CUDA_CHECK_LAUNCH();
  return launch_quantize(x, fmt, nullptr, true, pow2_scales, out, s);
}

Status amax_cuda(const bf16* x, int64_t n, float* amax, int32_t* nonfinite, Stream stream) {
  auto s = static_cast<cudaStream_t>(stream);
  CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), s));
  if (nonfinite) CUDA_CHECK(cudaMemsetAsync(nonfinite, 0, sizeof(int32_t), s));
  const int sms = current_device_sm_count();
  int64_t blocks = (n / 8 + kThreads * kAmaxLoads - 1) / (kThreads * kAmaxLoads);
  blocks = std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(sms) * (2048 / kThreads)));
  amax_kernel<<<unsigned(blocks), kThreads, 0, s>>>(x, n, amax, nonfinite);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

// The scale comes from *out.amax, as in quantize_current_cuda after its amax pass.
Status quantize_with_amax_cuda(const bf16* x, Format fmt, bool pow2_scales, const TensorView& out, Stream stream) {
  NB_TRY(check_shape(out.rows, out.cols));
  if (!out.amax) return errorf("FP8 quantize_with_amax_cuda: the amax pointer is required");
  return launch_quantize(x, fmt, nullptr, true, pow2_scales, out, static_cast<cudaStream_t>(stream));
}

Status quantize_with_scale_cuda(const bf16* x, Format fmt, const float* scale, const TensorView& out, Stream stream) {
  NB_TRY(check_shape(out.rows, out.cols));
  if (!out.amax) return errorf("FP8 quantize_with_scale_cuda: the amax output pointer is required");
  auto s = static_cast<cudaStream_t>(stream);
  CUDA_CHECK(cudaMemsetAsync(out.amax, 0, sizeof(float), s));
  if (out.nonfinite) CUDA_CHECK(cudaMemsetAsync(out.nonfinite, 0, sizeof(int32_t), s));
  return launch_quantize(x, fmt, scale, false, false, out, s);
}

}  // namespace nb::fp8
