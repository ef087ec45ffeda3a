// Sequence parallelism's quantized gathers (linear.h, set_input_gather / set_grad_gather): a column-parallel
// Linear's input and a row-parallel Linear's output gradient are spread by tokens over the tensor-parallel ranks.
// Instead of all-gathering BF16 and quantizing the whole tensor on every rank, each rank quantizes its own rows
// with the whole tensor's amax (the role's amax group) and, for NVFP4's SR, each element's place in the whole
// tensor (nvfp4::SrOrigin); the quantized chunks are all-gathered as bytes in one collective, and
// recipe/row_chunks.h assembles them into the copies the GEMMs read: the bytes one GPU's quantization of the
// whole tensor gives, at 1 byte per element and copy for FP8 and 0.5625 for NVFP4 instead of BF16's 2. Both
// copies travel: every rank's Wgrad reduces over all the tokens, so it needs the copy blocked along them.
// Also here: the gradient's SR places under tensor and context parallelism (set_grad_columns, set_grad_cp_rows).
#include <algorithm>
#include "core/bf16.h"
#include "core/gpu_profile.h"
#include "recipe/linear.h"
#include "recipe/linear_device.h"
#include "recipe/linear_internal.h"
#include "recipe/row_chunks.h"

namespace nb::recipe {

using namespace detail;

namespace {

// The rows of one column block of the role's token-blocked copy, or 0 when a row chunk cannot reproduce the
// whole tensor's copies (1x128 FP8 blocks: their GEMM-ready scales run along the tokens with padding).
int64_t gather_block_rows(const RoleSpec& s) {
  switch (s.fmt) {
    case Fmt::fp8_e4m3:
    case Fmt::fp8_e5m2: return 1;
    case Fmt::mxfp8: return 32;
    case Fmt::nvfp4: return s.two_d ? 0 : 16;
    default: return 0;
  }
}

// The role's chunk layout for `ranks` chunks of M/ranks tokens (a dry QCopies gives the pieces).
Status role_chunks(Role role, const RoleSpec& spec, int64_t tokens, int64_t cols, int ranks, RowChunks* rc) {
  QCopies probe;
  LinearWorkspace ws(Device::cpu);
  NB_TRY(probe.init(role, spec, tokens, cols, Device::cpu, &ws, false, false, -1, /*dry=*/true));
  rc->rows_per_rank = tokens / ranks;
  rc->ranks = ranks;
  lay_out_row_chunks(probe, tokens, cols, rc);
  return Status::ok();
}

// The role's layout for a gather of `tokens` over `ranks`, or null where a row chunk cannot reproduce the whole
// tensor's copies (a BF16 layer, a format gather_block_rows refuses, tokens that are not whole blocks per rank).
std::shared_ptr<RowChunks> gather_layout(Role role, const Recipe& r, bool bf16_layer, int64_t tokens, int64_t cols,
                                         int ranks) {
  const RoleSpec& spec = role == Role::input ? r.input : r.grad;
  if (bf16_layer || !r.quantized() || ranks < 2 || tokens % ranks != 0) return nullptr;
  const int64_t blk = gather_block_rows(spec);
  if (blk == 0 || (tokens / ranks) % blk != 0) return nullptr;
  auto rc = std::make_shared<RowChunks>();
  if (!role_chunks(role, spec, tokens, cols, ranks, rc.get()).is_ok()) return nullptr;
  return rc;
}

// The workspace's gather slot for a layout: this rank's chunk and the gathered chunks of every rank.
size_t slot_bytes(const RowChunks& rc) { return align256(rc.chunk_bytes) * size_t(1 + rc.ranks); }

size_t gather_bytes(Role role, const Recipe& r, bool bf16_layer, int64_t tokens, int64_t cols, int ranks) {
  const auto rc = gather_layout(role, r, bf16_layer, tokens, cols, ranks);
  return rc ? slot_bytes(*rc) : 0;
}

ByteGroup* attach(Linear::Impl* s, Role role, ByteGroup* group) {
  if (!s || s->frozen || !group) return nullptr;
  const int64_t cols = role == Role::input ? s->in : s->out;
  s->gather_layout[int(role)] = gather_layout(role, s->recipe, s->all_bf16, s->max_tokens, cols, group->size());
  if (!s->gather_layout[int(role)]) return nullptr;
  s->workspace->reserve(LinearWorkspace::Slot::gather, slot_bytes(*s->gather_layout[int(role)]));
  return group;
}

// The role's copies of M = local rows x ranks tokens from this rank's rows: its chunk quantized with the group's
// amax (the role's amax group) at its place in the whole (SR), all-gathered, assembled where the GEMMs read.
Status gather_role(Linear::Impl& s, Role role, ByteGroup* group, const Tensor& local, Stream stream) {
  const int ranks = group->size();
  const int64_t rows = local.shape[0], m = rows * ranks, cols = role == Role::input ? s.in : s.out;
  QCopies& c = s.q[int(role)];
  RowChunks fewer;  // a micro-batch of fewer tokens than max_tokens: its own layout (the model's are all whole)
  const RowChunks* cached = s.gather_layout[int(role)].get();
  if (cached->whole_rows != m) NB_TRY(role_chunks(role, c.spec, m, cols, ranks, &fewer));
  const RowChunks& rc = cached->whole_rows == m ? *cached : fewer;
  const size_t stride = align256(rc.chunk_bytes);
  uint8_t* chunk = nullptr;
  NB_TRY(s.workspace->acquire(LinearWorkspace::Slot::gather, stride * size_t(1 + ranks), &chunk));
  const QCopies::Outputs into = chunk_outputs(rc, chunk, c.state_i.ptr<int>() + kFlag);
  nvfp4::SrOrigin& origin = s.sr_origin[int(role)];
  origin.row0 = int64_t(group->rank()) * rows;
  origin.whole_rows = m;
  const Status st = s.quantize(role, local, stream, &into);
  origin.row0 = origin.whole_rows = 0;
  NB_TRY(st);
  uint8_t* gathered = chunk + stride;
  const std::string what = std::string("linear '") + s.name + (role == Role::input ? "' input" : "' gradient");
  NB_PROFILE_BEGIN("tp: all-gather (quantized)");  // --profile: collectives are phases of their own
  Status gathered_st = group->all_gather(chunk, stride, gathered, stream);
  NB_PROFILE_END("tp: all-gather (quantized)");
  NB_TRY(gathered_st.context(what + " gather"));
  uint8_t* const whole[4] = {c.ptr(c.row_data), c.ptr(c.row_scales), rc.has_col ? c.ptr(c.col_data) : nullptr,
                             rc.has_col ? c.ptr(c.col_scales) : nullptr};
  NB_TRY(assemble_row_chunks(rc, gathered, stride, whole, s.dev, stream));
  c.rows = m;
  return Status::ok();
}

Status check_chunk(const Linear::Impl& s, Role role, const Tensor& local, int ranks, const char* what) {
  const DType act = s.dev == Device::cuda ? DType::bf16 : DType::f32;
  const int64_t cols = role == Role::input ? s.in : s.out;
  const int64_t rows = local.ndim == 2 ? local.shape[0] : -1;
  NB_TRY(check_2d(local, what, s.name, rows, cols, act, s.dev));
  const int64_t blk = gather_block_rows(role == Role::input ? s.recipe.input : s.recipe.grad);
  if (rows * ranks > s.max_tokens || blk == 0 || rows % blk != 0)
    return errorf("linear '%s': %lld tokens over %d ranks cannot be gathered quantized (at most %lld, whole blocks)",
                  s.name.c_str(), (long long)(rows * ranks), ranks, (long long)s.max_tokens);
  return Status::ok();
}

}  // namespace

size_t Linear::input_gather_bytes(const Recipe& r, bool bf16_layer, int64_t max_tokens, int64_t in_features,
                                  int ranks) {
  return gather_bytes(Role::input, r, bf16_layer, max_tokens, in_features, ranks);
}
size_t Linear::grad_gather_bytes(const Recipe& r, bool bf16_layer, int64_t max_tokens, int64_t out_features,
                                 int ranks) {
  return gather_bytes(Role::grad, r, bf16_layer, max_tokens, out_features, ranks);
}

void Linear::set_input_gather(ByteGroup* group) {
  if (impl_) impl_->input_gather = attach(impl_.get(), Role::input, group);
}
void Linear::set_grad_gather(ByteGroup* group) {
  if (impl_) impl_->grad_gather = attach(impl_.get(), Role::grad, group);
}

// A step that collects statistics gathers BF16: their Wgrad error reads the whole BF16 X and dY. So does an operand
// that Mixture of Representations decided BF16: its GEMMs read its BF16 values, which the quantized gather does not
// carry. The gradient's gathered backward is given neither X nor W, so a BF16-decided input or weight (which Wgrad
// and Dgrad read in BF16) gathers the gradient in BF16 too, for the backward that takes them.
bool Linear::gathers_quantized_input() const {
  return impl_ && impl_->input_gather && !impl_->collect_stats && !impl_->fprop_bf16 &&
         !(impl_->recipe.mor.on && impl_->mor_rung[int(Role::input)] == MorRung::bf16);
}
bool Linear::gathers_quantized_grad() const {
  if (!impl_ || !impl_->grad_gather || impl_->collect_stats) return false;
  const MorRung* rung = impl_->mor_rung;
  return !impl_->recipe.mor.on || (rung[0] != MorRung::bf16 && rung[1] != MorRung::bf16 && rung[2] != MorRung::bf16);
}

Status Linear::forward_gathered(const Tensor& x_local, const Tensor& w, const Tensor& y, float beta, Stream stream) {
  if (!gathers_quantized_input())
    return errorf("internal: linear '%s' does not gather its input quantized now (gather BF16 and call forward)",
                  impl_ ? impl_->name.c_str() : "?");
  Impl& s = *impl_;
  const int ranks = s.input_gather->size();
  const DType act = s.dev == Device::cuda ? DType::bf16 : DType::f32;
  NB_TRY(check_chunk(s, Role::input, x_local, ranks, "x (this rank's tokens)"));
  if (!s.sharded) NB_TRY(check_2d(w, "w", s.name, s.out, s.in, act, s.dev));  // a sharded one reads its window
  NB_TRY(check_2d(y, "y", s.name, x_local.shape[0] * ranks, s.out, act, s.dev));
  NB_TRY(s.prepare_weight(w, stream));
  NB_TRY(gather_role(s, Role::input, s.input_gather, x_local, stream));
  s.have_input = true;
  return s.fprop(Tensor{}, w, y, beta, stream);
}

Status Linear::backward_gathered(const Tensor& dy_local, const Tensor& dx, float dx_beta, const Tensor& dw_f32,
                                 Stream stream) {
  if (!gathers_quantized_grad())
    return errorf("internal: linear '%s' does not gather its gradient quantized now (gather BF16, call backward)",
                  impl_ ? impl_->name.c_str() : "?");
  Impl& s = *impl_;
  const int ranks = s.grad_gather->size();
  const DType act = s.dev == Device::cuda ? DType::bf16 : DType::f32;
  NB_TRY(check_chunk(s, Role::grad, dy_local, ranks, "dy (this rank's tokens)"));
  const int64_t m = dy_local.shape[0] * ranks;
  NB_TRY(check_2d(dx, "dx", s.name, m, s.in, act, s.dev));
  NB_TRY(check_2d(dw_f32, "dw", s.name, s.out, s.in, DType::f32, s.dev));
  if (!s.have_input || !s.weight_valid || s.q[0].rows != m)
    return errorf("linear '%s': backward with %lld tokens needs the forward of the same micro-batch first",
                  s.name.c_str(), (long long)m);
  NB_TRY(gather_role(s, Role::grad, s.grad_gather, dy_local, stream));
  return s.dgrad_wgrad(Tensor{}, dx, dx_beta, dw_f32, stream, {});
}

void Linear::set_grad_columns(int64_t whole_cols, const std::vector<std::pair<int64_t, int64_t>>& segments) {
  if (!impl_) return;
  nvfp4::SrOrigin& o = impl_->sr_origin[int(Role::grad)];
  o.whole_cols = whole_cols;
  NB_CHECK(segments.size() <= size_t(nvfp4::kMaxSrColSegments), "linear '%s': %zu column segments, at most %d",
           impl_->name.c_str(), segments.size(), nvfp4::kMaxSrColSegments);
  o.n_col_segments = int(segments.size());
  for (int i = 0; i < o.n_col_segments; ++i)
    o.col_segments[i] = {segments[size_t(i)].first, segments[size_t(i)].second};
}

void Linear::set_grad_cp_rows(int64_t chunk, int64_t seq, int64_t first, int64_t second) {
  if (impl_) impl_->sr_origin[int(Role::grad)].cp = nvfp4::SrCpRows{chunk, seq, first, second};
}

}  // namespace nb::recipe
