// `nibble info`: build configuration, libraries and GPUs, with the native/emulated status of each format.
#include <cstdio>
#include "cli/commands.h"
#include "core/device_info.h"

namespace nb::cli {

static int run_info() {
  BuildInfo b = build_info();
  std::printf("nibble %s\n", NIBBLE_VERSION);
  std::printf("  backends      : cpu%s\n", b.cuda ? ", cuda" : " (built without CUDA)");
  if (b.cuda)
    std::printf("  libraries     : CUDA runtime %s, cuBLASLt %s, cuDNN %s\n", b.cuda_runtime.c_str(),
                b.cublaslt.c_str(), b.cudnn.c_str());
  std::string why;
  auto gpus = query_gpus(&why);
  if (gpus.empty()) {
    std::printf("  GPUs          : none (%s); the CPU backend will be used\n", why.c_str());
    return 0;
  }
  for (const auto& g : gpus) {
    std::printf("  GPU %d         : %s, compute capability %d.%d, %d SMs, %.1f GiB, L2 %d MiB\n", g.index,
                g.name.c_str(), g.cc_major, g.cc_minor, g.sm_count, g.memory_gib, g.l2_bytes >> 20);
    bool blackwell = g.cc_major >= 10;
    std::printf("    NVFP4 GEMM  : %s\n",
                blackwell ? "native (FP4 tensor cores)" : "emulated (exact codes, BF16 tensor cores)");
    std::printf("    MXFP8 GEMM  : %s\n", blackwell ? "native" : "emulated (exact codes, BF16 tensor cores)");
    std::printf("    FP8 GEMM    : %s\n",
                g.cc_major >= 9 || (g.cc_major == 8 && g.cc_minor == 9) ? "native" : "unsupported on this GPU");
  }
  return 0;
}

void add_info_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "Show the build, libraries and GPUs, and which formats run natively");
  cmd->callback([] { exit_code() = run_info(); });
}

}  // namespace nb::cli
