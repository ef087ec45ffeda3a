// CPU reference and device dispatch for SwiGLU (see swiglu.h).
// d/dg [silu(g) u] = u * sig(g) * (1 + g * (1 - sig(g))), d/du = silu(g).
#include "ops/swiglu.h"
#include <cmath>
#include "ops/ops_common.h"

namespace nb::ops {
using namespace detail;

static void check_swiglu(const char* op, const Tensor& gate_up, const Tensor& half_t, const char* half_name) {
  check_contiguous(op, "gate_up", gate_up);
  check_contiguous(op, half_name, half_t);
  check_float(op, "gate_up", gate_up);
  check_float(op, half_name, half_t);
  check_same_device(op, gate_up, half_t);
  NB_CHECK(cols_of(gate_up) % 2 == 0, "%s: gate_up %s must have an even last dimension", op,
           gate_up.shape_str().c_str());
  NB_CHECK(cols_of(half_t) * 2 == cols_of(gate_up) && rows_of(half_t) == rows_of(gate_up),
           "%s: %s %s must be [T, F] for gate_up %s", op, half_name, half_t.shape_str().c_str(),
           gate_up.shape_str().c_str());
}

void swiglu_forward(const Tensor& gate_up, const Tensor& out, [[maybe_unused]] Stream stream) {
  check_swiglu("swiglu_forward", gate_up, out, "out");
  if (gate_up.device == Device::cuda) NB_OPS_CUDA("swiglu_forward", swiglu_forward_cuda(gate_up, out, stream));
  const int64_t T = rows_of(out), F = cols_of(out);
  const float* in = gate_up.ptr<float>();
  float* po = out.ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < F; ++j) {
      float g = in[t * 2 * F + j], u = in[t * 2 * F + F + j];
      po[t * F + j] = g / (1.f + std::exp(-g)) * u;
    }
}

void swiglu_backward(const Tensor& gate_up, const Tensor& dout, const Tensor& dgate_up,
                     [[maybe_unused]] Stream stream) {
  check_swiglu("swiglu_backward", gate_up, dout, "dout");
  check_contiguous("swiglu_backward", "dgate_up", dgate_up);
  check_float("swiglu_backward", "dgate_up", dgate_up);
  check_same_device("swiglu_backward", gate_up, dgate_up);
  check_numel("swiglu_backward", "dgate_up", dgate_up, gate_up.numel());
  if (gate_up.device == Device::cuda)
    NB_OPS_CUDA("swiglu_backward", swiglu_backward_cuda(gate_up, dout, dgate_up, stream));
  const int64_t T = rows_of(dout), F = cols_of(dout);
  const float* in = gate_up.ptr<float>();
  const float* pd = dout.ptr<float>();
  float* pg = dgate_up.ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < F; ++j) {
      float g = in[t * 2 * F + j], u = in[t * 2 * F + F + j], d = pd[t * F + j];
      float sig = 1.f / (1.f + std::exp(-g));
      pg[t * 2 * F + j] = d * u * sig * (1.f + g * (1.f - sig));
      pg[t * 2 * F + F + j] = d * g * sig;
    }
}

}  // namespace nb::ops
