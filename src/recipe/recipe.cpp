// Recipe presets (Megatron-Bridge names), knobs, GEMM descriptions and GPU support checks. Pure data:
// no numerics here; linear.cpp applies a Recipe to one linear layer.
#include "recipe/recipe.h"
#include <cstdio>

namespace nb::recipe {

const char* fmt_name(Fmt f) {
  switch (f) {
    case Fmt::bf16: return "bf16";
    case Fmt::fp8_e4m3: return "fp8_e4m3";
    case Fmt::fp8_e5m2: return "fp8_e5m2";
    case Fmt::fp8_block128: return "fp8_block128";
    case Fmt::fp8_block128x128: return "fp8_block128x128";
    case Fmt::mxfp8: return "mxfp8";
    case Fmt::nvfp4: return "nvfp4";
    case Fmt::mor_block: return "mor_block";
  }
  return "?";
}

bool Recipe::layer_in_bf16(int64_t layer, int64_t num_layers) const {
  if (!quantized()) return true;
  return layer < bf16_layers_at_start || layer >= num_layers - bf16_layers_at_end;
}

int64_t weight_block_rows(Fmt f) {
  switch (f) {
    case Fmt::nvfp4: return 16;
    case Fmt::mxfp8: return 32;
    case Fmt::fp8_block128:
    case Fmt::fp8_block128x128:
    case Fmt::mor_block: return 128;
    default: return 1;
  }
}

const char* mor_rung_name(MorRung r) {
  switch (r) {
    case MorRung::bf16: return "bf16";
    case MorRung::fp8: return "e4m3";
    case MorRung::nvfp4: return "nvfp4";
  }
  return "?";
}

bool Recipe::quantized() const { return input.fmt != Fmt::bf16 || weight.fmt != Fmt::bf16 || grad.fmt != Fmt::bf16; }

std::vector<std::string> recipe_names() {
  return {"bf16_mixed",
          "bf16_with_fp8_current_scaling_mixed",
          "bf16_with_fp8_delayed_scaling_mixed",
          "bf16_with_fp8_subchannel_scaling_mixed",
          "bf16_with_mxfp8_mixed",
          "bf16_with_nvfp4_mixed",
          "bf16_with_mor_fp8_mixed",
          "bf16_with_mor_nvfp4_mixed"};
}

Status recipe_preset(const std::string& name, Recipe* out) {
  Recipe r;
  r.name = name;
  if (name == "bf16_mixed") {
    // all roles bf16 (the defaults)
  } else if (name == "bf16_with_fp8_current_scaling_mixed") {
    // [MB]: fp8 "hybrid", fp8_recipe "tensorwise", first_last_layers_bf16 with one layer at each end.
    r.input.fmt = r.weight.fmt = Fmt::fp8_e4m3;
    r.grad.fmt = Fmt::fp8_e5m2;
    r.fp8_scaling = Fp8Scaling::current;
    r.bf16_layers_at_start = r.bf16_layers_at_end = 1;
  } else if (name == "bf16_with_fp8_delayed_scaling_mixed") {
    // [MB]: fp8 "hybrid", fp8_recipe "delayed", amax history 1024, amax_compute_algo "max", margin 0.
    r.input.fmt = r.weight.fmt = Fmt::fp8_e4m3;
    r.grad.fmt = Fmt::fp8_e5m2;
    r.fp8_scaling = Fp8Scaling::delayed;
    r.amax_history_len = 1024;
  } else if (name == "bf16_with_fp8_subchannel_scaling_mixed") {
    // [MB]: fp8 "e4m3", fp8_recipe "blockwise": 1x128 activations and gradients, 128x128 weights.
    r.input.fmt = r.grad.fmt = Fmt::fp8_block128;
    r.weight.fmt = Fmt::fp8_block128x128;
  } else if (name == "bf16_with_mxfp8_mixed") {
    r.input.fmt = r.weight.fmt = r.grad.fmt = Fmt::mxfp8;
  } else if (name == "bf16_with_nvfp4_mixed") {
    r.input = {Fmt::nvfp4, /*rht=*/true, /*sr=*/false, /*two_d=*/false};
    r.weight = {Fmt::nvfp4, false, false, /*two_d=*/true};
    r.grad = {Fmt::nvfp4, /*rht=*/true, /*sr=*/true, false};
    r.bf16_layers_at_end = 4;  // Llama 3.1 8B NVFP4 playbook (spec §5)
  } else if (name == "bf16_with_mor_fp8_mixed") {
    // MoR's tensor-level rule (docs/MOR.md): E4M3 for every role (the rule measures E4M3's error), per-tensor
    // current scaling, BF16 where the data says so.
    r.input.fmt = r.weight.fmt = r.grad.fmt = Fmt::fp8_e4m3;
    r.fp8_scaling = Fp8Scaling::current;
    r.mor.on = true;
  } else if (name == "bf16_with_mor_nvfp4_mixed") {
    // The ladder: the NVFP4 recipe's roles (RHT on the Wgrad pair while both its operands are NVFP4, 2D weight tiles,
    // SR on gradients), per-tensor current-scaled E4M3 below it, BF16 at the bottom; no layer BF16 by position.
    r.input = {Fmt::nvfp4, /*rht=*/true, /*sr=*/false, /*two_d=*/false};
    r.weight = {Fmt::nvfp4, false, false, /*two_d=*/true};
    r.grad = {Fmt::nvfp4, /*rht=*/true, /*sr=*/true, false};
    r.fp8_scaling = Fp8Scaling::current;
    r.mor.on = true;
    r.mor.ladder = true;
  } else {
    std::string known;
    for (const std::string& n : recipe_names()) known += (known.empty() ? "" : ", ") + n;
    return errorf("unknown precision recipe '%s'; choose one of: %s", name.c_str(), known.c_str());
  }
  *out = r;
  return Status::ok();
}

static bool uses_nvfp4(const Recipe& r) {
  return r.input.fmt == Fmt::nvfp4 || r.weight.fmt == Fmt::nvfp4 || r.grad.fmt == Fmt::nvfp4 || r.mor.ladder;
}

// fp4_4over6 and fp4_4over6_err_mode (known values): which roles get 4/6 scaling, with which error
// metric; each named role must be NVFP4, and mse alone (4/6 off) would do nothing.
static Status apply_4over6(const std::string& v, const std::string& err, Recipe* r) {
  if (v == "none" && err != "mae")
    return errorf(
        "recipe '%s': fp4-4over6-err-mode %s picks 4/6's error metric, but fp4-4over6 is none; add "
        "--fp4-4over6 weights|activations|all or drop the err mode",
        r->name.c_str(), err.c_str());
  const bool weights = v == "weights" || v == "all", activations = v == "activations" || v == "all";
  if ((weights && r->weight.fmt != Fmt::nvfp4) || (activations && r->input.fmt != Fmt::nvfp4))
    return errorf(
        "recipe '%s' does not quantize the %s to NVFP4, so fp4-4over6 %s would do nothing; use "
        "bf16_with_nvfp4_mixed or fp4-4over6 none",
        r->name.c_str(), weights && r->weight.fmt != Fmt::nvfp4 ? "weights" : "activations", v.c_str());
  const nvfp4::ErrMode mode = err == "mse" ? nvfp4::ErrMode::mse : nvfp4::ErrMode::mae;
  if (weights) {
    r->weight.four_over_six = true;
    r->weight.four_over_six_err = mode;
  }
  if (activations) {
    r->input.four_over_six = true;
    r->input.four_over_six_err = mode;
  }
  return Status::ok();
}

// mor-granularity block and its knobs (three-way, scaling): the E4M3 recipe only; decided inside each quantization.
static Status apply_mor_block_knobs(const RecipeKnobs& k, Recipe* r) {
  const char* name = r->name.c_str();
  if (k.mor_granularity != "tensor" && k.mor_granularity != "block")
    return errorf("recipe '%s': unknown mor-granularity '%s'; use tensor or block", name, k.mor_granularity.c_str());
  if (k.mor_granularity == "tensor") {
    if (k.mor_nvfp4_rows)
      return errorf(
          "recipe '%s': mor-nvfp4-rows shapes the NVFP4 ladder per block's blocks (the tensor ladder already uses "
          "1x16 blocks); add mor-granularity block or drop it",
          name);
    if (k.mor_three_way || !k.mor_scaling.empty())
      return errorf(
          "recipe '%s': mor-three-way and mor-scaling belong to the block rule (one tensor has one scale, where GAM "
          "is amax scaling); add mor-granularity block or drop them",
          name);
    return Status::ok();
  }
  if (k.mor_decide_now || k.mor_interval > 1)
    return errorf(
        "recipe '%s': the block rule decides every block inside its quantization, from the data it quantizes (no lag, "
        "every step), so mor-decide-now and mor-interval do not apply; drop them",
        name);
  const std::string& sc = k.mor_scaling;
  if (!sc.empty() && sc != "gam" && sc != "amax" && sc != "pow2")
    return errorf("recipe '%s': unknown mor-scaling '%s'; use gam, amax or pow2", name, sc.c_str());
  r->mor.blocks = true;
  r->mor.three_way = k.mor_three_way;
  if (!sc.empty())
    r->mor.scaling = sc == "gam" ? mor::ScaleMode::gam : sc == "amax" ? mor::ScaleMode::amax : mor::ScaleMode::pow2;
  // The ladder per block: NVFP4 blocks of 16x16 tiles in every role (one copy reads the same in all three GEMMs, so
  // no RHT), the gradient's stochastically rounded as the NVFP4 recipe's are.
  const bool grad_sr = r->mor.ladder && r->grad.sr;
  r->input = r->weight = RoleSpec{Fmt::mor_block};
  r->grad = RoleSpec{Fmt::mor_block, /*rht=*/false, grad_sr, /*two_d=*/false};
  if (k.mor_nvfp4_rows) {
    if (!r->mor.ladder)
      return errorf(
          "recipe '%s': mor-nvfp4-rows shapes the NVFP4 ladder's blocks, and this recipe has no NVFP4 rung; use "
          "bf16_with_mor_nvfp4_mixed or drop it",
          name);
    r->input.nvfp4_rows = r->grad.nvfp4_rows = true;
  }
  r->fp8_scaling = Fp8Scaling::none;
  return Status::ok();
}

// mor-channel-statistic: the per-row scaled E4M3 statistic beside the tensor rule's own, reported in the decision
// records (so not with mor-decide-now, which writes none); the ladder and the block rule use those cells for theirs.
static Status apply_mor_channel_knob(const RecipeKnobs& k, Recipe* r) {
  if (!k.mor_channel_stat) return Status::ok();
  if (r->mor.ladder || r->mor.blocks)
    return errorf(
        "recipe '%s': mor-channel-statistic measures the E4M3 tensor rule's operands with per-row scaling, which is "
        "built for bf16_with_mor_fp8_mixed with mor-granularity tensor only (the %s keeps its own statistics in those "
        "cells); drop it",
        r->name.c_str(), r->mor.ladder ? "NVFP4 ladder" : "block rule");
  if (k.mor_decide_now)
    return errorf(
        "recipe '%s': mor-channel-statistic is reported in the decision records, which mor-decide-now does not "
        "write; drop one of them",
        r->name.c_str());
  r->mor.channel_stat = true;
  return Status::ok();
}

// The mor_* knobs: only on a MoR recipe, with a threshold in (0, 1) and an interval of at least one step.
static Status apply_mor_knobs(const RecipeKnobs& k, Recipe* r) {
  const bool given = k.mor_threshold >= 0 || k.mor_nvfp4_threshold >= 0 || k.mor_interval >= 0 ||
                     k.mor_granularity != "tensor" || k.mor_decide_now || k.mor_three_way || !k.mor_scaling.empty() ||
                     k.mor_channel_stat || k.mor_nvfp4_rows;
  if (!given) return Status::ok();
  if (!r->mor.on)
    return errorf(
        "recipe '%s' has no Mixture of Representations, so the mor-* settings would do nothing; drop them "
        "or choose bf16_with_mor_fp8_mixed or bf16_with_mor_nvfp4_mixed",
        r->name.c_str());
  if (k.mor_nvfp4_threshold >= 0) {
    if (!r->mor.ladder)
      return errorf(
          "recipe '%s' has no NVFP4 rung, so mor-nvfp4-threshold would do nothing; use bf16_with_mor_nvfp4_mixed or "
          "drop it",
          r->name.c_str());
    if (!(k.mor_nvfp4_threshold > 0 && k.mor_nvfp4_threshold < 1))
      return errorf("recipe '%s': mor-nvfp4-threshold %g is outside (0, 1); it is a mean relative error (0.3 = 30%%)",
                    r->name.c_str(), k.mor_nvfp4_threshold);
    r->mor.nvfp4_threshold = k.mor_nvfp4_threshold;
  }
  if (k.mor_decide_now && r->mor.ladder)
    return errorf(
        "recipe '%s': mor-decide-now is built for bf16_with_mor_fp8_mixed only (the ladder picks the RHT of its Wgrad "
        "pair before the step from both operands' rungs); drop it",
        r->name.c_str());
  NB_TRY(apply_mor_block_knobs(k, r));
  if (k.mor_threshold >= 0) {
    if (!(k.mor_threshold > 0 && k.mor_threshold < 1))
      return errorf("recipe '%s': mor-threshold %g is outside (0, 1); it is a mean relative error (0.045 = 4.5%%)",
                    r->name.c_str(), k.mor_threshold);
    r->mor.threshold = k.mor_threshold;
  }
  if (k.mor_interval >= 0) {
    if (k.mor_interval < 1)
      return errorf("recipe '%s': mor-interval %lld must be at least 1 (decide every N steps)", r->name.c_str(),
                    (long long)k.mor_interval);
    r->mor.interval = k.mor_interval;
  }
  r->mor.decide_now = k.mor_decide_now;
  return apply_mor_channel_knob(k, r);
}

Status apply_knobs(const RecipeKnobs& k, Recipe* r) {
  NB_TRY(apply_mor_knobs(k, r));
  const std::string& v46 = k.fp4_4over6;
  if (v46 != "none" && v46 != "weights" && v46 != "activations" && v46 != "all")
    return errorf("recipe '%s': unknown fp4-4over6 value '%s'; use none, weights, activations or all", r->name.c_str(),
                  v46.c_str());
  if (k.fp4_4over6_err_mode != "mae" && k.fp4_4over6_err_mode != "mse")
    return errorf("recipe '%s': unknown fp4-4over6-err-mode '%s'; use mae or mse", r->name.c_str(),
                  k.fp4_4over6_err_mode.c_str());
  if (k.layers_at_start_bf16 < -1 || k.layers_at_end_bf16 < -1)
    return errorf("recipe '%s': BF16 layer counts must be >= 0 (got start %lld, end %lld)", r->name.c_str(),
                  (long long)k.layers_at_start_bf16, (long long)k.layers_at_end_bf16);
  if (k.disable_fp4 && uses_nvfp4(*r)) {
    // The playbook's switch: the same job, all in BF16.
    uint64_t seed = r->seed;
    *r = Recipe{};
    r->seed = seed;
    return Status::ok();
  }
  bool fp4_knob = k.fp4_disable_rht || k.fp4_disable_sr || k.fp4_disable_2d;
  if (fp4_knob && !uses_nvfp4(*r))
    return errorf(
        "recipe '%s' has no NVFP4 operands, so the fp4 RHT/SR/2D switches would do nothing; drop them "
        "or choose bf16_with_nvfp4_mixed",
        r->name.c_str());
  if (r->mor.ladder && r->mor.blocks && (k.fp4_disable_rht || k.fp4_disable_2d))
    return errorf(
        "recipe '%s': the NVFP4 ladder per block has no RHT and always uses 16x16 tiles (one copy per role serves all "
        "three GEMMs), so fp4-disable-rht and fp4-disable-2d do not apply; drop them",
        r->name.c_str());
  if (r->mor.ladder && r->mor.blocks && k.fp4_disable_sr) r->grad.sr = false;
  for (RoleSpec* role : {&r->input, &r->weight, &r->grad}) {
    if (role->fmt != Fmt::nvfp4) continue;
    if (k.fp4_disable_rht) role->rht = false;
    if (k.fp4_disable_sr) role->sr = false;
    if (k.fp4_disable_2d) role->two_d = false;
  }
  NB_TRY(apply_4over6(k.fp4_4over6, k.fp4_4over6_err_mode, r));
  if (r->mor.ladder && k.fp4_4over6 != "none")
    return errorf(
        "recipe '%s': 4/6 block scaling is not measured by the NVFP4 ladder's statistic (it decodes with the E4M3 "
        "bound 448); drop fp4-4over6",
        r->name.c_str());
  // A given count always wins; first_last_layers_bf16 alone keeps one layer at each end that the
  // preset left quantized ([MB]'s defaults for num_layers_at_start/end_in_bf16 are 1).
  if (k.first_last_layers_bf16) {
    if (r->bf16_layers_at_start == 0) r->bf16_layers_at_start = 1;
    if (r->bf16_layers_at_end == 0) r->bf16_layers_at_end = 1;
  }
  if (k.layers_at_start_bf16 >= 0) r->bf16_layers_at_start = k.layers_at_start_bf16;
  if (k.layers_at_end_bf16 >= 0) r->bf16_layers_at_end = k.layers_at_end_bf16;
  return Status::ok();
}

static std::string role_str(const RoleSpec& s, bool wgrad_copy) {
  std::string out = fmt_name(s.fmt);
  if (s.fmt != Fmt::nvfp4) return out;
  if (s.two_d) out += "+2d";
  if (s.rht && wgrad_copy) out += "+rht";
  if (s.sr) out += "+sr";
  if (s.four_over_six) out += s.four_over_six_err == nvfp4::ErrMode::mse ? "+4/6(mse)" : "+4/6";
  return out;
}

static std::string gemm_engine(Fmt a, int cc_major) {
  if (cc_major <= 0) return " (cpu reference)";
  switch (a) {
    case Fmt::bf16:
    case Fmt::mor_block: return " (cublaslt bf16)";
    case Fmt::fp8_e4m3:
    case Fmt::fp8_e5m2:
    case Fmt::fp8_block128:
    case Fmt::fp8_block128x128: return " (cublaslt fp8)";
    case Fmt::mxfp8:
    case Fmt::nvfp4: return " (emulated)";
  }
  return "";
}

// MoR: each operand FP8 or BF16 (the ladder: NVFP4, FP8 or BF16) by its own data; a GEMM with both operands FP8 runs
// on FP8 tensor cores, any other pair as the emulated BF16 GEMM.
static std::string describe_mor_gemms(const Recipe& r, int cc_major) {
  char t[32], t4[32];
  std::snprintf(t, sizeof t, "%.4g", r.mor.threshold * 100.0);
  std::snprintf(t4, sizeof t4, "%.4g", r.mor.nvfp4_threshold * 100.0);
  if (r.mor.blocks) {
    const std::string e = cc_major <= 0 ? " (cpu reference)" : " (cublaslt bf16)";
    const std::string top = r.mor.ladder ? "nvfp4|" : "";
    const std::string op = "blocks[" + top + (r.mor.three_way ? "e4m3|e5m2|bf16]" : "e4m3|bf16]");
    std::string rule = r.mor.three_way ? "E4M3 where its error beats E5M2's, else E5M2 where the range fits, else BF16"
                                       : std::string("E4M3 while its mean relative error < ") + t + "%, else BF16";
    if (r.mor.ladder)
      rule = std::string(r.input.nvfp4_rows ? "NVFP4 (1x16 blocks on X and dY, a copy per direction; 16x16 weight tiles"
                                            : "NVFP4 (16x16 tiles") +
             (r.grad.sr ? ", SR on gradients" : "") + ") while its mean relative error < " + t4 + "%, else " + rule;
    return "Fprop " + op + " x " + op + e + " | Dgrad " + op + " x " + op + e + " | Wgrad " + op + " x " + op + e +
           " fp32 accumulate; each 128x128 block " + rule + ", " + mor::scale_mode_name(r.mor.scaling) +
           " scales, decided in its quantization (no lag)";
  }
  const std::string op = r.mor.ladder ? "nvfp4|e4m3|bf16" : "e4m3|bf16";
  const std::string e = cc_major <= 0  ? " (cpu reference)"
                        : r.mor.ladder ? " (cublaslt fp8, or emulated)"
                                       : " (cublaslt fp8 or bf16)";
  std::string rule = r.mor.ladder ? std::string("each operand NVFP4 while its mean relative error < ") + t4 +
                                        "%, else E4M3 while < " + t + "%, else BF16"
                                  : std::string("each operand E4M3 while its mean relative error < ") + t + "%";
  return "Fprop " + op + " x " + op + e + " | Dgrad " + op + " x " + op + e + " | Wgrad " + op + " x " + op + e +
         " fp32 accumulate; " + rule + ", decided every " + std::to_string(r.mor.interval) +
         " step(s) from the last ones";
}

std::string describe_gemms(const Recipe& r, bool bf16_layer, int cc_major, int /*cc_minor*/) {
  if (r.mor.on && !bf16_layer) return describe_mor_gemms(r, cc_major);
  RoleSpec in = r.input, w = r.weight, g = r.grad;
  if (bf16_layer || !r.quantized()) in = w = g = RoleSpec{};
  std::string e = gemm_engine(in.fmt, cc_major);
  std::string fast = (in.fmt == Fmt::fp8_e4m3 || in.fmt == Fmt::fp8_e5m2) ? ", fast accum" : "";
  std::string out = "Fprop " + role_str(in, false) + " x " + role_str(w, false) + e;
  if (!fast.empty()) out.insert(out.size() - 1, fast);
  out += " | Dgrad " + role_str(g, false) + " x " + role_str(w, false) + e;
  out += " | Wgrad " + role_str(g, true) + " x " + role_str(in, true) + e + " fp32 accumulate";
  return out;
}

Status check_supported(const Recipe& r, int cc_major, int cc_minor) {
  if (cc_major <= 0) return Status::ok();
  int cc = cc_major * 10 + cc_minor;
  Fmt fmts[3] = {r.input.fmt, r.weight.fmt, r.grad.fmt};
  if (cc < 80)
    return errorf(
        "recipe '%s' needs BF16 tensor cores (sm_80 or newer) but this GPU is sm_%d%d; use an Ampere or "
        "newer GPU",
        r.name.c_str(), cc_major, cc_minor);
  for (Fmt f : fmts) {
    if ((f == Fmt::fp8_e4m3 || f == Fmt::fp8_e5m2 || f == Fmt::mor_block) && cc < 89)
      return errorf(
          "recipe '%s' needs FP8 tensor cores (sm_89 or newer) but this GPU is sm_%d%d; use "
          "bf16_mixed or an Ada/Hopper/Blackwell GPU",
          r.name.c_str(), cc_major, cc_minor);
    if ((f == Fmt::fp8_block128 || f == Fmt::fp8_block128x128) && cc_major != 9)
      return errorf(
          "recipe '%s' needs cuBLASLt's FP8 block-scaled GEMMs, which nibble runs on Hopper (sm_90) only, "
          "but this GPU is sm_%d%d; use bf16_with_fp8_current_scaling_mixed or a Hopper GPU",
          r.name.c_str(), cc_major, cc_minor);
  }
  return Status::ok();
}

}  // namespace nb::recipe
