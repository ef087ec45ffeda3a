// CUDA NVFP4 quantizer: an amax pre-pass (reduction) and one fused pass that reads each BF16 tile
// once and writes the row-wise copy and the transposed column-wise copy (with optional RHT, SR, 2D
// tiles). Bit-identical to nvfp4_ref.cpp: the per-block math is the shared nvfp4_math.h.
//
// Quantize pass: persistent CTAs walk 64 x 128 tiles (16 KiB of BF16) through a ring of kStages tiles in
// shared memory filled by cp.async (16-byte pieces, no registers held while in flight), so the next
// tiles' loads are in flight while the current one is encoded. The pass is instruction-bound (see
// docs/NVFP4_QUANTIZER.md), so the per-element work is kept minimal: hardware E4M3 scale conversion, a
// magic-add E2M1 encoder, SIMD BF16 amaxes, a swizzled tile layout that needs no register shuffling.
//   row phase : 512 row blocks (1x16), 2 per thread; 8-byte code stores, 8 threads per 64 B of a row.
//   col phase : thread = (column pair, 16-row chunk); a warp reads 32 consecutive 4-byte words of one
//               smem row (conflict-free); codes are staged in smem so each column's 32 output bytes
//               leave as full 32-byte sectors.
// Tiles at the right/bottom edge are partial (dims are multiples of 16 only): guards per 16-row
// chunk and per 8-column load; missing values read as zero and are never stored.
#include <algorithm>
#include <cfloat>
#include "core/cuda_check.h"
#include "core/device_info.h"
#include "formats/hadamard/hadamard.h"
#include "formats/nvfp4/nvfp4.h"
#include "formats/nvfp4/nvfp4_math.h"

namespace nb::nvfp4 {
namespace {

constexpr int kTileRows = 64, kTileCols = 128, kThreads = 256;
constexpr int kColStagePitchWords = 9;  // 32 code bytes per column + 4 pad bytes: fewer bank conflicts
// Tiles in the shared-memory ring: kStages - 1 tiles are in flight while one is encoded.
#ifndef NB_NVFP4_STAGES
#define NB_NVFP4_STAGES 2
#endif
constexpr int kStages = NB_NVFP4_STAGES;
static_assert(kStages >= 2, "the ring needs a slot being encoded and one in flight");
constexpr int kTilePieces = kTileRows * kTileCols / 8;  // 16-byte pieces per tile
constexpr size_t kRingBytes = size_t(kStages) * kTilePieces * 16;
// CTAs per SM the register budget is set for (RHT + SR needs more registers per thread).
#ifndef NB_NVFP4_MIN_CTAS
#define NB_NVFP4_MIN_CTAS 4
#endif
#ifndef NB_NVFP4_MIN_CTAS_SR
#define NB_NVFP4_MIN_CTAS_SR 3
#endif
#ifndef NB_NVFP4_MIN_CTAS_RHT_SR
#define NB_NVFP4_MIN_CTAS_RHT_SR 2
#endif

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
__global__ void __launch_bounds__(256)
    amax_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, uint32_t* row_amax, uint32_t* col_amax) {
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
  if ((threadIdx.x & 31) == 0) {
    red[0][threadIdx.x / 32] = mr;
    red[1][threadIdx.x / 32] = mc;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < int(blockDim.x / 32); ++i) {
      mr = max(mr, red[0][i]);
      mc = max(mc, red[1][i]);
    }
    mr = f32_bits(amax_from_abs_bits(mr));  // one NaN pattern, as the reference stores it
    mc = f32_bits(amax_from_abs_bits(mc));
    if (mr != 0 && row_amax) atomicMax(row_amax, mr);
    if (kRht && mc != 0 && col_amax) atomicMax(col_amax, mc);
    if (!kRht && mr != 0 && col_amax) atomicMax(col_amax, mr);
  }
}

// ---- per-element work: Philox bytes and E2M1 codes ------------------------------------------------
// Philox4x32-10 as core/philox.h computes it, with everything that is the same for every block of a copy
// worked out once on the host: the 10 round keys (k += W per round, 32-bit wrap, as philox4x32_10), the
// counter words that do not depend on the block (c2 = stream, c3 = step) and the copy's SR origin terms
// (sr_blocks: the counter of a block is base + line * pitch + block in line + its column segment's shift,
// looked up once per tile and thread in each phase; a uniform branch skips it without segments; the kCp
// instances add a context-parallel row map's shift per row or block). The kernel reads them from the parameter
// bank, so a round is two IMAD.WIDE (hi and lo at once) and two 3-input XORs, with no registers and no
// instructions spent on the key schedule.
constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

struct PhiloxStream {
  uint32_t n0_xor;  // round 0: n0 = c1 ^ (hi(M1 * stream) ^ k0)
  uint32_t n1;      // round 0: n1 = lo(M1 * stream)
  uint32_t n2_xor;  // round 0: n2 = hi(M0 * c0) ^ (step ^ k1)
  SrBlocks at;      // Philox block of (line, block in line) of this copy: sr_block_index(at, line, block)
};
struct PhiloxSchedule {
  uint32_t k0[10], k1[10];  // key of round r
  PhiloxStream row, col;    // row-wise copy: the key's stream; column-wise: colwise_key's
};

PhiloxStream philox_stream(const RngKey& key, SrBlocks at) {
  const uint64_t p1 = uint64_t(kPhiloxM1) * key.stream;
  return {uint32_t(p1 >> 32) ^ uint32_t(key.seed), uint32_t(p1), key.step ^ uint32_t(key.seed >> 32), at};
}

PhiloxSchedule philox_schedule(const RngKey& key, const SrOrigin& origin, int64_t rows, int64_t cols) {
  PhiloxSchedule ps{};
  uint32_t k0 = uint32_t(key.seed), k1 = uint32_t(key.seed >> 32);
  for (int r = 0; r < 10; ++r, k0 += kPhiloxW0, k1 += kPhiloxW1) {
    ps.k0[r] = k0;
    ps.k1[r] = k1;
  }
  ps.row = philox_stream(key, sr_blocks(origin, rows, cols, false));
  ps.col = philox_stream(colwise_key(key), sr_blocks(origin, rows, cols, true));
  return ps;
}

// 32 x 32 -> 64-bit product, one IMAD.WIDE.U32 (from uint64_t(a) * b with a truncated 64-bit counter
// the compiler builds a 64-bit multiply and adds a zero high part).
NB_DEVICE uint64_t mul_wide_u32(uint32_t a, uint32_t b) {
  uint64_t p;
  asm("mul.wide.u32 %0, %1, %2;" : "=l"(p) : "r"(a), "r"(b));
  return p;
}

// philox_block(key, block) for stream st of schedule ks: the same 16 bytes.
NB_DEVICE Philox4x32 philox_block_sched(const PhiloxSchedule& ks, const PhiloxStream& st, uint64_t block) {
  const uint64_t p = mul_wide_u32(kPhiloxM0, uint32_t(block));
  uint32_t c0 = uint32_t(block >> 32) ^ st.n0_xor, c1 = st.n1, c2 = uint32_t(p >> 32) ^ st.n2_xor, c3 = uint32_t(p);
  NB_UNROLL
  for (int r = 1; r < 10; ++r) {
    const uint64_t p0 = mul_wide_u32(kPhiloxM0, c0), p1 = mul_wide_u32(kPhiloxM1, c2);
    c0 = uint32_t(p1 >> 32) ^ c1 ^ ks.k0[r];
    c1 = uint32_t(p1);
    c2 = uint32_t(p0 >> 32) ^ c3 ^ ks.k1[r];
    c3 = uint32_t(p0);
  }
  return {{c0, c1, c2, c3}};
}

// The E2M1 codecs below return the code of x (sign in bit 3) in the low 4 bits of a float's bit pattern
// whose bits 4..22 are 0 (bits 23..30 hold an exponent: see pack8_codes). Both add a magic number M' to
// a = min(|x|, 6): e2m1_code_rne's M = 2^(e - 105) with e = max(exponent field of a, 127) (127, 128, 129
// for a < 2, < 4, <= 6), whose ulp is the grid step of a's binade (2^(e - 128): 0.5, 1, 2), plus
// 2 * (e - 127) ulps (the binade's code offset), plus 8 ulps when x < 0 (the sign bit of the code, in
// the sum instead of a select and an OR). Byte 1 of M' is 0 and byte 0 at most 12; a + M' stays in M's
// binade (mantissa <= 15), so the low 4 bits of the sum are 8 * (x < 0) + 2 * (e - 127) + (steps of a).
NB_DEVICE uint32_t e2m1_magic_bits(float a, float x) {
  const uint32_t ab = f32_bits(a);
  return ((ab > 0x3F800000u ? ab : 0x3F800000u) >> 23) * 0x800002u + (x < 0.0f ? 0x0AFFFF0Au : 0x0AFFFF02u);
}

// e2m1_code_rne(x): the FPU rounds a to a multiple of the step, ties to even; the 8 sign ulps are an even
// number of steps, like the code offset, so the tie parity and hence the code are unchanged.
NB_DEVICE uint32_t e2m1_code_rne_bits(float x) {
  const float a = fminf(fabsf(x), 6.0f);
  return f32_bits(a + bits_f32(e2m1_magic_bits(a, x)));
}

// e2m1_code_sr(x, byte `byte` of w), without a byte -> float conversion or step selects:
//  - the random offset: q = M' with byte 1 replaced by the random byte is M' + rand8 * 256 steps, so
//    q - M' = rand8 * 256 * step exactly (same binade) and t = fma(q - M', 2^-16, a) rounds the exact
//    a + rand8 * step / 256 once, as the codec's a + float(rand8) * (step / 256) (exact product) does.
//  - the floor: t + M' rounded toward zero adds floor(t / step) steps to M' (t < 5 steps), i.e. codes:
//    for a < 2, t < 2.5 and floor(2t) is the code (t in [2, 2.5) gives 4, the code of 2); for
//    2 <= a < 4, t < 5 and 2 + floor(t) is the code; for a >= 4, t < 8 (a <= 6 and the offset < 2 are
//    multiples of 2^-21) and 4 + floor(t / 2) is 6 below 6 and 7 from 6 up, the codec's saturation.
//  - |x| > 6, Inf and NaN: a = 6 (fminf returns the non-NaN operand), t >= 6, code 7; the codec's
//    min(|x| + offset, 6) is 6 there too. The sign is the codec's (x < 0; -0.0 and NaN give 0).
NB_DEVICE uint32_t e2m1_code_sr_bits(float x, uint32_t w, int byte) {
  const float a = fminf(fabsf(x), 6.0f);
  const uint32_t magic = e2m1_magic_bits(a, x);
  const float q = bits_f32(__byte_perm(magic, w, 0x3200u | ((4u + byte) << 4)));
  const float t = __fmaf_rn(__fsub_rn(q, bits_f32(magic)), 0x1p-16f, a);
  return f32_bits(__fadd_rz(t, bits_f32(magic)));
}

// Eight results of e2m1_code_*_bits packed into one word without a mask per code: shifted left by 4 * i
// for i >= 3, a result's exponent bits leave the word and its bits 4..22 are 0, so the shifted codes do
// not overlap (sum = OR); codes 0..2 are summed apart and masked once (their exponent bits only reach
// bits >= 23 of that sum, and carries only go up).
NB_DEVICE uint32_t pack8_codes(const uint32_t* u) {
  const uint32_t lo = u[0] + (u[1] << 4) + (u[2] << 8);
  uint32_t hi = 0;
  NB_UNROLL
  for (int i = 3; i < 8; ++i) hi += u[i] << (4 * i);
  return (lo & 0xFFFu) | hi;
}

// encode_block16 (nvfp4_math.h) on the GPU: the same 8 bytes, through the codecs above.
NB_DEVICE uint64_t encode_block16_gpu(const float* v, float enc, bool sr, const Philox4x32& rand) {
  uint32_t word[2];
  NB_UNROLL
  for (int h = 0; h < 2; ++h) {
    uint32_t u[8];
    NB_UNROLL
    for (int i = 0; i < 8; ++i) {
      const float x = v[8 * h + i] * enc;
      u[i] = sr ? e2m1_code_sr_bits(x, rand.v[2 * h + i / 4], i % 4) : e2m1_code_rne_bits(x);
    }
    word[h] = pack8_codes(u);
  }
  return uint64_t(word[0]) | (uint64_t(word[1]) << 32);
}

// ---- fused quantize pass -------------------------------------------------------------------------
struct KernelArgs {
  const bf16* x;
  int64_t rows, cols;
  bool rowwise, colwise;
  PhiloxSchedule rng;
  uint8_t *row_data, *row_scales, *col_data, *col_scales;
  const float *row_amax, *col_amax;
  int* nonfinite;
};

// Two packed BF16 magnitudes at once (sm_90 SIMD max): the amax of a block from its raw words.
NB_DEVICE uint32_t max_u16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
constexpr uint32_t kAbs2 = 0x7FFF7FFFu;

struct TileCoords {
  int64_t r0, c0;
  int valid_rows, valid_cols;
};

NB_DEVICE TileCoords tile_coords(const KernelArgs& a, int64_t tile_id, int64_t tiles_x) {
  TileCoords tc;
  tc.r0 = (tile_id / tiles_x) * kTileRows;
  tc.c0 = (tile_id % tiles_x) * kTileCols;
  tc.valid_rows = int(a.rows - tc.r0 < kTileRows ? a.rows - tc.r0 : kTileRows);
  tc.valid_cols = int(a.cols - tc.c0 < kTileCols ? a.cols - tc.c0 : kTileCols);
  return tc;
}

// Shared-memory tile layout: row pitch 16 pieces of 16 bytes; in the right half of a row (pieces 8..15)
// the two halves of each row block trade places. A 64-word row spans the 32 banks twice, so row blocks
// j and j + 4 sit on the same banks: with the trade, the 8 threads reading one row's first halves hit
// 8 different 16-byte bank groups (and the column phase's 32 consecutive words stay one 128-byte line).
NB_DEVICE int swizzled_piece(int row, int piece) { return row * 16 + (piece ^ (piece >> 3)); }
NB_DEVICE int swizzled_word(int row, int word) { return row * 64 + (word ^ ((word >> 5) << 2)); }

// The tile's 1024 16-byte pieces, 4 per thread, copied global -> shared with cp.async (no registers
// held while in flight); out-of-range pieces are zero-filled (source size 0).
NB_DEVICE void load_tile_async(const KernelArgs& a, const TileCoords& tc, uint4* stage) {
  NB_UNROLL
  for (int i = 0; i < 4; ++i) {
    const int idx = threadIdx.x + kThreads * i, row = idx / 16, q = idx % 16;
    const bool valid = row < tc.valid_rows && q * 8 < tc.valid_cols;
    const bf16* src = valid ? a.x + (tc.r0 + row) * a.cols + tc.c0 + q * 8 : a.x;
    const uint32_t dst = uint32_t(__cvta_generic_to_shared(stage + swizzled_piece(row, q)));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
  }
}
NB_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
NB_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// hadamard::rht16_bf16 (the same FP32 butterfly and bf16x2 RNE rounding) that also returns the
// block's largest |value| as a BF16 bit pattern, taken two at a time on the packed pairs (SIMD max)
// instead of 16 scalar compares on the unpacked floats.
NB_DEVICE uint32_t rht16_bf16_amax(float* v) {
  hadamard::rht16_f32(v);
  uint32_t m2 = 0;
  NB_UNROLL
  for (int i = 0; i < 16; i += 2) {
    uint32_t packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(v[i + 1]), "f"(v[i]));
    v[i] = bits_f32(packed << 16);
    v[i + 1] = bits_f32(packed & 0xFFFF0000u);
    m2 = max_u16x2(m2, packed & kAbs2);
  }
  return max(m2 & 0xFFFFu, m2 >> 16);
}

// E4M3 block scale code with the sm_90 conversion instruction (RNE, satfinite, NaN -> 0x7F): the same
// byte as f32_to_e4m3_satfinite for every input (block_scale_code with s_enc_div6 = s_enc * (1/6)).
NB_DEVICE uint32_t block_scale_code_hw(float block_amax, float s_enc_div6) {
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(block_amax * s_enc_div6));
  return pair & 0xFFu;
}

// Persistent CTAs: each walks tiles blockIdx.x, + gridDim.x, ...; a ring of kStages tiles in shared
// memory keeps the next kStages - 1 tiles' loads in flight while the current one is encoded. kCp: SR with a
// context-parallel row map (an instance of its own, so that the default SR instances keep their code: the map's
// shift in them cost 2-3% with RHT + SR on an H100 through the registers it adds).
template <bool kTwoD, bool kRht, bool kSr, bool kCp>
__global__ void __launch_bounds__(kThreads, kSr ? (kRht ? NB_NVFP4_MIN_CTAS_RHT_SR : NB_NVFP4_MIN_CTAS_SR)
                                                : NB_NVFP4_MIN_CTAS) quantize_kernel(KernelArgs a) {
  extern __shared__ __align__(16) uint4 ring[];  // kStages tiles of BF16 pairs, row pitch 64 words
  __shared__ uint32_t col_stage[kTileCols * kColStagePitchWords];
  __shared__ uint8_t col_scale_stage[kTileCols * 4];
  __shared__ uint8_t tile_scale[4 * 8];  // 2D: one code per 16x16 tile
  __shared__ float enc_lut[2][256];      // enc_b for every scale code: [0] row-wise, [1] column-wise

  const int t = threadIdx.x;
  const float row_amax = a.row_amax ? *a.row_amax : *a.col_amax;
  const float col_amax = a.col_amax ? *a.col_amax : row_amax;
  if (blockIdx.x == 0 && t == 0 && a.nonfinite && (!amax_is_finite(row_amax) || !amax_is_finite(col_amax)))
    *a.nonfinite = 1;
  const float s_enc_row = global_encode_scale(row_amax);
  const float s_enc_col = kTwoD ? s_enc_row : global_encode_scale(col_amax);
  const float s_enc_row_div6 = s_enc_row * (1.0f / 6.0f), s_enc_col_div6 = s_enc_col * (1.0f / 6.0f);
  // One division per scale code instead of one per block (same expression as block_encode_scale).
  enc_lut[0][t] = block_encode_scale_dec(uint32_t(t), 1.0f / s_enc_row);
  enc_lut[1][t] = block_encode_scale_dec(uint32_t(t), 1.0f / s_enc_col);

  const int64_t tiles_x = (a.cols + kTileCols - 1) / kTileCols;
  const int64_t tiles = tiles_x * ((a.rows + kTileRows - 1) / kTileRows);
  NB_UNROLL
  for (int st = 0; st < kStages - 1; ++st) {
    const int64_t id = blockIdx.x + int64_t(st) * gridDim.x;
    if (id < tiles) load_tile_async(a, tile_coords(a, id, tiles_x), ring + st * kTilePieces);
    cp_async_commit();  // one group per ring slot, empty or not, so the wait count below holds
  }

  int stage = 0;
  for (int64_t tile_id = blockIdx.x; tile_id < tiles; tile_id += gridDim.x) {
    const TileCoords tc = tile_coords(a, tile_id, tiles_x);
    const int64_t r0 = tc.r0, c0 = tc.c0;
    const int valid_rows = tc.valid_rows, valid_cols = tc.valid_cols;
    cp_async_wait<kStages - 2>();  // this thread's pieces of the current tile have landed
    __syncthreads();  // everyone's pieces landed; the previous tile's readers of the ring slot, col_stage and
                      // tile_scale are done
    {
      const int64_t next = tile_id + int64_t(kStages - 1) * gridDim.x;
      const int slot = stage == 0 ? kStages - 1 : stage - 1;  // the slot the previous tile used
      if (next < tiles) load_tile_async(a, tile_coords(a, next, tiles_x), ring + slot * kTilePieces);
      cp_async_commit();
    }
    const uint32_t* tile = reinterpret_cast<const uint32_t*>(ring + stage * kTilePieces);
    stage = stage + 1 == kStages ? 0 : stage + 1;

    if constexpr (kTwoD) {
      // 32 tiles of 16x16; 8 threads per tile, 2 rows each, reduced by shuffles within the 8 lanes.
      const int tl = t / 8, sub = t % 8, ti = tl / 8, tj = tl % 8;
      uint32_t m2 = 0;
      NB_UNROLL
      for (int rr = 0; rr < 2; ++rr) {
        // The tile's two pieces of this row (possibly traded by the swizzle: the max does not care).
        const uint4* src = reinterpret_cast<const uint4*>(tile) + (ti * 16 + sub * 2 + rr) * 16 + tj * 2;
        const uint4 p0 = src[0], p1 = src[1];
        m2 = max_u16x2(m2, max_u16x2(max_u16x2(p0.x & kAbs2, p0.y & kAbs2), max_u16x2(p0.z & kAbs2, p0.w & kAbs2)));
        m2 = max_u16x2(m2, max_u16x2(max_u16x2(p1.x & kAbs2, p1.y & kAbs2), max_u16x2(p1.z & kAbs2, p1.w & kAbs2)));
      }
      uint32_t m = max(m2 & 0xFFFFu, m2 >> 16) << 16;
      NB_UNROLL
      for (int o = 4; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
      if (sub == 0) tile_scale[tl] = uint8_t(block_scale_code_hw(bits_f32(m), s_enc_row_div6));
      __syncthreads();
    }

    // Row phase: 2 row blocks per thread.
    if (a.rowwise) {
      const int blk = t % 8;
      // The thread's block column is the same for both of its blocks: one segment lookup per tile.
      const int64_t gblk = c0 / 16 + blk;
      int64_t sr_col_block = 0;  // the Philox block of the block less grow * pitch
      if constexpr (kSr) sr_col_block = a.rng.row.at.base + gblk + sr_shift(a.rng.row.at, gblk);
      NB_UNROLL
      for (int i = 0; i < 2; ++i) {
        const int row = t / 8 + 32 * i;
        if (row >= valid_rows || blk * 16 >= valid_cols) continue;
        const uint4* pieces = reinterpret_cast<const uint4*>(tile);
        const uint4 p0 = pieces[swizzled_piece(row, 2 * blk)], p1 = pieces[swizzled_piece(row, 2 * blk + 1)];
        float v[16];
        unpack8(p0, v);
        unpack8(p1, v + 8);
        uint32_t s;
        if constexpr (kTwoD) {
          s = tile_scale[(row / 16) * 8 + blk];
        } else {
          uint32_t m2 =
              max_u16x2(max_u16x2(max_u16x2(p0.x & kAbs2, p0.y & kAbs2), max_u16x2(p0.z & kAbs2, p0.w & kAbs2)),
                        max_u16x2(max_u16x2(p1.x & kAbs2, p1.y & kAbs2), max_u16x2(p1.z & kAbs2, p1.w & kAbs2)));
          s = block_scale_code_hw(bits_f32(max(m2 & 0xFFFFu, m2 >> 16) << 16), s_enc_row_div6);
        }
        const float enc = enc_lut[0][s];
        // The block's index in the row-wise copy, (grow * cols) / 16 + gblk (cols is a multiple of 16):
        // its scale's offset and its 8 code bytes' offset / 8; its Philox counter is the whole tensor's.
        // A context-parallel row map moves the row (sr_cp_shift).
        const int64_t grow = r0 + row, gblock = grow * (a.cols / 16) + gblk;
        Philox4x32 rand{};
        if constexpr (kSr) {
          int64_t counter = sr_col_block + grow * a.rng.row.at.pitch;
          if constexpr (kCp) counter += sr_cp_shift(a.rng.row.at, grow);
          rand = philox_block_sched(a.rng, a.rng.row, uint64_t(counter));
        }
        const uint64_t packed = encode_block16_gpu(v, enc, kSr, rand);
        *reinterpret_cast<uint2*>(a.row_data + gblock * 8) = make_uint2(uint32_t(packed), uint32_t(packed >> 32));
        a.row_scales[gblock] = uint8_t(s);
      }
    }

    // Column phase: thread = (column pair p, 16-row chunk k).
    if (a.colwise) {
      const int warp = t / 32, lane = t % 32, p = (warp % 2) * 32 + lane, k = warp / 2;
      if (k * 16 < valid_rows && p * 2 < valid_cols) {
        // Each column of the pair re-reads its 16 words (cheap, conflict-free) so that only one
        // column's values are live in registers at a time.
        const uint32_t* words = tile + swizzled_word(k * 16, p);
        uint32_t m2 = 0;  // both columns' block amaxes (BF16 pairs), taken on the first pass only
        // Block r0 / 16 + k of line c0 + 2p (r0 is a multiple of 16), numbered in the whole tensor; both
        // columns of the pair lie in one column segment (segments start at multiples of 16): one lookup.
        int64_t sr_pair_block = 0;
        if constexpr (kSr) sr_pair_block = sr_block_index<kCp>(a.rng.col.at, c0 + 2 * p, r0 / 16 + k);
        NB_UNROLL
        for (int q = 0; q < 2; ++q) {
          float v[16];
          NB_UNROLL
          for (int j = 0; j < 16; ++j) {
            const uint32_t w = words[j * (kTileCols / 2)];
            if constexpr (!kRht && !kTwoD)
              if (q == 0) m2 = max_u16x2(m2, w & kAbs2);
            v[j] = bits_f32(q ? (w & 0xFFFF0000u) : (w << 16));
          }
          const int col = 2 * p + q;
          uint32_t s;
          if constexpr (kTwoD) {
            s = tile_scale[k * 8 + col / 16];
          } else if constexpr (kRht) {
            s = block_scale_code_hw(bits_f32(rht16_bf16_amax(v) << 16), s_enc_col_div6);
          } else {
            s = block_scale_code_hw(bits_f32((q ? m2 >> 16 : m2 & 0xFFFFu) << 16), s_enc_col_div6);
          }
          const float enc = enc_lut[1][s];
          Philox4x32 rand{};
          if constexpr (kSr)
            rand = philox_block_sched(a.rng, a.rng.col, uint64_t(sr_pair_block + q * a.rng.col.at.pitch));
          const uint64_t packed = encode_block16_gpu(v, enc, kSr, rand);
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
}

// Persistent grid: as many CTAs as fit on the GPU at once (never more than there are tiles).
template <bool kTwoD, bool kRht, bool kSr, bool kCp = false>
void launch_quantize(const KernelArgs& a, int64_t tiles, cudaStream_t s) {
  static int resident = [] {
    auto* kernel = quantize_kernel<kTwoD, kRht, kSr, kCp>;
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kRingBytes)));
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, kRingBytes));
    return std::max(per_sm, 1) * current_device_sm_count();
  }();
  const int grid = int(std::min<int64_t>(tiles, resident));
  quantize_kernel<kTwoD, kRht, kSr, kCp><<<grid, kThreads, kRingBytes, s>>>(a);
  CUDA_CHECK_LAUNCH();
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
  const int sms = current_device_sm_count();
  const int grid = int(std::min<int64_t>((patches + 255) / 256, int64_t(sms) * 8));
  auto* ra = reinterpret_cast<uint32_t*>(row_amax);
  auto* ca = reinterpret_cast<uint32_t*>(col_amax);
  if (rht)
    amax_kernel<true><<<grid, 256, 0, s>>>(x, rows, cols, ra, ca);
  else
    amax_kernel<false><<<grid, 256, 0, s>>>(x, rows, cols, ra, ca);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

Status quantize_cuda_with_amax(const bf16* x, const Options& opts, const QuantizedView& out, Stream stream) {
  NB_TRY(check_view(opts, out));
  if (opts.four_over_six) return quantize_4over6_cuda_with_amax(x, opts, out, stream);  // nvfp4_4over6.cu
  KernelArgs a{x,
               out.rows,
               out.cols,
               opts.rowwise,
               opts.colwise,
               philox_schedule(opts.rng, opts.sr_origin, out.rows, out.cols),
               out.row_data,
               out.row_scales,
               out.col_data,
               out.col_scales,
               opts.rowwise ? out.row_amax : nullptr,
               opts.colwise ? out.col_amax : nullptr,
               out.nonfinite};
  const int64_t tiles = ((out.cols + kTileCols - 1) / kTileCols) * ((out.rows + kTileRows - 1) / kTileRows);
  auto s = static_cast<cudaStream_t>(stream);
  const bool rht = opts.rht && opts.colwise, cp = opts.sr_origin.cp.chunk != 0;
  if (opts.two_d)
    launch_quantize<true, false, false>(a, tiles, s);
  else if (rht && opts.sr && cp)
    launch_quantize<false, true, true, true>(a, tiles, s);
  else if (rht && opts.sr)
    launch_quantize<false, true, true>(a, tiles, s);
  else if (rht)
    launch_quantize<false, true, false>(a, tiles, s);
  else if (opts.sr && cp)
    launch_quantize<false, false, true, true>(a, tiles, s);
  else if (opts.sr)
    launch_quantize<false, false, true>(a, tiles, s);
  else
    launch_quantize<false, false, false>(a, tiles, s);
  return Status::ok();
}

Status quantize_cuda(const bf16* x, const Options& opts, const QuantizedView& out, Stream stream) {
  NB_TRY(check_view(opts, out));
  NB_TRY(compute_amax_cuda(x, out.rows, out.cols, opts.rht && opts.colwise, opts.rowwise ? out.row_amax : nullptr,
                           opts.colwise ? out.col_amax : nullptr, stream));
  return quantize_cuda_with_amax(x, opts, out, stream);
}

}  // namespace nb::nvfp4
