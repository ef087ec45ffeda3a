// A GEMM call as the step profiler sees it: shape, operand formats and layout, enough to name it, count
// its work from the shape, and run it again on random data of the same layout for its ceiling
// (measure_gemm_call_tflops in gemm_bench.h). matmul() and matmul_quantized() open a ProfiledGemm while
// the profiler is on (core/gpu_profile.h): the call becomes a timed sub-interval of the open phase and
// is remembered (recorded_gemm_calls) so that the run can measure its ceiling at the end.
//
// Work of a call (docs/PERFORMANCE.md, "Roofline"): FLOPs = 2 M N K; bytes = each operand read once at
// its stored size (BF16 2 bytes per element; FP8 1; MXFP8 1 + 1/32; NVFP4 1/2 + 1/16; FP8 blocks 1 plus
// their FP32 scales; an operand given already dequantized 2) + C written once (read too when beta != 0).
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include "core/dtype.h"
#include "gemm/gemm.h"
#include "gemm/gemm_quantized.h"

namespace nb::gemm {

struct GemmOperandDesc {
  QFormat format = QFormat::fp8_e4m3;
  bool k_major = true;         // stored [rows, K]; else [K, rows]
  bool given = false;          // mxfp8/nvfp4: read as its dequantized BF16 copy (QOperand::dequantized)
  bool four_over_six = false;  // nvfp4 quantized with 4/6
};

struct GemmCall {
  bool quantized = false;
  int64_t m = 0, n = 0, k = 0;
  DType c_dtype = DType::bf16;
  GemmArgs args;         // BF16 calls: layout, alpha, beta
  GemmOperandDesc a, b;  // quantized calls
  QGemmOptions qopt;     // quantized calls: beta, fast accumulation

  static GemmCall bf16(int64_t m, int64_t n, int64_t k, const GemmArgs& args, DType c_dtype);
  static GemmCall quant(const QOperand& a, const QOperand& b, DType c_dtype, const QGemmOptions& opt);
  float beta() const { return quantized ? qopt.beta : args.beta; }
  // "bf16 NT 8192x6144x4096 C=bf16", "nvfp4 x nvfp4(bf16) 8192x4096x4096 C=bf16+=": formats, layout, shape.
  std::string key() const;
  double flops() const { return 2.0 * double(m) * double(n) * double(k); }
  double bytes() const;
};

// Bytes per element of an operand stored in `d`'s format (scales included), as the header comment states.
double operand_bytes_per_element(const GemmOperandDesc& d);

// While the profiler is on: times the call as a sub-interval of the open phase and records it.
class ProfiledGemm {
 public:
  ProfiledGemm(int64_t m, int64_t n, int64_t k, const GemmArgs& args, DType c_dtype);
  ProfiledGemm(const QOperand& a, const QOperand& b, DType c_dtype, const QGemmOptions& opt);
  ~ProfiledGemm();
  ProfiledGemm(const ProfiledGemm&) = delete;
  ProfiledGemm& operator=(const ProfiledGemm&) = delete;

 private:
  void open(const GemmCall& call);
  bool on_ = false;
};

// The distinct calls made while profiling (one per key), in the order first seen.
std::vector<GemmCall> recorded_gemm_calls();

}  // namespace nb::gemm
