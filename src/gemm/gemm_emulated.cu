// MXFP8 and NVFP4 GEMMs on GPUs without block-scaled tensor cores (Hopper): each operand is
// dequantized to BF16 with its block scales only, then BF16 cuBLASLt GEMMs with FP32 accumulation
// apply alpha (the product of the global scales) -- spec §6 "On Hopper".
//
//   NVFP4 operand [rows, K]: data [rows, K/2] packed E2M1 (low nibble first), scales E4M3 [rows, K/16]
//          -> BF16 [rows, K], value e2m1 x e4m3 (exact: <= 6 significant bits, |v| in [2^-10, 2688]).
//          Or stored [K, rows] (k_major = false: a 2D weight's row copy as the Dgrad operand): data
//          [K, rows/2], scales [K, rows/16], dequantized in its stored layout (the GEMM transposes).
//          alpha = (amax_a * amax_b) / (6*6*448*448) in FP32 (256 for a 4/6 operand's 448; the
//          denominator comes from the host, exact), computed by a one-thread kernel into
//          device memory and read by cuBLASLt in device pointer mode (no host synchronization).
//   MXFP8  row copy [rows, K] with E8M0 [rows, K/32], or the column-wise copy [K, rows] with E8M0
//          [K/32, rows]: dequantized in its stored layout (the GEMM transposes), value
//          e4m3 x 2^(code-127) in FP32 (exact), then rounded to BF16 (exact in the range stated in
//          gemm_quantized.h). alpha = 1.
//   mixed  a BF16 operand (Mixture of Representations' fallback) with an FP8 per-tensor or BF16 one: the BF16
//          operand is read as it is (never chunked, no scratch); FP8 codes are decoded to BF16 without their
//          scale (exact), and alpha = the FP8 operands' scale_inv product, on the device. MoR's NVFP4 ladder
//          pairs an NVFP4 operand (dequantized as above) with an FP8 per-tensor or BF16 one: alpha =
//          (amax * the other's scale_inv, or 1) / (6*448), on the device.
// Kernels: one thread per 16 consecutive stored elements (one NVFP4 block, half an MXFP8 block),
// 16-byte loads and two 16-byte stores; memory bound. They read a window of each stored row (source
// row pitch >= window width) and write it densely, so a block of an operand's rows is dequantized
// on its own whether those rows are stored rows (K-major) or stored columns ([K, rows]).
// Scratch: a per-device buffer, grown on demand and kept: [block of the chunked operand | the other
// operand | 2 device scalars]. plan_emulation() (gemm_quantized.cpp) caps the chunked operand's
// block at emulation_chunk_elements() (the gate+up Wgrad of Llama-3-8B at 8192 tokens needs 192 MiB
// instead of 534 MB); each block is one GEMM writing its rows (or columns) of C. Blocks reuse the
// buffer: the next block's dequantization is queued on `stream` after the previous GEMM, so it
// cannot overwrite what that GEMM reads. Growing waits for `stream` first, because earlier GEMMs on
// it may still read the old buffer.
#include <cuda_runtime.h>
#include <algorithm>
#include <map>
#include <mutex>
#include "core/bf16.h"
#include "core/cuda_check.h"
#include "core/memory_ledger.h"
#include "formats/nvfp4/nvfp4_math.h"
#include "formats/scalar_codecs.h"
#include "gemm/gemm_quantized.h"

namespace nb::gemm::detail {
namespace {

constexpr int kThreads = 256;
constexpr size_t kAlign = 256;

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return uint32_t(f32_to_bf16(lo).bits) | (uint32_t(f32_to_bf16(hi).bits) << 16);
}

// One NVFP4 block (8 bytes, 16 elements) per thread: `outer` stored rows of `inner_blocks` blocks each,
// consecutive source rows `pitch_blocks` blocks apart (data in 8-byte units, scales in bytes).
__global__ void dequant_nvfp4_kernel(const uint2* __restrict__ data, const uint8_t* __restrict__ scales,
                                     uint4* __restrict__ out, int64_t outer, int64_t inner_blocks,
                                     int64_t pitch_blocks) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= outer * inner_blocks) return;
  const int64_t src = pitch_blocks == inner_blocks ? i : (i / inner_blocks) * pitch_blocks + i % inner_blocks;
  const uint2 packed = data[src];
  const float s = e4m3_to_f32(scales[src]);
  uint32_t w[8];
  NB_UNROLL
  for (int j = 0; j < 8; ++j) {
    const uint32_t byte = ((j < 4 ? packed.x : packed.y) >> (8 * (j & 3))) & 0xFFu;
    w[j] = pack_bf16x2(e2m1_to_f32(byte & 0xFu) * s, e2m1_to_f32(byte >> 4) * s);
  }
  out[2 * i] = make_uint4(w[0], w[1], w[2], w[3]);
  out[2 * i + 1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// 16 stored MXFP8 elements per thread over a window of `cols` elements of each of `rows` stored rows,
// source rows `pitch` elements apart; `colwise`: scales [rows/32, pitch], else [rows, pitch/32].
__global__ void dequant_mxfp8_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scales,
                                     uint4* __restrict__ out, int64_t rows, int64_t cols, int64_t pitch, bool colwise) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t chunks_per_row = cols / 16;
  if (i >= rows * chunks_per_row) return;
  const int64_t r = i / chunks_per_row, c0 = (i % chunks_per_row) * 16;
  const uint4 q = *reinterpret_cast<const uint4*>(data + r * pitch + c0);
  const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
  uint32_t sw[4];
  if (colwise) {
    const uint4 s = *reinterpret_cast<const uint4*>(scales + (r / 32) * pitch + c0);
    sw[0] = s.x;
    sw[1] = s.y;
    sw[2] = s.z;
    sw[3] = s.w;
  } else {
    const uint32_t code = scales[r * (pitch / 32) + c0 / 32];
    const uint32_t rep = code * 0x01010101u;
    sw[0] = sw[1] = sw[2] = sw[3] = rep;
  }
  uint32_t w[8];
  NB_UNROLL
  for (int j = 0; j < 8; ++j) {
    const int e0 = 2 * j, e1 = 2 * j + 1;
    const float v0 =
        e4m3_to_f32((qw[e0 / 4] >> (8 * (e0 & 3))) & 0xFFu) * e8m0_to_f32((sw[e0 / 4] >> (8 * (e0 & 3))) & 0xFFu);
    const float v1 =
        e4m3_to_f32((qw[e1 / 4] >> (8 * (e1 & 3))) & 0xFFu) * e8m0_to_f32((sw[e1 / 4] >> (8 * (e1 & 3))) & 0xFFu);
    w[j] = pack_bf16x2(v0, v1);
  }
  out[2 * i] = make_uint4(w[0], w[1], w[2], w[3]);
  out[2 * i + 1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// 16 per-tensor FP8 codes per thread, decoded to BF16 without the scale (every E4M3 and E5M2 value is a BF16 value).
__global__ void decode_fp8_kernel(const uint4* __restrict__ data, uint4* __restrict__ out, int64_t chunks, bool e5m2) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= chunks) return;
  const uint4 q = data[i];
  const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
  uint32_t w[8];
  NB_UNROLL
  for (int j = 0; j < 8; ++j) {
    const uint32_t lo = (qw[j / 2] >> (16 * (j & 1))) & 0xFFu, hi = (qw[j / 2] >> (16 * (j & 1) + 8)) & 0xFFu;
    w[j] = e5m2 ? pack_bf16x2(e5m2_to_f32(uint8_t(lo)), e5m2_to_f32(uint8_t(hi)))
                : pack_bf16x2(e4m3_to_f32(uint8_t(lo)), e4m3_to_f32(uint8_t(hi)));
  }
  out[2 * i] = make_uint4(w[0], w[1], w[2], w[3]);
  out[2 * i + 1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// A mixed GEMM's alpha: the product of its FP8 operands' scale_inv (null for a BF16 operand: 1).
__global__ void mixed_alpha_kernel(const float* scale_inv_a, const float* scale_inv_b, float beta, float* scalars) {
  scalars[0] = (scale_inv_a ? *scale_inv_a : 1.f) * (scale_inv_b ? *scale_inv_b : 1.f);
  scalars[1] = beta;
}

// A mixed GEMM with one NVFP4 operand: its global decode scale times the other's scale_inv (null for BF16: 1).
__global__ void nvfp4_mixed_alpha_kernel(const float* amax, const float* scale_inv, float denom, float beta,
                                         float* scalars) {
  scalars[0] = (*amax * (scale_inv ? *scale_inv : 1.f)) / denom;
  scalars[1] = beta;
}

// The same FP32 expression as nvfp4_global_alpha() on the host.
__global__ void nvfp4_alpha_kernel(const float* amax_a, const float* amax_b, float denom, float beta, float* scalars) {
  scalars[0] = (*amax_a * *amax_b) / denom;
  scalars[1] = beta;
}

struct Scratch {
  void* mem = nullptr;
  size_t bytes = 0;
};

struct Workspaces {
  std::mutex mu;
  std::map<int, Scratch> per_device;
};

Workspaces& workspaces() {
  static Workspaces* w = new Workspaces();  // leaked on purpose, as the cuBLASLt workspace
  return *w;
}

size_t align_up(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

Status get_scratch(size_t need, Stream stream, char** out) {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  Workspaces& ws = workspaces();
  std::lock_guard<std::mutex> lock(ws.mu);
  Scratch& s = ws.per_device[device];
  if (s.bytes < need) {
    if (s.mem) {
      CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
      device_free(s.mem);
      s.mem = nullptr;
      s.bytes = 0;
    }
    const size_t grown = align_up(need + need / 8);  // some headroom for the next larger shape
    MemoryScope scope(MemPart::emulated_scratch);
    NB_TRY(device_malloc(&s.mem, grown).context("allocating the BF16 scratch of the emulated MXFP8/NVFP4 GEMM"));
    s.bytes = grown;
  }
  *out = static_cast<char*>(s.mem);
  return Status::ok();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

void describe_bf16(const void* data, bool k_major, LtOperand* lt) {
  lt->data = data;
  lt->type = ElemType::bf16;
  lt->k_major = k_major;
  lt->scale_mode = ScaleMode::none;
  lt->scale = nullptr;
}

// Dequantizes rows [r0, r0 + rows) of one operand into `out` (BF16, dense, in the stored layout:
// [rows, K] or [K, rows]) and describes that block for the BF16 GEMM. An operand given dequantized is
// only described (it is never chunked: r0 = 0, rows = all).
Status dequantize_rows(const QOperand& q, int64_t r0, int64_t rows, bf16* out, Stream stream, LtOperand* lt,
                       const char* name) {
  if (q.dequantized || q.format == QFormat::bf16) {
    describe_bf16(q.dequantized ? q.dequantized : q.data, q.k_major, lt);
    return Status::ok();
  }
  const bool fp8_tensor = q.format == QFormat::fp8_e4m3 || q.format == QFormat::fp8_e5m2;
  if (!aligned16(q.data) || (!fp8_tensor && !aligned16(q.scales)))
    return errorf("matmul_quantized: %s operand %s needs 16-byte aligned data and scales pointers",
                  qformat_name(q.format), name);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const auto* data = static_cast<const uint8_t*>(q.data);
  const auto* scales = static_cast<const uint8_t*>(q.scales);
  // Stored [outer, inner] with row pitch `pitch` elements; the block is a window of it.
  const int64_t outer = q.k_major ? rows : q.k, inner = q.k_major ? q.k : rows, pitch = q.k_major ? q.k : q.rows;
  const int64_t first = q.k_major ? r0 * pitch : r0;  // element offset of the window's first element
  const int64_t chunks = outer * inner / 16;
  const unsigned grid = unsigned((chunks + kThreads - 1) / kThreads);
  if (fp8_tensor) {
    // K-major codes (K a multiple of 16): the window is whole rows, contiguous.
    decode_fp8_kernel<<<grid, kThreads, 0, st>>>(reinterpret_cast<const uint4*>(data + first),
                                                 reinterpret_cast<uint4*>(out), chunks, q.format == QFormat::fp8_e5m2);
  } else if (q.format == QFormat::nvfp4) {
    dequant_nvfp4_kernel<<<grid, kThreads, 0, st>>>(reinterpret_cast<const uint2*>(data + first / 2),
                                                    scales + first / 16, reinterpret_cast<uint4*>(out), outer,
                                                    inner / 16, pitch / 16);
  } else {
    // MXFP8 scales: row-wise [rows, K/32] (offset first/32); column-wise [K/32, rows] (offset r0).
    const uint8_t* s = q.k_major ? scales + first / 32 : scales + r0;
    dequant_mxfp8_kernel<<<grid, kThreads, 0, st>>>(data + first, s, reinterpret_cast<uint4*>(out), outer, inner, pitch,
                                                    !q.k_major);
  }
  CUDA_CHECK_LAUNCH();
  describe_bf16(out, q.k_major, lt);
  return Status::ok();
}

}  // namespace

Status emulated_matmul_cuda(const QOperand& a, const QOperand& b, const CView& c, int64_t m, int64_t n, int64_t k,
                            float beta, Stream stream) {
  const bool a_bf16 = a.format == QFormat::bf16, b_bf16 = b.format == QFormat::bf16;
  const EmulationPlan plan =
      plan_emulation(m, n, k, a.dequantized != nullptr || a_bf16, b.dequantized != nullptr || b_bf16);
  const QOperand& chunked = plan.chunk_b ? b : a;
  const QOperand& whole = plan.chunk_b ? a : b;
  char* scratch = nullptr;
  NB_TRY(get_scratch(plan.scratch_bytes, stream, &scratch));
  LtProblem p;
  p.k = k;
  LtOperand whole_lt;
  NB_TRY(dequantize_rows(whole, 0, whole.rows, reinterpret_cast<bf16*>(scratch + plan.chunk_bytes), stream, &whole_lt,
                         plan.chunk_b ? "A" : "B"));
  (plan.chunk_b ? p.a : p.b) = whole_lt;
  const bool a_nvfp4 = a.format == QFormat::nvfp4, b_nvfp4 = b.format == QFormat::nvfp4;
  if (a_nvfp4 != b_nvfp4) {  // the ladder: NVFP4 with per-tensor FP8 or BF16
    const QOperand& nv = a_nvfp4 ? a : b;
    const QOperand& other = a_nvfp4 ? b : a;
    float* scalars = reinterpret_cast<float*>(scratch + plan.chunk_bytes + plan.whole_bytes);
    nvfp4_mixed_alpha_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(
        nv.amax, other.format == QFormat::bf16 ? nullptr : static_cast<const float*>(other.scales),
        nvfp4::decode_denominator(nv.nvfp4_4over6), beta, scalars);
    CUDA_CHECK_LAUNCH();
    p.device_alpha_beta = scalars;
    p.beta = beta;
  } else if (a_bf16 || b_bf16) {
    float* scalars = reinterpret_cast<float*>(scratch + plan.chunk_bytes + plan.whole_bytes);
    mixed_alpha_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(
        a_bf16 ? nullptr : static_cast<const float*>(a.scales), b_bf16 ? nullptr : static_cast<const float*>(b.scales),
        beta, scalars);
    CUDA_CHECK_LAUNCH();
    p.device_alpha_beta = scalars;
    p.beta = beta;
  } else if (a.format == QFormat::nvfp4) {
    float* scalars = reinterpret_cast<float*>(scratch + plan.chunk_bytes + plan.whole_bytes);
    nvfp4_alpha_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(
        a.amax, b.amax, nvfp4_alpha_denominator(a.nvfp4_4over6, b.nvfp4_4over6), beta, scalars);
    CUDA_CHECK_LAUNCH();
    p.device_alpha_beta = scalars;
    p.beta = beta;  // the plan key distinguishes beta == 0 only in host mode; kept for messages
  } else {
    p.alpha = 1.f;
    p.beta = beta;
  }
  const size_t c_elem = c.dtype == DType::bf16 ? 2 : 4;
  for (int64_t r0 = 0; r0 < chunked.rows; r0 += plan.chunk_rows) {
    const int64_t rows = std::min(plan.chunk_rows, chunked.rows - r0);
    LtOperand block;
    NB_TRY(
        dequantize_rows(chunked, r0, rows, reinterpret_cast<bf16*>(scratch), stream, &block, plan.chunk_b ? "B" : "A"));
    p.c = c;
    if (plan.chunk_b) {
      // Rows of B are columns of C: the block writes C[:, r0:r0+rows] (same row stride).
      p.b = block;
      p.m = m;
      p.n = rows;
      p.c.data = static_cast<char*>(c.data) + size_t(r0) * c_elem;
    } else {
      p.a = block;
      p.m = rows;
      p.n = n;
      p.c.data = static_cast<char*>(c.data) + size_t(r0 * c.ld) * c_elem;
    }
    NB_TRY(lt_matmul(p, stream));
  }
  return Status::ok();
}

}  // namespace nb::gemm::detail

namespace nb::gemm {

Status dequantize_operand_cuda(const QOperand& op, void* out, Stream stream) {
  if (op.format != QFormat::mxfp8 && op.format != QFormat::nvfp4)
    return errorf("dequantize_operand_cuda: %s operands run on FP8 tensor cores and are never dequantized",
                  qformat_name(op.format));
  QOperand q = op;
  q.dequantized = nullptr;
  detail::LtOperand unused;
  return detail::dequantize_rows(q, 0, q.rows, static_cast<bf16*>(out), stream, &unused, "operand");
}

}  // namespace nb::gemm
