// Sequence parallelism's quantized input gather (linear.h, set_input_gather / forward_gathered): a
// column-parallel Linear's input is spread by tokens over the tensor-parallel ranks. Instead of all-gathering
// BF16 and quantizing the whole tensor on every rank, each rank quantizes its own rows with the whole tensor's
// amax (the input role's amax group), the quantized chunks are all-gathered as bytes in one collective, and
// recipe/row_chunks.h assembles them into the input copies Fprop and Wgrad read: the bytes one GPU's
// quantization of the whole tensor gives, at 1 byte per element and copy for FP8 and 0.5625 for NVFP4 instead
// of BF16's 2. The Wgrad copy (blocks along tokens) is gathered with the Fprop copy: every rank's Wgrad
// reduces over all the tokens.
#include <algorithm>
#include "core/bf16.h"
#include "recipe/linear.h"
#include "recipe/linear_device.h"
#include "recipe/linear_internal.h"
#include "recipe/row_chunks.h"

namespace nb::recipe {

using namespace detail;

namespace {

// The rows of one column block of the input's Wgrad copy, or 0 when a row chunk cannot reproduce the whole
// tensor's copies (1x128 FP8 blocks: their scales run along the tokens; SR: its random bytes follow each
// element's place in the whole copy).
int64_t gather_block_rows(const RoleSpec& s) {
  switch (s.fmt) {
    case Fmt::fp8_e4m3:
    case Fmt::fp8_e5m2: return 1;
    case Fmt::mxfp8: return 32;
    case Fmt::nvfp4: return s.sr || s.two_d ? 0 : 16;
    default: return 0;
  }
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// The input role's chunk layout for `ranks` chunks of M/ranks tokens (a dry QCopies gives the pieces).
Status input_chunks(const Recipe& r, int64_t tokens, int64_t in, int ranks, RowChunks* rc) {
  QCopies probe;
  LinearWorkspace ws(Device::cpu);
  NB_TRY(probe.init(Role::input, r.input, tokens, in, Device::cpu, &ws, false, false, -1, /*dry=*/true));
  rc->rows_per_rank = tokens / ranks;
  rc->ranks = ranks;
  lay_out_row_chunks(probe, tokens, in, rc);
  return Status::ok();
}

}  // namespace

size_t Linear::input_gather_bytes(const Recipe& r, bool bf16_layer, int64_t max_tokens, int64_t in_features,
                                  int ranks) {
  if (bf16_layer || !r.quantized() || ranks < 2 || max_tokens % ranks != 0) return 0;
  const int64_t blk = gather_block_rows(r.input);
  if (blk == 0 || (max_tokens / ranks) % blk != 0) return 0;
  RowChunks rc;
  if (!input_chunks(r, max_tokens, in_features, ranks, &rc).is_ok()) return 0;
  return align256(rc.chunk_bytes) * size_t(1 + ranks);
}

void Linear::set_input_gather(ByteGroup* group) {
  if (!impl_ || impl_->frozen || impl_->sharded) return;
  Impl& s = *impl_;
  const size_t bytes = group ? input_gather_bytes(s.recipe, s.all_bf16, s.max_tokens, s.in, group->size()) : 0;
  s.input_gather = bytes > 0 ? group : nullptr;
  if (bytes > 0) s.workspace->reserve(LinearWorkspace::Slot::gather, bytes);
}

bool Linear::gathers_quantized_input() const {
  return impl_ && impl_->input_gather && !impl_->collect_stats && !impl_->fprop_bf16;
}

Status Linear::forward_gathered(const Tensor& x_local, const Tensor& w, const Tensor& y, float beta, Stream stream) {
  if (!gathers_quantized_input())
    return errorf("internal: linear '%s' does not gather its input quantized now (gather BF16 and call forward)",
                  impl_ ? impl_->name.c_str() : "?");
  Impl& s = *impl_;
  const int ranks = s.input_gather->size();
  const DType act = s.dev == Device::cuda ? DType::bf16 : DType::f32;
  const int64_t local = x_local.ndim == 2 ? x_local.shape[0] : -1, m = local * ranks;
  NB_TRY(check_2d(x_local, "x (this rank's tokens)", s.name, local, s.in, act, s.dev));
  NB_TRY(check_2d(w, "w", s.name, s.out, s.in, act, s.dev));
  NB_TRY(check_2d(y, "y", s.name, m, s.out, act, s.dev));
  if (m > s.max_tokens || local % gather_block_rows(s.recipe.input) != 0)
    return errorf("linear '%s': %lld tokens over %d ranks cannot be gathered quantized (at most %lld, whole blocks)",
                  s.name.c_str(), (long long)m, ranks, (long long)s.max_tokens);
  NB_TRY(s.prepare_weight(w, stream));
  RowChunks rc;
  NB_TRY(input_chunks(s.recipe, m, s.in, ranks, &rc));
  const size_t stride = align256(rc.chunk_bytes);
  uint8_t* chunk = nullptr;
  NB_TRY(s.workspace->acquire(LinearWorkspace::Slot::gather, stride * size_t(1 + ranks), &chunk));
  uint8_t* gathered = chunk + stride;
  QCopies& c = s.q[int(Role::input)];
  const QCopies::Outputs into = chunk_outputs(rc, chunk, c.state_i.ptr<int>() + kFlag);
  NB_TRY(s.quantize(Role::input, x_local, stream, &into));  // the amaxes: MAX over the group (set_amax_groups)
  NB_TRY(s.input_gather->all_gather(chunk, stride, gathered, stream).context("linear '" + s.name + "' input gather"));
  uint8_t* const whole[4] = {c.ptr(c.row_data), c.ptr(c.row_scales), rc.has_col ? c.ptr(c.col_data) : nullptr,
                             rc.has_col ? c.ptr(c.col_scales) : nullptr};
  NB_TRY(assemble_row_chunks(rc, gathered, stride, whole, s.dev, stream));
  c.rows = m;
  s.have_input = true;
  return s.fprop(Tensor{}, w, y, beta, stream);
}

}  // namespace nb::recipe
