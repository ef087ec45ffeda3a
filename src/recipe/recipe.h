// Precision recipes as data: which number format each operand role (input X, weight W, gradient dY)
// of a linear layer's three GEMMs gets, with the NVFP4 techniques (RHT, stochastic rounding, 2D weight
// tiles), FP8 scaling mode, and which transformer layers stay BF16. Names follow Megatron-Bridge's
// mixed-precision recipes; the numerics are the precision spec's (§6 decides which copy each GEMM uses):
//   Fprop  Y  = X W^T    input (row-wise)            x weight (row-wise)
//   Dgrad  dX = dY W     grad (row-wise)             x weight (column-wise copy)
//   Wgrad  dW = dY^T X   grad (column-wise, +RHT/SR) x input (column-wise, +RHT)
// RHT and SR flags describe the NVFP4 operand of that role: RHT applies to its column-wise (Wgrad)
// copy only, SR to every copy of that role (only the gradient uses it in the presets).
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include "core/status.h"
#include "formats/mor/mor.h"
#include "formats/nvfp4/nvfp4.h"

namespace nb::recipe {

// mor_block: MoR's block rule in training (MorSpec::blocks): the role's BF16 values with every 128x128 block that the
// rule lets quantize replaced by its FP8 values (formats/mor/mor_block.h); its GEMMs are BF16 GEMMs.
enum class Fmt { bf16, fp8_e4m3, fp8_e5m2, fp8_block128, fp8_block128x128, mxfp8, nvfp4, mor_block };
const char* fmt_name(Fmt f);

struct RoleSpec {
  Fmt fmt = Fmt::bf16;
  bool rht = false, sr = false, two_d = false;
  bool four_over_six = false;  // NVFP4 4/6 adaptive block scaling of every copy (nvfp4::Options)
  nvfp4::ErrMode four_over_six_err = nvfp4::ErrMode::mae;  // its error metric (TE's default, MAE)
  // Fmt::mor_block on the NVFP4 ladder: the NVFP4 blocks of a copy per direction, 1x16 along each GEMM's K as
  // bf16_with_nvfp4_mixed's (the Fprop or Dgrad copy's along the row, the Wgrad copy's down the column), each copy's
  // blocks decided on their own; else 16x16 tiles in one copy that every GEMM reads.
  bool nvfp4_rows = false;
};

enum class Fp8Scaling { none, current, delayed };

// The NVFP4 ladder's default NVFP4 threshold (docs/MOR.md says how it was chosen).
inline constexpr double kDefaultNvfp4Threshold = 0.3;

// Mixture of Representations (docs/MOR.md, formats/mor/): every transformer Linear's input, weight and gradient
// operand is decided on its own: its GEMMs read its per-tensor E4M3 copy while the copy's mean relative error
// (over the non-zero elements) is below `threshold`, else its BF16 values. Every `interval` steps the last step's
// quantizations are measured (on the GPU, read back with the loss) and decide the next `interval` steps; the steps
// between measure nothing. Until the first decision every operand is FP8. A GEMM whose operands are both FP8 runs on
// FP8 tensor cores; one with a BF16 operand runs in BF16 with the other operand's FP8 values (gemm_quantized.h,
// "mixed").
struct MorSpec {
  bool on = false;
  double threshold = 0.045;  // the paper's E4M3 default
  int64_t interval = 1;
  // The NVFP4 ladder (bf16_with_mor_nvfp4_mixed): the roles are NVFP4 (the top rung, the NVFP4 recipe's settings) and
  // each operand takes NVFP4 while its NVFP4 copy's mean relative error is below nvfp4_threshold, else E4M3 while the
  // E4M3 copy's is below `threshold`, else BF16.
  bool ladder = false;
  double nvfp4_threshold = kDefaultNvfp4Threshold;
  // The block rule (--mor-granularity block; formats/mor/mor_block.h): every role is Fmt::mor_block, each 128x128
  // block decided inside its quantization from its own numbers (no lag, every step), E4M3 while its error is below
  // `threshold` (three_way: E4M3 if it beats E5M2, else E5M2 if the block's range fits, else BF16), scaled by
  // `scaling`. Nothing is decided on the host; the cells count the blocks. With `ladder` too, NVFP4 (16x16 tiles, SR
  // where the role's spec has sr) is the rung above, kept while the block's NVFP4 error is below nvfp4_threshold.
  bool blocks = false;
  bool three_way = false;
  mor::ScaleMode scaling = mor::ScaleMode::gam;
  // The E4M3 tensor rule only (--mor-channel-statistic): each measured quantization also adds the statistic that
  // per-row (per-channel) scaling of the role's row-wise operand would give (mor::add_fp8_rowwise_stat_*), for the
  // study; decisions still read the per-tensor statistic.
  bool channel_stat = false;
  // Statistic cells per MoR Linear: E4M3's input, weight and grad, then (the ladder) NVFP4's, (blocks) each role's
  // blocks per choice (mor::BlockCounts), or (channel_stat) the per-row scaled E4M3 statistic; the ladder per block
  // (ladder and blocks) has the block rule's six, then NVFP4's three.
  int cells_per_linear() const { return ladder && blocks ? 9 : ladder || blocks || channel_stat ? 6 : 3; }
  // Each quantization decides its own operands from its own statistic (no lag), to show what the lag of the
  // training schedule changes; on a GPU the host waits for every measured quantization (a study's setting).
  bool decide_now = false;
};

// The rung of one MoR operand: which copy its GEMMs read.
enum class MorRung : uint8_t { bf16 = 0, fp8 = 1, nvfp4 = 2 };
const char* mor_rung_name(MorRung r);  // "bf16", "e4m3", "nvfp4"

struct Recipe {
  std::string name = "bf16_mixed";
  RoleSpec input, weight, grad;  // Fprop: input x weight; Dgrad: grad x weight; Wgrad: grad x input
  Fp8Scaling fp8_scaling = Fp8Scaling::none;
  int64_t amax_history_len = 1024;  // delayed scaling
  bool fp8_pow2_scales = false;     // sub-channel
  int64_t bf16_layers_at_start = 0, bf16_layers_at_end = 0;
  uint64_t seed = 0;  // stochastic-rounding key seed (RngKey.seed); addition to the agreed API
  // Execution, not numerics: the emulated GEMMs (mxfp8, nvfp4 on Hopper) read each quantized weight
  // dequantized to BF16 once per step instead of dequantizing it in every micro-batch (linear.h). Costs
  // 2 bytes per weight element per kept copy (nvfp4 2D: one; mxfp8, 1D nvfp4: two).
  bool keep_dequantized_weights = false;
  MorSpec mor;

  // True when transformer layer `layer` (0-based) of `num_layers` keeps its linears in BF16.
  bool layer_in_bf16(int64_t layer, int64_t num_layers) const;
  bool quantized() const;  // any role not bf16
};

// Megatron-Bridge names: bf16_mixed, bf16_with_fp8_current_scaling_mixed (E4M3 input/weight, E5M2 grad:
// HYBRID; first and last layer BF16 as [MB] sets), bf16_with_fp8_delayed_scaling_mixed (HYBRID, history
// 1024), bf16_with_fp8_subchannel_scaling_mixed (1x128 input/grad, 128x128 weight),
// bf16_with_mxfp8_mixed, bf16_with_nvfp4_mixed (input nvfp4; weight nvfp4 2D; grad nvfp4 + SR; RHT on
// the Wgrad operands; last 4 layers BF16 as the Llama 3.1 8B playbook does), bf16_with_mor_fp8_mixed (MoR's
// tensor-level rule: every role E4M3 per tensor, current scaling, or BF16 by MorSpec; no layer BF16 by position,
// the data decides), bf16_with_mor_nvfp4_mixed (the ladder: bf16_with_nvfp4_mixed's roles, each operand NVFP4, else
// E4M3 per tensor, else BF16 by MorSpec; no layer BF16 by position).
// Rows of one block of a weight format along the weight's rows (2D tiles, column-copy blocks): a row chunk of
// a whole number of them quantizes alone exactly as inside the whole weight (Megatron-FSDP's row shards).
int64_t weight_block_rows(Fmt f);

Status recipe_preset(const std::string& name, Recipe* out);
std::vector<std::string> recipe_names();

// Command-line / config knobs. Counts: -1 = keep the preset's; a count >= 0 replaces it.
// first_last_layers_bf16 sets a count the preset left at 0 to 1 ([MB]'s default counts), before the
// given counts apply.
struct RecipeKnobs {
  bool disable_fp4 = false, fp4_disable_rht = false, fp4_disable_sr = false, fp4_disable_2d = false,
       first_last_layers_bf16 = false;
  int64_t layers_at_start_bf16 = -1, layers_at_end_bf16 = -1;
  // NVFP4 4/6 adaptive block scaling: none | weights (the weight role) | activations (the input role) |
  // all (both). Gradients never get it (as TransformerEngine).
  std::string fp4_4over6 = "none";
  // Its block error metric: mae (TransformerEngine's default) | mse.
  std::string fp4_4over6_err_mode = "mae";
  // Mixture of Representations (MorSpec): < 0 keeps the preset's. mor_granularity: tensor (block is not built).
  double mor_threshold = -1;
  double mor_nvfp4_threshold = -1;  // the ladder's NVFP4 rung
  int64_t mor_interval = -1;
  bool mor_decide_now = false;
  std::string mor_granularity = "tensor";
  bool mor_three_way = false;     // the block rule: E5M2 as a rung between E4M3 and BF16
  std::string mor_scaling;        // the block rule's scales: gam (default), amax or pow2; empty keeps the default
  bool mor_channel_stat = false;  // the E4M3 tensor rule: also measure per-row scaling (MorSpec::channel_stat)
  bool mor_nvfp4_rows = false;    // the ladder per block: X's and dY's NVFP4 blocks 1x16 along K (RoleSpec::nvfp4_rows)
};
// --disable-fp4 turns an NVFP4 job into bf16_mixed (the other knobs then have nothing to act on);
// the fp4_* knobs on a recipe without NVFP4 are an error (they would silently do nothing), and so are
// fp4_4over6 naming a role that is not NVFP4 and fp4_4over6_err_mode mse without fp4_4over6; the mor_* knobs
// on a recipe without MoR, a threshold outside (0, 1) and an interval below 1 too.
Status apply_knobs(const RecipeKnobs& knobs, Recipe* r);

// One line per layer kind: "Fprop nvfp4 x nvfp4 (emulated) | Dgrad nvfp4+sr x nvfp4 (emulated) | Wgrad
// nvfp4+rht+sr x nvfp4+rht (emulated)". cc_major <= 0 describes the CPU reference.
std::string describe_gemms(const Recipe& r, bool bf16_layer, int cc_major, int cc_minor);
// OK when a GPU of compute capability cc_major.cc_minor runs every GEMM of the recipe; otherwise one
// sentence naming the recipe, the GPU and what to do. cc_major <= 0 (CPU reference) runs everything.
Status check_supported(const Recipe& r, int cc_major, int cc_minor);

}  // namespace nb::recipe
