// Linear's schedule (linear.h): when each role is quantized, which copies each GEMM takes (spec §6),
// the BF16 path, delayed-scaling bookkeeping per step, and the health report.
#include <algorithm>
#include <cmath>
#include <vector>
#include "core/bf16.h"
#include "formats/fp8/fp8_block.h"
#include "formats/mor/mor_stat.h"
#include "gemm/gemm.h"
#include "gemm/gemm_quantized.h"
#include "recipe/linear.h"
#include "recipe/linear_device.h"
#include "recipe/linear_internal.h"
#include "recipe/linear_stats.h"

namespace nb::recipe {

using namespace detail;

Linear::Linear() = default;
Linear::~Linear() = default;
Linear::Linear(Linear&&) noexcept = default;
Linear& Linear::operator=(Linear&&) noexcept = default;

static const char* kRoleNames[3] = {"input", "weight", "grad"};

Status check_2d(const Tensor& t, const char* what, const std::string& layer, int64_t rows, int64_t cols, DType dt,
                Device dev) {
  if (t.ndim != 2 || t.shape[0] != rows || t.shape[1] != cols || !t.is_contiguous())
    return errorf("linear '%s': %s is %s; need a contiguous [%lld, %lld]", layer.c_str(), what, t.shape_str().c_str(),
                  (long long)rows, (long long)cols);
  if (t.dtype != dt || t.device != dev)
    return errorf("linear '%s': %s is %s on %s; need %s on %s", layer.c_str(), what,
                  std::string(dtype_name(t.dtype)).c_str(), device_name(t.device), std::string(dtype_name(dt)).c_str(),
                  device_name(dev));
  return Status::ok();
}

// The quantizers read BF16: on the CPU backend the f32 tensor is rounded to BF16 first.
Status Linear::Impl::quantize(Role role, const Tensor& src, Stream stream, const QCopies::Outputs* into) {
  QCopies& c = q[int(role)];
  const int64_t rows = src.shape[0];
  const bf16* p = nullptr;
  if (dev == Device::cuda) {
    p = src.ptr<bf16>();
  } else {
    host_bf16.resize(size_t(src.numel()));
    const float* f = src.ptr<float>();
    for (int64_t i = 0; i < src.numel(); ++i) host_bf16[size_t(i)] = f32_to_bf16(f[i]);
    p = host_bf16.data();
  }
  // A sequence-parallel gather quantizes this rank's rows with the group's amax (into its chunk): their statistic,
  // summed over the tensor-parallel ranks, is the whole tensor's.
  const bool mor_measure = recipe.mor.on && !mor_paused;
  if (mor_ladder())
    NB_TRY(mor_ladder_quantize(role, p, rows, mor_measure, stream));
  else if (recipe.mor.blocks)
    NB_TRY(mor_block_quantize(role, p, rows, mor_measure, stream));
  else
    NB_TRY(quantize_copies(c, role, p, rows, mor_measure ? int(role) : -1, stream, into));
  if (mor_measure && recipe.mor.channel_stat) NB_TRY(mor_channel_measure(role, p, rows, stream));
  if (collect_stats) NB_TRY(stats.add(c, p, stream));
  return Status::ok();
}

Status Linear::Impl::quantize_copies(QCopies& c, Role role, const bf16* p, int64_t rows, int cell, Stream stream,
                                     const QCopies::Outputs* into) {
  QuantizeArgs qa = args(role);
  mor::StatCell own;
  if (cell >= 0) {  // the FP8 quantizer adds it as it encodes
    NB_TRY(mor_stat_target(cell, &own, &qa.mor_stat));
    NB_TRY(mor_cell_before_quantize(qa.mor_stat, stream));
  }
  NB_TRY(c.quantize(p, rows, qa, stream, into).context("linear '" + name + "' " + kRoleNames[int(role)]));
  return cell >= 0 ? mor_took_stat(cell, own, stream) : Status::ok();
}

// The quantized copies of a quantized layer, placed per linear.h (frozen: no column-wise input or grad
// copy; a per-tensor FP8 weight's column copy is a workspace transient).
static Status init_copies(Linear::Impl* impl, std::shared_ptr<LinearWorkspace> workspace, bool dry = false) {
  const Recipe& r = impl->recipe;
  const std::string& name = impl->name;
  const RoleSpec* roles[3] = {&r.input, &r.weight, &r.grad};
  for (int i = 0; i < 3; ++i) {
    if (roles[i]->fmt == Fmt::bf16)
      return errorf(
          "linear '%s': recipe '%s' quantizes some roles but leaves %s in bf16; every GEMM needs both "
          "operands in one format family (quantize all three roles or none)",
          name.c_str(), r.name.c_str(), kRoleNames[i]);
  }
  if (impl->frozen && r.fp8_scaling == Fp8Scaling::delayed)
    return errorf(
        "linear '%s': recipe '%s' uses delayed FP8 scaling, which a frozen weight cannot follow (its scale "
        "would never be updated); frozen weights need current scaling or a non-FP8 recipe",
        name.c_str(), r.name.c_str());
  // Every dimension is the reduction dim of one GEMM (K of Fprop, N of Dgrad, M of Wgrad).
  int64_t mult = 1;
  for (const RoleSpec* s : roles) mult = std::max(mult, fmt_multiple(s->fmt));
  const int64_t in = impl->in, out = impl->out;
  if (in % mult != 0 || out % mult != 0)
    return errorf(
        "linear '%s': [%lld out x %lld in] cannot run recipe '%s': its formats need in and out features "
        "that are multiples of %lld (keep this layer in BF16 or pad it)",
        name.c_str(), (long long)out, (long long)in, r.name.c_str(), (long long)mult);
  const int64_t tokens_cap = (impl->max_tokens + mult - 1) / mult * mult;
  // A private workspace is allocated here, so a lone Linear fails at init on out-of-memory as it did
  // with owned copies; a shared one is allocated by its owner after every init (or grows on first use).
  const bool private_workspace = !workspace;
  impl->workspace = private_workspace ? std::make_shared<LinearWorkspace>(impl->dev) : std::move(workspace);
  LinearWorkspace* ws = impl->workspace.get();
  const bool frozen = impl->frozen;
  impl->weight_transposed_on_use = frozen && (r.weight.fmt == Fmt::fp8_e4m3 || r.weight.fmt == Fmt::fp8_e5m2);
  NB_TRY(impl->q[0].init(Role::input, r.input, tokens_cap, in, impl->dev, ws, frozen, false,
                         private_workspace ? -1 : impl->input_col_slot, dry));
  NB_TRY(impl->q[1].init(Role::weight, r.weight, out, in, impl->dev, nullptr, impl->weight_transposed_on_use, false, -1,
                         dry));
  if (r.keep_dequantized_weights) NB_TRY(impl->q[1].keep_dequantized(out, dry).context("linear '" + name + "' weight"));
  NB_TRY(impl->q[2].init(Role::grad, r.grad, tokens_cap, out, impl->dev, ws, frozen, false, -1, dry));
  if (impl->mor_ladder()) NB_TRY(impl->mor_init_ladder(tokens_cap, dry));
  if (impl->weight_transposed_on_use) ws->reserve(LinearWorkspace::Slot::weight_col, size_t(out * in));
  if (private_workspace && !dry) NB_TRY(ws->allocate().context("linear '" + name + "'"));
  for (QCopies& c : impl->q)
    if (r.fp8_scaling == Fp8Scaling::delayed)
      c.delayed = fp8::DelayedScaling(c.delayed.format, int(r.amax_history_len));
  return Status::ok();
}

Status Linear::init(const Recipe& r, bool bf16_layer, const std::string& name, uint32_t tensor_id, int64_t max_tokens,
                    int64_t in_features, int64_t out_features, Device dev, std::shared_ptr<LinearWorkspace> workspace,
                    bool frozen, int input_col_slot) {
  return init_impl(r, bf16_layer, name, tensor_id, max_tokens, in_features, out_features, dev, std::move(workspace),
                   frozen, input_col_slot, false);
}

// What init would allocate, from the same placement code run dry: the bytes this Linear would own and, in
// the workspace (the caller's shared one; nullptr: a private one, counted as owned), the needs it registers.
Status Linear::plan_bytes(const Recipe& r, bool bf16_layer, int64_t max_tokens, int64_t in_features,
                          int64_t out_features, Device dev, LinearWorkspace* shared, bool frozen, int input_col_slot,
                          size_t* owned, size_t* weight, int input_slots) {
  *owned = 0;
  if (weight) *weight = 0;
  std::shared_ptr<LinearWorkspace> ws;
  if (shared) ws = std::shared_ptr<LinearWorkspace>(shared, [](LinearWorkspace*) {});  // not owned here
  Linear probe;
  NB_TRY(probe.init_impl(r, bf16_layer, "estimate", 0, max_tokens, in_features, out_features, dev, ws, frozen,
                         input_col_slot, true));
  if (probe.impl_->all_bf16) return Status::ok();
  for (const QCopies& c : probe.impl_->q) *owned += c.allocated_bytes;
  for (const QCopies& c : probe.impl_->q8) *owned += c.allocated_bytes;  // the NVFP4 ladder's E4M3 rung
  if (input_slots > 1) *owned += size_t(input_slots - 1) * probe.impl_->slot_bytes();
  if (weight)
    *weight = probe.impl_->q[int(Role::weight)].allocated_bytes + probe.impl_->q8[int(Role::weight)].allocated_bytes;
  if (!shared && probe.impl_->workspace) *owned += probe.impl_->workspace->planned_bytes();  // init allocates it
  return Status::ok();
}

Status Linear::init_impl(const Recipe& r, bool bf16_layer, const std::string& name, uint32_t tensor_id,
                         int64_t max_tokens, int64_t in_features, int64_t out_features, Device dev,
                         std::shared_ptr<LinearWorkspace> workspace, bool frozen, int input_col_slot, bool dry) {
  if (tensor_id >= (1u << 24))
    return errorf("linear '%s': tensor_id %u is too large for the SR key (at most 2^24 - 1)", name.c_str(), tensor_id);
  if (max_tokens <= 0 || in_features <= 0 || out_features <= 0)
    return errorf("linear '%s': tokens %lld, in %lld, out %lld must all be positive", name.c_str(),
                  (long long)max_tokens, (long long)in_features, (long long)out_features);
  if (workspace && workspace->device() != dev)
    return errorf(
        "linear '%s': its workspace is on %s but the linear on %s; create the workspace on the "
        "linear's device",
        name.c_str(), device_name(workspace->device()), device_name(dev));
  auto impl = std::make_unique<Impl>();
  impl->recipe = r;
  impl->all_bf16 = bf16_layer || !r.quantized();
  impl->frozen = frozen;
  if (input_col_slot >= LinearWorkspace::kInputColSlots)
    return errorf("linear '%s': input_col_slot %d is not in 0..%d", name.c_str(), input_col_slot,
                  LinearWorkspace::kInputColSlots - 1);
  impl->input_col_slot = input_col_slot;
  impl->name = name;
  impl->tensor_id = tensor_id;
  impl->max_tokens = max_tokens;
  impl->in = in_features;
  impl->out = out_features;
  impl->dev = dev;
  NB_TRY(impl->mor_init(dry));  // its refusals before anything is allocated
  if (!impl->all_bf16) NB_TRY(init_copies(impl.get(), std::move(workspace), dry));
  impl_ = std::move(impl);
  return Status::ok();
}

static Status check_tokens(const Linear::Impl& s, int64_t m) {
  if (m > s.max_tokens)
    return errorf("linear '%s': %lld tokens exceed the %lld given at init", s.name.c_str(), (long long)m,
                  (long long)s.max_tokens);
  if (s.all_bf16) return Status::ok();
  const int64_t mult = std::max(fmt_multiple(s.recipe.input.fmt), fmt_multiple(s.recipe.grad.fmt));
  if (m % mult != 0)
    return errorf(
        "linear '%s': %lld tokens is not a multiple of %lld, which recipe '%s' needs for the Wgrad "
        "reduction over tokens (pad the micro-batch)",
        s.name.c_str(), (long long)m, (long long)mult, s.recipe.name.c_str());
  return Status::ok();
}

Status Linear::forward(const Tensor& x, const Tensor& w, const Tensor& y, float beta, Stream stream) {
  if (!impl_) return errorf("Linear::forward before a successful init");
  Impl& s = *impl_;
  const DType act = s.dev == Device::cuda ? DType::bf16 : DType::f32;
  const int64_t m = x.ndim == 2 ? x.shape[0] : -1;
  NB_TRY(check_2d(x, "x", s.name, m, s.in, act, s.dev));
  // A frozen quantized Linear ignores w: its weight was quantized once by freeze_weight(); a sharded one
  // reads the gathered window.
  const bool frozen_q = s.frozen && !s.all_bf16;
  if (!frozen_q && !s.sharded) NB_TRY(check_2d(w, "w", s.name, s.out, s.in, act, s.dev));
  NB_TRY(check_2d(y, "y", s.name, m, s.out, act, s.dev));
  NB_TRY(check_tokens(s, m));
  if (s.collect_stats) NB_TRY(s.stats.keep_input(s, x, stream));  // the Wgrad error's BF16 X (linear_stats.h)
  if (s.all_bf16) {
    // The CPU backend is the FP32 reference of the model (finite-difference tests): no BF16 rounding there.
    return gemm::matmul(x, w, y, {.trans_b = true, .beta = beta}, stream);
  }
  NB_TRY(s.prepare_weight(w, stream));
  NB_TRY(s.quantize(Role::input, x, stream));
  s.have_input = true;
  return s.fprop(x, w, y, beta, stream);
}

Status Linear::Impl::prepare_weight(const Tensor& w, Stream stream) {
  if (frozen && !weight_valid)
    return errorf("linear '%s' is frozen: call freeze_weight(w) once before its first forward", name.c_str());
  if (frozen) return mor_frozen_weight_stat(stream);  // MoR: the frozen weight's statistic, once per measured step
  if (sharded && !weight_valid)
    return errorf("internal: linear '%s' is sharded and its weight window is not bound", name.c_str());
  if (!weight_valid) {
    NB_TRY(quantize(Role::weight, w, stream));
    weight_valid = true;
  }
  return Status::ok();
}

Status Linear::Impl::fprop(const Tensor& x, const Tensor& w, const Tensor& y, float beta, Stream stream) {
  if (fprop_bf16) return gemm::matmul(x, w, y, {.trans_b = true, .beta = beta}, stream);  // as a BF16 layer's
  gemm::QOperand a = q[0].row_operand(), b = q[1].row_operand();
  NB_TRY(mor_operand(Role::input, x, true, &a));
  NB_TRY(mor_operand(Role::weight, w, true, &b));
  const auto per_tensor = [](gemm::QFormat f) { return f == gemm::QFormat::fp8_e4m3 || f == gemm::QFormat::fp8_e5m2; };
  gemm::QGemmOptions o{beta, /*fast_accum=*/per_tensor(a.format) && per_tensor(b.format)};
  return gemm::matmul_quantized(a, b, y, o, stream).context("linear '" + name + "' Fprop");
}

bool Linear::input_copy_shared() const { return impl_ && !impl_->all_bf16 && impl_->input_col_slot >= 0; }

Status Linear::quantize_input(const Tensor& x, Stream stream) {
  if (!input_copy_shared()) return errorf("Linear::quantize_input: the input copy is not in a shared slot");
  Impl& s = *impl_;
  const DType act = s.dev == Device::cuda ? DType::bf16 : DType::f32;
  const int64_t m = x.ndim == 2 ? x.shape[0] : -1;
  NB_TRY(check_2d(x, "x", s.name, m, s.in, act, s.dev));
  NB_TRY(check_tokens(s, m));
  if (s.collect_stats) NB_TRY(s.stats.keep_input(s, x, stream));  // as forward() keeps it for the Wgrad error
  NB_TRY(s.quantize(Role::input, x, stream));
  s.have_input = true;
  return Status::ok();
}

Status Linear::backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& dx, float dx_beta,
                        const Tensor& dw_f32, Stream stream, const std::function<Status()>& after_dgrad) {
  if (!impl_) return errorf("Linear::backward before a successful init");
  Impl& s = *impl_;
  const DType act = s.dev == Device::cuda ? DType::bf16 : DType::f32;
  const int64_t m = dy.ndim == 2 ? dy.shape[0] : -1;
  NB_TRY(check_2d(dy, "dy", s.name, m, s.out, act, s.dev));
  NB_TRY(check_2d(dx, "dx", s.name, m, s.in, act, s.dev));
  NB_TRY(check_tokens(s, m));
  if (s.frozen) return s.frozen_backward(dy, w, dx, dx_beta, stream);  // Dgrad only: x and dw_f32 unread
  NB_TRY(check_2d(dw_f32, "dw", s.name, s.out, s.in, DType::f32, s.dev));
  if (s.all_bf16) {
    NB_TRY(check_2d(x, "x", s.name, m, s.in, act, s.dev));
    NB_TRY(check_2d(w, "w", s.name, s.out, s.in, act, s.dev));
    NB_TRY(gemm::matmul(dy, w, dx, {.beta = dx_beta}, stream));
    if (after_dgrad) NB_TRY(after_dgrad());
    return gemm::matmul(dy, x, dw_f32, {.trans_a = true, .beta = 1.f}, stream);
  }
  if (!s.have_input || !s.weight_valid || s.q[0].rows != m)
    return errorf("linear '%s': backward with %lld tokens needs the forward of the same micro-batch first",
                  s.name.c_str(), (long long)m);
  NB_TRY(s.quantize(Role::grad, dy, stream));
  s.mor_x = x;  // a BF16-decided input or weight operand reads these (linear_mor.cpp)
  s.mor_w = w;
  return s.dgrad_wgrad(dy, dx, dx_beta, dw_f32, stream, after_dgrad);
}

Status Linear::Impl::dgrad_wgrad(const Tensor& dy, const Tensor& dx, float dx_beta, const Tensor& dw_f32, Stream stream,
                                 const std::function<Status()>& after_dgrad) {
  gemm::QOperand wcol, dy_row = q[2].row_operand(), dy_col = q[2].col_operand(), x_col = q[0].col_operand();
  NB_TRY(dgrad_weight_operand(stream, &wcol));
  NB_TRY(mor_operand(Role::grad, dy, true, &dy_row));
  NB_TRY(mor_operand(Role::weight, mor_w, false, &wcol));
  NB_TRY(gemm::matmul_quantized(dy_row, wcol, dx, {dx_beta, false}, stream).context("linear '" + name + "' Dgrad"));
  if (after_dgrad) NB_TRY(after_dgrad());
  if (collect_stats) NB_TRY(stats.before_wgrad(*this, dw_f32, stream));
  NB_TRY(mor_operand(Role::grad, dy, false, &dy_col));
  NB_TRY(mor_operand(Role::input, mor_x, false, &x_col));
  NB_TRY(gemm::matmul_quantized(dy_col, x_col, dw_f32, {1.f, false}, stream).context("linear '" + name + "' Wgrad"));
  if (collect_stats) NB_TRY(stats.after_wgrad(*this, dy, dw_f32, stream));
  have_input = false;
  micro += micro_stride;
  return Status::ok();
}

void Linear::weight_changed() {
  // A frozen weight never changes (freeze_weight quantized it once); a sharded one is valid while bound.
  if (impl_ && !impl_->frozen && !impl_->sharded) impl_->weight_valid = false;
}

void Linear::new_step(uint32_t step, uint32_t first_micro, uint32_t micro_stride) {
  if (!impl_) return;
  Impl& s = *impl_;
  weight_changed();
  s.mor_frozen_set = false;
  s.step = step;
  s.micro = first_micro;
  s.micro_stride = micro_stride;
  s.stats.arm();  // --quant-stats measures the Wgrad error of a step's first micro-batch
  if (s.all_bf16 || s.recipe.fp8_scaling != Fp8Scaling::delayed) return;
  // Delayed scaling: this step's amaxes into each history, then the next step's scales (one sync per step).
  for (QCopies& c : s.q) {
    if (!c.used_in_step) continue;
    float f[kStateFloats];
    int i[kStateInts];
    Status st = c.read_state(f, i, nullptr);
    NB_CHECK(st.is_ok(), "%s", st.message().c_str());
    c.delayed.record(f[kStepAmax]);
    c.delayed.update();
    c.has_history = true;
    f[kScale] = c.delayed.scale;
    f[kStepAmax] = 0.f;
    st = c.write_state(f, i, nullptr);
    NB_CHECK(st.is_ok(), "%s", st.message().c_str());
    c.used_in_step = false;
  }
}

void Linear::set_collect_stats(bool on, std::shared_ptr<StatsScratch> scratch) {
  if (!impl_) return;
  if (on != impl_->collect_stats || scratch) impl_->stats.set_collect(on, std::move(scratch));
  impl_->collect_stats = on;
}

Status Linear::take_health(LinearHealth* out) {
  *out = LinearHealth{};
  if (!impl_ || impl_->all_bf16) return Status::ok();
  Impl& s = *impl_;
  for (int r = 0; r < 3; ++r) {
    float f[kStateFloats];
    int i[kStateInts];
    NB_TRY(s.q[r].read_state(f, i, nullptr));
    if (i[kNonfiniteCount] > 0) {
      if (out->nonfinite == 0) out->first_nonfinite_role = kRoleNames[r];
      out->nonfinite += i[kNonfiniteCount];
      NB_TRY(s.q[r].clear_nonfinite_count());
    }
  }
  s.stats.take(out);
  if (s.recipe.mor.on)
    for (int r = 0; r < 3; ++r) out->roles[r].mor_rung = int(s.mor_rung[r]);
  return Status::ok();
}

bool Linear::keeps_quantized_input() const { return impl_ && !impl_->all_bf16; }

bool Linear::frozen() const { return impl_ && impl_->frozen; }

void Linear::set_amax_groups(AmaxGroup* input, AmaxGroup* weight, AmaxGroup* grad) {
  impl_->amax_groups[int(Role::input)] = input;
  impl_->amax_groups[int(Role::weight)] = weight;
  impl_->amax_groups[int(Role::grad)] = grad;
}

Status Linear::set_fprop_bf16(bool on) {
  if (!impl_) return errorf("Linear::set_fprop_bf16 before a successful init");
  if (on && impl_->sharded)
    return errorf("linear '%s' is sharded: it gathers its quantized weight only, so Fprop cannot run in BF16",
                  impl_->name.c_str());
  if (on && impl_->frozen && !impl_->all_bf16)
    return errorf("linear '%s' is frozen: its forward reads its quantized weight only, so Fprop cannot run in BF16",
                  impl_->name.c_str());
  impl_->fprop_bf16 = on && !impl_->all_bf16;
  return Status::ok();
}

std::shared_ptr<LinearWorkspace> Linear::workspace() const { return impl_ ? impl_->workspace : nullptr; }

size_t Linear::bytes() const {
  if (!impl_ || impl_->dev != Device::cuda) return 0;
  size_t n = 0;
  for (const QCopies& c : impl_->q) n += c.owned_bytes;
  if (impl_->frozen && frozen_chunk()) n += weight_chunk_bytes();  // a sharded frozen weight's own chunk
  if (!impl_->input_slots.empty()) {
    n += (impl_->input_slots.size() - 1) * (impl_->q[0].col_owned_bytes + kStateFloats * sizeof(float));
    if (impl_->mor_ladder())
      n += (impl_->input_slots.size() - 1) * (impl_->q8[0].col_owned_bytes + kStateFloats * sizeof(float));
  }
  return n;
}

Status Linear::debug_copies(int role, QuantizedBytes* out) const {
  if (!impl_ || impl_->all_bf16 || role < 0 || role > 2)
    return errorf("Linear::debug_copies: no quantized copies (BF16 layer, no init, or role %d not in 0..2)", role);
  const QCopies& c = impl_->q[role];
  *out = QuantizedBytes{};
  out->fmt = c.spec.fmt;
  out->rows = c.rows;
  out->cols = c.cols;
  const int64_t n = c.rows * c.cols;
  size_t data = size_t(c.spec.fmt == Fmt::nvfp4       ? n / 2
                       : c.spec.fmt == Fmt::mor_block ? 2 * n
                                                      : n),
         row_sc = 0, col_sc = 0;
  switch (c.spec.fmt) {
    case Fmt::fp8_block128:
    case Fmt::fp8_block128x128: {
      auto kind = c.spec.fmt == Fmt::fp8_block128 ? fp8::BlockKind::vec128 : fp8::BlockKind::blk128x128;
      row_sc = 4 * size_t(fp8::block_scale_count(kind, c.rows, c.cols, false));
      col_sc = 4 * size_t(fp8::block_scale_count(kind, c.rows, c.cols, true));
      break;
    }
    case Fmt::mxfp8: row_sc = col_sc = size_t(n / 32); break;
    case Fmt::nvfp4: row_sc = col_sc = size_t(n / 16); break;
    default: break;
  }
  // 2D NVFP4: no column-wise copy (col_operand reads the row copy); row_only (frozen): none either.
  const bool no_col = c.col_is_row || c.row_only;
  const size_t col_data = no_col ? 0 : data;
  if (no_col) col_sc = 0;
  auto fetch = [&](std::vector<uint8_t>* v, const QCopies::Piece& p, size_t bytes) -> Status {
    v->resize(bytes);
    if (bytes == 0) return Status::ok();
    const uint8_t* src = c.ptr(p);
    if (!src) return errorf("Linear::debug_copies: role %d has not been quantized yet", role);
    if (c.dev == Device::cuda) return copy_to_host_cuda(v->data(), src, bytes, nullptr);
    std::copy(src, src + bytes, v->data());
    return Status::ok();
  };
  NB_TRY(fetch(&out->row_data, c.row_data_piece(), data));
  NB_TRY(fetch(&out->col_data, c.col_data, col_data));
  NB_TRY(fetch(&out->row_scales, c.row_scales, row_sc));
  NB_TRY(fetch(&out->col_scales, c.col_scales, col_sc));
  float f[kStateFloats];
  int i[kStateInts];
  NB_TRY(c.read_state(f, i, nullptr));
  out->row_amax = f[kRowAmax];
  out->col_amax = c.col_is_row ? f[kRowAmax] : f[kColAmax];  // the amax the column operand is used with
  out->scale_inv = f[kScaleInv];
  return Status::ok();
}

}  // namespace nb::recipe

namespace nb::recipe {

Status Linear::scaling_state(std::vector<ScalingState>* out) const {
  out->clear();
  if (!impl_ || impl_->all_bf16 || impl_->recipe.fp8_scaling != Fp8Scaling::delayed) return Status::ok();
  for (int r = 0; r < 3; ++r) {
    const QCopies& c = impl_->q[r];
    float f[kStateFloats];
    int i[kStateInts];
    NB_TRY(c.read_state(f, i, nullptr));
    out->push_back({r, c.has_history, c.used_in_step, c.delayed.scale, f[kStepAmax], c.delayed.history});
  }
  return Status::ok();
}

Status Linear::set_scaling_state(const std::vector<ScalingState>& in) {
  std::vector<ScalingState> mine;
  NB_TRY(scaling_state(&mine));
  if (in.size() != mine.size())
    return errorf("linear '%s': the checkpoint has delayed-scaling state for %zu roles, this recipe %zu",
                  impl_ ? impl_->name.c_str() : "?", in.size(), mine.size());
  for (const ScalingState& s : in) {
    if (s.role < 0 || s.role > 2 || s.history.size() != mine[size_t(s.role)].history.size())
      return errorf("linear '%s' %s: the checkpoint's amax history has %zu entries, this recipe's %zu",
                    impl_->name.c_str(), kRoleNames[std::clamp(s.role, 0, 2)], s.history.size(),
                    mine[size_t(std::clamp(s.role, 0, 2))].history.size());
    QCopies& c = impl_->q[s.role];
    float f[kStateFloats];
    int i[kStateInts];
    NB_TRY(c.read_state(f, i, nullptr));
    c.has_history = s.has_history;
    c.used_in_step = s.used_in_step;
    c.delayed.scale = s.scale;
    c.delayed.history = s.history;
    f[kScale] = s.scale;
    f[kStepAmax] = s.step_amax;
    NB_TRY(c.write_state(f, i, nullptr));
  }
  return Status::ok();
}

}  // namespace nb::recipe
