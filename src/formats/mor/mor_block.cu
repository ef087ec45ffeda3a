// GPU side of MoR's block rule in training (mor_block.h): one thread block per 128x128 block (clipped), which it
// stages in shared memory and passes over three times: its ranges, its E4M3 (and E5M2) statistics, then the output.
// The ladder adds its NVFP4 rung: the tiles' amaxes (shared atomics on the bit patterns) and scale codes (16x16
// tiles; 1x16 and 16x1 blocks take theirs from their own 16 elements), and the NVFP4 statistic, each a pass over the
// block's runs of 16 elements (one Philox block each under SR).
// Every reduction is of integers or of fmax/fmin, so any order gives apply_block_rule_ref's bits; the per-element
// float expressions are the host's (IEEE products and divisions, never contracted).
#include <cuda_runtime.h>
#include "core/cuda_check.h"
#include "formats/fp8/fp8_convert.cuh"
#include "formats/mor/mor_block.h"
#include "formats/mor/mor_stat.cuh"
#include "formats/nvfp4/nvfp4.h"
#include "formats/nvfp4/nvfp4_math.h"

namespace nb::mor {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Every thread gets the block's combination of v (op: fmax, fmin or a sum).
template <typename T, typename Op>
__device__ T block_all(T v, Op op) {
  __shared__ T partial[kWarps];
  for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
  __syncthreads();  // the previous call's readers are done with `partial`
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  T all = partial[0];
  for (int w = 1; w < kWarps; ++w) all = op(all, partial[w]);
  return all;
}

struct FMax {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct FMin {
  __device__ float operator()(float a, float b) const { return fminf(a, b); }
};
struct Add {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};

template <fp8::Format F>
__device__ __forceinline__ float fake_quantize(float v, float scale, float scale_inv) {
  const uint32_t code = fp8::cvt_fp8x2<F>(__fmul_rn(v, scale), 0.0f) & 0xFFu;
  return __fmul_rn(device::decode_fp8(code, F == fp8::Format::e5m2), scale_inv);
}

template <fp8::Format F>
__device__ unsigned long long error_sum(const bf16* tile, int n, float scale, float scale_inv, unsigned* nonzero) {
  unsigned long long err = 0;
  unsigned nz = 0;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const float v = bf16_to_f32(tile[i]);
    if (!isfinite(v) || v == 0.0f) continue;
    err += device::element_term(v, fake_quantize<F>(v, scale, scale_inv));
    ++nz;
  }
  *nonzero = nz;
  return err;
}

// The NVFP4 rung of one block, staged in `tile` (h x w, multiples of 16): the scale code and encode scale of each
// 16x16 tile (tile t at row t / 8, column t % 8 of the block's tiles).
struct Nvfp4Tiles {
  uint32_t bits[64];  // each tile's amax by bit pattern, then its scale code
  float enc[64];
};

__device__ void nvfp4_tile_scales(const bf16* tile, int h, int w, float s_enc, Nvfp4Tiles* t) {
  const int segs = h * w / 16, seg_cols = w / 16;
  for (int i = threadIdx.x; i < 64; i += kThreads) t->bits[i] = 0;
  __syncthreads();
  for (int g = threadIdx.x; g < segs; g += kThreads) {  // one 16-element row of a tile
    const int r = g / seg_cols, c16 = g % seg_cols;
    uint32_t m = 0;
    for (int j = 0; j < 16; ++j) m = max(m, nvfp4::abs_bits(bf16_to_f32(tile[r * w + c16 * 16 + j])));
    atomicMax(&t->bits[(r / 16) * 8 + c16], m);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < (h / 16) * 8; i += kThreads) {
    const uint32_t code = nvfp4::block_scale_code(__uint_as_float(t->bits[i]), s_enc);
    t->bits[i] = code;
    t->enc[i] = nvfp4::block_encode_scale(code, s_enc);
  }
  __syncthreads();
}

// Segment g of the block's n / 16 runs of 16 elements, each one block of the rung's (or one row of a 16x16 tile):
// along a row for tiles and rows (row g / (w / 16), columns from 16 (g % (w / 16))), down a column for cols
// (rows from 16 (g / w), column g % w). Element j is at tile[at + j * step] in the staged block.
struct Segment {
  int r, c, at, step;
  bool down;
};
__device__ __forceinline__ Segment segment(int g, int w, Nvfp4Blocks blocks) {
  Segment s;
  s.down = blocks == Nvfp4Blocks::cols;
  s.r = s.down ? (g / w) * 16 : g / (w / 16);
  s.c = s.down ? g % w : (g % (w / 16)) * 16;
  s.at = s.r * w + s.c;
  s.step = s.down ? w : 1;
  return s;
}

// The NVFP4 values of segment g of the block at (r0, c0) of x [rows, cols] into v[16]: its scale code the tile's
// (tiles) or its own.
__device__ __forceinline__ void nvfp4_segment(const bf16* tile, int w, int g, int64_t r0, int64_t c0, int64_t rows,
                                              int64_t cols, float amax, float s_enc, const BlockLadder& top,
                                              const Nvfp4Tiles& t, float* v) {
  const Segment sg = segment(g, w, top.blocks);
  uint32_t sc = 0;
  float enc = 0.0f;
  if (top.blocks == Nvfp4Blocks::tiles) {
    const int ti = (sg.r / 16) * 8 + sg.c / 16;
    sc = t.bits[ti];
    enc = t.enc[ti];
  } else {
    uint32_t m = 0;
    for (int j = 0; j < 16; ++j) m = max(m, nvfp4::abs_bits(bf16_to_f32(tile[sg.at + j * sg.step])));
    sc = nvfp4::block_scale_code(__uint_as_float(m), s_enc);
    enc = nvfp4::block_encode_scale(sc, s_enc);
  }
  const int64_t e0 = sg.down ? (c0 + sg.c) * rows + r0 + sg.r : (r0 + sg.r) * cols + c0 + sg.c;
  const Philox4x32 rand = top.sr ? philox_block(top.rng, uint64_t(e0) / 16) : Philox4x32{};
  NB_UNROLL
  for (int j = 0; j < 16; ++j) {
    const float q = __fmul_rn(bf16_to_f32(tile[sg.at + j * sg.step]), enc);
    const uint32_t code = top.sr ? nvfp4::e2m1_code_sr(q, philox_byte(rand, j)) : nvfp4::e2m1_code_rne(q);
    v[j] = nvfp4::dequant_value(code, sc, amax);
  }
}

__device__ unsigned long long nvfp4_error_sum(const bf16* tile, int h, int w, int64_t r0, int64_t c0, int64_t rows,
                                              int64_t cols, float amax, float s_enc, const BlockLadder& top,
                                              const Nvfp4Tiles& t) {
  unsigned long long err = 0;
  for (int g = threadIdx.x; g < h * w / 16; g += kThreads) {
    float v[16];
    nvfp4_segment(tile, w, g, r0, c0, rows, cols, amax, s_enc, top, t, v);
    const Segment sg = segment(g, w, top.blocks);
    for (int j = 0; j < 16; ++j) {
      const float x = bf16_to_f32(tile[sg.at + j * sg.step]);
      if (isfinite(x) && x != 0.0f) err += device::element_term(x, v[j]);
    }
  }
  return err;
}

__device__ void add_stat(StatCell* cell, unsigned long long err, unsigned long long nonzero, unsigned nonfinite) {
  if (!cell) return;
  if (err) atomicAdd(reinterpret_cast<unsigned long long*>(&cell->err_fixed), err);
  if (nonzero) atomicAdd(reinterpret_cast<unsigned long long*>(&cell->nonzero), nonzero);
  if (nonfinite) atomicAdd(&cell->nonfinite, nonfinite);
}

// kLadder: the NVFP4 rung above the rule (tensor_amax[1]: NVFP4's amax); else top is unused.
template <bool kLadder>
__global__ void __launch_bounds__(kThreads)
    block_rule_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, BlockRule rule, BlockLadder top,
                      const float* __restrict__ tensor_amax, bf16* __restrict__ out, BlockTallies tallies) {
  __shared__ bf16 tile[kBlock * kBlock];
  __shared__ Nvfp4Tiles nv_tiles;
  const int64_t r0 = int64_t(blockIdx.y) * kBlock, c0 = int64_t(blockIdx.x) * kBlock;
  const int h = int(rows - r0 < kBlock ? rows - r0 : kBlock), w = int(cols - c0 < kBlock ? cols - c0 : kBlock);
  const int n = h * w;
  float amax = 0.0f, finite_amax = 0.0f, min_nonzero = INFINITY;
  unsigned nonfinite = 0;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const bf16 b = x[(r0 + i / w) * cols + c0 + i % w];
    tile[i] = b;
    const float a = fabsf(bf16_to_f32(b));
    amax = fmaxf(amax, a);
    if (!isfinite(a)) {
      ++nonfinite;
      continue;
    }
    finite_amax = fmaxf(finite_amax, a);
    if (a > 0.0f) min_nonzero = fminf(min_nonzero, a);
  }
  amax = block_all(amax, FMax{});
  finite_amax = block_all(finite_amax, FMax{});
  min_nonzero = block_all(min_nonzero, FMin{});
  nonfinite = block_all(nonfinite, Add{});
  float m4 = 1.0f, m5 = 1.0f;
  if (rule.mode == ScaleMode::gam) {
    m4 = gam_mantissa(fp8::scale_from_amax(*tensor_amax, kE4M3Max, false));
    m5 = gam_mantissa(fp8::scale_from_amax(*tensor_amax, kE5M2Max, false));
  }
  const float s4 = block_rule_scale(rule.mode, amax, kE4M3Max, m4), s4_inv = __fdiv_rn(1.0f, s4);
  const float s5 = block_rule_scale(rule.mode, amax, kE5M2Max, m5), s5_inv = __fdiv_rn(1.0f, s5);
  unsigned nz = 0, nz5 = 0;
  const unsigned long long err4 = block_all(error_sum<fp8::Format::e4m3>(tile, n, s4, s4_inv, &nz), Add{});
  const unsigned long long nonzero = block_all((unsigned long long)nz, Add{});
  unsigned long long err5 = 0;
  if (rule.three_way) err5 = block_all(error_sum<fp8::Format::e5m2>(tile, n, s5, s5_inv, &nz5), Add{});
  Choice choice = block_rule_choice(rule, err4, err5, nonzero, nonfinite > 0, finite_amax, min_nonzero);
  unsigned long long err_nv = 0;
  const float nv_amax = kLadder ? tensor_amax[1] : 0.0f;
  const float s_enc = nvfp4::global_encode_scale(nv_amax);
  if (kLadder) {
    if (top.blocks == Nvfp4Blocks::tiles) nvfp4_tile_scales(tile, h, w, s_enc, &nv_tiles);
    err_nv = block_all(nvfp4_error_sum(tile, h, w, r0, c0, rows, cols, nv_amax, s_enc, top, nv_tiles), Add{});
    if (ladder_keeps_nvfp4(top, err_nv, nonzero, nonfinite > 0)) choice = Choice::nvfp4;
  }
  if (kLadder && choice == Choice::nvfp4) {
    for (int g = threadIdx.x; g < n / 16; g += kThreads) {
      float v[16];
      nvfp4_segment(tile, w, g, r0, c0, rows, cols, nv_amax, s_enc, top, nv_tiles, v);
      const Segment sg = segment(g, w, top.blocks);
      for (int j = 0; j < 16; ++j) {
        const int at = sg.at + j * sg.step;
        out[(r0 + at / w) * cols + c0 + at % w] = f32_to_bf16(v[j]);
      }
    }
  } else {
    for (int i = threadIdx.x; i < n; i += kThreads) {
      const float v = bf16_to_f32(tile[i]);
      bf16 o = tile[i];
      if (choice == Choice::fp8_e4m3) o = f32_to_bf16(fake_quantize<fp8::Format::e4m3>(v, s4, s4_inv));
      if (choice == Choice::fp8_e5m2) o = f32_to_bf16(fake_quantize<fp8::Format::e5m2>(v, s5, s5_inv));
      out[(r0 + i / w) * cols + c0 + i % w] = o;
    }
  }
  if (threadIdx.x != 0) return;
  add_stat(tallies.e4m3_stat, err4, nonzero, nonfinite);
  if (kLadder) add_stat(tallies.nvfp4_stat, err_nv, nonzero, nonfinite);
  if (BlockCounts* counts = tallies.counts) {
    if (choice == Choice::fp8_e4m3) atomicAdd(&counts->e4m3, 1u);
    if (choice == Choice::fp8_e5m2) atomicAdd(&counts->e5m2, 1u);
    if (choice == Choice::nvfp4) atomicAdd(&counts->nvfp4, 1u);
    if (choice == Choice::bf16) atomicAdd(&counts->bf16, 1u);
    if (nonfinite) atomicAdd(&counts->nonfinite, 1u);
  }
}

// Both entry points: top null, the FP8 rule alone. scratch: GAM's amax, then (the ladder) NVFP4's.
Status launch(const bf16* x, int64_t rows, int64_t cols, const BlockRule& rule, const BlockLadder* top, bf16* out,
              const BlockTallies& tallies, float* scratch, Stream stream, bool amaxes_given) {
  const int64_t brows = (rows + kBlock - 1) / kBlock, bcols = (cols + kBlock - 1) / kBlock;
  if (brows > 65535) return errorf("mor: the block rule takes at most %lld rows", (long long)(65535 * kBlock));
  if ((rule.mode == ScaleMode::gam || top) && !scratch)
    return errorf("internal: the block rule needs device floats for the tensor's amaxes (GAM's, NVFP4's)");
  if (!amaxes_given && rule.mode == ScaleMode::gam) NB_TRY(fp8::amax_cuda(x, rows * cols, scratch, nullptr, stream));
  if (!amaxes_given && top) NB_TRY(nvfp4::compute_amax_cuda(x, rows, cols, false, scratch + 1, nullptr, stream));
  const auto st = static_cast<cudaStream_t>(stream);
  const dim3 grid{unsigned(bcols), unsigned(brows)};
  if (top)
    block_rule_kernel<true><<<grid, kThreads, 0, st>>>(x, rows, cols, rule, *top, scratch, out, tallies);
  else
    block_rule_kernel<false><<<grid, kThreads, 0, st>>>(x, rows, cols, rule, BlockLadder{}, scratch, out, tallies);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace

Status block_rule_amaxes_cuda(const bf16* x, int64_t rows, int64_t cols, bool nvfp4, float* amaxes, Stream stream) {
  NB_TRY(fp8::amax_cuda(x, rows * cols, amaxes, nullptr, stream));
  return nvfp4 ? nvfp4::compute_amax_cuda(x, rows, cols, false, amaxes + 1, nullptr, stream) : Status::ok();
}

Status apply_block_rule_cuda(const bf16* x, int64_t rows, int64_t cols, const BlockRule& rule, bf16* out,
                             StatCell* e4m3_stat, BlockCounts* counts, float* scratch, Stream stream,
                             bool amaxes_given) {
  if (rows < 1 || cols < 1)
    return errorf("mor: the block rule needs a non-empty tensor; got [%lld, %lld]", (long long)rows, (long long)cols);
  return launch(x, rows, cols, rule, nullptr, out, BlockTallies{e4m3_stat, nullptr, counts}, scratch, stream,
                amaxes_given);
}

Status apply_block_ladder_cuda(const bf16* x, int64_t rows, int64_t cols, const BlockRule& rule, const BlockLadder& top,
                               bf16* out, const BlockTallies& tallies, float* scratch, Stream stream,
                               bool amaxes_given) {
  NB_TRY(check_block_ladder(rows, cols, top));
  return launch(x, rows, cols, rule, &top, out, tallies, scratch, stream, amaxes_given);
}

}  // namespace nb::mor
