// GPU side of MoR's block rule in training (mor_block.h): one thread block per 128x128 block (clipped), which it
// stages in shared memory and passes over three times: its ranges, its E4M3 (and E5M2) statistics, then the output.
// The ladder adds its NVFP4 rung: the tiles' amaxes (shared atomics on the bit patterns) and scale codes (16x16
// tiles; 1x16 and 16x1 blocks take theirs from their own 16 elements), and the NVFP4 statistic, each a pass over the
// block's runs of 16 elements (one Philox block each under SR); each run's E2M1 codes stay in registers for the output.
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

// The 16 elements of segment sg from the staged block: two 16-byte loads along a row (sg.at is a multiple of 16, so a
// warp's loads no longer pile onto four banks as 16 two-byte loads 32 bytes apart did), 16 loads down a column (a
// warp's threads read neighbours).
__device__ __forceinline__ void load_segment(const bf16* tile, const Segment& sg, float* xs) {
  if (sg.down) {
    NB_UNROLL
    for (int j = 0; j < 16; ++j) xs[j] = bf16_to_f32(tile[sg.at + j * sg.step]);
    return;
  }
  const uint4* p = reinterpret_cast<const uint4*>(tile + sg.at);
  const uint4 a = p[0], b = p[1];
  const uint32_t words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  NB_UNROLL
  for (int i = 0; i < 8; ++i) {  // little-endian: a word's lower half is the earlier element
    xs[2 * i] = __uint_as_float(words[i] << 16);
    xs[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
  }
}

__device__ void nvfp4_tile_scales(const bf16* tile, int h, int w, float s_enc, Nvfp4Tiles* t) {
  for (int i = threadIdx.x; i < 64; i += kThreads) t->bits[i] = 0;
  __syncthreads();
  for (int g = threadIdx.x; g < h * w / 16; g += kThreads) {  // one 16-element row of a tile
    const Segment sg = segment(g, w, Nvfp4Blocks::tiles);
    float xs[16];
    load_segment(tile, sg, xs);
    atomicMax(&t->bits[(sg.r / 16) * 8 + sg.c / 16], f32_bits(nvfp4::block_amax16(xs)));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < (h / 16) * 8; i += kThreads) {
    const uint32_t code = nvfp4::block_scale_code(__uint_as_float(t->bits[i]), s_enc);
    t->bits[i] = code;
    t->enc[i] = nvfp4::block_encode_scale(code, s_enc);
  }
  __syncthreads();
}

// A segment's 16 E2M1 codes (element j at bits 4 (j % 8) of word j / 8) and its scale code: what the output pass
// needs, kept in registers from the statistic's pass so the output does not quantize again.
struct SegmentCodes {
  uint32_t word[2];
  uint32_t scale;
};

// The values of the eight E2M1 magnitudes under scale code sc, each by nvfp4::dequant_value's expression, into the
// thread's column of the block's table (magnitude m at dq[m * kThreads]): per segment 8 divisions and 8 scale decodes
// where each element took one of each. A negative code's value is its magnitude's negated: IEEE products and quotients
// are sign-symmetric (a NaN's sign could differ, but a NaN comes with an error that keeps the block off NVFP4).
__device__ __forceinline__ void fill_dequant(uint32_t sc, float amax, float* dq) {
  NB_UNROLL
  for (uint32_t m = 0; m < 8; ++m) dq[m * kThreads] = nvfp4::dequant_value(m, sc, amax);
}
__device__ __forceinline__ float dequant(const float* dq, uint32_t code) {
  const float v = dq[(code & 7u) * kThreads];
  return (code & 8u) ? -v : v;
}

// Segment g of the block at (r0, c0) of x [rows, cols], quantized to NVFP4: its codes into *out, and its error sum.
// The scale code is its tile's (tiles) or its own.
__device__ __forceinline__ unsigned long long nvfp4_segment(const bf16* tile, int w, int g, int64_t r0, int64_t c0,
                                                            int64_t rows, int64_t cols, float amax, float s_enc,
                                                            const BlockLadder& top, const Nvfp4Tiles& t, float* dq,
                                                            SegmentCodes* out) {
  const Segment sg = segment(g, w, top.blocks);
  float xs[16];
  load_segment(tile, sg, xs);
  float enc = 0.0f;
  if (top.blocks == Nvfp4Blocks::tiles) {
    const int ti = (sg.r / 16) * 8 + sg.c / 16;
    out->scale = t.bits[ti];
    enc = t.enc[ti];
  } else {
    out->scale = nvfp4::block_scale_code(nvfp4::block_amax16(xs), s_enc);
    enc = nvfp4::block_encode_scale(out->scale, s_enc);
  }
  fill_dequant(out->scale, amax, dq);
  const int64_t e0 = sg.down ? (c0 + sg.c) * rows + r0 + sg.r : (r0 + sg.r) * cols + c0 + sg.c;
  const Philox4x32 rand = top.sr ? philox_block(top.rng, uint64_t(e0) / 16) : Philox4x32{};
  out->word[0] = out->word[1] = 0;
  unsigned long long err = 0;
  NB_UNROLL
  for (int j = 0; j < 16; ++j) {
    const float q = __fmul_rn(xs[j], enc);
    const uint32_t code = top.sr ? nvfp4::e2m1_code_sr(q, philox_byte(rand, j)) : nvfp4::e2m1_code_rne(q);
    out->word[j / 8] |= code << (4 * (j % 8));
    if (isfinite(xs[j]) && xs[j] != 0.0f) err += device::element_term(xs[j], dequant(dq, code));
  }
  return err;
}

// Segment g's NVFP4 values, rounded once to BF16, into out (x's layout).
__device__ __forceinline__ void write_nvfp4_segment(bf16* out, int w, int g, int64_t r0, int64_t c0, int64_t cols,
                                                    float amax, Nvfp4Blocks blocks, const SegmentCodes& codes,
                                                    float* dq) {
  const Segment sg = segment(g, w, blocks);
  fill_dequant(codes.scale, amax, dq);
  bf16* o = out + (r0 + sg.r) * cols + c0 + sg.c;
  const int64_t step = sg.down ? cols : 1;
  NB_UNROLL
  for (int j = 0; j < 16; ++j) o[j * step] = f32_to_bf16(dequant(dq, (codes.word[j / 8] >> (4 * (j % 8))) & 0xFu));
}

// Element i of a staged h x w block (row-major), walked by one thread in strides of kThreads, with its row and column
// kept by additions: a division per element cost about as much as the element's statistic.
struct BlockWalk {
  int r, c, dr, dc;
  __device__ explicit BlockWalk(int w) : r(threadIdx.x / w), c(threadIdx.x % w), dr(kThreads / w), dc(kThreads % w) {}
  __device__ void next(int w) {
    r += dr;
    c += dc;
    if (c >= w) {
      c -= w;
      ++r;
    }
  }
};

// A block's ranges, as decide_blocks_ref reads them: its amax (NaN and Inf included), finite amax, smallest non-zero
// magnitude and count of non-finite elements.
struct BlockRanges {
  float amax = 0.0f, finite_amax = 0.0f, min_nonzero = INFINITY;
  unsigned nonfinite = 0;
};

// Stages the h x w block at (r0, c0) of x into tile and returns its ranges (the same in every thread).
__device__ BlockRanges stage_block(const bf16* __restrict__ x, int64_t cols, int64_t r0, int64_t c0, int h, int w,
                                   bf16* tile) {
  BlockRanges g;
  BlockWalk at(w);
  for (int i = threadIdx.x; i < h * w; i += kThreads, at.next(w)) {
    const bf16 b = x[(r0 + at.r) * cols + c0 + at.c];
    tile[i] = b;
    const float a = fabsf(bf16_to_f32(b));
    g.amax = fmaxf(g.amax, a);
    if (!isfinite(a)) {
      ++g.nonfinite;
      continue;
    }
    g.finite_amax = fmaxf(g.finite_amax, a);
    if (a > 0.0f) g.min_nonzero = fminf(g.min_nonzero, a);
  }
  g.amax = block_all(g.amax, FMax{});
  g.finite_amax = block_all(g.finite_amax, FMax{});
  g.min_nonzero = block_all(g.min_nonzero, FMin{});
  g.nonfinite = block_all(g.nonfinite, Add{});
  return g;
}

// The output of a block the FP8 rule decided (E4M3, E5M2 or BF16): its FP8 values rounded to BF16, or itself.
__device__ void write_rule_block(const bf16* tile, int h, int w, int64_t r0, int64_t c0, int64_t cols, Choice choice,
                                 float s4, float s4_inv, float s5, float s5_inv, bf16* __restrict__ out) {
  BlockWalk at(w);
  for (int i = threadIdx.x; i < h * w; i += kThreads, at.next(w)) {
    const float v = bf16_to_f32(tile[i]);
    bf16 o = tile[i];
    if (choice == Choice::fp8_e4m3) o = f32_to_bf16(fake_quantize<fp8::Format::e4m3>(v, s4, s4_inv));
    if (choice == Choice::fp8_e5m2) o = f32_to_bf16(fake_quantize<fp8::Format::e5m2>(v, s5, s5_inv));
    out[(r0 + at.r) * cols + c0 + at.c] = o;
  }
}

__device__ void add_stat(StatCell* cell, unsigned long long err, unsigned long long nonzero, unsigned nonfinite) {
  if (!cell) return;
  if (err) atomicAdd(reinterpret_cast<unsigned long long*>(&cell->err_fixed), err);
  if (nonzero) atomicAdd(reinterpret_cast<unsigned long long*>(&cell->nonzero), nonzero);
  if (nonfinite) atomicAdd(&cell->nonfinite, nonfinite);
}

__device__ void add_tallies(const BlockTallies& tallies, unsigned long long err4, unsigned long long err_nv,
                            unsigned long long nonzero, unsigned nonfinite, Choice choice, bool ladder) {
  add_stat(tallies.e4m3_stat, err4, nonzero, nonfinite);
  if (ladder) add_stat(tallies.nvfp4_stat, err_nv, nonzero, nonfinite);
  if (BlockCounts* counts = tallies.counts) {
    if (choice == Choice::fp8_e4m3) atomicAdd(&counts->e4m3, 1u);
    if (choice == Choice::fp8_e5m2) atomicAdd(&counts->e5m2, 1u);
    if (choice == Choice::nvfp4) atomicAdd(&counts->nvfp4, 1u);
    if (choice == Choice::bf16) atomicAdd(&counts->bf16, 1u);
    if (nonfinite) atomicAdd(&counts->nonfinite, 1u);
  }
}

// A full block's runs of 16 per thread: each thread keeps the codes of at most this many segments.
constexpr int kSegsPerThread = kBlock * kBlock / 16 / kThreads;
static_assert(kSegsPerThread * kThreads * 16 == kBlock * kBlock, "the block's segments share out evenly");

// kLadder: the NVFP4 rung above the rule (tensor_amax[1]: NVFP4's amax); else top is unused.
template <bool kLadder>
__global__ void __launch_bounds__(kThreads)
    block_rule_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, BlockRule rule, BlockLadder top,
                      const float* __restrict__ tensor_amax, bf16* __restrict__ out, BlockTallies tallies) {
  __shared__ __align__(16) bf16 tile[kBlock * kBlock];  // 16-byte aligned for load_segment
  __shared__ Nvfp4Tiles nv_tiles;
  __shared__ float dq_table[kLadder ? 8 * kThreads : 1];
  const int64_t r0 = int64_t(blockIdx.y) * kBlock, c0 = int64_t(blockIdx.x) * kBlock;
  const int h = int(rows - r0 < kBlock ? rows - r0 : kBlock), w = int(cols - c0 < kBlock ? cols - c0 : kBlock);
  const int n = h * w;
  const BlockRanges g = stage_block(x, cols, r0, c0, h, w, tile);
  float m4 = 1.0f, m5 = 1.0f;
  if (rule.mode == ScaleMode::gam) {
    m4 = gam_mantissa(fp8::scale_from_amax(*tensor_amax, kE4M3Max, false));
    m5 = gam_mantissa(fp8::scale_from_amax(*tensor_amax, kE5M2Max, false));
  }
  const float s4 = block_rule_scale(rule.mode, g.amax, kE4M3Max, m4), s4_inv = __fdiv_rn(1.0f, s4);
  const float s5 = block_rule_scale(rule.mode, g.amax, kE5M2Max, m5), s5_inv = __fdiv_rn(1.0f, s5);
  unsigned nz = 0, nz5 = 0;
  const unsigned long long err4 = block_all(error_sum<fp8::Format::e4m3>(tile, n, s4, s4_inv, &nz), Add{});
  const unsigned long long nonzero = block_all((unsigned long long)nz, Add{});
  unsigned long long err5 = 0;
  if (rule.three_way) err5 = block_all(error_sum<fp8::Format::e5m2>(tile, n, s5, s5_inv, &nz5), Add{});
  Choice choice = block_rule_choice(rule, err4, err5, nonzero, g.nonfinite > 0, g.finite_amax, g.min_nonzero);
  unsigned long long err_nv = 0;
  const float nv_amax = kLadder ? tensor_amax[1] : 0.0f;
  SegmentCodes codes[kSegsPerThread];
  if (kLadder) {
    const float s_enc = nvfp4::global_encode_scale(nv_amax);
    if (top.blocks == Nvfp4Blocks::tiles) nvfp4_tile_scales(tile, h, w, s_enc, &nv_tiles);
    unsigned long long err = 0;
    NB_UNROLL
    for (int k = 0; k < kSegsPerThread; ++k) {
      const int seg = threadIdx.x + k * kThreads;
      if (seg < n / 16)
        err += nvfp4_segment(tile, w, seg, r0, c0, rows, cols, nv_amax, s_enc, top, nv_tiles, dq_table + threadIdx.x,
                             &codes[k]);
    }
    err_nv = block_all(err, Add{});
    if (ladder_keeps_nvfp4(top, err_nv, nonzero, g.nonfinite > 0)) choice = Choice::nvfp4;
  }
  if (kLadder && choice == Choice::nvfp4) {
    NB_UNROLL
    for (int k = 0; k < kSegsPerThread; ++k) {
      const int seg = threadIdx.x + k * kThreads;
      if (seg < n / 16)
        write_nvfp4_segment(out, w, seg, r0, c0, cols, nv_amax, top.blocks, codes[k], dq_table + threadIdx.x);
    }
  } else {
    write_rule_block(tile, h, w, r0, c0, cols, choice, s4, s4_inv, s5, s5_inv, out);
  }
  if (threadIdx.x == 0) add_tallies(tallies, err4, err_nv, nonzero, g.nonfinite, choice, kLadder);
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
