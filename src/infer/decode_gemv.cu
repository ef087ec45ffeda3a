// The decode step's linears at a few rows (see decode_ops.h, decode_gemv): y[M, N] = x[M, K] W[N, K]^T with
// M <= kGemvMaxRows. At such M every linear is a pass over its weight, so the kernel is built to stream W at
// HBM bandwidth: one warp per output column n, each lane holding kUnroll 16-byte loads of W's row in flight
// (read once, through the non-coherent path), the few x rows (a few KiB, L1/L2-resident) read beside them,
// FP32 fused multiply-adds per lane in k order, then a fixed-order warp butterfly. A GEMM library's tiles
// at M = 1 compute 64+ rows of which one is used, and its heuristics often pick split-K with a second
// reduction kernel; here one kernel reads each weight byte once.
#include "infer/decode_ops.h"
#include "ops/cuda_common.cuh"
#include "ops/ops_common.h"

namespace nb::infer {
namespace {
using namespace ops::cuda;

constexpr int kWarps = 8;   // output columns per block
constexpr int kUnroll = 4;  // 16-byte weight loads in flight per lane (Little's law: ~64 KiB per SM in flight)
constexpr int kChunk = 8;   // BF16 elements per 16-byte load

NB_DEVICE void unpack(const uint4& raw, float (&out)[kChunk]) {
  const bf16* e = reinterpret_cast<const bf16*>(&raw);
  NB_UNROLL for (int i = 0; i < kChunk; ++i) out[i] = to_f32(e[i]);
}

// R: the rows the kernel is compiled for (M <= R; rows m >= M are skipped, uniformly across the warp).
template <int R, typename O>
__global__ void __launch_bounds__(kWarps * 32) gemv_kernel(const bf16* __restrict__ x, const bf16* __restrict__ w, O* y,
                                                           int M, int64_t N, int64_t K, bool accumulate) {
  const int lane = int(threadIdx.x % 32);
  const int64_t n = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (n >= N) return;  // whole warps leave together: the butterfly below stays full
  const uint4* wr = reinterpret_cast<const uint4*>(w + n * K);
  const int64_t chunks = K / kChunk;
  float acc[R] = {};
  for (int64_t c0 = lane; c0 < chunks; c0 += 32 * kUnroll) {
    uint4 wv[kUnroll];
    NB_UNROLL for (int u = 0; u < kUnroll; ++u) {  // every load issued before any is used
      const int64_t c = c0 + int64_t(u) * 32;
      wv[u] = c < chunks ? __ldg(wr + c) : make_uint4(0, 0, 0, 0);
    }
    NB_UNROLL for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + int64_t(u) * 32;
      if (c >= chunks) break;
      float wf[kChunk];
      unpack(wv[u], wf);
      NB_UNROLL for (int r = 0; r < R; ++r) {
        if (r >= M) break;
        float xf[kChunk];
        unpack(__ldg(reinterpret_cast<const uint4*>(x + int64_t(r) * K) + c), xf);
        NB_UNROLL for (int i = 0; i < kChunk; ++i) acc[r] = fmaf(wf[i], xf[i], acc[r]);
      }
    }
  }
  NB_UNROLL for (int r = 0; r < R; ++r) {
    if (r >= M) break;
    const float s = warp_sum(acc[r]);
    if (lane == 0) {
      O* out = y + int64_t(r) * N + n;
      *out = from_f32<O>(accumulate ? s + to_f32(*out) : s);  // one rounding of acc + residual
    }
  }
}

template <typename O>
void launch(const Tensor& x, const Tensor& w, const Tensor& y, bool accumulate, cudaStream_t s) {
  const int M = int(ops::detail::rows_of(x));
  const int64_t N = w.shape[0], K = w.shape[1];
  const unsigned blocks = unsigned((N + kWarps - 1) / kWarps);
  const bf16 *xp = x.ptr<bf16>(), *wp = w.ptr<bf16>();
  O* yp = y.ptr<O>();
  if (M <= 1)
    gemv_kernel<1, O><<<blocks, kWarps * 32, 0, s>>>(xp, wp, yp, M, N, K, accumulate);
  else if (M <= 2)
    gemv_kernel<2, O><<<blocks, kWarps * 32, 0, s>>>(xp, wp, yp, M, N, K, accumulate);
  else if (M <= 4)
    gemv_kernel<4, O><<<blocks, kWarps * 32, 0, s>>>(xp, wp, yp, M, N, K, accumulate);
  else
    gemv_kernel<8, O><<<blocks, kWarps * 32, 0, s>>>(xp, wp, yp, M, N, K, accumulate);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

namespace detail {

void decode_gemv_cuda(const Tensor& x, const Tensor& w, const Tensor& y, bool accumulate, Stream s) {
  if (y.dtype == DType::bf16)
    launch<bf16>(x, w, y, accumulate, as_cuda(s));
  else
    launch<float>(x, w, y, accumulate, as_cuda(s));
}

}  // namespace detail
}  // namespace nb::infer
