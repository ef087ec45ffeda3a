// Internals of Linear shared by linear.cpp (quantized copies of one role), linear_layer.cpp (the
// layer: schedule, GEMMs, health) and linear_frozen.cpp (the frozen-weight mode). Not part of the public API.
//
// QCopies holds the two copies of one role's source [rows, cols] (rows <= the capacity given at init):
//   row copy   blocks along cols (the Fprop / Dgrad operand)
//   col copy   blocks along rows, stored transposed [cols, rows] (MXFP8: un-transposed, as its quantizer
//              writes it); the Dgrad weight operand and both Wgrad operands
//              2D NVFP4 (16x16 tiles, the weight): not stored. Both copies would hold the same values,
//              so col_operand() is the row copy read as [K = rows, cols] (k_major = false) with the row
//              amax; this saves 9/16 byte per element. A native FP4 GEMM (sm_100, not implemented)
//              needs K-major operands and would need the real column-wise copy here again.
//              row_only (a frozen Linear): not stored either; nothing reads it (input, grad: only Wgrad
//              did) or Dgrad transposes the row copy on use (a per-tensor FP8 weight: both copies hold
//              the same codes under one scale, so col_operand_at(transposed row bytes) is exact).
// plus a small state block (linear_device.h): amaxes, FP8 scale/scale_inv, non-finite flag and count.
// Where the copies live: owned Buffers for the copies kept across calls (input column, weight both), a
// LinearWorkspace slot for the transient ones (input row -> input_row slot, grad both -> grad slot). In a
// slot the pieces sit at 256-byte-aligned offsets (as separate cudaMalloc'd buffers were):
//   [row data | row scales | col data | col scales]  (only the transient pieces of the role)
// The state block and the delayed-scaling history are always owned. Pointers into a slot are looked up
// at each use: another Linear may have grown (reallocated) the slot since this one last quantized.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include "core/bf16.h"
#include "core/philox.h"
#include "core/tensor.h"
#include "formats/fp8/fp8.h"
#include "formats/mor/mor_block.h"
#include "formats/mor/mor_stat.h"
#include "formats/nvfp4/nvfp4.h"
#include "gemm/gemm_quantized.h"
#include "recipe/linear.h"
#include "recipe/linear_stats.h"
#include "recipe/linear_workspace.h"

namespace nb::recipe {

struct RowChunks;  // row_chunks.h

enum class Role : int { input = 0, weight = 1, grad = 2 };

// Granularity each format's GEMMs need of every dimension that is some GEMM's rows or K
// (gemm_quantized.cpp validates the same numbers; NVFP4's GEMM K must be a multiple of 32).
inline int64_t fmt_multiple(Fmt f) {
  switch (f) {
    case Fmt::fp8_e4m3:
    case Fmt::fp8_e5m2: return 16;
    case Fmt::fp8_block128:
    case Fmt::fp8_block128x128: return 128;
    case Fmt::mxfp8:
    case Fmt::nvfp4: return 32;
    default: return 1;
  }
}

struct QuantizeArgs {
  Fp8Scaling scaling = Fp8Scaling::none;
  bool pow2_scales = false;
  RngKey rng{};
  AmaxGroup* amax_group = nullptr;    // the tensor's amax is the MAX over these ranks' (Linear::set_amax_group)
  nvfp4::SrOrigin sr_origin{};        // NVFP4 SR: this tensor's place in the whole one (tensor / sequence parallel)
  mor::StatCell* mor_stat = nullptr;  // MoR: the quantization adds its error statistic here (fp8::TensorView)
  mor::BlockRule mor_rule{};          // Fmt::mor_block: the rule, and where its blocks per choice are counted
  mor::BlockCounts* mor_blocks = nullptr;
  mor::BlockLadder mor_top{};          // Fmt::mor_block on the NVFP4 ladder: its NVFP4 rung (threshold 0: none)
  mor::StatCell* mor_nvfp4 = nullptr;  // and where its NVFP4 statistic is added
};

struct QCopies {
  // One piece of a copy: an owned buffer, or `offset` bytes into the workspace slot.
  struct Piece {
    Buffer owned;
    bool transient = false;
    bool external = false;  // `offset` bytes into external_base (a sharded weight's gathered window)
    LinearWorkspace::Slot slot = LinearWorkspace::Slot::input_row;  // a transient piece's slot
    size_t offset = 0;
  };
  Role role = Role::input;
  RoleSpec spec;
  int64_t rows = 0, cols = 0;
  Device dev = Device::cpu;
  Piece row_data, row_scales, col_data, col_scales;
  bool col_is_row = false;  // 2D NVFP4: no column-wise copy; col_operand() reads the row copy
  bool row_only = false;    // frozen Linear: no column-wise copy is made or stored (see above)
  Buffer state_f, state_i;
  // keep_dequantized(): the copies dequantized to BF16 after every quantize (the emulated GEMMs read
  // them, gemm::QOperand::dequantized); dequant_col stays empty when col_is_row. Empty: not kept.
  Buffer dequant_row, dequant_col;
  bool dequantized_kept() const { return dequant_row.data() != nullptr; }
  // A sharded weight (linear_sharded.cpp): every piece lives in memory bound from outside, laid out at
  // 256-byte-aligned offsets in external_bytes; nullptr while unbound.
  uint8_t* external_base = nullptr;
  size_t external_bytes = 0;
  LinearWorkspace* workspace = nullptr;  // set when some piece is transient (the Linear keeps it alive)
  LinearWorkspace::Slot slot = LinearWorkspace::Slot::input_row;
  size_t slot_bytes = 0;  // this role's need in the slot (registered at init)
  // Full recompute: the input's column pieces in a shared input_col slot of their own (col_slot_bytes > 0).
  LinearWorkspace::Slot col_slot = LinearWorkspace::Slot::input_col0;
  size_t col_slot_bytes = 0;
  size_t col_owned_bytes = 0;  // of those, the owned column pieces (what each extra input slot repeats)
  size_t col_allocated_bytes = 0;
  size_t owned_bytes = 0;       // bytes of the owned pieces and the state block
  size_t allocated_bytes = 0;   // the same as the allocator holds them (each piece a 256-byte multiple)
  fp8::DelayedScaling delayed;  // host history (delayed scaling only)
  bool has_history = false;     // delayed scaling: some step's amax was recorded (else current scaling)
  bool used_in_step = false;

  // workspace == nullptr: every piece owned. Otherwise the input role's row pieces (or all the grad
  // role's pieces) go into the workspace, whose need is registered here. row_only: no column-wise pieces.
  // external: every piece in external memory (see external_base), none owned; workspace must be nullptr.
  // input_col_slot >= 0 (the input role, a workspace given): its column pieces go to slot input_col0 + that.
  // dry: lays the pieces out and registers the workspace needs (owned_bytes, allocated_bytes) without
  // allocating anything: the memory estimate's path (Linear::plan_bytes).
  // slot_base: the transient pieces start this many bytes into the slot (after another copy's of the same role:
  // the NVFP4 ladder's E4M3 copies follow the NVFP4 ones).
  Status init(Role role, const RoleSpec& s, int64_t rows_cap, int64_t cols, Device dev, LinearWorkspace* workspace,
              bool row_only = false, bool external = false, int input_col_slot = -1, bool dry = false,
              size_t slot_base = 0);
  // Where a quantize writes: the copies' data and scales (column ones null unless colwise) and the non-finite flag.
  struct Outputs {
    bool colwise;
    uint8_t *row_data, *row_scales, *col_data, *col_scales;
    int* flag;
  };
  // src: BF16 [rows, cols] on dev. Writes both copies (the row copy only when col_is_row or row_only),
  // then folds flag/amax into the state. into: write the copies there instead of this role's pieces (a row
  // chunk of sequence parallelism's quantized gather, row_chunks.h).
  Status quantize(const bf16* src, int64_t rows, const QuantizeArgs& a, Stream stream, const Outputs* into = nullptr);
  // Owned-copies roles (the weight) of an emulated format on cuda: from now on each quantize also keeps
  // the BF16 dequantization of its copies, sized for `rows_cap` rows as init was (a no-op elsewhere).
  Status keep_dequantized(int64_t rows_cap, bool dry = false);
  gemm::QOperand row_operand() const;  // [rows, cols]
  gemm::QOperand col_operand() const;  // [cols, rows] (col_is_row: the row copy, stored [rows, cols])
  // The column operand with its data at `data` (the column copy's layout); its scales and amax are this
  // role's. Per-tensor FP8 row_only: `data` = the row copy transposed.
  gemm::QOperand col_operand_at(const uint8_t* data) const;
  uint8_t* ptr(const Piece& p) const;  // the piece's memory now
  // The piece the row operand reads: the row data, or the block rule's input, whose one copy is its column piece
  // (with the ladder's 1x16 blocks, nvfp4_rows, the input has a row copy of its own).
  const Piece& row_data_piece() const {
    return spec.fmt == Fmt::mor_block && !spec.nvfp4_rows && !col_is_row ? col_data : row_data;
  }
  // quantize()'s steps: the slot and the cleared flag, one per format family, then the block formats' amaxes.
  Outputs outputs() const;
  Status begin_quantize(Stream stream);
  Status quantize_fp8_tensor(const bf16* src, const QuantizeArgs& a, const Outputs& o, Stream stream);
  Status quantize_fp8_block(const bf16* src, const QuantizeArgs& a, const Outputs& o, Stream stream);
  Status quantize_mxfp8(const bf16* src, const Outputs& o, Stream stream);
  Status quantize_nvfp4(const bf16* src, const QuantizeArgs& a, const Outputs& o, Stream stream);
  Status quantize_mor_block(const bf16* src, const QuantizeArgs& a, const Outputs& o, Stream stream);
  Status clear_block_amaxes(Stream stream);
  // Whole state block to / from the host (synchronizes on cuda).
  Status read_state(float* floats, int* ints, Stream stream) const;
  Status write_state(const float* floats, const int* ints, Stream stream);
  Status clear_nonfinite_count();
};

// Bytes as the allocator holds them (and as pieces sit in a slot): rounded up to 256.
inline size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// What one extra input slot allocates (Linear::set_input_slots): the column pieces and a state block's floats.
size_t input_slot_allocated_bytes(const QCopies& input);

// A contiguous [rows, cols] tensor of dtype dt on dev, or one sentence naming the layer and what it got.
Status check_2d(const Tensor& t, const char* what, const std::string& layer, int64_t rows, int64_t cols, DType dt,
                Device dev);

struct Linear::Impl {
  Recipe recipe;
  bool all_bf16 = true;  // BF16 layer or bf16_mixed: no quantization at all
  bool frozen = false;   // no Wgrad; quantized: freeze_weight() quantizes the weight once (linear_frozen.cpp)
  bool weight_transposed_on_use = false;  // frozen per-tensor FP8 weight: Dgrad transposes the row copy
  bool fprop_bf16 = false;                // set_fprop_bf16: Fprop in BF16, the copies quantized as usual
  int input_col_slot = -1;                // init's: the input's column copy in a shared workspace slot
  std::string name;
  uint32_t tensor_id = 0;
  int64_t max_tokens = 0, in = 0, out = 0;
  Device dev = Device::cpu;
  std::shared_ptr<LinearWorkspace> workspace;  // transient copies (shared with the model's other Linears)
  QCopies q[3];                                // input, weight, grad
  bool weight_valid = false;                   // frozen: set by freeze_weight, never cleared by new_step
  bool have_input = false;
  // Linear::set_input_slots (several micro-batches in flight): what one micro-batch's backward reads of the
  // input role, per slot. The slot in use lives in q[input] (its entry here is empty); use_input_slot swaps.
  struct InputSlot {
    Buffer col_data, col_scales, state_f;
    int64_t rows = 0;
    bool have_input = false;
    Buffer e4m3_col_data, e4m3_col_scales, e4m3_state_f;  // the NVFP4 ladder: its E4M3 rung's copy (q8[input])
    int64_t e4m3_rows = 0;
  };
  std::vector<InputSlot> input_slots;
  int active_input_slot = 0;
  void swap_input_slot(InputSlot* slot);
  size_t slot_bytes() const;  // what one extra input slot allocates (the ladder: its E4M3 rung's copy too)
  uint32_t step = 0, micro = 0, micro_stride = 1;
  bool collect_stats = false;
  StatsAccumulator stats;
  // CPU backend: BF16-rounded sources of the quantizers.
  std::vector<bf16> host_bf16;

  RngKey rng_key(Role role) const {
    uint32_t stream = (tensor_id << 8) | ((micro % 64u) << 2) | (role == Role::grad ? 2u : 0u);
    return RngKey{recipe.seed, step, stream};
  }
  QuantizeArgs args(Role role) const {
    return QuantizeArgs{recipe.fp8_scaling,
                        recipe.fp8_pow2_scales,
                        rng_key(role),
                        amax_groups[int(role)],
                        sr_origin[int(role)],
                        nullptr,
                        mor::BlockRule{recipe.mor.three_way, recipe.mor.scaling, recipe.mor.threshold},
                        nullptr,
                        mor_block_ladder(role)};
  }
  // The block ladder's NVFP4 rung for role (SR as the role's spec says, with its key); none without the ladder.
  mor::BlockLadder mor_block_ladder(Role role) const {
    if (!recipe.mor.on || !recipe.mor.ladder || !recipe.mor.blocks) return {};
    return {recipe.mor.nvfp4_threshold, q[int(role)].spec.sr, rng_key(role)};
  }
  // Per Role: the columns from set_grad_columns; the rows set around a gathered chunk's quantization.
  nvfp4::SrOrigin sr_origin[3] = {};
  AmaxGroup* amax_groups[3] = {nullptr, nullptr, nullptr};  // per Role (set_amax_groups)
  Status quantize(Role role, const Tensor& src, Stream stream, const QCopies::Outputs* into = nullptr);
  // linear_frozen.cpp: backward() of a frozen Linear (Dgrad only; dw is never touched).
  Status frozen_backward(const Tensor& dy, const Tensor& w, const Tensor& dx, float dx_beta, Stream stream);
  // linear_frozen.cpp: the Dgrad weight operand (the column copy, or a per-tensor FP8 weight's row copy
  // transposed into the workspace when weight_transposed_on_use).
  Status dgrad_weight_operand(Stream stream, gemm::QOperand* op);
  // linear_sharded.cpp: the weight's layout over the ranks (set_sharded_weight), empty when not sharded.
  struct ShardedWeight;
  std::shared_ptr<ShardedWeight> sharded;
  // linear_gather.cpp: sequence parallelism's quantized gathers of the input (set_input_gather) or of the
  // gradient (set_grad_gather), else null.
  ByteGroup* input_gather = nullptr;
  ByteGroup* grad_gather = nullptr;
  // Per Role: the chunk layout of a gather of max_tokens tokens, made once by set_*_gather (row_chunks.h).
  std::shared_ptr<RowChunks> gather_layout[3];
  // The Dgrad and Wgrad GEMMs of backward() and backward_gathered(), on the grad copies just made.
  Status dgrad_wgrad(const Tensor& dy, const Tensor& dx, float dx_beta, const Tensor& dw_f32, Stream stream,
                     const std::function<Status()>& after_dgrad);
  // The Fprop GEMM of forward() and forward_gathered(), on the input copies just made.
  Status fprop(const Tensor& x, const Tensor& w, const Tensor& y, float beta, Stream stream);
  // The weight's copies for this step's first forward.
  Status prepare_weight(const Tensor& w, Stream stream);
  // ---- Mixture of Representations (recipe.mor; linear_mor.cpp) ----
  // Per role: which copy its GEMM operands are (its q copy: E4M3, or NVFP4 on the ladder; the ladder's E4M3 copy q8;
  // or its BF16 values), and the cells its quantizations' statistics add into (mor_cells: mor_cell_count() cells of
  // a model's board, or mor_own_cells): cell role for the E4M3 copy, 3 + role for the ladder's NVFP4 copy (or, with
  // MorSpec::channel_stat, the per-row scaled E4M3 statistic of the same quantization's source).
  MorRung mor_rung[3] = {MorRung::fp8, MorRung::fp8, MorRung::fp8};
  bool mor_paused = false;
  mor::StatCell* mor_cells = nullptr;
  Buffer mor_own_cells;
  QCopies q8[3];  // the ladder: each role's per-tensor E4M3 copies, the rung below NVFP4
  // The tensor ladder (the ladder per block keeps Fmt::mor_block copies, as the block rule: none of these).
  bool mor_ladder() const { return recipe.mor.on && recipe.mor.ladder && !recipe.mor.blocks; }
  int mor_cell_count() const { return recipe.mor.cells_per_linear(); }
  MorRung mor_top() const { return mor_ladder() ? MorRung::nvfp4 : MorRung::fp8; }
  // Quantizes c (one of role's copies) from p; an FP8 copy adds its statistic into cell `cell` (-1: none).
  Status quantize_copies(QCopies& c, Role role, const bf16* p, int64_t rows, int cell, Stream stream,
                         const QCopies::Outputs* into);
  // The ladder: the NVFP4 copies always (their RHT on the Wgrad pair only while both its operands are NVFP4), the
  // E4M3 copies when the role reads them; with `measure` both statistics (mor_ladder_measure).
  Status mor_ladder_quantize(Role role, const bf16* p, int64_t rows, bool measure, Stream stream);
  Status mor_init_ladder(int64_t tokens_cap, bool dry);
  // The block rule: role's operand from p, its blocks counted into the role's cells when `measure`.
  Status mor_block_quantize(Role role, const bf16* p, int64_t rows, bool measure,
                            Stream stream);  // the q8 copies, for init_copies' token capacity
  // The ladder's statistics of a measured step from role r's NVFP4 row copy just made: NVFP4's, and E4M3's from its
  // amax unless the role's E4M3 copy measured it (e4m3_measured); on the GPU one pass over x for both.
  Status mor_ladder_measure(int r, const bf16* p, int64_t rows, bool e4m3_measured, Stream stream);
  // The tensor rule with channel_stat, on a measured quantization: cell 3 + role += the statistic per-row scaling of
  // p [rows, role's cols] would give (the study's measurement; it decides nothing and never touches mor_rung).
  Status mor_channel_measure(Role role, const bf16* p, int64_t rows, Stream stream);
  std::vector<bf16> mor_bf16[3];  // CPU: a BF16 operand's values (the CUDA side reads its tensor)
  Tensor mor_x, mor_w;            // backward's x and w: a BF16 Wgrad input or Dgrad weight operand reads them
  // A frozen (LoRA base) weight, decided once by freeze_weight from all of it (mor_freeze): its statistic (a cell of
  // its own, set into the board's weight cell on each measured step, so the trainer's decisions read it as a trained
  // weight's), and its BF16 values when MoR keeps it BF16 (a frozen quantized Linear otherwise keeps no BF16 weight).
  Buffer mor_frozen_cell, mor_frozen_w;
  bool mor_frozen_set = false;  // this step's board holds the frozen weight's statistic
  Status mor_freeze(const Tensor& w, Stream stream);
  Status mor_frozen_weight_stat(Stream stream);  // the board's weight cell for this measured step
  Status mor_init(bool dry);                     // refusals
  Status mor_cells_now(mor::StatCell** out);
  // Where role's next quantization adds its statistic: on cuda the role's cell (the quantizer computes it while it
  // encodes); on the CPU *own, which mor_took_stat then adds into the cell. With decide-now, mor_took_stat also
  // decides the role from this quantization's statistic (on cuda read back from the cell, zeroed just before).
  Status mor_stat_target(int cell, mor::StatCell* own, mor::StatCell** target);
  Status mor_took_stat(int cell, const mor::StatCell& own, Stream stream);
  Status mor_cell_before_quantize(mor::StatCell* cell, Stream stream);
  // A BF16-decided role's operand over t (its [rows, K] values, or stored [K, rows] when !k_major) in place of
  // *op; the ladder's E4M3-decided role its q8 copy (row copy when k_major, else the column copy); a role on the
  // recipe's top rung (or a recipe without MoR) leaves *op as it is.
  Status mor_operand(Role role, const Tensor& t, bool k_major, gemm::QOperand* op);
};

}  // namespace nb::recipe
