// Linear: one linear layer Y = X W^T (X [M,K] tokens x in features, W [N,K]) in one precision recipe.
// It holds the quantized copies of its operands and runs the three GEMMs of precision spec §6:
//   forward   Fprop  y  = x w^T + beta*y      (y bf16 on cuda, f32 on cpu)
//   backward  Dgrad  dx = dy w + dx_beta*dx    Wgrad  dw_f32 += dy^T x  (FP32 accumulation)
// Tensors: cuda backend x, w, dy, dx bf16; cpu backend all f32 (the BF16 source of a quantizer is the
// f32 value rounded to BF16 first, so CPU and CUDA quantize the same numbers; a BF16 layer on the cpu
// runs its GEMMs in FP32 on the given values, unrounded: the FP32 reference of the model). All 2-D, contiguous.
// Quantization schedule: x once per forward into every copy the layer needs (row-wise for Fprop,
// column-wise for Wgrad, kept until backward); w once per optimizer step (row-wise and column-wise --
// a 2D NVFP4 weight row-wise only, which Dgrad reads as its column operand -- reused by every
// micro-batch until new_step); dy once per backward (row-wise for Dgrad, column-wise
// for Wgrad). A BF16 layer (or bf16_mixed) quantizes nothing and calls the BF16 GEMM.
// Memory: the copies kept across calls (input column-wise, weight both) are owned by the Linear; the
// transient ones (input row-wise: forward only; grad both: backward only) live in a LinearWorkspace,
// shared by all Linears of a model (they run one after another on one stream) or private to this one.
// Recipe::keep_dequantized_weights (emulated mxfp8/nvfp4 on cuda): the weight role also keeps its copies
// dequantized to BF16, made right after each quantization (once per step), which the emulated Fprop and
// Dgrad read instead of dequantizing the weight in every micro-batch; counted in bytes().
// Stochastic-rounding key: RngKey{recipe.seed, step, (tensor_id << 8) | (micro_batch % 64) << 2 | role << 1},
// role 0 = input, 1 = grad; the NVFP4 quantizer flips bit 0 for the column-wise copy.
// backward() pairs with the latest forward() (the forward/backward of one micro-batch run back to back).
//
// Frozen mode (init(..., frozen = true); LoRA fine-tuning, where base weights are never trained):
//   - no Wgrad: backward() runs Dgrad only and never reads x or dw_f32 (pass Tensor{}; a non-empty dw_f32
//     is ignored too, neither checked nor written);
//   - no column-wise copy of the input or the gradient (only Wgrad read them): the input role quantizes its
//     row copy only and owns nothing but its state block (for a 70B model the input column copies are ~17 GB);
//   - quantized: freeze_weight(w) quantizes the weight once (delayed FP8 scaling is refused at init); then
//     forward()/backward() ignore their w (Tensor{} is fine) and new_step() keeps the weight. Calling
//     forward() before freeze_weight() is an error. Weight copies kept per format, bytes per element:
//       nvfp4 2D          row copy only, as in training: 0.5 + 1/16
//       fp8 per tensor    row copy only: 1; Dgrad transposes its codes (exact: one scale, same codes) into
//                         the workspace's weight_col slot, shared by all Linears (the largest weight's size)
//       mxfp8, fp8 block, 1D nvfp4   both copies, as in training (quantized once)
//   - BF16 (bf16 layer or bf16_mixed): forward as usual, backward = the Dgrad GEMM on the given w.
#pragma once
#include <functional>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>
#include "core/status.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "formats/mor/mor_stat.h"
#include "recipe/linear_workspace.h"
#include "recipe/recipe.h"

namespace nb::recipe {

// Host copy of one role's quantized copies, in the format quantizers' layouts (see recipe/linear_internal.h
// and formats/*): for tests and diagnostics (addition to the agreed API). A 2D NVFP4 weight has no
// column-wise copy: col_data/col_scales are empty and col_amax = row_amax. Nor have a frozen Linear's
// input and grad roles and its per-tensor FP8 weight: col_data/col_scales empty, col_amax 0.
struct QuantizedBytes {
  Fmt fmt = Fmt::bf16;
  int64_t rows = 0, cols = 0;  // the source [rows, cols] of the latest quantization
  std::vector<uint8_t> row_data, row_scales, col_data, col_scales;
  float row_amax = 0, col_amax = 0, scale_inv = 1;  // nvfp4 amaxes; fp8 per-tensor scale_inv
};

// Quantization statistics of one role's row-wise copies since the last take_health (linear_stats.h).
struct RoleQuantStats {
  bool seen = false;  // the role was quantized while collection was on
  Fmt fmt = Fmt::bf16;
  double flushed = 0, saturated = 0, sqnr_db = 0;
  // NVFP4 input and grad roles (linear_stats.h): mean crest factor max|x| / rms(x) of the column-wise
  // blocks (16 tokens of one feature) of the source, and of the same blocks after the 16-point RHT.
  bool has_crest = false;
  double crest = 0, crest_rht = 0;
  // Mixture of Representations: the rung this role's GEMM operands had (a MorRung: 0 BF16, 1 E4M3, 2 NVFP4); -1
  // without MoR.
  int mor_rung = -1;
};

// Weight-gradient error of the measured micro-batch (linear_stats.h): dW_ref = dY^T X from the BF16
// sources with FP32 accumulation, dW_q the recipe's quantized Wgrad; norms are Frobenius norms.
struct WgradQuantStats {
  bool measured = false;
  double grad_norm = 0, noise_norm = 0;  // ||dW_ref||, ||dW_q - dW_ref||
  bool has_alt = false;                  // NVFP4 Wgrad operands: the same Wgrad with RHT toggled
  bool alt_rht = false;                  // the alternative's RHT setting
  double alt_noise_norm = 0;             // ||dW_alt - dW_ref||
};

struct LinearHealth {
  int64_t nonfinite = 0;             // quantizations whose source held NaN/Inf since the last take_health
  std::string first_nonfinite_role;  // "input" | "weight" | "grad" (first role in that order with a count)
  double flushed = 0, saturated = 0, sqnr_db = 0;  // worst over the roles seen (set_collect_stats)
  bool has_stats = false;
  RoleQuantStats roles[3];  // input, weight, grad (set_collect_stats)
  WgradQuantStats wgrad;    // set_collect_stats, a non-frozen quantized Linear
  double stats_ms = 0;      // wall time of the statistics passes since the last take_health
};

class StatsScratch;  // linear_stats.h: FP32 scratch of the Wgrad comparison, shareable by Linears

// FP8 delayed-scaling state of one role of one Linear: what a checkpoint must carry for the next step to
// scale exactly as an uninterrupted run would (the amax history window, the scale it produced, and the
// amax this step recorded, which new_step() folds into the history).
struct ScalingState {
  int role = 0;  // 0 input, 1 weight, 2 grad
  bool has_history = false, used_in_step = false;
  float scale = 1.f, step_amax = 0.f;
  std::vector<float> history;
};

// Ranks that each hold some tokens of one activation or gradient (context parallelism): per-tensor scaling
// (FP8 current scaling, NVFP4's tensor amaxes) must see the whole tensor's amax for every rank to quantize
// as one GPU would. max() all-reduces n floats in place (device memory on CUDA) with MAX over those ranks.
class AmaxGroup {
 public:
  virtual ~AmaxGroup() = default;
  virtual Status max(float* values, int n, Stream stream) = 0;
};

// The tensor-parallel ranks of sequence parallelism, for a quantized input gather (Linear::set_input_gather).
class ByteGroup {
 public:
  virtual ~ByteGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // gathered = every rank's `bytes` bytes of `local`, in rank order (device memory on CUDA, on `stream`).
  virtual Status all_gather(const uint8_t* local, size_t bytes, uint8_t* gathered, Stream stream) = 0;
};

class Linear {
 public:
  Linear();
  ~Linear();
  Linear(Linear&&) noexcept;
  Linear& operator=(Linear&&) noexcept;
  Linear(const Linear&) = delete;
  Linear& operator=(const Linear&) = delete;

  // tensor_id: unique per linear (used in the SR random key); max_tokens: largest M it will see.
  // workspace: where the transient copies go; init registers this Linear's needs in it (the owner calls
  // allocate() after all inits; until then the first use allocates). nullptr: a private workspace,
  // allocated here. Its device must be dev. frozen: the frozen-weight mode (see above).
  // input_col_slot (0..3, a shared workspace): the input's column-wise copy lives in the workspace's
  // input_col slot of that index instead of being owned, for a model whose full activation recompute runs
  // each layer's forward again right before its backward (the i-th Linears of all layers share one slot).
  Status init(const Recipe& r, bool bf16_layer, const std::string& name, uint32_t tensor_id, int64_t max_tokens,
              int64_t in_features, int64_t out_features, Device dev,
              std::shared_ptr<LinearWorkspace> workspace = nullptr, bool frozen = false, int input_col_slot = -1);
  // The memory estimate's view of init: *owned = the device bytes (as allocated, 256-byte pieces) this Linear
  // would own, computed by init's own placement code without allocating; the workspace needs it would
  // register go to `shared` (nullptr: a private workspace, counted in *owned). On the cpu backend the same
  // layout in host memory (which bytes() leaves out).
  // *weight (optional): the part of *owned that is the weight's copies, which a sharded weight
  // (set_sharded_weight) does not own.
  // input_slots: set_input_slots(input_slots) follows init (its extra slots counted in *owned).
  static Status plan_bytes(const Recipe& r, bool bf16_layer, int64_t max_tokens, int64_t in_features,
                           int64_t out_features, Device dev, LinearWorkspace* shared, bool frozen, int input_col_slot,
                           size_t* owned, size_t* weight = nullptr, int input_slots = 1);
  // ---- Several micro-batches in flight (pipeline parallelism without full recompute; linear_slots.cpp) ----
  // backward() reads the input's column copy (and its scale or amax) that its micro-batch's forward made; with
  // n slots, n micro-batches keep theirs at once, and use_input_slot(i) picks the one the next forward writes
  // and the next backward reads (backward pairs with the latest forward in that slot). Slot 0 is the copy
  // init made, so a Linear that never calls these behaves as before. Refused for a frozen Linear (it keeps
  // no input copy), for one whose input copy lives in a shared workspace slot (init's input_col_slot: full
  // recompute needs none), for 2D NVFP4 inputs, for FP8 delayed scaling and for --quant-stats' collection.
  // A BF16 layer has nothing to keep: both are no-ops there.
  Status set_input_slots(int n);
  Status use_input_slot(int i);
  // A Linear whose input column copy lives in a shared slot (init's input_col_slot): quantizes x as forward()
  // would (the copies backward's Wgrad reads) without the Fprop GEMM, for a recomputed forward that does not
  // need this Linear's output. input_copy_shared() says whether such a Linear needs it.
  Status quantize_input(const Tensor& x, Stream stream);
  bool input_copy_shared() const;
  // Frozen quantized Linear only: quantizes w ([out, in], bf16 on cuda, f32 on cpu, like forward's) into
  // the weight role's kept copies, once (call again only if the base weight itself changes). An error for
  // a Linear that is not frozen, and for a frozen BF16 layer (it reads its BF16 w in forward/backward).
  Status freeze_weight(const Tensor& w, Stream stream);
  // Fprop: y = x w^T + beta*y. A frozen quantized Linear ignores w (its frozen copy is used).
  Status forward(const Tensor& x, const Tensor& w, const Tensor& y, float beta, Stream stream);
  // Dgrad dx = dy w + dx_beta*dx; Wgrad dw_f32 += dy^T x (FP32). A quantized recipe uses its kept copy
  // of x (the caller may have overwritten x); a BF16 layer reads x. Frozen: Dgrad only (see above).
  // after_dgrad (optional) runs once dx's GEMM is queued, before the Wgrad's: tensor parallelism launches dx's
  // all-reduce there, on another stream, so that it runs beside the Wgrad GEMM.
  Status backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& dx, float dx_beta,
                  const Tensor& dw_f32, Stream stream, const std::function<Status()>& after_dgrad = {});
  // Weights changed: requantize on next forward; SR key step; delayed-scaling roll. The SR key's
  // micro-batch index starts at first_micro and grows by micro_stride per backward (data parallelism).
  void new_step(uint32_t step, uint32_t first_micro = 0, uint32_t micro_stride = 1);
  // The weight changed outside a step (the optimizer's update before an evaluation): the next forward quantizes it
  // again, as new_step's does, and nothing else of the step moves.
  void weight_changed();
  // Per-operand flushed/saturated/SQNR and the Wgrad error of the next micro-batch (extra passes,
  // synchronizing; off by default; linear_stats.h). scratch: the Wgrad comparison's FP32 scratch, shared by
  // a model's Linears (nullptr: a private one). Turning it on re-arms the Wgrad measurement, as new_step does.
  void set_collect_stats(bool on, std::shared_ptr<StatsScratch> scratch = nullptr);
  Status take_health(LinearHealth* out);  // since the last call; may synchronize
  bool keeps_quantized_input() const;     // true when backward() does not read x
  bool frozen() const;                    // initialized in the frozen-weight mode
  // Precision annealing of Fprop only (docs/RECIPES.md): forward() still quantizes x (and w once per step)
  // exactly as before, because backward's Dgrad and Wgrad read those copies, but computes y with the BF16
  // GEMM on the given x and w (w must then be the real weight). No effect on a BF16 layer; an error on a
  // frozen quantized Linear, whose forward is not given its weight.
  Status set_fprop_bf16(bool on);
  // The input and gradient roles' per-tensor amaxes are reduced over `group` before they scale (nullptr:
  // this rank's own). Delayed scaling keeps its own rule (its step amaxes are reduced after the step,
  // train/amax_reduce.h); block formats have no tensor amax.
  void set_amax_group(AmaxGroup* group) { set_amax_groups(group, nullptr, group); }
  // Each role its own group (tensor parallelism: a sharded weight over the tensor-parallel ranks, a sharded
  // input or gradient over them too, a replicated one over none).
  void set_amax_groups(AmaxGroup* input, AmaxGroup* weight, AmaxGroup* grad);
  // ---- Sequence parallelism's quantized input gather (linear_gather.cpp) ----
  // A column-parallel Linear's input X [M, in] is spread by tokens over the `group` ranks (rank r holds rows
  // [r*M/T, (r+1)*M/T)). forward_gathered quantizes this rank's rows with the whole tensor's amax (the input
  // role's amax group must span the group), all-gathers the quantized bytes (one collective) and assembles the
  // copies the GEMMs read: byte for byte the whole tensor's quantization, never a second one
  // (recipe/row_chunks.h). Formats: per-tensor FP8 (current or delayed), MXFP8 and NVFP4 without SR on the input
  // (SR's random bytes follow each element's place in the whole), each with M/T a whole number of the format's
  // column blocks; others (and a BF16 layer) return 0 from input_gather_bytes and gather BF16 as before.
  // input_gather_bytes: the workspace's gather slot for such a Linear (its chunk and the T gathered chunks).
  static size_t input_gather_bytes(const Recipe& r, bool bf16_layer, int64_t max_tokens, int64_t in_features,
                                   int ranks);
  // Registers the gather slot; a Linear input_gather_bytes refuses stays as it was (not an error).
  void set_input_gather(ByteGroup* group);
  // Whether forward_gathered applies now: set, and neither collecting statistics (their Wgrad error reads the
  // whole BF16 X) nor running Fprop in BF16. Otherwise gather X in BF16 and call forward().
  bool gathers_quantized_input() const;
  // x_local [M/T, in] (this rank's tokens), y [M, out]: y = X w^T + beta*y with X gathered quantized.
  Status forward_gathered(const Tensor& x_local, const Tensor& w, const Tensor& y, float beta, Stream stream);
  // The same for a row-parallel Linear's output gradient dY [M, out] (its grad role; the role's amax group must
  // span the group): NVFP4's SR draws each element's random bits at its place in the whole dY, so SR gradients
  // gather quantized too. grad_gather_bytes / set_grad_gather / gathers_quantized_grad as above;
  // backward_gathered(dy_local [M/T, out], ...) is backward() with dY gathered quantized.
  static size_t grad_gather_bytes(const Recipe& r, bool bf16_layer, int64_t max_tokens, int64_t out_features,
                                  int ranks);
  void set_grad_gather(ByteGroup* group);
  bool gathers_quantized_grad() const;
  Status backward_gathered(const Tensor& dy_local, const Tensor& dx, float dx_beta, const Tensor& dw_f32,
                           Stream stream);
  // Tensor parallelism: this Linear's outputs are the given column ranges of a whole layer's [M, whole_cols]
  // output ({local column, whole column} starts, sorted, the first at 0; a column-parallel shard of a fused
  // projection has one per part: q, k, v or gate, up). NVFP4's SR then draws the gradient's random bits at
  // each element's place in the whole gradient, as one GPU does (nvfp4::SrOrigin).
  void set_grad_columns(int64_t whole_cols, const std::vector<std::pair<int64_t, int64_t>>& segments);
  // Context parallelism: this Linear's tokens are, per sequence of `seq`, its chunks `first` and `second` of
  // `chunk` tokens each (a rank's share, row after row); NVFP4's SR then draws the gradient's random bits at each
  // token's row of the whole sequences (nvfp4::SrOrigin::cp), with sequence parallelism's row offsets inside the
  // rank's tokens. chunk 0: no map. A chunk that is not whole NVFP4 blocks (16) is refused by the quantizer.
  void set_grad_cp_rows(int64_t chunk, int64_t seq, int64_t first, int64_t second);

  // Device bytes (0 on the cpu backend) of what this Linear owns: input column-wise copy, both weight
  // copies, the per-role state blocks (frozen: no input column copy, and a per-tensor FP8 weight's row
  // copy only). The workspace's bytes are not included: count them once, where the workspace is owned
  // (workspace()->bytes() for a private one).
  size_t bytes() const;
  std::shared_ptr<LinearWorkspace> workspace() const;  // nullptr for a BF16 layer or before init
  // role 0 = input, 1 = weight, 2 = grad (synchronizes on cuda); an error for a BF16 layer.
  // The transient copies (input row-wise, grad both) are read from the workspace: they are valid only
  // until another Linear sharing the workspace runs its forward (input) or backward (grad).
  Status debug_copies(int role, QuantizedBytes* out) const;
  // Delayed scaling only (otherwise empty / ignored): the roles' scaling state, for checkpoints.
  // set_scaling_state refuses a state whose roles or history lengths differ from this Linear's.
  Status scaling_state(std::vector<ScalingState>* out) const;
  Status set_scaling_state(const std::vector<ScalingState>& in);
  // Delayed scaling only (otherwise appends nothing): appends one-element f32 views, on this Linear's
  // device, of the step amax of each role (input, weight, grad) that new_step() records in the histories.
  // Data parallelism all-reduces them with MAX before that (amax_gather.h; defined in amax_gather.cpp).
  void step_amax_views(std::vector<Tensor>* out) const;

  // ---- Sharded weight (Megatron-FSDP's training-format gathers; linear_sharded.cpp) ----
  // The weight [out, in] is cut into `ranks` chunks of rows_per_rank rows (the last ones padded with zero
  // rows); each rank quantizes its own chunk with the whole weight's amax, the chunks are all-gathered as
  // bytes, and assemble_weight lays them out as the copies the GEMMs read, byte-identical to quantizing the
  // whole weight on one rank. From set_sharded_weight on the Linear owns no weight copies: forward() and
  // backward() read the window bound by bind_weight (and ignore their w). Per-tensor FP8 gathers the row
  // copy only (Dgrad transposes it, as a frozen weight does); 2D NVFP4 has no column copy; the column
  // copies of MXFP8 (other blocks: not derivable), 1D NVFP4 and 128x128 FP8 are gathered too.
  // Refused (one sentence) for a BF16 Linear, stochastic rounding or RHT on the weight, and a
  // rows_per_rank that is not a whole number of the format's block rows.
  // A frozen Linear (a LoRA base under Megatron-FSDP) quantizes its chunk once, with freeze_weight_chunk, and
  // keeps it (weight_chunk_bytes() owned); the gathers copy frozen_chunk() instead of quantizing each step.
  Status set_sharded_weight(int64_t rows_per_rank, int ranks);
  Status freeze_weight_chunk(const Tensor& chunk, const float* amax, Stream stream);
  const uint8_t* frozen_chunk() const;  // nullptr before freeze_weight_chunk
  bool sharded_weight() const;
  size_t weight_chunk_bytes() const;   // one rank's quantized chunk (256-byte multiple)
  size_t weight_window_bytes() const;  // the assembled copies (256-byte multiple)
  // chunk: this rank's [rows_per_rank, in] rows (bf16 on cuda, f32 on cpu). *amax (on this Linear's device)
  // = the chunk's amax as the whole weight's quantizer takes it (0 for the block formats, which need none).
  Status weight_chunk_amax(const Tensor& chunk, float* amax, Stream stream);
  // Quantizes the chunk into `out` (weight_chunk_bytes()) with the weight's amax (*amax, the MAX of every
  // rank's weight_chunk_amax; device memory on cuda), and sets this Linear's scales and amaxes from it: every
  // rank ends with the same state. Once per optimizer step, before the step's first bind.
  Status quantize_weight_chunk(const Tensor& chunk, const float* amax, uint8_t* out, Stream stream);
  // gathered: `ranks` chunks, rank r's at gathered + r * rank_stride; window: weight_window_bytes().
  Status assemble_weight(const uint8_t* gathered, size_t rank_stride, uint8_t* window, Stream stream);
  // The assembled window the GEMMs read from now on; nullptr unbinds (forward/backward then refuse).
  void bind_weight(uint8_t* window);

  // ---- Mixture of Representations (Recipe::mor; linear_mor.cpp) ----
  // Each quantization of a role adds its E4M3 error statistic (formats/mor/mor_stat.h) into that role's cell:
  // mor_cell_count() cells (input, weight, grad; the NVFP4 ladder adds the three roles' NVFP4 statistics after
  // them; device memory on cuda), this Linear's own or, after set_mor_cells, a slice of a model-wide board that
  // comes back to the host in one copy. mor_stats reads them all (synchronizes); clear_mor_stats zeroes them on
  // `stream`. set_mor_rung(role, bf16) makes the role's GEMM operands its BF16 values (backward then reads the x and
  // w it is given) from the next GEMM on; fp8, its E4M3 copies; nvfp4 (the ladder only), its NVFP4 copies.
  // set_mor_fp8(role, fp8) is set_mor_rung with fp8 or bf16. An error for a Linear without MoR (a BF16 layer,
  // another recipe) except the readers, which then say bf16 / false.
  Status set_mor_cells(mor::StatCell* cells);
  int mor_cell_count() const;
  Status mor_stats(mor::ErrorStat* out) const;  // mor_cell_count() entries
  Status clear_mor_stats(Stream stream);
  Status set_mor_rung(int role, MorRung rung);
  MorRung mor_rung(int role) const;
  Status set_mor_fp8(int role, bool fp8);
  bool mor_fp8(int role) const;  // mor_rung(role) == fp8
  bool mor() const;              // this Linear decides its operands by MoR
  // Paused, quantizations add nothing to the cells (evaluation forwards must not move a training decision).
  void pause_mor_stats(bool paused);
  bool mor_stats_paused() const;

  struct Impl;  // linear.cpp

 private:
  Status init_impl(const Recipe& r, bool bf16_layer, const std::string& name, uint32_t tensor_id, int64_t max_tokens,
                   int64_t in_features, int64_t out_features, Device dev, std::shared_ptr<LinearWorkspace> workspace,
                   bool frozen, int input_col_slot, bool dry);
  std::unique_ptr<Impl> impl_;
};

}  // namespace nb::recipe
