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
constexpr int kConvTileBytes = 64 * kBK * 2;  // one consumer's converted 64x64 BF16 A tile

// The shared-memory map, from a 1024-byte aligned base: [stage: B tile | A tile] x kStages, then (quantized
// A) 2 consumers x 2 converted tiles, then the barriers.
template <InLoopFormat F>
struct SmemMap {
  static constexpr int stage_bytes = (kBTileBytes + ATile<F>::bytes + 1023) / 1024 * 1024;
  static constexpr int conv_offset = kStages * stage_bytes;
  static constexpr int conv_bytes = F == InLoopFormat::bf16 ? 0 : 2 * 2 * kConvTileBytes;
  static constexpr int bar_offset = conv_offset + conv_bytes;
  static constexpr int total = bar_offset + 2 * kStages * 8 + 1024;  // + slack to align the base
};

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// 16 MXFP8 codes (E4M3) times 2^(e-127) -> 16 BF16 (8 words), rounded as dequantize_operand_cuda does.
__device__ __forceinline__ void convert16_mxfp8(uint4 q, uint8_t scale_code, uint32_t* out) {
  const float s = e8m0_to_f32(scale_code);
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  NB_UNROLL
  for (int i = 0; i < 8; ++i) {
    const uint16_t pair = uint16_t(w[i / 2] >> (16 * (i % 2)));
    uint32_t h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(pair));
    float lo, hi;
    asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}"
        : "=f"(lo), "=f"(hi)
        : "r"(h2));
    out[i] = pack_bf16x2(lo * s, hi * s);
  }
}

// 8 packed E2M1 codes (one 32-bit word, low nibble first) -> 4 words of BF16 pairs, by table lookup: the
// magnitude's 3 bits select the high and low byte of its BF16 value (prmt), the sign bit moves to bit 15.
__device__ __forceinline__ void e2m1x8_to_bf16(uint32_t w, uint32_t* out) {
  NB_UNROLL
  for (int half = 0; half < 2; ++half) {
    const uint32_t v = w >> (16 * half);  // 4 codes in the low 16 bits
    const uint32_t sel = v & 0x7777u;
    uint32_t hi, lo, p01, p23;
    // BF16 of 0, 0.5, 1, 1.5, 2, 3, 4, 6: high bytes 00 3F 3F 3F 40 40 40 40, low bytes 00 00 80 C0 00 40 80 C0.
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(hi) : "r"(0x3F3F3F00u), "r"(0x40404040u), "r"(sel));
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(lo) : "r"(0xC0800000u), "r"(0xC0804000u), "r"(sel));
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(p01) : "r"(lo), "r"(hi), "r"(0x5140u));
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(p23) : "r"(lo), "r"(hi), "r"(0x7362u));
    out[2 * half] = p01 | ((v << 12) & 0x8000u) | ((v << 24) & 0x80000000u);
    out[2 * half + 1] = p23 | ((v << 4) & 0x8000u) | ((v << 16) & 0x80000000u);
  }
}

// 16 NVFP4 codes times their E4M3 block scale -> 16 BF16; exact (at most 6 significant bits).
__device__ __forceinline__ void convert16_nvfp4(uint2 q, uint8_t scale_code, uint32_t* out) {
  const uint32_t sb = f32_bits(e4m3_to_f32(scale_code)) >> 16;  // E4M3 is exact in BF16
  const uint32_t s2 = sb | (sb << 16);
  e2m1x8_to_bf16(q.x, out);
  e2m1x8_to_bf16(q.y, out + 4);
  NB_UNROLL
  for (int i = 0; i < 8; ++i) asm("mul.rn.bf16x2 %0, %0, %1;" : "+r"(out[i]) : "r"(s2));
}

// Where this thread's two 16-element chunks of its consumer's 64x64 A tile lie: chunk j = tid + 128 p,
// row j / 4, elements 16 (j % 4) ...
struct ChunkPos {
  int row[2], col16[2];
};
__device__ __forceinline__ ChunkPos chunk_positions(int tid) {
  ChunkPos p;
  NB_UNROLL
  for (int i = 0; i < 2; ++i) {
    const int j = tid + 128 * i;
    p.row[i] = j / 4;
    p.col16[i] = j % 4;
  }
  return p;
}

// One scale byte per chunk (the chunk lies inside one MXFP8 or NVFP4 block), from global memory.
template <InLoopFormat F>
__device__ __forceinline__ void load_scales(const uint8_t* scales, int64_t pitch, int64_t row0, int kb,
                                            const ChunkPos& p, uint8_t* out) {
  constexpr int kBlock = F == InLoopFormat::mxfp8 ? 32 : 16;
  NB_UNROLL
  for (int i = 0; i < 2; ++i)
    out[i] = __ldg(scales + (row0 + p.row[i]) * pitch + (int64_t(kb) * kBK + 16 * p.col16[i]) / kBlock);
}

// Converts this consumer's 64 rows of the stage's A codes into `dst` (64x64 BF16, 128-byte swizzle:
// 16-byte chunk c of row r at chunk c ^ (r % 8)).
template <InLoopFormat F>
__device__ __forceinline__ void convert_tile(const uint8_t* codes, const ChunkPos& p, const uint8_t* scale,
                                             uint8_t* dst) {
  NB_UNROLL
  for (int i = 0; i < 2; ++i) {
    const int r = p.row[i], c = p.col16[i];
    uint32_t w[8];
    if constexpr (F == InLoopFormat::mxfp8)
      convert16_mxfp8(*reinterpret_cast<const uint4*>(codes + r * ATile<F>::row_bytes + 16 * c), scale[i], w);
    else
      convert16_nvfp4(*reinterpret_cast<const uint2*>(codes + r * ATile<F>::row_bytes + 8 * c), scale[i], w);
    uint8_t* row = dst + r * 128;
    *reinterpret_cast<uint4*>(row + (((2 * c) ^ (r & 7)) * 16)) = make_uint4(w[0], w[1], w[2], w[3]);
    *reinterpret_cast<uint4*>(row + (((2 * c + 1) ^ (r & 7)) * 16)) = make_uint4(w[4], w[5], w[6], w[7]);
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

template <InLoopFormat F>
__device__ void consume(uint8_t* smem, uint64_t* full, uint64_t* empty, const uint8_t* scales, int64_t scale_pitch,
                        bf16* c, int n, TileCoord t, int kblocks, const float* alpha) {
  constexpr int kStage = SmemMap<F>::stage_bytes;
  const int cw = threadIdx.x / 128 - 1, tid = threadIdx.x % 128;
  float acc[2][64];
  NB_UNROLL
  for (int i = 0; i < 64; ++i) acc[0][i] = acc[1][i] = 0.f;
  const ChunkPos pos = chunk_positions(tid);
  uint8_t scale[2] = {0, 0};
  if constexpr (F != InLoopFormat::bf16) load_scales<F>(scales, scale_pitch, t.m0 + 64 * cw, 0, pos, scale);
  for (int kb = 0; kb < kblocks; ++kb) {
    const int s = kb % kStages;
    uint8_t* stage = smem + s * kStage;
    mbar_wait(&full[s], (kb / kStages) & 1);
    const uint8_t* a_tile;
    if constexpr (F == InLoopFormat::bf16) {
      a_tile = stage + kBTileBytes + cw * 64 * 128;
    } else {
      uint8_t* conv = smem + SmemMap<F>::conv_offset + (2 * cw + (kb & 1)) * kConvTileBytes;
      convert_tile<F>(stage + kBTileBytes + cw * 64 * ATile<F>::row_bytes, pos, scale, conv);
      if (kb + 1 < kblocks) load_scales<F>(scales, scale_pitch, t.m0 + 64 * cw, kb + 1, pos, scale);
      fence_async_shared();
      named_barrier(1 + cw, 128);
      a_tile = conv;
    }
    wgmma_fence();
    NB_UNROLL
    for (int ks = 0; ks < kBK / 16; ++ks) {
      const uint64_t da = sw128_desc(a_tile) + 2 * ks;  // +32 bytes per 16 K-elements, in 16-byte units
      wgmma_m64n128k16(acc[0], da, sw128_desc(stage) + 2 * ks);
      wgmma_m64n128k16(acc[1], da, sw128_desc(stage + kBTileBytes / 2) + 2 * ks);
    }
    wgmma_commit();
    wgmma_wait<1>();  // the previous step's MMAs are done: its stage (and converted tile) may be reused
    if (kb > 0 && tid == 0) mbar_arrive(&empty[(kb - 1) % kStages]);
  }
  wgmma_wait<0>();
  store_c(acc, c, n, t.m0 + 64 * cw, t.n0, alpha ? *alpha : 1.0f);
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
    consume<F>(smem, full, empty, scales, scale_pitch, c, n, t, k / kBK, alpha);
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
  auto s = static_cast<cudaStream_t>(stream);
  switch (a.format) {
    case InLoopFormat::bf16: return launch<InLoopFormat::bf16>(a, b, c, m, n, k, alpha, s);
    case InLoopFormat::mxfp8: return launch<InLoopFormat::mxfp8>(a, b, c, m, n, k, alpha, s);
    case InLoopFormat::nvfp4: return launch<InLoopFormat::nvfp4>(a, b, c, m, n, k, alpha, s);
  }
  return errorf("in-loop GEMM: unknown A format");
}

}  // namespace nb::gemm
