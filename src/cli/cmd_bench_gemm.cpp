// `nibble bench gemm`: the BF16 GEMM ceiling (8192^3 through cuBLASLt) and the Llama-3.1-8B layer
// shapes, plus the device-to-device copy bandwidth: the two ceilings every other figure is read against.
// --format fp8|mxfp8|nvfp4 times the same Fprop shapes with both operands in that format, as the recipes
// run them (the ceilings the step profiler's roofline reads each GEMM against).
#include <cstdio>
#include <memory>
#include <string>
#include "cli/commands.h"
#include "core/device_info.h"
#include "core/tensor.h"
#include "gemm/gemm_bench.h"

namespace nb::cli {

namespace {
struct BenchGemmArgs {
  int iters = 20;
  bool markdown = false;
  bool in_loop = false;
  std::string format = "bf16";  // bf16 | fp8 | mxfp8 | nvfp4: the Fprop GEMMs' operand format
  bool weight_cache = false;    // mxfp8/nvfp4: B (the weight) given dequantized, as --emulated-weight-cache
  double min_ceiling = -1;      // TFLOP/s the 8192^3 GEMM must reach; -1 = the device's expected floor
};

// The floor below which the ceiling GEMM means a broken set-up (a poor cuBLASLt algorithm, a throttled or
// shared GPU), not a slow nibble: H100/H200 reach 760-810 TFLOP/s through cuBLAS. 0 = no expectation.
double expected_ceiling_floor(const GpuInfo& g) { return g.cc_major == 9 ? 600.0 : 0.0; }

// One sentence and a non-zero exit when the ceiling is under the floor, so the benchmark script stops
// trusting the figures measured on this GPU.
int check_ceiling(const GpuInfo& g, double ceiling, double floor) {
  if (floor <= 0 || ceiling >= floor) return 0;
  std::fprintf(stderr,
               "bench gemm: the BF16 8192^3 ceiling on %s is %.0f TFLOP/s, below the expected %.0f; the GPU is "
               "busy, throttled or misconfigured, so figures measured on it now are not comparable (check "
               "nvidia-smi, or pass --min-ceiling-tflops 0 to measure anyway)\n",
               g.name.c_str(), ceiling, floor);
  return 3;
}

struct Shape {
  const char* name;
  int64_t m, n, k;
};

// The in-loop dequantizing GEMM's table (docs/PERFORMANCE.md): every figure a TFLOP/s of the same shape.
int print_in_loop_table(const Shape* shapes, size_t count, const BenchGemmArgs& a) {
  std::printf(
      "%sIn-loop dequantization (A quantized, B BF16; TFLOP/s, median of %d runs): cuBLASLt BF16; the wgmma kernel "
      "with a BF16 A; per format the emulation (dequantize A, then cuBLASLt) and the kernel dequantizing A in its "
      "main loop.\n\n",
      a.markdown ? "\n" : "", a.iters);
  if (a.markdown)
    std::printf(
        "| GEMM (M x N x K) | cuBLASLt BF16 | wgmma BF16 | MXFP8 emulated | MXFP8 in-loop | NVFP4 emulated | "
        "NVFP4 in-loop |\n|---|---:|---:|---:|---:|---:|---:|\n");
  for (size_t i = 0; i < count; ++i) {
    const Shape& sh = shapes[i];
    gemm::InLoopTflops t;
    Status s = gemm::measure_in_loop_gemms(sh.m, sh.n, sh.k, a.iters, &t);
    if (!s) {
      std::fprintf(stderr, "error: %s\n", s.message().c_str());
      return 1;
    }
    std::printf(a.markdown ? "| %s: %lld x %lld x %lld | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f |\n"
                           : "%-34s %6lld x %6lld x %6lld  %5.0f %5.0f  mxfp8 %5.0f %5.0f  nvfp4 %5.0f %5.0f\n",
                sh.name, (long long)sh.m, (long long)sh.n, (long long)sh.k, t.cublaslt_bf16, t.in_loop_bf16,
                t.emulated_mxfp8, t.in_loop_mxfp8, t.emulated_nvfp4, t.in_loop_nvfp4);
  }
  return 0;
}

// One Fprop GEMM, Y[M,N] = X[M,K] W[N,K]^T, in the format --format names (TFLOP/s).
Status measure_fprop(const Shape& sh, const BenchGemmArgs& a, double* tflops) {
  if (a.format == "bf16") return gemm::measure_gemm_tflops(sh.m, sh.n, sh.k, a.iters, tflops);
  gemm::GemmCall call;
  call.quantized = true;
  call.m = sh.m;
  call.n = sh.n;
  call.k = sh.k;
  const gemm::QFormat f = a.format == "fp8"     ? gemm::QFormat::fp8_e4m3
                          : a.format == "mxfp8" ? gemm::QFormat::mxfp8
                                                : gemm::QFormat::nvfp4;
  call.a.format = call.b.format = f;
  call.b.given = a.weight_cache && f != gemm::QFormat::fp8_e4m3;
  call.qopt.fast_accum = f == gemm::QFormat::fp8_e4m3;  // as the FP8 recipes' Fprop
  return gemm::measure_gemm_call_tflops(call, a.iters, tflops);
}

int run_bench_gemm(const BenchGemmArgs& a) {
  std::string why;
  auto gpus = query_gpus(&why);
  if (gpus.empty()) {
    std::fprintf(stderr, "bench gemm needs a GPU: %s\n", why.c_str());
    return 1;
  }
  // Fprop shapes of one Llama-3.1-8B layer at 8192 tokens (Y[M,N] = X[M,K] W[N,K]^T).
  const Shape shapes[] = {
      {"8192^3 (ceiling)", 8192, 8192, 8192},         {"Llama-8B q/k/v fused (N 6144)", 8192, 6144, 4096},
      {"Llama-8B o_proj", 8192, 4096, 4096},          {"Llama-8B gate+up (N 28672)", 8192, 28672, 4096},
      {"Llama-8B down (K 14336)", 8192, 4096, 14336}, {"Llama-8B LM head (N 128256)", 8192, 128256, 4096}};
  double copy_gbs = 0;
  Status s = gemm::measure_copy_bandwidth(size_t(1) << 30, a.iters, &copy_gbs);
  if (!s) {
    std::fprintf(stderr, "error: %s\n", s.message().c_str());
    return 1;
  }
  if (a.markdown) {
    std::printf(
        "%s GEMMs through cuBLASLt on %s (BF16 out, FP32 accumulation), median of %d runs; "
        "device-to-device copy of 1 GiB: %.0f GB/s (read + write).\n\n| GEMM (M x N x K) | TFLOP/s |\n|---|---:|\n",
        a.format.c_str(), gpus[0].name.c_str(), a.iters, copy_gbs);
  } else {
    std::printf("bench gemm on %s: D2D copy %.0f GB/s; format %s%s\n", gpus[0].name.c_str(), copy_gbs, a.format.c_str(),
                a.weight_cache ? " (weights given in BF16)" : "");
  }
  double ceiling = 0;
  for (const Shape& sh : shapes) {
    double tflops = 0;
    s = measure_fprop(sh, a, &tflops);
    if (!s) {
      std::fprintf(stderr, "error: %s\n", s.message().c_str());
      return 1;
    }
    if (ceiling == 0) ceiling = tflops;  // the first shape is the ceiling
    if (a.markdown)
      std::printf("| %s: %lld x %lld x %lld | %.0f |\n", sh.name, (long long)sh.m, (long long)sh.n, (long long)sh.k,
                  tflops);
    else
      std::printf("%-34s %6lld x %6lld x %6lld  %7.1f TFLOP/s\n", sh.name, (long long)sh.m, (long long)sh.n,
                  (long long)sh.k, tflops);
  }
  const double floor = a.format != "bf16" ? 0.0 : a.min_ceiling >= 0 ? a.min_ceiling : expected_ceiling_floor(gpus[0]);
  const int rc = check_ceiling(gpus[0], ceiling, floor);
  if (rc != 0 || !a.in_loop) return rc;
  return print_in_loop_table(shapes, 5, a);  // every shape but the LM head (BF16 in every recipe)
}
}  // namespace

void add_bench_gemm_command(CLI::App& bench) {
  auto* g = bench.add_subcommand("gemm", "Time BF16 cuBLASLt GEMMs (the ceiling and Llama-8B shapes) and a D2D copy");
  auto a = std::make_shared<BenchGemmArgs>();
  g->add_option("--iters", a->iters, "timed runs per GEMM (the median is reported)")->check(CLI::PositiveNumber);
  g->add_option("--min-ceiling-tflops", a->min_ceiling,
                "exit 3 if the 8192^3 GEMM is slower (default: 600 on Hopper, no check elsewhere; 0 = none)");
  g->add_flag("--markdown", a->markdown, "print a Markdown table for BENCHMARKS.md");
  g->add_option("--format", a->format,
                "operand format of the timed GEMMs: bf16, or fp8 (E4M3, per-tensor scale), mxfp8, nvfp4 (emulated "
                "on Hopper) as the recipes run their Fprop")
      ->check(CLI::IsMember({"bf16", "fp8", "mxfp8", "nvfp4"}));
  g->add_flag("--weight-cache", a->weight_cache,
              "with --format mxfp8/nvfp4: the weight operand given dequantized (--emulated-weight-cache)");
  g->add_flag("--in-loop", a->in_loop,
              "also time the Hopper GEMM that dequantizes MXFP8/NVFP4 A in its main loop against the emulation");
  g->callback([a] { exit_code() = run_bench_gemm(*a); });
}

}  // namespace nb::cli
