// GemmCall: names, work counts and the profiler's record of the GEMM calls of a run (gemm_call.h).
#include "gemm/gemm_call.h"
#include <cstdio>
#include <map>
#include <mutex>
#include "core/gpu_profile.h"

namespace nb::gemm {

namespace {
struct Registry {
  std::mutex mu;
  std::map<std::string, size_t> index;
  std::vector<GemmCall> calls;
};
Registry& registry() {
  static Registry r;
  return r;
}

std::string operand_name(const GemmOperandDesc& d) {
  std::string s = qformat_name(d.format);
  if (!d.k_major) s += "^T";
  if (d.four_over_six) s += "(4/6)";
  if (d.given) s += "(bf16)";
  return s;
}
}  // namespace

GemmCall GemmCall::bf16(int64_t m, int64_t n, int64_t k, const GemmArgs& args, DType c_dtype) {
  GemmCall c;
  c.m = m;
  c.n = n;
  c.k = k;
  c.args = args;
  c.c_dtype = c_dtype;
  return c;
}

GemmCall GemmCall::quant(const QOperand& a, const QOperand& b, DType c_dtype, const QGemmOptions& opt) {
  GemmCall c;
  c.quantized = true;
  c.m = a.rows;
  c.n = b.rows;
  c.k = a.k;
  c.c_dtype = c_dtype;
  c.qopt = opt;
  c.a = {a.format, a.k_major, a.dequantized != nullptr, a.nvfp4_4over6};
  c.b = {b.format, b.k_major, b.dequantized != nullptr, b.nvfp4_4over6};
  return c;
}

std::string GemmCall::key() const {
  std::string s = quantized ? operand_name(a) + " x " + operand_name(b)
                            : std::string("bf16 ") + (args.trans_a ? "T" : "N") + (args.trans_b ? "T" : "N");
  char shape[96];
  std::snprintf(shape, sizeof shape, " %lldx%lldx%lld C=%s%s", (long long)m, (long long)n, (long long)k,
                c_dtype == DType::f32 ? "f32" : "bf16", beta() != 0.f ? "+=" : "");
  s += shape;
  if (quantized && qopt.fast_accum) s += " fast";
  return s;
}

double operand_bytes_per_element(const GemmOperandDesc& d) {
  if (d.given) return 2.0;
  switch (d.format) {
    case QFormat::fp8_e4m3:
    case QFormat::fp8_e5m2: return 1.0;
    case QFormat::fp8_block128: return 1.0 + 4.0 / 128.0;
    case QFormat::fp8_block128x128: return 1.0 + 4.0 / (128.0 * 128.0);
    case QFormat::mxfp8: return 1.0 + 1.0 / 32.0;
    case QFormat::nvfp4: return 0.5 + 1.0 / 16.0;
    case QFormat::bf16: return 2.0;
  }
  return 1.0;
}

double GemmCall::bytes() const {
  const double mk = double(m) * double(k), nk = double(n) * double(k), mn = double(m) * double(n);
  const double c_bytes = mn * (c_dtype == DType::f32 ? 4.0 : 2.0) * (beta() != 0.f ? 2.0 : 1.0);
  if (!quantized) return 2.0 * (mk + nk) + c_bytes;
  return mk * operand_bytes_per_element(a) + nk * operand_bytes_per_element(b) + c_bytes;
}

ProfiledGemm::ProfiledGemm(int64_t m, int64_t n, int64_t k, const GemmArgs& args, DType c_dtype) {
  if (profile::enabled()) open(GemmCall::bf16(m, n, k, args, c_dtype));
}

ProfiledGemm::ProfiledGemm(const QOperand& a, const QOperand& b, DType c_dtype, const QGemmOptions& opt) {
  if (profile::enabled()) open(GemmCall::quant(a, b, c_dtype, opt));
}

ProfiledGemm::~ProfiledGemm() {
  if (on_) profile::end_child();
}

void ProfiledGemm::open(const GemmCall& call) {
  const std::string key = call.key();
  {
    Registry& r = registry();
    const std::lock_guard<std::mutex> lock(r.mu);
    if (r.index.emplace(key, r.calls.size()).second) r.calls.push_back(call);
  }
  profile::begin_child("gemm " + key, call.flops(), call.bytes());
  on_ = true;
}

std::vector<GemmCall> recorded_gemm_calls() {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  return r.calls;
}

}  // namespace nb::gemm
