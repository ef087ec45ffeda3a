// MXFP8 and NVFP4 GEMMs on GPUs without block-scaled tensor cores (Hopper): each operand is
// dequantized to BF16 with its block scales only, then one BF16 cuBLASLt GEMM with FP32
// accumulation applies alpha (the product of the global scales) -- spec §6 "On Hopper".
//
//   NVFP4 operand [rows, K]: data [rows, K/2] packed E2M1 (low nibble first), scales E4M3 [rows, K/16]
//          -> BF16 [rows, K], value e2m1 x e4m3 (exact: <= 6 significant bits, |v| in [2^-10, 2688]).
//          alpha = (amax_a * amax_b) / (6*6*448*448) in FP32, computed by a one-thread kernel into
//          device memory and read by cuBLASLt in device pointer mode (no host synchronization).
//   MXFP8  row copy [rows, K] with E8M0 [rows, K/32], or the column-wise copy [K, rows] with E8M0
//          [K/32, rows]: dequantized in its stored layout (the GEMM transposes), value
//          e4m3 x 2^(code-127) in FP32 (exact), then rounded to BF16 (exact in the range stated in
//          gemm_quantized.h). alpha = 1.
// Kernels: one thread per 16 consecutive stored elements (one NVFP4 block, half an MXFP8 block),
// 16-byte loads and two 16-byte stores; memory bound.
// Scratch: a per-device buffer holding both BF16 operands (+ the two device scalars), grown on demand;
// growing waits for `stream` first, because earlier GEMMs on it may still read the old buffer.
#include <cuda_runtime.h>
#include <map>
#include <mutex>
#include "core/bf16.h"
#include "core/cuda_check.h"
#include "formats/scalar_codecs.h"
#include "gemm/gemm_quantized.h"

namespace nb::gemm::detail {
namespace {

constexpr int kThreads = 256;
constexpr size_t kAlign = 256;

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return uint32_t(f32_to_bf16(lo).bits) | (uint32_t(f32_to_bf16(hi).bits) << 16);
}

// One NVFP4 block (8 bytes, 16 elements) per thread.
__global__ void dequant_nvfp4_kernel(const uint2* __restrict__ data, const uint8_t* __restrict__ scales,
                                     uint4* __restrict__ out, int64_t blocks) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= blocks) return;
  const uint2 packed = data[i];
  const float s = e4m3_to_f32(scales[i]);
  uint32_t w[8];
  NB_UNROLL
  for (int j = 0; j < 8; ++j) {
    const uint32_t byte = ((j < 4 ? packed.x : packed.y) >> (8 * (j & 3))) & 0xFFu;
    w[j] = pack_bf16x2(e2m1_to_f32(byte & 0xFu) * s, e2m1_to_f32(byte >> 4) * s);
  }
  out[2 * i] = make_uint4(w[0], w[1], w[2], w[3]);
  out[2 * i + 1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// 16 stored MXFP8 elements per thread; `colwise`: scales [rows/32, cols], else [rows, cols/32].
__global__ void dequant_mxfp8_kernel(const uint4* __restrict__ data, const uint8_t* __restrict__ scales,
                                     uint4* __restrict__ out, int64_t rows, int64_t cols, bool colwise) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t chunks_per_row = cols / 16;
  if (i >= rows * chunks_per_row) return;
  const int64_t r = i / chunks_per_row, c0 = (i % chunks_per_row) * 16;
  const uint4 q = data[i];
  const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
  uint32_t sw[4];
  if (colwise) {
    const uint4 s = *reinterpret_cast<const uint4*>(scales + (r / 32) * cols + c0);
    sw[0] = s.x; sw[1] = s.y; sw[2] = s.z; sw[3] = s.w;
  } else {
    const uint32_t code = scales[r * (cols / 32) + c0 / 32];
    const uint32_t rep = code * 0x01010101u;
    sw[0] = sw[1] = sw[2] = sw[3] = rep;
  }
  uint32_t w[8];
  NB_UNROLL
  for (int j = 0; j < 8; ++j) {
    const int e0 = 2 * j, e1 = 2 * j + 1;
    const float v0 = e4m3_to_f32((qw[e0 / 4] >> (8 * (e0 & 3))) & 0xFFu) * e8m0_to_f32((sw[e0 / 4] >> (8 * (e0 & 3))) & 0xFFu);
    const float v1 = e4m3_to_f32((qw[e1 / 4] >> (8 * (e1 & 3))) & 0xFFu) * e8m0_to_f32((sw[e1 / 4] >> (8 * (e1 & 3))) & 0xFFu);
    w[j] = pack_bf16x2(v0, v1);
  }
  out[2 * i] = make_uint4(w[0], w[1], w[2], w[3]);
  out[2 * i + 1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// The same FP32 expression as nvfp4_global_alpha() on the host.
__global__ void nvfp4_alpha_kernel(const float* amax_a, const float* amax_b, float beta, float* scalars) {
  const float denom = 6.0f * 6.0f * 448.0f * 448.0f;
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
    NB_TRY(device_malloc(&s.mem, grown)
               .context("allocating the BF16 scratch of the emulated MXFP8/NVFP4 GEMM"));
    s.bytes = grown;
  }
  *out = static_cast<char*>(s.mem);
  return Status::ok();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Dequantizes one operand into `out` (BF16, stored layout) and describes it for the BF16 GEMM.
Status dequantize_operand(const QOperand& q, bf16* out, Stream stream, LtOperand* lt, const char* name) {
  if (!aligned16(q.data) || !aligned16(q.scales))
    return errorf("matmul_quantized: %s operand %s needs 16-byte aligned data and scales pointers",
                  qformat_name(q.format), name);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t elems = q.rows * q.k;
  if (q.format == QFormat::nvfp4) {
    const int64_t blocks = elems / 16;
    dequant_nvfp4_kernel<<<unsigned((blocks + kThreads - 1) / kThreads), kThreads, 0, st>>>(
        static_cast<const uint2*>(q.data), static_cast<const uint8_t*>(q.scales), reinterpret_cast<uint4*>(out),
        blocks);
  } else {
    const int64_t stored_rows = q.k_major ? q.rows : q.k, stored_cols = q.k_major ? q.k : q.rows;
    const int64_t chunks = elems / 16;
    dequant_mxfp8_kernel<<<unsigned((chunks + kThreads - 1) / kThreads), kThreads, 0, st>>>(
        static_cast<const uint4*>(q.data), static_cast<const uint8_t*>(q.scales), reinterpret_cast<uint4*>(out),
        stored_rows, stored_cols, !q.k_major);
  }
  CUDA_CHECK_LAUNCH();
  lt->data = out;
  lt->type = ElemType::bf16;
  lt->k_major = q.k_major;
  lt->scale_mode = ScaleMode::none;
  lt->scale = nullptr;
  return Status::ok();
}

}  // namespace

Status emulated_matmul_cuda(const QOperand& a, const QOperand& b, const CView& c, int64_t m, int64_t n, int64_t k,
                            float beta, Stream stream) {
  const size_t a_bytes = align_up(size_t(m * k) * sizeof(bf16)), b_bytes = align_up(size_t(n * k) * sizeof(bf16));
  char* scratch = nullptr;
  NB_TRY(get_scratch(a_bytes + b_bytes + kAlign, stream, &scratch));
  LtProblem p;
  p.m = m; p.n = n; p.k = k;
  p.c = c;
  NB_TRY(dequantize_operand(a, reinterpret_cast<bf16*>(scratch), stream, &p.a, "A"));
  NB_TRY(dequantize_operand(b, reinterpret_cast<bf16*>(scratch + a_bytes), stream, &p.b, "B"));
  if (a.format == QFormat::nvfp4) {
    float* scalars = reinterpret_cast<float*>(scratch + a_bytes + b_bytes);
    nvfp4_alpha_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(a.amax, b.amax, beta, scalars);
    CUDA_CHECK_LAUNCH();
    p.device_alpha_beta = scalars;
    p.beta = beta;  // the plan key distinguishes beta == 0 only in host mode; kept for messages
  } else {
    p.alpha = 1.f;
    p.beta = beta;
  }
  return lt_matmul(p, stream);
}

}  // namespace nb::gemm::detail
