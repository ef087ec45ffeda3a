// The in-loop dequantizing Hopper GEMM of wgmma_gemm.h: kernel and launcher. The pipeline, the smem
// map and the thread roles are described in the header; the converters below are the only part that
// differs between the A formats.
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <mutex>
#include "core/cuda_check.h"
#include "core/macros.h"
#include "formats/scalar_codecs.h"
#include "gemm/wgmma_gemm.h"
#include "gemm/wgmma_ptx.cuh"

namespace nb::gemm {
namespace {

using namespace wgmma;

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kGroupM = 16;    // C tiles are visited in groups of 16 M-tiles so that A and B stay in L2

template <InLoopFormat F>
struct ATile {  // bytes of one stage's A tile, as loaded (codes for the quantized formats)
  static constexpr int bytes = F == InLoopFormat::bf16    ? kBM * kBK * 2
                               : F == InLoopFormat::mxfp8 ? kBM * kBK
                                                          : kBM * kBK / 2;
  static constexpr int row_bytes = bytes / kBM;
};
constexpr int kBTileBytes = kBN * kBK * 2;

// The shared-memory map, from a 1024-byte aligned base: [stage: B tile | A tile] x kStages, then the barriers.
template <InLoopFormat F>
struct SmemMap {
  static constexpr int stage_bytes = (kBTileBytes + ATile<F>::bytes + 1023) / 1024 * 1024;
  static constexpr int bar_offset = kStages * stage_bytes;
  static constexpr int total = bar_offset + 2 * kStages * 8 + 1024;  // + slack to align the base
};

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// Two E4M3 codes in bytes 0 and 2 (bytes 1 and 3 ignored) -> their exact values as a BF16 pair, with integer
// ops and one BF16 multiply instead of the conversion pipe (16 results per clock per SM, which bound the
// first version): the code's exponent and mantissa bits placed as a BF16's low exponent bits read as
// 2^(e-127) x 1.m (or m/8 x 2^-126 for e = 0), and x 2^120 rebiases them to 2^(e-7) x 1.m, exactly.
// The NaN codes 0x7F/0xFF come out as +-480; see mxfp8_fragment for why that is harmless.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t v) {
  const uint32_t x = ((v << 4) & 0x07F007F0u) | ((v << 8) & 0x80008000u);
  return mul_bf16x2(x, 0x7B807B80u);  // 2^120 in both halves
}

// 8 packed E2M1 codes (one 32-bit word, low nibble first) -> 4 words of BF16 pairs, by table lookup: the
// magnitude's 3 bits select the high and low byte of its BF16 value (prmt), the sign bit moves to bit 15.
__device__ __forceinline__ void e2m1x8_to_bf16(uint32_t w, uint32_t* out) {
  NB_UNROLL
  for (int half = 0; half < 2; ++half) {
    const uint32_t v = w >> (16 * half);  // 4 codes in the low 16 bits
    const uint32_t sel = v & 0x7777u;
    // BF16 of 0, 0.5, 1, 1.5, 2, 3, 4, 6: high bytes 00 3F 3F 3F 40 40 40 40, low bytes 00 00 80 C0 00 40 80 C0.
    const uint32_t hi = prmt(0x3F3F3F00u, 0x40404040u, sel), lo = prmt(0xC0800000u, 0xC0804000u, sel);
    out[2 * half] = prmt(lo, hi, 0x5140u) | ((v << 12) & 0x8000u) | ((v << 24) & 0x80000000u);
    out[2 * half + 1] = prmt(lo, hi, 0x7362u) | ((v << 4) & 0x8000u) | ((v << 16) & 0x80000000u);
  }
}

// The A fragment of wgmma (per warp the mma.m16n8k16 layout) asks each thread for rows g and g + 8 of its
// warp's 16 and, per 16-wide K slice, elements 2t, 2t + 1 and 2t + 8, 2t + 9 (g = lane / 4, t = lane % 4).
struct FragPos {
  int row;  // g within the consumer's 64 rows (16 * warp + lane / 4); the second row is row + 8
  int t;
};

// Block scales of this thread's two rows for one K step, loaded a step ahead from global memory.
// NVFP4: 4 E4M3 bytes per row (one per 16-wide slice); MXFP8: 2 E8M0 bytes per row (slices 0-1, 2-3).
template <InLoopFormat F>
__device__ __forceinline__ void load_scales(const uint8_t* scales, int64_t pitch, int64_t row, int kb, uint32_t* sc) {
  NB_UNROLL
  for (int i = 0; i < 2; ++i) {
    const uint8_t* p = scales + (row + 8 * i) * pitch;
    if constexpr (F == InLoopFormat::nvfp4)
      sc[i] = __ldg(reinterpret_cast<const uint32_t*>(p) + kb);
    else
      sc[i] = __ldg(reinterpret_cast<const uint16_t*>(p) + kb);
  }
}

// NVFP4 rows are 32 code bytes per K step: slice s is bytes 8s..8s+7, and a thread's pairs are byte t (a0/a1)
// and byte t + 4 (a2/a3) of it. The four bytes gather into one word, converted by table; each pair is then
// multiplied by its row's E4M3 scale in BF16 (exact: at most 6 significant bits).
__device__ __forceinline__ void nvfp4_fragment(const uint8_t* codes, FragPos p, const uint32_t* sc, uint32_t* f) {
  const uint8_t* rg = codes + p.row * 32;
  const uint32_t pick = uint32_t(p.t) | (uint32_t(p.t + 4) << 4);
  uint32_t s2[2][4];  // per row and slice: the scale as a BF16 pair (E4M3 is exact in BF16)
  NB_UNROLL
  for (int i = 0; i < 2; ++i) {
    NB_UNROLL
    for (int j = 0; j < 4; ++j) s2[i][j] = e4m3x2_to_bf16x2(prmt(sc[i], 0, uint32_t(j) | (uint32_t(j) << 8)));
  }
  NB_UNROLL
  for (int s = 0; s < 4; ++s) {
    const uint2 x = *reinterpret_cast<const uint2*>(rg + 8 * s);
    const uint2 y = *reinterpret_cast<const uint2*>(rg + 8 * 32 + 8 * s);
    const uint32_t w = prmt(prmt(x.x, y.x, pick), prmt(x.y, y.y, pick), 0x5410u);
    e2m1x8_to_bf16(w, f + 4 * s);
    NB_UNROLL
    for (int j = 0; j < 4; ++j) f[4 * s + j] = mul_bf16x2(f[4 * s + j], s2[j & 1][s]);
  }
}

// MXFP8 rows are 64 code bytes per K step: slice s is bytes 16s..16s+15, a thread's pairs bytes 2t, 2t + 1
// (a0/a1) and 2t + 8, 2t + 9 (a2/a3), each picked into bytes 0 and 2 of a word. Value = E4M3 x 2^(e-127):
// the exact BF16 of the code times the block's 2^(e-127) as a BF16 (exact for every E8M0 code: 2^-127 is a
// BF16 subnormal, 255 is NaN), one rounding, as dequantize_operand_cuda's FP32 product rounded to BF16.
// E4M3 NaN codes never meet a finite scale: the MXFP8 quantizer writes them only for NaN inputs, whose
// block then has the NaN scale (mxfp8.h), so the product is NaN either way.
__device__ __forceinline__ void mxfp8_fragment(const uint8_t* codes, FragPos p, const uint32_t* sc, uint32_t* f) {
  const uint8_t* rg = codes + p.row * 64;
  const uint32_t pick = uint32_t(2 * p.t) | (uint32_t(2 * p.t + 1) << 8);
  uint32_t scale[2][2];  // per row and 32-block: 2^(e-127) as a BF16 pair
  NB_UNROLL
  for (int i = 0; i < 2; ++i) {
    NB_UNROLL
    for (int b = 0; b < 2; ++b) {
      const uint32_t bits = __float_as_uint(e8m0_to_f32((sc[i] >> (8 * b)) & 0xFFu)) >> 16;  // exact
      scale[i][b] = bits | (bits << 16);
    }
  }
  NB_UNROLL
  for (int s = 0; s < 4; ++s) {
    NB_UNROLL
    for (int i = 0; i < 2; ++i) {
      const uint4 q = *reinterpret_cast<const uint4*>(rg + i * 8 * 64 + 16 * s);
      f[4 * s + i] = mul_bf16x2(e4m3x2_to_bf16x2(prmt(q.x, q.y, pick)), scale[i][s / 2]);
      f[4 * s + 2 + i] = mul_bf16x2(e4m3x2_to_bf16x2(prmt(q.z, q.w, pick)), scale[i][s / 2]);
    }
  }
}

struct TileCoord {
  int m0, n0;
};
__device__ __forceinline__ TileCoord tile_coord(int m, int n) {
  const int tiles_m = m / kBM, tiles_n = n / kBN;
  const int id = blockIdx.x, per_group = kGroupM * tiles_n;
  const int first_m = (id / per_group) * kGroupM;
  const int group_m = min(tiles_m - first_m, kGroupM);
  const int in_group = id % per_group;
  return {(first_m + in_group % group_m) * kBM, (in_group / group_m) * kBN};
}

template <InLoopFormat F>
__device__ void produce(const CUtensorMap* map_a, const CUtensorMap* map_b, uint8_t* smem, uint64_t* full,
                        uint64_t* empty, TileCoord t, int kblocks) {
  constexpr int kStage = SmemMap<F>::stage_bytes;
  for (int kb = 0; kb < kblocks; ++kb) {
    const int s = kb % kStages;
    if (kb >= kStages) mbar_wait(&empty[s], ((kb / kStages) - 1) & 1);
    mbar_arrive_expect_tx(&full[s], kBTileBytes + ATile<F>::bytes);
    uint8_t* stage = smem + s * kStage;
    tma_load_2d(stage, map_b, &full[s], kb * kBK, t.n0);
    // A's inner coordinate counts its map's elements: BF16 elements, or code bytes.
    tma_load_2d(stage + kBTileBytes, map_a, &full[s], kb * ATile<F>::row_bytes / (F == InLoopFormat::bf16 ? 2 : 1),
                t.m0);
  }
}

// The FP32 fragment of m64n128 (thread's d[4j + {0,1}] at row g, columns 8j + 2t + {0,1}; d[4j + {2,3}] at
// row g + 8) for both 128-column halves, scaled by alpha, rounded to BF16 and stored.
__device__ __forceinline__ void store_c(const float (*acc)[64], bf16* c, int n, int row0, int col0, float alpha) {
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const int r = row0 + 16 * warp + lane / 4;
  NB_UNROLL
  for (int h = 0; h < 2; ++h) {
    NB_UNROLL
    for (int j = 0; j < 16; ++j) {
      const int col = col0 + 128 * h + 8 * j + 2 * (lane % 4);
      const float* d = &acc[h][4 * j];
      *reinterpret_cast<uint32_t*>(c + int64_t(r) * n + col) = pack_bf16x2(alpha * d[0], alpha * d[1]);
      *reinterpret_cast<uint32_t*>(c + int64_t(r + 8) * n + col) = pack_bf16x2(alpha * d[2], alpha * d[3]);
    }
  }
}

// BF16 A: both operands from shared memory. Per K step: wait for the stage, 8 MMAs, retire the previous
// step's MMAs and hand their stage back to the producer.
__device__ __forceinline__ void consume_bf16(uint8_t* smem, uint64_t* full, uint64_t* empty, float (*acc)[64], int cw,
                                             int kblocks) {
  constexpr int kStage = SmemMap<InLoopFormat::bf16>::stage_bytes;
  for (int kb = 0; kb < kblocks; ++kb) {
    const int s = kb % kStages;
    uint8_t* stage = smem + s * kStage;
    mbar_wait(&full[s], (kb / kStages) & 1);
    const uint8_t* a_tile = stage + kBTileBytes + cw * 64 * 128;
    wgmma_fence();
    NB_UNROLL
    for (int ks = 0; ks < kBK / 16; ++ks) {
      const uint64_t da = sw128_desc(a_tile) + 2 * ks;  // +32 bytes per 16 K-elements, in 16-byte units
      wgmma_m64n128k16(acc[0], da, sw128_desc(stage) + 2 * ks);
      wgmma_m64n128k16(acc[1], da, sw128_desc(stage + kBTileBytes / 2) + 2 * ks);
    }
    wgmma_commit();
    wgmma_wait<1>();
    if (kb > 0 && threadIdx.x % 128 == 0) mbar_arrive(&empty[(kb - 1) % kStages]);
  }
  wgmma_wait<0>();
}

// Quantized A: each thread dequantizes its own A fragment from the stage's codes straight into registers
// and the MMAs read A from there (RS wgmma), so the BF16 A never touches shared memory. Three fragment
// buffers (three K steps per loop trip keep the buffer index static): step kb issues its MMAs, then
// converts step kb + 1 while the MMAs of kb - 1 and kb run, then retires kb - 1's (freeing its stage and,
// for step kb + 2, its buffer). The conversion thus never waits on the tensor cores, nor they on it.
template <InLoopFormat F>
__device__ __forceinline__ void consume_quantized(uint8_t* smem, uint64_t* full, uint64_t* empty, float (*acc)[64],
                                                  int cw, int kblocks, const uint8_t* scales, int64_t scale_pitch,
                                                  int64_t m0) {
  constexpr int kStage = SmemMap<F>::stage_bytes;
  const int lane = int(threadIdx.x % 32), warp = int(threadIdx.x % 128) / 32;
  const FragPos pos{16 * warp + lane / 4, lane % 4};
  const int64_t grow = m0 + 64 * cw + pos.row;
  uint32_t frag[3][16] = {};
  uint32_t sc[2];
  auto convert = [&](int kb, uint32_t* f) {  // waits for step kb's stage, fills f, prefetches kb + 1's scales
    const int s = kb % kStages;
    mbar_wait(&full[s], (kb / kStages) & 1);
    const uint8_t* codes = smem + s * kStage + kBTileBytes + cw * 64 * ATile<F>::row_bytes;
    if constexpr (F == InLoopFormat::nvfp4)
      nvfp4_fragment(codes, pos, sc, f);
    else
      mxfp8_fragment(codes, pos, sc, f);
    if (kb + 1 < kblocks) load_scales<F>(scales, scale_pitch, grow, kb + 1, sc);
  };
  auto step = [&](int kb, uint32_t* f, uint32_t* next, uint32_t* prev) {
    const uint8_t* stage = smem + (kb % kStages) * kStage;
    wgmma_fence();
    NB_UNROLL
    for (int ks = 0; ks < kBK / 16; ++ks) {
      wgmma_m64n128k16_rs(acc[0], f + 4 * ks, sw128_desc(stage) + 2 * ks);
      wgmma_m64n128k16_rs(acc[1], f + 4 * ks, sw128_desc(stage + kBTileBytes / 2) + 2 * ks);
    }
    wgmma_commit();
    if (kb + 1 < kblocks) convert(kb + 1, next);
    wgmma_wait<1>();  // step kb - 1's MMAs are retired: `prev` and that stage are free
    NB_UNROLL
    for (int i = 0; i < 16; ++i) fence_operand(prev[i]);
    if (kb > 0 && threadIdx.x % 128 == 0) mbar_arrive(&empty[(kb - 1) % kStages]);
  };
  load_scales<F>(scales, scale_pitch, grow, 0, sc);
  convert(0, frag[0]);
  for (int kb = 0; kb < kblocks; kb += 3) {
    step(kb, frag[0], frag[1], frag[2]);
    if (kb + 1 < kblocks) step(kb + 1, frag[1], frag[2], frag[0]);
    if (kb + 2 < kblocks) step(kb + 2, frag[2], frag[0], frag[1]);
  }
  wgmma_wait<0>();
  NB_UNROLL
  for (int i = 0; i < 16; ++i) fence_operand(frag[0][i]), fence_operand(frag[1][i]), fence_operand(frag[2][i]);
}

template <InLoopFormat F>
__global__ void __launch_bounds__(kThreads, 1)
    in_loop_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                        const uint8_t* __restrict__ scales, int64_t scale_pitch, bf16* __restrict__ c, int m, int n,
                        int k, const float* __restrict__ alpha) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + SmemMap<F>::bar_offset);
  uint64_t* empty = full + kStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 2);  // one arrival per consumer warpgroup
    }
    mbar_init_fence();
  }
  __syncthreads();
  const TileCoord t = tile_coord(m, n);
  if (threadIdx.x < 128) {
    regs_dealloc<40>();
    if (threadIdx.x == 0) produce<F>(&map_a, &map_b, smem, full, empty, t, k / kBK);
  } else {
    regs_alloc<232>();
    const int cw = threadIdx.x / 128 - 1;  // consumer warpgroup: rows 64 cw .. 64 cw + 63 of the tile
    float acc[2][64];
    NB_UNROLL
    for (int i = 0; i < 64; ++i) acc[0][i] = acc[1][i] = 0.f;
    if constexpr (F == InLoopFormat::bf16)
      consume_bf16(smem, full, empty, acc, cw, k / kBK);
    else
      consume_quantized<F>(smem, full, empty, acc, cw, k / kBK, scales, scale_pitch, t.m0);
    store_c(acc, c, n, t.m0 + 64 * cw, t.n0, alpha ? *alpha : 1.0f);
  }
}

// ---- host ----

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A 2-D map over `rows` rows of `inner` elements (`row_bytes` apart), boxes of box_inner x box_rows.
Status make_map(CUtensorMap* map, CUtensorMapDataType type, const void* base, uint64_t inner, uint64_t rows,
                uint64_t row_bytes, uint32_t box_inner, uint32_t box_rows, CUtensorMapSwizzle swizzle) {
  auto fn = encode_tiled();
  if (!fn) return errorf("in-loop GEMM: the driver has no cuTensorMapEncodeTiled (TMA needs a Hopper driver)");
  const cuuint64_t dims[2] = {inner, rows};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_inner, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r =
      fn(map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
         swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return errorf("in-loop GEMM: cuTensorMapEncodeTiled failed (CUresult %d)", int(r));
  return Status::ok();
}

template <InLoopFormat F>
Status launch(const InLoopOperand& a, const bf16* b, bf16* c, int64_t m, int64_t n, int64_t k, const float* alpha,
              cudaStream_t stream) {
  CUtensorMap map_a, map_b;
  NB_TRY(make_map(&map_b, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, b, uint64_t(k), uint64_t(n), uint64_t(k) * 2, kBK, kBN,
                  CU_TENSOR_MAP_SWIZZLE_128B));
  int64_t scale_pitch = 0;
  if constexpr (F == InLoopFormat::bf16) {
    NB_TRY(make_map(&map_a, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, a.data, uint64_t(k), uint64_t(m), uint64_t(k) * 2, kBK,
                    kBM, CU_TENSOR_MAP_SWIZZLE_128B));
  } else {
    constexpr int kRow = ATile<F>::row_bytes;  // code bytes per 64 elements
    const uint64_t row_bytes = uint64_t(k) * kRow / kBK;
    NB_TRY(make_map(&map_a, CU_TENSOR_MAP_DATA_TYPE_UINT8, a.data, row_bytes, uint64_t(m), row_bytes, kRow, kBM,
                    CU_TENSOR_MAP_SWIZZLE_NONE));
    scale_pitch = k / (F == InLoopFormat::mxfp8 ? 32 : 16);
  }
  static std::once_flag attr_once;
  std::call_once(attr_once, [] {
    CUDA_CHECK(
        cudaFuncSetAttribute(in_loop_gemm_kernel<F>, cudaFuncAttributeMaxDynamicSharedMemorySize, SmemMap<F>::total));
  });
  const unsigned tiles = unsigned((m / kBM) * (n / kBN));
  in_loop_gemm_kernel<F><<<tiles, kThreads, SmemMap<F>::total, stream>>>(map_a, map_b, a.scales, scale_pitch, c, int(m),
                                                                         int(n), int(k), alpha);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace

Status in_loop_gemm_cuda(const InLoopOperand& a, const bf16* b, bf16* c, int64_t m, int64_t n, int64_t k,
                         const float* alpha, Stream stream) {
  if (m <= 0 || n <= 0 || k <= 0 || m % kBM || n % kBN || k % kBK)
    return errorf("in-loop GEMM: M, N, K must be positive multiples of %d, %d, %d, got %lld, %lld, %lld", kBM, kBN, kBK,
                  (long long)m, (long long)n, (long long)k);
  if (m > (int64_t(1) << 30) || n > (int64_t(1) << 30) || k > (int64_t(1) << 30))
    return errorf("in-loop GEMM: dimensions above 2^30 are not supported");
  if (!a.data || !b || !c || (a.format != InLoopFormat::bf16 && !a.scales))
    return errorf("in-loop GEMM: null operand pointer");
  auto misaligned = [](const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) != 0; };
  if (misaligned(a.data, 16) || misaligned(b, 16) || misaligned(c, 16) ||
      (a.format != InLoopFormat::bf16 && misaligned(a.scales, 4)))
    return errorf(
        "in-loop GEMM: A, B and C must be 16-byte aligned and A's scales 4-byte aligned (TMA and the "
        "scale loads need it)");
  auto s = static_cast<cudaStream_t>(stream);
  switch (a.format) {
    case InLoopFormat::bf16: return launch<InLoopFormat::bf16>(a, b, c, m, n, k, alpha, s);
    case InLoopFormat::mxfp8: return launch<InLoopFormat::mxfp8>(a, b, c, m, n, k, alpha, s);
    case InLoopFormat::nvfp4: return launch<InLoopFormat::nvfp4>(a, b, c, m, n, k, alpha, s);
  }
  return errorf("in-loop GEMM: unknown A format");
}

}  // namespace nb::gemm
