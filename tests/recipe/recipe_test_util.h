// Shared by the recipe tests (CPU and GPU): an independent FP64 model of one Linear's three GEMMs.
// The Linear's quantized copies (Linear::debug_copies) are decoded with the formats' own dequantizers
// (not the GEMM layer's), the products are formed in FP64 over the operands spec §6 assigns:
//   Fprop  y  = X_row . W_row^T     Dgrad dx = dY_row . W_col^T (W_col = W^T [K, N]; a 2D NVFP4 weight
//                                   has no column copy: W_row read transposed)
//   Wgrad  dw = dY_col . X_col^T    (dY_col [N, M], X_col [K, M])
// and the result is compared within a bound derived from the accumulation precision only.
#pragma once
#include <gtest/gtest.h>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>
#include "core/bf16.h"
#include "formats/fp8/fp8.h"
#include "formats/fp8/fp8_block.h"
#include "formats/mxfp8/mxfp8.h"
#include "formats/nvfp4/nvfp4.h"
#include "recipe/linear.h"

namespace nb::recipe::testing {

constexpr double kU = 1.0 / 16777216.0;  // FP32 unit roundoff 2^-24

inline std::vector<float> random_bf16_values(int64_t n, double sigma, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> d(0.0, sigma);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = bf16_to_f32(f32_to_bf16(float(d(rng))));
  return v;
}

// Exact value of each element of the row copy [rows, cols] or of the column copy [cols, rows] (nvfp4
// with its global scale in FP64).
inline std::vector<double> dequant_copy(const QuantizedBytes& q, bool col) {
  const int64_t r = q.rows, c = q.cols, n = r * c;
  std::vector<float> f(static_cast<size_t>(n));
  const std::vector<uint8_t>& data = col ? q.col_data : q.row_data;
  const std::vector<uint8_t>& sc = col ? q.col_scales : q.row_scales;
  std::vector<double> out(static_cast<size_t>(n));
  double global = 1.0;
  switch (q.fmt) {
    case Fmt::fp8_e4m3:
    case Fmt::fp8_e5m2: {
      // The formats' FP32 dequantizers round code x scale_inv; the GEMM's operand is the exact product.
      auto ff = q.fmt == Fmt::fp8_e4m3 ? fp8::Format::e4m3 : fp8::Format::e5m2;
      for (int64_t i = 0; i < n; ++i) out[size_t(i)] = double(fp8::decode(data[size_t(i)], ff)) * double(q.scale_inv);
      return out;
    }
    case Fmt::mor_block: {  // BF16 values [r, c]; the column operand reads its copy (or the only one) transposed
      const auto* v = reinterpret_cast<const bf16*>((col && !q.col_data.empty() ? q.col_data : q.row_data).data());
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < c; ++j) out[size_t(col ? j * r + i : i * c + j)] = bf16_to_f32(v[i * c + j]);
      return out;
    }
    case Fmt::fp8_block128:
    case Fmt::fp8_block128x128: {
      // Scale layouts of fp8_block.h; the copy is [outer, inner] = [r, c] (row) or [c, r] (col).
      const float* s = reinterpret_cast<const float*>(sc.data());
      const int64_t outer = col ? c : r, inner = col ? r : c;
      for (int64_t o = 0; o < outer; ++o)
        for (int64_t i = 0; i < inner; ++i) {
          int64_t idx = q.fmt == Fmt::fp8_block128 ? (i / 128) * fp8::round4(outer) + o
                                                   : (o / 128) * fp8::round4(inner / 128) + i / 128;
          out[size_t(o * inner + i)] =
              double(fp8::decode(data[size_t(o * inner + i)], fp8::Format::e4m3)) * double(s[idx]);
        }
      return out;
    }
    case Fmt::mxfp8: {
      std::vector<float> g(static_cast<size_t>(n));
      mxfp8::dequantize_ref(data.data(), sc.data(), r, c, col, g.data());
      if (!col)
        f = g;
      else
        for (int64_t i = 0; i < r; ++i)
          for (int64_t j = 0; j < c; ++j) f[size_t(j * r + i)] = g[size_t(i * c + j)];  // to [cols, rows]
      break;
    }
    case Fmt::nvfp4:
      // amax = 6*448 makes the dequantizer's global factor exactly 1: e2m1 x E4M3 scale, exact in FP32.
      nvfp4::dequantize_ref(data.data(), sc.data(), nvfp4::kScaleMax, col ? c : r, col ? r : c, f.data());
      global = double(col ? q.col_amax : q.row_amax) / double(nvfp4::kScaleMax);
      break;
    case Fmt::bf16: break;
  }
  for (int64_t i = 0; i < n; ++i) out[size_t(i)] = double(f[size_t(i)]) * global;
  return out;
}

// FP64 a [m, k] . b [n, k]^T and the magnitude sum_k |a b| of each output (for accumulation bounds).
inline void product_nt(const std::vector<double>& a, const std::vector<double>& b, int64_t m, int64_t n, int64_t k,
                       std::vector<double>* c, std::vector<double>* mag) {
  c->assign(size_t(m * n), 0.0);
  mag->assign(size_t(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0, t = 0;
      for (int64_t p = 0; p < k; ++p) {
        double v = a[size_t(i * k + p)] * b[size_t(j * k + p)];
        s += v;
        t += std::fabs(v);
      }
      (*c)[size_t(i * n + j)] = s;
      (*mag)[size_t(i * n + j)] = t;
    }
}

inline std::vector<double> transpose(const std::vector<double>& a, int64_t rows, int64_t cols) {
  std::vector<double> t(a.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) t[size_t(j * rows + i)] = a[size_t(i * cols + j)];
  return t;
}

inline std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// How the backend accumulates, for the error bound |got - ref| <= bound (S = sum_k |a b|, u = 2^-24;
// the GPU model is the one tests/qgemm derived and measured on H200 for matmul_quantized):
//   cpu quantized: FP64 sums (here and in the GEMM), FP32 alpha (<= 2 roundings), one rounding to f32:
//                                                        4u |ref| + (k + 2) 2^-52 S
//   FP32 accumulation (cpu BF16 matmul, cuBLASLt FP32 compute incl. the emulated MXFP8/NVFP4 paths,
//   any summation order), FP32 alpha:                    2 (k + 3) u S + 4u |ref|
//   Hopper FP8 split accumulator (per-tensor Dgrad/Wgrad, every block-scaled GEMM): about 13-14 bits
//   kept per MMA step of 32 products before promotion:   + 2^-10 S
//   Hopper FP8 fast accumulation (per-tensor Fprop), the running sum truncated every 32 products:
//                                                        + (k/32 + 1) 2^-13 S
//   output rounded to bf16: + 2^-8 (|ref| + accumulation error); to f32: + u (|ref| + accumulation error)
struct Bound {
  bool fp64_accumulate = false, fast_accum = false, bf16_out = false, fp8_split = false;
  double operator()(double ref, double mag, int64_t k) const {
    double acc = fp64_accumulate ? 4 * kU * std::fabs(ref) + double(k + 2) * std::ldexp(1.0, -52) * mag
                                 : 2 * double(k + 3) * kU * mag + 4 * kU * std::fabs(ref);
    if (fp8_split) acc += std::ldexp(1.0, -10) * mag;
    if (fast_accum) acc += double(k / 32 + 1) * std::ldexp(1.0, -13) * mag;
    acc += (bf16_out ? std::ldexp(1.0, -8) : kU) * (std::fabs(ref) + acc);
    return acc + 1e-30;
  }
};

// Checks got against ref within the bound; returns the relative Frobenius distance of ref to `exact`
// (the unquantized product), so callers can check quantization did happen and stayed sane.
inline double expect_close(const char* what, const std::vector<double>& got, const std::vector<double>& ref,
                           const std::vector<double>& mag, int64_t k, const Bound& bound,
                           const std::vector<double>& exact) {
  int bad = 0;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    double tol = bound(ref[i], mag[i], k);
    if (!(std::fabs(got[i] - ref[i]) <= tol) && bad++ < 5)
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << " ref " << ref[i] << " tol " << tol;
    num += (ref[i] - exact[i]) * (ref[i] - exact[i]);
    den += exact[i] * exact[i];
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " elements outside the bound";
  return std::sqrt(num / den);
}

}  // namespace nb::recipe::testing

namespace nb::recipe::testing {

struct LinearRun {
  std::vector<double> y, dx, dw;  // outputs
  QuantizedBytes q[3];            // input, weight, grad copies (quantized recipes)
  LinearHealth health;
};

// One Linear on `dev`: forward(x) then backward(dy) with beta = 0, dw starting at zero. x [m,k], w [n,k],
// dy [m,n] hold BF16-representable values (f32 on cpu, bf16 on cuda).
// configure (optional) runs after init, before the step; inspect (optional) at the end.
inline Status run_linear(const Recipe& r, Device dev, int64_t m, int64_t k, int64_t n, const std::vector<float>& x,
                         const std::vector<float>& w, const std::vector<float>& dy, LinearRun* out,
                         uint32_t tensor_id = 7, uint32_t step = 3,
                         const std::function<Status(Linear&)>& configure = {},
                         const std::function<Status(Linear&)>& inspect = {}) {
  const bool cuda = dev == Device::cuda;
  const DType act = cuda ? DType::bf16 : DType::f32;
  auto upload = [&](Buffer* b, const std::vector<float>& v, int64_t rows, int64_t cols) -> Status {
    NB_TRY(Buffer::allocate(b, act, dev, {rows, cols}));
    if (!cuda) return copy_bytes(b->data(), dev, v.data(), Device::cpu, v.size() * 4);
    std::vector<bf16> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
    return copy_bytes(b->data(), dev, h.data(), Device::cpu, h.size() * 2);
  };
  auto download = [&](const Buffer& b, std::vector<double>* v) -> Status {
    const int64_t cnt = b.tensor().numel();
    v->resize(size_t(cnt));
    if (b.tensor().dtype == DType::f32) {
      std::vector<float> h(static_cast<size_t>(cnt));
      NB_TRY(copy_bytes(h.data(), Device::cpu, b.data(), dev, h.size() * 4));
      for (int64_t i = 0; i < cnt; ++i) (*v)[size_t(i)] = h[size_t(i)];
    } else {
      std::vector<bf16> h(static_cast<size_t>(cnt));
      NB_TRY(copy_bytes(h.data(), Device::cpu, b.data(), dev, h.size() * 2));
      for (int64_t i = 0; i < cnt; ++i) (*v)[size_t(i)] = bf16_to_f32(h[size_t(i)]);
    }
    return Status::ok();
  };
  Buffer bx, bw, bdy, by, bdx, bdw;
  NB_TRY(upload(&bx, x, m, k));
  NB_TRY(upload(&bw, w, n, k));
  NB_TRY(upload(&bdy, dy, m, n));
  NB_TRY(Buffer::allocate(&by, act, dev, {m, n}));
  NB_TRY(Buffer::allocate(&bdx, act, dev, {m, k}));
  NB_TRY(Buffer::allocate(&bdw, DType::f32, dev, {n, k}));
  std::vector<float> zeros(size_t(n * k), 0.f);
  NB_TRY(copy_bytes(bdw.data(), dev, zeros.data(), Device::cpu, zeros.size() * 4));
  Linear lin;
  NB_TRY(lin.init(r, false, "test", tensor_id, m, k, n, dev));
  if (configure) NB_TRY(configure(lin));
  lin.new_step(step);
  NB_TRY(lin.forward(bx.tensor(), bw.tensor(), by.tensor(), 0.f, nullptr));
  NB_TRY(lin.backward(bdy.tensor(), bx.tensor(), bw.tensor(), bdx.tensor(), 0.f, bdw.tensor(), nullptr));
  if (cuda) device_synchronize();
  NB_TRY(download(by, &out->y));
  NB_TRY(download(bdx, &out->dx));
  NB_TRY(download(bdw, &out->dw));
  if (r.quantized())
    for (int i = 0; i < 3; ++i) NB_TRY(lin.debug_copies(i, &out->q[i]));
  if (inspect) NB_TRY(inspect(lin));
  return lin.take_health(&out->health);
}

// The FP64 model of the three GEMMs on the run's own quantized operands (or the BF16 inputs for a
// BF16 recipe), checked within the accumulation bound of `dev`. Returns the largest relative distance
// of the reference to the unquantized product over the three GEMMs.
inline double check_run(const Recipe& r, Device dev, int64_t m, int64_t k, int64_t n, const std::vector<float>& x,
                        const std::vector<float>& w, const std::vector<float>& dy, const LinearRun& run) {
  std::vector<double> xd = to_double(x), wd = to_double(w), dyd = to_double(dy);
  std::vector<double> dyt = transpose(dyd, m, n), xt = transpose(xd, m, k), wt = transpose(wd, n, k);
  std::vector<double> ey, edx, edw, mag;
  product_nt(xd, wd, m, n, k, &ey, &mag);
  product_nt(dyd, wt, m, k, n, &edx, &mag);
  product_nt(dyt, xt, n, k, m, &edw, &mag);
  std::vector<double> a_y = xd, b_y = wd, a_dx = dyd, b_dx = wt, a_dw = dyt, b_dw = xt;
  if (r.quantized()) {
    a_y = dequant_copy(run.q[0], false);
    b_y = dequant_copy(run.q[1], false);
    a_dx = dequant_copy(run.q[2], false);
    // A 2D NVFP4 weight keeps no column-wise copy: Dgrad reads its row copy transposed.
    b_dx = run.q[1].col_data.empty() ? transpose(dequant_copy(run.q[1], false), n, k) : dequant_copy(run.q[1], true);
    a_dw = dequant_copy(run.q[2], true);
    b_dw = dequant_copy(run.q[0], true);
  }
  const bool cuda = dev == Device::cuda;
  const bool per_tensor = r.input.fmt == Fmt::fp8_e4m3;
  const bool fp8 = cuda && (per_tensor || r.input.fmt == Fmt::fp8_block128);
  const bool fp64 = !cuda && r.quantized();
  Bound fprop{fp64, cuda && per_tensor, cuda, fp8 && !per_tensor};
  Bound dgrad{fp64, false, cuda, fp8};
  Bound wgrad{fp64, false, false, fp8};
  std::vector<double> ref;
  double worst = 0;
  product_nt(a_y, b_y, m, n, k, &ref, &mag);
  worst = std::max(worst, expect_close("Fprop", run.y, ref, mag, k, fprop, ey));
  product_nt(a_dx, b_dx, m, k, n, &ref, &mag);
  worst = std::max(worst, expect_close("Dgrad", run.dx, ref, mag, n, dgrad, edx));
  product_nt(a_dw, b_dw, n, k, m, &ref, &mag);
  worst = std::max(worst, expect_close("Wgrad", run.dw, ref, mag, m, wgrad, edw));
  return worst;
}

}  // namespace nb::recipe::testing
