// CPU reference and device dispatch for RoPE (see rope.h), and the host table builder.
#include "ops/rope.h"
#include <algorithm>
#include <cmath>
#include <vector>
#include "ops/ops_common.h"

namespace nb::ops {
using namespace detail;

void rope_inv_freq(const RopeConfig& cfg, int64_t head_dim, double* inv_freq) {
  NB_CHECK(head_dim > 0 && head_dim % 2 == 0, "rope_inv_freq: head_dim %lld must be even", (long long)head_dim);
  const double pi = 3.14159265358979323846;
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    double f = std::pow(cfg.theta, -double(2 * i) / double(head_dim));
    if (cfg.llama31_scaling) {
      double wavelen = 2 * pi / f;
      double low_wavelen = double(cfg.original_max_pos) / cfg.low_freq_factor;    // 8192: slower gets divided
      double high_wavelen = double(cfg.original_max_pos) / cfg.high_freq_factor;  // 2048: faster is kept
      if (wavelen > low_wavelen) {
        f = f / cfg.factor;
      } else if (wavelen >= high_wavelen) {
        double s = (double(cfg.original_max_pos) / wavelen - cfg.low_freq_factor) /
                   (cfg.high_freq_factor - cfg.low_freq_factor);
        f = (1 - s) * f / cfg.factor + s * f;
      }
    }
    inv_freq[i] = f;
  }
}

void rope_table(const RopeConfig& cfg, int64_t seq_len, int64_t head_dim, float* cos_out, float* sin_out) {
  const int64_t half = head_dim / 2;
  std::vector<double> inv(size_t(half > 0 ? half : 1));
  rope_inv_freq(cfg, head_dim, inv.data());
  for (int64_t s = 0; s < seq_len; ++s)
    for (int64_t i = 0; i < half; ++i) {
      double a = double(s) * inv[size_t(i)];
      cos_out[s * half + i] = float(std::cos(a));
      sin_out[s * half + i] = float(std::sin(a));
    }
}

// Rotates the pairs (src[i], src[i + half]) of one head by one row of the tables into dst (may equal src).
static void rotate_head(const float* src, float* dst, const float* cos_row, const float* sin_row, int64_t half,
                        float sign) {
  for (int64_t i = 0; i < half; ++i) {
    float c = cos_row[i], sn = sign * sin_row[i];
    float x1 = src[i], x2 = src[i + half];
    dst[i] = x1 * c - x2 * sn;
    dst[i + half] = x2 * c + x1 * sn;
  }
}

// Checks the optional positions against B*S tokens and the table length; returns its data (or nullptr).
// The range check reads the array, so it runs on the CPU only (CUDA trusts the caller, see rope.h).
static const int32_t* checked_positions(const char* op, const Tensor* positions, const Tensor& x, int64_t tokens,
                                        int64_t table_rows) {
  if (positions == nullptr) return nullptr;
  NB_CHECK(positions->ndim == 1 && positions->shape[0] == tokens, "%s: positions must be [%lld] (B*S), got %s", op,
           (long long)tokens, positions->shape_str().c_str());
  check_dtype(op, "positions", *positions, DType::i32);
  check_contiguous(op, "positions", *positions);
  check_same_device(op, x, *positions);
  const int32_t* pos = positions->ptr<int32_t>();
  if (positions->device == Device::cpu)
    for (int64_t t = 0; t < tokens; ++t)
      NB_CHECK(pos[t] >= 0 && pos[t] < table_rows,
               "%s: position %d of token %lld is outside the cos/sin table of %lld rows", op, pos[t], (long long)t,
               (long long)table_rows);
  return pos;
}

static void rope_apply(const char* op, const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse,
                       const Tensor* positions, [[maybe_unused]] Stream stream) {
  NB_CHECK(x.ndim == 4, "%s: x must be [B, S, nheads, hd], got %s", op, x.shape_str().c_str());
  check_contiguous(op, "x", x);
  check_contiguous(op, "cos", cos);
  check_contiguous(op, "sin", sin);
  check_float(op, "x", x);
  check_dtype(op, "cos", cos, DType::f32);
  check_dtype(op, "sin", sin, DType::f32);
  check_same_device(op, x, cos);
  check_same_device(op, x, sin);
  const int64_t S = x.shape[1], hd = x.shape[3], half = hd / 2;
  NB_CHECK(hd % 2 == 0, "%s: head_dim %lld must be even", op, (long long)hd);
  NB_CHECK(cos.ndim == 2 && cos.shape[1] == half && cos.shape[0] >= S, "%s: cos must be [>=%lld, %lld], got %s", op,
           (long long)S, (long long)half, cos.shape_str().c_str());
  NB_CHECK(sin.ndim == 2 && sin.shape[0] == cos.shape[0] && sin.shape[1] == half, "%s: sin must match cos", op);
  const int64_t B = x.shape[0], nh = x.shape[2];
  const int32_t* pos = checked_positions(op, positions, x, B * S, cos.shape[0]);
  if (x.device == Device::cuda) NB_OPS_CUDA(op, rope_apply_cuda(x, cos, sin, inverse, pos, stream));
  const float sign = inverse ? -1.f : 1.f;
  float* p = x.ptr<float>();
  for (int64_t t = 0; t < B * S; ++t) {
    const int64_t s = pos ? pos[t] : t % S;
    for (int64_t h = 0; h < nh; ++h) {
      float* head = p + (t * nh + h) * hd;
      rotate_head(head, head, cos.ptr<float>() + s * half, sin.ptr<float>() + s * half, half, sign);
    }
  }
}

void rope_forward(const Tensor& x, const Tensor& cos, const Tensor& sin, Stream stream, const Tensor* positions) {
  rope_apply("rope_forward", x, cos, sin, false, positions, stream);
}
void rope_backward(const Tensor& dx, const Tensor& cos, const Tensor& sin, Stream stream, const Tensor* positions) {
  rope_apply("rope_backward", dx, cos, sin, true, positions, stream);
}

// Shared by the split and its backward: shapes and the per-head rotation (or copy for v heads).
static void rope_qkv(const char* op, const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v,
                     const Tensor& cos, const Tensor& sin, bool merge, const Tensor* positions,
                     [[maybe_unused]] Stream stream) {
  for (const Tensor* t : {&qkv, &q, &k, &v}) {
    NB_CHECK(t->ndim == 4, "%s: tensors must be [B, S, heads, hd], got %s", op, t->shape_str().c_str());
    check_contiguous(op, "qkv/q/k/v", *t);
    check_float(op, "qkv/q/k/v", *t);
    NB_CHECK(t->dtype == qkv.dtype, "%s: qkv, q, k and v must share one dtype", op);
    check_same_device(op, qkv, *t);
  }
  const int64_t B = q.shape[0], S = q.shape[1], hq = q.shape[2], hkv = k.shape[2], hd = q.shape[3], half = hd / 2;
  NB_CHECK(hd % 2 == 0, "%s: head_dim %lld must be even", op, (long long)hd);
  for (const Tensor* t : {&qkv, &k, &v})
    NB_CHECK(t->shape[0] == B && t->shape[1] == S && t->shape[3] == hd, "%s: %s does not match q %s", op,
             t->shape_str().c_str(), q.shape_str().c_str());
  NB_CHECK(v.shape[2] == hkv && qkv.shape[2] == hq + 2 * hkv, "%s: qkv %s must hold q %s, k %s and v %s heads", op,
           qkv.shape_str().c_str(), q.shape_str().c_str(), k.shape_str().c_str(), v.shape_str().c_str());
  check_dtype(op, "cos", cos, DType::f32);
  check_dtype(op, "sin", sin, DType::f32);
  check_same_device(op, qkv, cos);
  check_same_device(op, qkv, sin);
  NB_CHECK(cos.ndim == 2 && cos.shape[1] == half && cos.shape[0] >= S && sin.ndim == 2 &&
               sin.shape[0] == cos.shape[0] && sin.shape[1] == half,
           "%s: cos and sin must be [>=%lld, %lld]", op, (long long)S, (long long)half);
  const int32_t* pos = checked_positions(op, positions, qkv, B * S, cos.shape[0]);
  if (qkv.device == Device::cuda) NB_OPS_CUDA(op, rope_qkv_cuda(qkv, q, k, v, cos, sin, merge, pos, stream));
  const int64_t heads = hq + 2 * hkv;
  const float sign = merge ? -1.f : 1.f;
  for (int64_t t = 0; t < B * S; ++t) {
    const int64_t s = pos ? pos[t] : t % S;
    for (int64_t h = 0; h < heads; ++h) {
      float* fused = qkv.ptr<float>() + (t * heads + h) * hd;
      float* sep = h < hq         ? q.ptr<float>() + (t * hq + h) * hd
                   : h < hq + hkv ? k.ptr<float>() + (t * hkv + h - hq) * hd
                                  : v.ptr<float>() + (t * hkv + h - hq - hkv) * hd;
      const float* src = merge ? sep : fused;
      float* dst = merge ? fused : sep;
      if (h >= hq + hkv) {
        std::copy(src, src + hd, dst);
        continue;
      }
      rotate_head(src, dst, cos.ptr<float>() + s * half, sin.ptr<float>() + s * half, half, sign);
    }
  }
}

void rope_split_qkv(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const Tensor& q, const Tensor& k,
                    const Tensor& v, Stream stream, const Tensor* positions) {
  rope_qkv("rope_split_qkv", qkv, q, k, v, cos, sin, false, positions, stream);
}

void rope_merge_qkv_grad(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& cos, const Tensor& sin,
                         const Tensor& dqkv, Stream stream, const Tensor* positions) {
  rope_qkv("rope_merge_qkv_grad", dqkv, dq, dk, dv, cos, sin, true, positions, stream);
}

}  // namespace nb::ops
