// Linear's sharded-weight mode (linear.h): Megatron-FSDP's training-format gathers. Each rank quantizes its
// row chunk of the weight with the whole weight's amax; the chunks' rows are whole blocks (set_sharded_weight
// checks it), so every block (1x16, 16x16, 1x32, 32x1, 128x128) lies inside one chunk. The gathered chunks
// become the copies the GEMMs read as recipe/row_chunks.h assembles them.
#include <algorithm>
#include <cstring>
#include "formats/fp8/fp8.h"
#include "formats/fp8/fp8_block.h"
#include "formats/mxfp8/mxfp8.h"
#include "formats/nvfp4/nvfp4.h"
#include "recipe/linear.h"
#include "recipe/linear_device.h"
#include "recipe/linear_internal.h"
#include "recipe/row_chunks.h"

namespace nb::recipe {

using namespace detail;

namespace {

bool per_tensor_fp8(Fmt f) { return f == Fmt::fp8_e4m3 || f == Fmt::fp8_e5m2; }

}  // namespace

struct Linear::Impl::ShardedWeight : RowChunks {
  Buffer frozen_chunk;  // a frozen weight: this rank's chunk, quantized once (freeze_weight_chunk)
};

Status Linear::set_sharded_weight(int64_t rows_per_rank, int ranks) {
  if (!impl_) return errorf("Linear::set_sharded_weight before a successful init");
  Impl& s = *impl_;
  if (s.all_bf16)
    return errorf("linear '%s': only a quantized weight is gathered in its training format", s.name.c_str());
  if (s.recipe.mor.on)
    return errorf(
        "linear '%s': Mixture of Representations decides the weight's format from the whole weight, which a "
        "training-format gather of chunks does not do yet; gather this weight in BF16",
        s.name.c_str());
  const RoleSpec& w = s.recipe.weight;
  if (w.sr || w.rht)
    return errorf(
        "linear '%s': stochastic rounding or the RHT of the weight depend on each element's place in the whole "
        "copy, which a chunk cannot reproduce; gather this weight in BF16",
        s.name.c_str());
  if (w.fmt == Fmt::fp8_block128)
    return errorf(
        "linear '%s': a weight in 1x128 FP8 blocks cannot be gathered in its training format (the "
        "sub-channel recipe's weights use 128x128 tiles); gather it in BF16",
        s.name.c_str());
  const int64_t blk = weight_block_rows(w.fmt);
  if (ranks < 1 || rows_per_rank <= 0 || rows_per_rank % blk != 0 || rows_per_rank * ranks < s.out)
    return errorf("linear '%s': %lld rows per rank over %d ranks do not cover %lld rows in whole %lld-row blocks",
                  s.name.c_str(), (long long)rows_per_rank, ranks, (long long)s.out, (long long)blk);
  if (s.sharded && s.sharded->rows_per_rank == rows_per_rank && s.sharded->ranks == ranks) return Status::ok();
  const bool transposed_on_use = per_tensor_fp8(w.fmt);
  QCopies fresh;
  NB_TRY(fresh.init(Role::weight, w, rows_per_rank * ranks, s.in, s.dev, nullptr, transposed_on_use, true));
  QCopies& old = s.q[int(Role::weight)];
  fresh.state_f = std::move(old.state_f);  // the scales and delayed-scaling history carry over
  fresh.state_i = std::move(old.state_i);
  fresh.owned_bytes = size_t(kStateFloats * 4 + kStateInts * 4);
  fresh.delayed = old.delayed;
  fresh.has_history = old.has_history;
  fresh.used_in_step = old.used_in_step;
  fresh.rows = s.out;
  auto sh = std::make_shared<Impl::ShardedWeight>();
  sh->rows_per_rank = rows_per_rank;
  sh->ranks = ranks;
  lay_out_row_chunks(fresh, s.out, s.in, sh.get());
  old = std::move(fresh);
  s.weight_transposed_on_use = transposed_on_use;
  if (transposed_on_use) s.workspace->reserve(LinearWorkspace::Slot::weight_col, size_t(s.out * s.in));
  s.sharded = std::move(sh);
  s.weight_valid = false;
  return Status::ok();
}

bool Linear::sharded_weight() const { return impl_ && impl_->sharded; }

Status Linear::freeze_weight_chunk(const Tensor& chunk, const float* amax, Stream stream) {
  if (!sharded_weight() || !impl_->frozen)
    return errorf("Linear::freeze_weight_chunk: the Linear is not frozen with a sharded weight");
  Impl::ShardedWeight& sh = *impl_->sharded;
  if (!sh.frozen_chunk.data())
    NB_TRY(Buffer::allocate(&sh.frozen_chunk, DType::u8, impl_->dev, {int64_t(sh.chunk_bytes)})
               .context("linear '" + impl_->name + "' frozen weight chunk"));
  return quantize_weight_chunk(chunk, amax, sh.frozen_chunk.ptr<uint8_t>(), stream);
}

const uint8_t* Linear::frozen_chunk() const {
  return sharded_weight() ? impl_->sharded->frozen_chunk.ptr<uint8_t>() : nullptr;
}
size_t Linear::weight_chunk_bytes() const { return sharded_weight() ? impl_->sharded->chunk_bytes : 0; }
size_t Linear::weight_window_bytes() const {
  return sharded_weight() ? std::max<size_t>(impl_->q[int(Role::weight)].external_bytes, 256) : 0;
}

// The chunk as the quantizers read it: BF16 on cuda; on the cpu rounded to BF16 first, as Impl::quantize does.
static Status chunk_source(Linear::Impl& s, const Tensor& chunk, const bf16** out) {
  const DType act = s.dev == Device::cuda ? DType::bf16 : DType::f32;
  NB_TRY(check_2d(chunk, "weight chunk", s.name, s.sharded->rows_per_rank, s.in, act, s.dev));
  if (s.dev == Device::cuda) {
    *out = chunk.ptr<bf16>();
    return Status::ok();
  }
  s.host_bf16.resize(size_t(chunk.numel()));
  const float* f = chunk.ptr<float>();
  for (int64_t i = 0; i < chunk.numel(); ++i) s.host_bf16[size_t(i)] = f32_to_bf16(f[i]);
  *out = s.host_bf16.data();
  return Status::ok();
}

Status Linear::weight_chunk_amax(const Tensor& chunk, float* amax, Stream stream) {
  if (!sharded_weight()) return errorf("Linear::weight_chunk_amax: the weight is not sharded");
  Impl& s = *impl_;
  QCopies& c = s.q[int(Role::weight)];
  const bf16* src = nullptr;
  NB_TRY(chunk_source(s, chunk, &src));
  NB_TRY(c.begin_quantize(stream));  // clears the non-finite flag, which this pass may set
  const bool cuda = s.dev == Device::cuda;
  const int64_t rows = chunk.shape[0], n = chunk.numel();
  int* flag = c.state_i.ptr<int>() + kFlag;
  if (per_tensor_fp8(c.spec.fmt)) {
    if (cuda) return fp8::amax_cuda(src, n, amax, flag, stream);
    *amax = fp8::amax_ref(src, n, flag);
    return Status::ok();
  }
  if (c.spec.fmt == Fmt::nvfp4) {
    if (cuda) return nvfp4::compute_amax_cuda(src, rows, s.in, false, amax, nullptr, stream);
    nvfp4::compute_amax_ref(src, rows, s.in, false, amax, nullptr);
    return Status::ok();
  }
  if (cuda) return memset_cuda(amax, 0, sizeof(float), stream);
  *amax = 0.f;
  return Status::ok();
}

// The per-tensor formats' amax slots := the weight's amax (device-to-device on cuda).
static Status store_amax(QCopies& c, const float* amax, bool col_too, Stream stream) {
  float* sf = c.state_f.ptr<float>();
  if (c.dev != Device::cuda) {
    sf[kRowAmax] = *amax;
    sf[kColAmax] = col_too ? *amax : 0.f;
    return Status::ok();
  }
  NB_TRY(copy_bytes_async(sf + kRowAmax, Device::cuda, amax, Device::cuda, sizeof(float), stream));
  if (!col_too) return memset_cuda(sf + kColAmax, 0, sizeof(float), stream);
  return copy_bytes_async(sf + kColAmax, Device::cuda, amax, Device::cuda, sizeof(float), stream);
}

// Per-tensor FP8: delayed scaling with a history scales by its kept scale, otherwise by the weight's amax.
static Status quantize_chunk_fp8(Linear::Impl& s, QCopies& c, const bf16* src, uint8_t* data, Stream stream) {
  const bool cuda = s.dev == Device::cuda;
  float* sf = c.state_f.ptr<float>();
  const auto f = c.spec.fmt == Fmt::fp8_e4m3 ? fp8::Format::e4m3 : fp8::Format::e5m2;
  fp8::TensorView v{s.sharded->rows_per_rank, s.in, data, nullptr, sf + kScaleInv, sf + kRowAmax, nullptr};
  if (s.recipe.fp8_scaling == Fp8Scaling::delayed && c.has_history) {
    v.amax = sf + kColAmax;  // the chunk's own amax, a scratch slot cleared below
    NB_TRY(cuda ? fp8::quantize_with_scale_cuda(src, f, sf + kScale, v, stream)
                : fp8::quantize_with_scale_ref(src, f, sf[kScale], v));
    if (cuda) return memset_cuda(sf + kColAmax, 0, sizeof(float), stream);
    sf[kColAmax] = 0.f;
    return Status::ok();
  }
  const bool pow2 = s.recipe.fp8_pow2_scales;
  return cuda ? fp8::quantize_with_amax_cuda(src, f, pow2, v, stream)
              : fp8::quantize_with_amax_ref(src, f, pow2, sf[kRowAmax], v);
}

static Status quantize_chunk_blocks(Linear::Impl& s, QCopies& c, const bf16* src, uint8_t* out, Stream stream) {
  const Linear::Impl::ShardedWeight& sh = *s.sharded;
  const bool cuda = s.dev == Device::cuda;
  const int64_t rows = sh.rows_per_rank;
  uint8_t* rd = out + sh.row_data.chunk_offset;
  uint8_t* rs = out + sh.row_scales.chunk_offset;
  uint8_t* cd = sh.has_col ? out + sh.col_data.chunk_offset : nullptr;
  uint8_t* cs = sh.has_col ? out + sh.col_scales.chunk_offset : nullptr;
  int* flag = c.state_i.ptr<int>() + kFlag;
  if (c.spec.fmt == Fmt::mxfp8) {
    mxfp8::QuantizedView v{rows, s.in, rd, rs, cd, cs, flag};
    const mxfp8::Options opt{true, true};
    return cuda ? mxfp8::quantize_cuda(src, opt, v, stream) : mxfp8::quantize_ref(src, opt, v);
  }
  if (c.spec.fmt == Fmt::nvfp4) {
    nvfp4::Options opt;
    opt.two_d = c.spec.two_d;
    opt.four_over_six = c.spec.four_over_six;
    opt.err_mode = c.spec.four_over_six_err;
    opt.colwise = sh.has_col;
    float* sf = c.state_f.ptr<float>();
    nvfp4::QuantizedView v{rows, s.in, rd, rs, cd, cs, sf + kRowAmax, sh.has_col ? sf + kColAmax : nullptr, flag};
    return cuda ? nvfp4::quantize_cuda_with_amax(src, opt, v, stream) : nvfp4::quantize_ref_with_amax(src, opt, v);
  }
  fp8::BlockOptions opt;
  opt.kind = c.spec.fmt == Fmt::fp8_block128 ? fp8::BlockKind::vec128 : fp8::BlockKind::blk128x128;
  opt.pow2_scales = s.recipe.fp8_pow2_scales;
  opt.colwise = sh.has_col;
  fp8::BlockView v{rows, s.in, rd, reinterpret_cast<float*>(rs), cd, reinterpret_cast<float*>(cs), flag};
  return cuda ? fp8::quantize_block_cuda(src, opt, v, stream) : fp8::quantize_block_ref(src, opt, v);
}

Status Linear::quantize_weight_chunk(const Tensor& chunk, const float* amax, uint8_t* out, Stream stream) {
  if (!sharded_weight()) return errorf("Linear::quantize_weight_chunk: the weight is not sharded");
  Impl& s = *impl_;
  QCopies& c = s.q[int(Role::weight)];
  const bf16* src = nullptr;
  NB_TRY(chunk_source(s, chunk, &src));
  const Fmt f = c.spec.fmt;
  if (per_tensor_fp8(f) || f == Fmt::nvfp4) NB_TRY(store_amax(c, amax, f == Fmt::nvfp4 && s.sharded->has_col, stream));
  if (per_tensor_fp8(f))
    NB_TRY(quantize_chunk_fp8(s, c, src, out + s.sharded->row_data.chunk_offset, stream));
  else
    NB_TRY(quantize_chunk_blocks(s, c, src, out, stream));
  NB_TRY(c.clear_block_amaxes(stream).context("linear '" + s.name + "' weight chunk"));
  c.used_in_step = true;
  float* sf = c.state_f.ptr<float>();
  int* si = c.state_i.ptr<int>();
  if (s.dev == Device::cuda) return fold_role_state_cuda(sf, si, stream);
  fold_role_state_host(sf, si);
  return Status::ok();
}

Status Linear::assemble_weight(const uint8_t* gathered, size_t rank_stride, uint8_t* window, Stream stream) {
  if (!sharded_weight()) return errorf("Linear::assemble_weight: the weight is not sharded");
  const Impl& s = *impl_;
  const QCopies& c = s.q[int(Role::weight)];
  uint8_t* const whole[4] = {window + c.row_data.offset, window + c.row_scales.offset, window + c.col_data.offset,
                             window + c.col_scales.offset};
  return assemble_row_chunks(*s.sharded, gathered, rank_stride, whole, s.dev, stream);
}

void Linear::bind_weight(uint8_t* window) {
  if (!sharded_weight()) return;
  impl_->q[int(Role::weight)].external_base = window;
  impl_->weight_valid = window != nullptr;
}

}  // namespace nb::recipe
