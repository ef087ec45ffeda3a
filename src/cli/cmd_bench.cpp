// `nibble bench`: kernel benchmarks against the measured copy bandwidth.
//   bench quant: every CUDA quantizer on a random BF16 input (default 8192x8192), achieved GB/s
//   (source read once + outputs written once, divided by the median time) beside a device-to-device
//   copy of the same input buffer timed in the same run, and the ratio to that copy.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>
#include "cli/commands.h"
#include "core/device_info.h"
#include "core/tensor.h"
#include "formats/fp8/fp8_bench.h"
#include "formats/nvfp4/nvfp4_bench.h"

namespace nb::cli {
namespace {

struct BenchQuantArgs {
  int64_t rows = 8192, cols = 8192;
  int iters = 20;
  bool markdown = false;
};

struct Row {
  std::string name;
  double ms, bytes;
};

int run_bench_quant(const BenchQuantArgs& a) {
  std::string why;
  if (!cuda_device_available(&why)) {
    std::fprintf(stderr, "bench quant needs a GPU: %s\n", why.c_str());
    return 1;
  }
  fp8::FormatsBenchResult fr;
  Status s = fp8::bench_formats_cuda(a.rows, a.cols, a.iters, &fr);
  if (!s) {
    std::fprintf(stderr, "error: %s\n", s.message().c_str());
    return 1;
  }

  std::vector<Row> rows;
  struct NvCase {
    const char* name;
    nvfp4::Options opt;
  };
  nvfp4::Options rht_sr;
  rht_sr.rht = true;
  rht_sr.sr = true;
  nvfp4::Options two_d;
  two_d.two_d = true;
  for (const NvCase& c : {NvCase{"NVFP4 row + column, RHT + SR", rht_sr}, NvCase{"NVFP4 2D 16x16 weights", two_d}}) {
    nvfp4::BenchResult nr;
    s = nvfp4::bench_nvfp4_cuda(a.rows, a.cols, c.opt, a.iters, &nr);
    if (!s) {
      std::fprintf(stderr, "error: %s\n", s.message().c_str());
      return 1;
    }
    rows.push_back({std::string(c.name) + " (quantize, amax given)", nr.ms_quantize, nr.bytes_min});
    rows.push_back({std::string(c.name) + " (amax pass + quantize)", nr.ms_total, nr.bytes_min});
  }
  for (const auto& q : fr.quantizers) rows.push_back({q.name, q.ms, q.bytes});

  std::vector<GpuInfo> gpus = query_gpus(&why);
  const std::string gpu = gpus.empty() ? "GPU" : gpus[0].name;
  const double copy_gbs = fr.copy_bytes / (fr.ms_copy * 1e6);
  if (a.markdown) {
    std::printf(
        "Quantizers on %s, %lldx%lld BF16 input, median of %d runs; copy = cudaMemcpy D2D of the input "
        "(%.1f GB/s).\n\n",
        gpu.c_str(), (long long)a.rows, (long long)a.cols, a.iters, copy_gbs);
    std::printf("| Quantizer | ms | GB/s | vs. copy |\n|---|---:|---:|---:|\n");
    std::printf("| D2D copy (yardstick) | %.3f | %.1f | 1.00 |\n", fr.ms_copy, copy_gbs);
    for (const Row& r : rows) {
      double gbs = r.bytes / (r.ms * 1e6);
      std::printf("| %s | %.3f | %.1f | %.2f |\n", r.name.c_str(), r.ms, gbs, gbs / copy_gbs);
    }
    return 0;
  }
  std::printf("bench quant on %s: %lldx%lld BF16, median of %d runs\n", gpu.c_str(), (long long)a.rows,
              (long long)a.cols, a.iters);
  std::printf("GB/s = (source read once + outputs written once) / time; copy = cudaMemcpy D2D of the input\n");
  std::printf("%-56s %9s %9s %9s\n", "quantizer", "ms", "GB/s", "vs copy");
  std::printf("%-56s %9.3f %9.1f %9.2f\n", "D2D copy of the input (read + write)", fr.ms_copy, copy_gbs, 1.0);
  for (const Row& r : rows) {
    double gbs = r.bytes / (r.ms * 1e6);
    std::printf("%-56s %9.3f %9.1f %9.2f\n", r.name.c_str(), r.ms, gbs, gbs / copy_gbs);
  }
  return 0;
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "Benchmark kernels against the measured copy bandwidth and GEMM ceiling");
  cmd->require_subcommand(1);
  auto* q = cmd->add_subcommand("quant", "Time every CUDA quantizer against a device-to-device copy");
  auto a = std::make_shared<BenchQuantArgs>();
  q->add_option("--rows", a->rows, "rows of the random BF16 input")->check(CLI::PositiveNumber);
  q->add_option("--cols", a->cols, "cols of the random BF16 input")->check(CLI::PositiveNumber);
  q->add_option("--iters", a->iters, "timed runs per quantizer (the median is reported)")->check(CLI::PositiveNumber);
  q->add_flag("--markdown", a->markdown, "print a Markdown table for BENCHMARKS.md");
  q->callback([a] { exit_code() = run_bench_quant(*a); });
  add_bench_gemm_command(*cmd);
}

}  // namespace nb::cli
