// GPU side of MoR's block rule in training (mor_block.h): one thread block per 128x128 block (clipped), which it
// stages in shared memory and passes over three times: its ranges, its E4M3 (and E5M2) statistics, then the output.
// Every reduction is of integers or of fmax/fmin, so any order gives apply_block_rule_ref's bits; the per-element
// float expressions are the host's (IEEE products and divisions, never contracted).
#include <cuda_runtime.h>
#include "core/cuda_check.h"
#include "formats/fp8/fp8_convert.cuh"
#include "formats/mor/mor_block.h"
#include "formats/mor/mor_stat.cuh"

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

__global__ void __launch_bounds__(kThreads)
    block_rule_kernel(const bf16* __restrict__ x, int64_t rows, int64_t cols, BlockRule rule,
                      const float* __restrict__ tensor_amax, bf16* __restrict__ out, StatCell* e4m3_stat,
                      BlockCounts* counts) {
  __shared__ bf16 tile[kBlock * kBlock];
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
  const Choice choice = block_rule_choice(rule, err4, err5, nonzero, nonfinite > 0, finite_amax, min_nonzero);
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const float v = bf16_to_f32(tile[i]);
    bf16 o = tile[i];
    if (choice == Choice::fp8_e4m3) o = f32_to_bf16(fake_quantize<fp8::Format::e4m3>(v, s4, s4_inv));
    if (choice == Choice::fp8_e5m2) o = f32_to_bf16(fake_quantize<fp8::Format::e5m2>(v, s5, s5_inv));
    out[(r0 + i / w) * cols + c0 + i % w] = o;
  }
  if (threadIdx.x != 0) return;
  if (e4m3_stat) {
    if (err4) atomicAdd(reinterpret_cast<unsigned long long*>(&e4m3_stat->err_fixed), err4);
    if (nonzero) atomicAdd(reinterpret_cast<unsigned long long*>(&e4m3_stat->nonzero), nonzero);
    if (nonfinite) atomicAdd(&e4m3_stat->nonfinite, nonfinite);
  }
  if (counts) {
    if (choice == Choice::fp8_e4m3) atomicAdd(reinterpret_cast<unsigned long long*>(&counts->e4m3), 1ull);
    if (choice == Choice::fp8_e5m2) atomicAdd(reinterpret_cast<unsigned long long*>(&counts->e5m2), 1ull);
    if (choice == Choice::bf16) atomicAdd(&counts->bf16, 1u);
    if (nonfinite) atomicAdd(&counts->nonfinite, 1u);
  }
}

}  // namespace

Status apply_block_rule_cuda(const bf16* x, int64_t rows, int64_t cols, const BlockRule& rule, bf16* out,
                             StatCell* e4m3_stat, BlockCounts* counts, float* scratch, Stream stream) {
  if (rows < 1 || cols < 1)
    return errorf("mor: the block rule needs a non-empty tensor; got [%lld, %lld]", (long long)rows, (long long)cols);
  const int64_t brows = (rows + kBlock - 1) / kBlock, bcols = (cols + kBlock - 1) / kBlock;
  if (brows > 65535) return errorf("mor: the block rule takes at most %lld rows", (long long)(65535 * kBlock));
  if (rule.mode == ScaleMode::gam) {
    if (!scratch) return errorf("internal: the block rule's GAM scaling needs a device float for the tensor's amax");
    NB_TRY(fp8::amax_cuda(x, rows * cols, scratch, nullptr, stream));
  }
  const auto st = static_cast<cudaStream_t>(stream);
  block_rule_kernel<<<dim3(unsigned(bcols), unsigned(brows)), kThreads, 0, st>>>(x, rows, cols, rule, scratch, out,
                                                                                 e4m3_stat, counts);
  CUDA_CHECK_LAUNCH();
  return Status::ok();
}

}  // namespace nb::mor
