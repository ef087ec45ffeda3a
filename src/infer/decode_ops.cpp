// CPU reference and device dispatch of the decode kernels (see decode_ops.h).
#include "infer/decode_ops.h"
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#include "ops/ops_common.h"

namespace nb::infer {
using ops::detail::check_contiguous;

namespace {
// The cache geometry shared by the checks: [B, L, Hkv, hd].
void check_cache(const char* op, const Tensor& ck, const Tensor& cv) {
  check_contiguous(op, "cache_k", ck);
  check_contiguous(op, "cache_v", cv);
  NB_CHECK(ck.ndim == 4 && cv.ndim == 4 && ck.numel() == cv.numel() && ck.dtype == cv.dtype,
           "%s: caches %s and %s must both be [B, L, Hkv, hd] of one dtype", op, ck.shape_str().c_str(),
           cv.shape_str().c_str());
}
}  // namespace

void kv_cache_write(const Tensor& k, const Tensor& v, const Tensor& cache_k, const Tensor& cache_v, const Tensor& pos,
                    int64_t per_row, [[maybe_unused]] Stream stream) {
  const char* op = "kv_cache_write";
  check_cache(op, cache_k, cache_v);
  check_contiguous(op, "k", k);
  check_contiguous(op, "v", v);
  const int64_t B = cache_k.shape[0], L = cache_k.shape[1], row = cache_k.shape[2] * cache_k.shape[3];
  const int64_t T = k.numel() / row;
  NB_CHECK(k.numel() == T * row && v.numel() == k.numel() && k.dtype == cache_k.dtype && v.dtype == cache_k.dtype,
           "%s: k %s and v %s must be [T, Hkv, hd] in the cache's dtype", op, k.shape_str().c_str(),
           v.shape_str().c_str());
  NB_CHECK(pos.dtype == DType::i32 && pos.numel() == T && per_row >= 1 && T <= B * per_row,
           "%s: pos must be [T] i32 and T <= B * per_row", op);
  if (cache_k.device == Device::cuda)
    NB_OPS_CUDA(op, detail::kv_cache_write_cuda(k, v, cache_k, cache_v, pos, per_row, stream));
  const size_t bytes = size_t(row) * 4;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t b = t / per_row, p = pos.ptr<int32_t>()[t];
    NB_CHECK(p >= 0 && p < L, "%s: position %lld outside the cache's %lld", op, (long long)p, (long long)L);
    std::memcpy(cache_k.ptr<float>() + (b * L + p) * row, k.ptr<float>() + t * row, bytes);
    std::memcpy(cache_v.ptr<float>() + (b * L + p) * row, v.ptr<float>() + t * row, bytes);
  }
}

Status cache_attention(const Tensor& q, const Tensor& cache_k, const Tensor& cache_v, const Tensor& pos,
                       const Tensor& out, float scale, [[maybe_unused]] Stream stream) {
  const char* op = "cache_attention";
  check_cache(op, cache_k, cache_v);
  check_contiguous(op, "q", q);
  check_contiguous(op, "out", out);
  const int64_t B = cache_k.shape[0], L = cache_k.shape[1], Hkv = cache_k.shape[2], D = cache_k.shape[3];
  NB_CHECK(q.ndim == 3 && q.shape[0] == B && q.shape[2] == D && q.shape[1] % Hkv == 0 && out.numel() == q.numel() &&
               q.dtype == cache_k.dtype && out.dtype == q.dtype,
           "%s: q %s must be [B, Hq, hd] for the cache %s, out likewise", op, q.shape_str().c_str(),
           cache_k.shape_str().c_str());
  NB_CHECK(pos.dtype == DType::i32 && pos.numel() == B, "%s: pos must be [B] i32", op);
  if (q.device == Device::cuda)
    NB_OPS_CUDA(op, detail::cache_attention_cuda(q, cache_k, cache_v, pos, out, scale, stream));
  // The reference attention's arithmetic, operation for operation (ops/attention.cpp, forward_sequence):
  // FP64 scores scale * (q . k), the max, the sum of exp(s - max), p = exp(s - (max + log sum)), the
  // output sum p v rounded once to FP32. A CPU decode step then equals the training forward's logits at
  // that position bit for bit, so CPU tests can compare the two exactly.
  const int64_t Hq = q.shape[1], group = Hq / Hkv;
  const double sc = double(scale);
  std::vector<double> s(static_cast<size_t>(L)), acc(static_cast<size_t>(D));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = int64_t(pos.ptr<int32_t>()[b]) + 1;
    NB_CHECK(n >= 1 && n <= L, "%s: position %lld outside the cache's %lld", op, (long long)(n - 1), (long long)L);
    for (int64_t h = 0; h < Hq; ++h) {
      const float* qh = q.ptr<float>() + (b * Hq + h) * D;
      const int64_t kvh = h / group;
      double mx = -std::numeric_limits<double>::infinity(), sum = 0;
      for (int64_t j = 0; j < n; ++j) {
        const float* kj = cache_k.ptr<float>() + ((b * L + j) * Hkv + kvh) * D;
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += double(qh[d]) * double(kj[d]);
        s[size_t(j)] = sc * dot;
        mx = std::max(mx, s[size_t(j)]);
      }
      for (int64_t j = 0; j < n; ++j) sum += std::exp(s[size_t(j)] - mx);
      const double log_sum = mx + std::log(sum);
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = 0; j < n; ++j) {
        const double p = std::exp(s[size_t(j)] - log_sum);
        const float* vj = cache_v.ptr<float>() + ((b * L + j) * Hkv + kvh) * D;
        for (int64_t d = 0; d < D; ++d) acc[size_t(d)] += p * double(vj[d]);
      }
      float* oh = out.ptr<float>() + (b * Hq + h) * D;
      for (int64_t d = 0; d < D; ++d) oh[d] = float(acc[size_t(d)]);
    }
  }
  return Status::ok();
}

void argmax_rows(const Tensor& logits, const Tensor& ids, [[maybe_unused]] Stream stream) {
  const char* op = "argmax_rows";
  check_contiguous(op, "logits", logits);
  NB_CHECK(logits.dtype == DType::f32 && ids.dtype == DType::i32 && ids.numel() == ops::detail::rows_of(logits),
           "%s: logits must be [B, V] f32 and ids [B] i32", op);
  if (logits.device == Device::cuda) NB_OPS_CUDA(op, detail::argmax_rows_cuda(logits, ids, stream));
  const int64_t B = ops::detail::rows_of(logits), V = ops::detail::cols_of(logits);
  for (int64_t b = 0; b < B; ++b) {
    const float* row = logits.ptr<float>() + b * V;
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i)
      if (row[i] > row[best]) best = i;
    ids.ptr<int32_t>()[b] = int32_t(best);
  }
}

void advance_positions(const Tensor& pos, [[maybe_unused]] Stream stream) {
  NB_CHECK(pos.dtype == DType::i32, "advance_positions: pos must be i32");
  if (pos.device == Device::cuda) NB_OPS_CUDA("advance_positions", detail::advance_positions_cuda(pos, stream));
  for (int64_t b = 0; b < pos.numel(); ++b) ++pos.ptr<int32_t>()[b];
}

void vocab_shard_ids(const Tensor& ids, int64_t begin, int64_t end, const Tensor& out, [[maybe_unused]] Stream stream) {
  NB_CHECK(ids.dtype == DType::i32 && out.dtype == DType::i32 && ids.numel() == out.numel() && begin <= end,
           "vocab_shard_ids: ids and out must be i32 of one length, and begin <= end");
  if (ids.device == Device::cuda)
    NB_OPS_CUDA("vocab_shard_ids", detail::vocab_shard_ids_cuda(ids, begin, end, out, stream));
  const int32_t* in = ids.ptr<int32_t>();
  int32_t* o = out.ptr<int32_t>();
  for (int64_t t = 0; t < ids.numel(); ++t) o[t] = in[t] >= begin && in[t] < end ? int32_t(in[t] - begin) : -1;
}

bool gemv_fits(const Tensor& x, const Tensor& w, const Tensor& y) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (x.device != Device::cuda || w.device != Device::cuda || y.device != Device::cuda) return false;
  if (x.dtype != DType::bf16 || w.dtype != DType::bf16 || (y.dtype != DType::bf16 && y.dtype != DType::f32))
    return false;
  if (!x.is_contiguous() || !w.is_contiguous() || !y.is_contiguous() || w.ndim != 2) return false;
  const int64_t M = ops::detail::rows_of(x), K = ops::detail::cols_of(x), N = w.shape[0];
  return M >= 1 && M <= kGemvMaxRows && K == w.shape[1] && K % 8 == 0 && ops::detail::rows_of(y) == M &&
         ops::detail::cols_of(y) == N && aligned(x.data) && aligned(w.data);
}

void decode_gemv(const Tensor& x, const Tensor& w, const Tensor& y, [[maybe_unused]] bool accumulate,
                 [[maybe_unused]] Stream stream) {
  NB_CHECK(gemv_fits(x, w, y), "decode_gemv: x %s, W %s and y %s do not fit it (see gemv_fits)", x.shape_str().c_str(),
           w.shape_str().c_str(), y.shape_str().c_str());
  NB_OPS_CUDA("decode_gemv", detail::decode_gemv_cuda(x, w, y, accumulate, stream));
}

}  // namespace nb::infer
