// The ring attention's merge on CUDA (cp_ring.h): one warp per (row, query, head) merges a block's partial
// output (BF16) and lse into the running FP32 ones with cp::merge_partial's arithmetic, so both backends
// follow one rule. lse is [B, H, S] for whole rows, token-major [B * S, H] for packed ones.
#include <cmath>
#include "ops/cp_ring.h"
#include "ops/cuda_common.cuh"

namespace nb::ops::cp::detail {

namespace {

template <typename T>
__global__ void merge_rows_kernel(float* out_acc, float* lse_acc, const T* part, const float* part_lse, int64_t B,
                                  int64_t S, int64_t Sp, int64_t H, int64_t D, int64_t offset, bool token_major) {
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (warp >= B * Sp * H) return;
  const int64_t h = warp % H, i = (warp / H) % Sp, b = warp / (H * Sp);
  const float lse_b = part_lse[token_major ? (b * Sp + i) * H + h : (b * H + h) * Sp + i];
  float* lse_a = lse_acc + (token_major ? (b * S + offset + i) * H + h : (b * H + h) * S + offset + i);
  float* o = out_acc + ((b * S + offset + i) * H + h) * D;
  const T* p = part + ((b * Sp + i) * H + h) * D;
  const float old = *lse_a;
  if (lse_b == -INFINITY) return;
  float wa = 0.f, wb = 1.f, lse = lse_b;
  if (old != -INFINITY) {
    const float hi = fmaxf(old, lse_b), lo = fminf(old, lse_b);
    lse = hi + log1pf(expf(lo - hi));
    wa = expf(old - lse);
    wb = expf(lse_b - lse);
  }
  for (int64_t d = lane; d < D; d += 32)
    o[d] = (old == -INFINITY) ? cuda::to_f32(p[d]) : o[d] * wa + cuda::to_f32(p[d]) * wb;
  __syncwarp();
  if (lane == 0) *lse_a = lse;
}

}  // namespace

void merge_rows_cuda(const Tensor& out_acc, const Tensor& lse_acc, const Tensor& part, const Tensor& part_lse,
                     int64_t offset, bool token_major, Stream stream) {
  const int64_t B = out_acc.shape[0], S = out_acc.shape[1], H = out_acc.shape[2], D = out_acc.shape[3];
  const int64_t Sp = part.shape[1], warps = B * Sp * H;
  if (warps == 0) return;
  const int threads = 256;
  const int64_t blocks = (warps * 32 + threads - 1) / threads;
  auto s = cuda::as_cuda(stream);
  if (part.dtype == DType::bf16)
    merge_rows_kernel<<<unsigned(blocks), threads, 0, s>>>(out_acc.ptr<float>(), lse_acc.ptr<float>(), part.ptr<bf16>(),
                                                           part_lse.ptr<float>(), B, S, Sp, H, D, offset, token_major);
  else
    merge_rows_kernel<<<unsigned(blocks), threads, 0, s>>>(out_acc.ptr<float>(), lse_acc.ptr<float>(),
                                                           part.ptr<float>(), part_lse.ptr<float>(), B, S, Sp, H, D,
                                                           offset, token_major);
  CUDA_CHECK_LAUNCH();
}

}  // namespace nb::ops::cp::detail
