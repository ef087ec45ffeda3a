// Causal GQA attention: argument checks, backend dispatch and the CPU reference (the spec).
//
// Reference math for one batch b, query head h (K/V head g = h / (Hq/Hkv)), query row i, keys j <= i:
//   s_ij = scale * q_i . k_j            lse_i = log sum_{j<=i} exp(s_ij)      p_ij = exp(s_ij - lse_i)
//   out_i = sum_j p_ij v_j
// Backward with D_i = dout_i . out_i (= sum_j p_ij dp_ij):
//   dp_ij = dout_i . v_j      ds_ij = p_ij (dp_ij - D_i)
//   dq_i = scale * sum_j ds_ij k_j      dk_j += scale * ds_ij q_i      dv_j += p_ij dout_i
// dk/dv sum over every query head of the group. All sums run in FP64; results are stored as FP32.
// Work is split over (batch, query head); the backward keeps per-head FP64 dk/dv partials and sums each
// group in head order, so threads never share output and the result does not depend on thread timing.
#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

namespace nb::ops {
namespace {

Status check_tensor(const char* name, const Tensor* t, Device dev, DType dt, std::initializer_list<int64_t> dims) {
  if (t == nullptr) return Status::ok();
  std::vector<int64_t> want(dims);
  bool same = t->ndim == int(want.size());
  for (int i = 0; same && i < t->ndim; ++i) same = t->shape[i] == want[i];
  std::string want_str = "[";
  for (size_t i = 0; i < want.size(); ++i) want_str += (i ? "," : "") + std::to_string(want[i]);
  want_str += "]";
  if (!same)
    return errorf("attention: tensor '%s' has shape %s but the attention shape needs %s", name, t->shape_str().c_str(),
                  want_str.c_str());
  if (t->device != dev)
    return errorf("attention: tensor '%s' is on %s but q is on %s; put all attention tensors on one device", name,
                  device_name(t->device), device_name(dev));
  if (t->dtype != dt)
    return errorf("attention: tensor '%s' is %s but must be %s on %s", name, std::string(dtype_name(t->dtype)).c_str(),
                  std::string(dtype_name(dt)).c_str(), device_name(dev));
  if (!t->is_contiguous() || t->data == nullptr)
    return errorf("attention: tensor '%s' must be contiguous with data", name);
  return Status::ok();
}

// Runs fn(item) for item in [0, n) on up to hardware_concurrency threads.
template <typename Fn>
void parallel_for(int64_t n, Fn fn) {
  int64_t workers = std::min<int64_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      for (int64_t i = w; i < n; i += workers) fn(i);
    });
  for (auto& t : pool) t.join();
}

double dot(const float* a, const float* b, int64_t n) {
  double s = 0.0;
  for (int64_t d = 0; d < n; ++d) s += double(a[d]) * double(b[d]);
  return s;
}

// Index helpers for the [B, S, H, D] and [B, H, S] layouts.
struct Layout {
  int64_t S, Hq, Hkv, D;
  int64_t q(int64_t b, int64_t i, int64_t h) const { return ((b * S + i) * Hq + h) * D; }
  int64_t kv(int64_t b, int64_t j, int64_t g) const { return ((b * S + j) * Hkv + g) * D; }
  int64_t stat(int64_t b, int64_t h, int64_t i) const { return (b * Hq + h) * S + i; }
};

}  // namespace

Status attention_check_args(const AttentionShape& sh, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& out, const Tensor& lse, const Tensor* dout, const Tensor* dq,
                            const Tensor* dk, const Tensor* dv) {
  if (sh.batch <= 0 || sh.seq <= 0 || sh.heads <= 0 || sh.kv_heads <= 0 || sh.head_dim <= 0)
    return errorf("attention: every dimension must be positive (B=%lld S=%lld Hq=%lld Hkv=%lld D=%lld)",
                  (long long)sh.batch, (long long)sh.seq, (long long)sh.heads, (long long)sh.kv_heads,
                  (long long)sh.head_dim);
  if (sh.heads % sh.kv_heads != 0)
    return errorf("attention: query heads (%lld) must be a multiple of K/V heads (%lld)", (long long)sh.heads,
                  (long long)sh.kv_heads);
  if (!(sh.scale > 0.0f) || !std::isfinite(sh.scale))
    return errorf("attention: softmax scale %g must be positive and finite (usually 1/sqrt(head_dim))", sh.scale);
  const Device dev = q.device;
  const DType act = dev == Device::cpu ? DType::f32 : DType::bf16;
  const auto B = sh.batch, S = sh.seq, Hq = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim;
  NB_TRY(check_tensor("q", &q, dev, act, {B, S, Hq, D}));
  NB_TRY(check_tensor("k", &k, dev, act, {B, S, Hkv, D}));
  NB_TRY(check_tensor("v", &v, dev, act, {B, S, Hkv, D}));
  NB_TRY(check_tensor("out", &out, dev, act, {B, S, Hq, D}));
  NB_TRY(check_tensor("lse", &lse, dev, DType::f32, {B, Hq, S}));
  NB_TRY(check_tensor("dout", dout, dev, act, {B, S, Hq, D}));
  NB_TRY(check_tensor("dq", dq, dev, act, {B, S, Hq, D}));
  NB_TRY(check_tensor("dk", dk, dev, act, {B, S, Hkv, D}));
  NB_TRY(check_tensor("dv", dv, dev, act, {B, S, Hkv, D}));
  return Status::ok();
}

Status attention_forward_ref(const AttentionShape& sh, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& out, const Tensor& lse) {
  NB_TRY(attention_check_args(sh, q, k, v, out, lse, nullptr, nullptr, nullptr, nullptr));
  if (q.device != Device::cpu) return errorf("attention_forward_ref: tensors must be on the cpu");
  const Layout L{sh.seq, sh.heads, sh.kv_heads, sh.head_dim};
  const int64_t group = sh.heads / sh.kv_heads, S = sh.seq, D = sh.head_dim;
  const float *Q = q.ptr<float>(), *K = k.ptr<float>(), *V = v.ptr<float>();
  float *O = out.ptr<float>(), *LSE = lse.ptr<float>();
  parallel_for(sh.batch * sh.heads, [&](int64_t item) {
    const int64_t b = item / sh.heads, h = item % sh.heads, g = h / group;
    std::vector<double> s(S), acc(D);
    for (int64_t i = 0; i < S; ++i) {
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j <= i; ++j) {
        s[j] = double(sh.scale) * dot(Q + L.q(b, i, h), K + L.kv(b, j, g), D);
        m = std::max(m, s[j]);
      }
      double sum = 0.0;
      for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[j] - m);
      const double log_sum = m + std::log(sum);
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = 0; j <= i; ++j) {
        const double p = std::exp(s[j] - log_sum);
        const float* vj = V + L.kv(b, j, g);
        for (int64_t d = 0; d < D; ++d) acc[d] += p * double(vj[d]);
      }
      for (int64_t d = 0; d < D; ++d) O[L.q(b, i, h) + d] = float(acc[d]);
      LSE[L.stat(b, h, i)] = float(log_sum);
    }
  });
  return Status::ok();
}

Status attention_backward_ref(const AttentionShape& sh, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& dout, const Tensor& lse, const Tensor& dq,
                              const Tensor& dk, const Tensor& dv) {
  NB_TRY(attention_check_args(sh, q, k, v, out, lse, &dout, &dq, &dk, &dv));
  if (q.device != Device::cpu) return errorf("attention_backward_ref: tensors must be on the cpu");
  const Layout L{sh.seq, sh.heads, sh.kv_heads, sh.head_dim};
  const int64_t group = sh.heads / sh.kv_heads, S = sh.seq, D = sh.head_dim;
  const float *Q = q.ptr<float>(), *K = k.ptr<float>(), *V = v.ptr<float>();
  const float *O = out.ptr<float>(), *dO = dout.ptr<float>(), *LSE = lse.ptr<float>();
  float *dQ = dq.ptr<float>(), *dK = dk.ptr<float>(), *dV = dv.ptr<float>();
  // Per query head FP64 partial dk/dv, summed over each group in head order afterwards (deterministic).
  std::vector<double> dk_part(size_t(sh.batch * sh.heads * S * D)), dv_part(dk_part.size());
  parallel_for(sh.batch * sh.heads, [&](int64_t item) {
    const int64_t b = item / sh.heads, h = item % sh.heads, g = h / group;
    double* dk_acc = dk_part.data() + item * S * D;
    double* dv_acc = dv_part.data() + item * S * D;
    std::vector<double> dq_acc(D);
    for (int64_t i = 0; i < S; ++i) {
      const float* qi = Q + L.q(b, i, h);
      const float* doi = dO + L.q(b, i, h);
      const double Di = dot(doi, O + L.q(b, i, h), D);
      const double lse_i = LSE[L.stat(b, h, i)];
      std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
      for (int64_t j = 0; j <= i; ++j) {
        const float* kj = K + L.kv(b, j, g);
        const float* vj = V + L.kv(b, j, g);
        const double p = std::exp(double(sh.scale) * dot(qi, kj, D) - lse_i);
        const double ds = p * (dot(doi, vj, D) - Di);
        for (int64_t d = 0; d < D; ++d) {
          dq_acc[d] += ds * double(kj[d]);
          dk_acc[j * D + d] += ds * double(qi[d]);
          dv_acc[j * D + d] += p * double(doi[d]);
        }
      }
      for (int64_t d = 0; d < D; ++d) dQ[L.q(b, i, h) + d] = float(double(sh.scale) * dq_acc[d]);
    }
  });
  parallel_for(sh.batch * sh.kv_heads, [&](int64_t item) {
    const int64_t b = item / sh.kv_heads, g = item % sh.kv_heads;
    for (int64_t j = 0; j < S; ++j)
      for (int64_t d = 0; d < D; ++d) {
        double sk = 0.0, sv = 0.0;
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          sk += dk_part[((b * sh.heads + h) * S + j) * D + d];
          sv += dv_part[((b * sh.heads + h) * S + j) * D + d];
        }
        dK[L.kv(b, j, g) + d] = float(double(sh.scale) * sk);
        dV[L.kv(b, j, g) + d] = float(sv);
      }
  });
  return Status::ok();
}

Status attention_forward(const AttentionShape& sh, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                         const Tensor& lse, Stream stream) {
  if (q.device == Device::cpu) return attention_forward_ref(sh, q, k, v, out, lse);
  return attention_forward_cudnn(sh, q, k, v, out, lse, stream);
}

Status attention_backward(const AttentionShape& sh, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& out, const Tensor& dout, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                          const Tensor& dv, Stream stream) {
  if (q.device == Device::cpu) return attention_backward_ref(sh, q, k, v, out, dout, lse, dq, dk, dv);
  return attention_backward_cudnn(sh, q, k, v, out, dout, lse, dq, dk, dv, stream);
}

#if !defined(NIBBLE_HAVE_CUDA)
Status attention_forward_cudnn(const AttentionShape&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                               const Tensor&, Stream) {
  return errorf("attention: CUDA tensors given, but this nibble was built without CUDA; rebuild with nvcc present");
}
Status attention_backward_cudnn(const AttentionShape&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Stream) {
  return errorf("attention: CUDA tensors given, but this nibble was built without CUDA; rebuild with nvcc present");
}
int64_t attention_workspace_bytes() { return 0; }
#endif

}  // namespace nb::ops
