// The CPU reference GEMM: C[M,N] = alpha * op(A) @ op(B) + beta * C, all f32 (semantics in gemm.h).
//
// Cache blocking: op(A) and op(B) are copied ("packed") block by block into contiguous row-major
// tiles (kMc x kKc of A, kKc x kNc of B), so the inner loop streams unit-stride rows whatever the
// transposes and strides are. A 4 x 8 tile of C stays in registers over a block's depth, so each loaded
// B value is used four times and each A value eight. Rows of C are split over std::threads in kMc-row blocks.
//
// Precision: every output element is accumulated in FP32 over k = 0..K-1 in order (k blocks are
// visited in order), then alpha * acc + beta * C is formed in FP32. No FMA contraction (build flag),
// so results do not depend on the compiler's choice of instructions.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>
#include "gemm/gemm_problem.h"

namespace nb::gemm {
namespace {

constexpr int64_t kMc = 64;   // rows of C per block (a thread's unit of work)
constexpr int64_t kNc = 256;  // columns of C per block
constexpr int64_t kKc = 256;  // depth per packed block

// op(X)[i, j] of a stored matrix; `trans` means op(X) = X^T.
inline float op_at(const float* x, int64_t ld, bool trans, int64_t i, int64_t j) {
  return trans ? x[j * ld + i] : x[i * ld + j];
}

// Copies op(X)[r0:r0+rows, c0:c0+cols] into `dst` (row-major, row length `cols`).
void pack(const float* x, int64_t ld, bool trans, int64_t r0, int64_t rows, int64_t c0, int64_t cols, float* dst) {
  if (!trans) {
    for (int64_t r = 0; r < rows; ++r) std::copy_n(x + (r0 + r) * ld + c0, cols, dst + r * cols);
  } else {
    // Walk the stored matrix row by row (op column by column) so reads stay sequential.
    for (int64_t c = 0; c < cols; ++c) {
      const float* src = x + (c0 + c) * ld + r0;
      for (int64_t r = 0; r < rows; ++r) dst[r * cols + c] = src[r];
    }
  }
}

using F32x4 = float __attribute__((vector_size(16)));

F32x4 load4(const float* p) {
  F32x4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
void store4(float* p, F32x4 v) { std::memcpy(p, &v, sizeof(v)); }

// acc[4 rows, 8 columns at j] += ap[4 rows, kc] @ bp[kc, 8 columns at j], the tile held in registers over k
// (the same sums in the same order as one element at a time).
void tile_4x8(const float* ap, const float* bp, int64_t kc, int64_t nc, int64_t j, float* acc) {
  F32x4 c[4][2];
  for (int r = 0; r < 4; ++r) {
    c[r][0] = load4(acc + r * nc + j);
    c[r][1] = load4(acc + r * nc + j + 4);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const F32x4 b0 = load4(bp + k * nc + j), b1 = load4(bp + k * nc + j + 4);
    for (int r = 0; r < 4; ++r) {
      const float a = ap[r * kc + k];
      const F32x4 av = {a, a, a, a};
      c[r][0] += av * b0;
      c[r][1] += av * b1;
    }
  }
  for (int r = 0; r < 4; ++r) {
    store4(acc + r * nc + j, c[r][0]);
    store4(acc + r * nc + j + 4, c[r][1]);
  }
}

// acc[rows, nc] += ap[rows, kc] @ bp[kc, nc]; all row-major and contiguous. Whole 4 x 8 tiles run in
// registers; the edges one row (and one column) at a time, which sums each element in the same order.
void block_multiply(const float* ap, const float* bp, int64_t rows, int64_t kc, int64_t nc, float* acc) {
  const int64_t full_cols = nc / 8 * 8;
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) {
    for (int64_t j = 0; j < full_cols; j += 8) tile_4x8(ap + i * kc, bp, kc, nc, j, acc + i * nc);
    for (int64_t r = i; r < i + 4; ++r) {
      float* __restrict c = acc + r * nc;
      for (int64_t k = 0; k < kc; ++k)
        for (int64_t j = full_cols; j < nc; ++j) c[j] += ap[r * kc + k] * bp[k * nc + j];
    }
  }
  for (; i < rows; ++i) {
    float* __restrict c = acc + i * nc;
    for (int64_t k = 0; k < kc; ++k) {
      const float a = ap[i * kc + k];
      const float* __restrict b = bp + k * nc;
      for (int64_t j = 0; j < nc; ++j) c[j] += a * b[j];
    }
  }
}

// Computes the C rows [m0, m0 + rows) with scratch space owned by the calling thread.
void compute_row_block(const GemmProblem& p, int64_t m0, int64_t rows, std::vector<float>& ap, std::vector<float>& bp,
                       std::vector<float>& acc) {
  const float* a = static_cast<const float*>(p.a.data);
  const float* b = static_cast<const float*>(p.b.data);
  float* c = static_cast<float*>(p.c.data);
  const float alpha = p.args.alpha, beta = p.args.beta;
  for (int64_t n0 = 0; n0 < p.n; n0 += kNc) {
    const int64_t nc = std::min(kNc, p.n - n0);
    std::fill_n(acc.data(), rows * nc, 0.f);
    for (int64_t k0 = 0; k0 < p.k; k0 += kKc) {
      const int64_t kc = std::min(kKc, p.k - k0);
      pack(a, p.a.ld, p.args.trans_a, m0, rows, k0, kc, ap.data());
      pack(b, p.b.ld, p.args.trans_b, k0, kc, n0, nc, bp.data());
      block_multiply(ap.data(), bp.data(), rows, kc, nc, acc.data());
    }
    for (int64_t i = 0; i < rows; ++i) {
      float* crow = c + (m0 + i) * p.c.ld + n0;
      const float* arow = acc.data() + i * nc;
      // beta == 0 never reads C, so an uninitialized (even NaN) output buffer is fine.
      if (beta == 0.f) {
        for (int64_t j = 0; j < nc; ++j) crow[j] = alpha * arow[j];
      } else {
        for (int64_t j = 0; j < nc; ++j) crow[j] = alpha * arow[j] + beta * crow[j];
      }
    }
  }
}

}  // namespace

Status matmul_cpu(const GemmProblem& p) {
  const int64_t row_blocks = (p.m + kMc - 1) / kMc;
  // Threads only pay off once there is real work: about 2 MFLOP per thread at least.
  const double flops = 2.0 * double(p.m) * double(p.n) * double(std::max<int64_t>(p.k, 1));
  int64_t threads = std::min<int64_t>(row_blocks, std::max(1u, std::thread::hardware_concurrency()));
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, int64_t(flops / 2e6)));

  std::atomic<int64_t> next_block{0};
  auto worker = [&]() {
    std::vector<float> ap(size_t(kMc * kKc)), bp(size_t(kKc * kNc)), acc(size_t(kMc * kNc));
    for (int64_t blk = next_block++; blk < row_blocks; blk = next_block++) {
      const int64_t m0 = blk * kMc;
      compute_row_block(p, m0, std::min(kMc, p.m - m0), ap, bp, acc);
    }
  };
  if (threads == 1) {
    worker();
    return Status::ok();
  }
  std::vector<std::thread> pool;
  pool.reserve(size_t(threads - 1));
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  return Status::ok();
}

}  // namespace nb::gemm
