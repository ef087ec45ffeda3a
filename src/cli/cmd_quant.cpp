// `nibble quant`: quantize one tensor (from a safetensors file, or random) with a chosen format on the
// CPU reference or the CUDA kernels, write codes/scales/amax to a safetensors file and print error
// statistics of every copy the format makes (row-wise, and column-wise / transposed).
//   SQNR = 10 log10(sum x^2 / sum (x - x_hat)^2); relative L2 = ||x - x_hat|| / ||x||;
//   flushed = non-zero inputs whose x_hat is 0, as a fraction of the non-zero inputs;
//   saturated = elements clipped by the element format: code at the largest magnitude (E4M3 448,
//   E5M2 57344, E2M1 6) and |x| beyond the rounding range of that value, |x| > |x_hat| * (max +
//   half its step) / max (464/448, 61440/57344, 7/6): round-to-nearest alone would not have reached it.
// The column-wise NVFP4 copy with --rht is compared with the Hadamard-transformed source it encodes.
// NaN/Inf inputs: the statistics cover the finite inputs and the count of the others is printed;
// the exit is 1 (and --out is not written) unless --allow-nonfinite passes them through.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>
#include "cli/commands.h"
#include "cli/quant_stats.h"
#include "core/tensor.h"
#include "formats/fp8/fp8.h"
#include "formats/fp8/fp8_block.h"
#include "formats/mxfp8/mxfp8.h"
#include "formats/nvfp4/nvfp4.h"
#include "io/safetensors.h"

namespace nb::cli {
namespace {

struct QuantArgs {
  std::string input, tensor, random, dist = "normal", format, device = "auto", out;
  uint64_t seed = 1;
  bool two_d = false, rht = false, sr = false, four_over_six = false;
  std::string err_mode;          // --fp4-4over6-err-mode: mae (default with --4over6) | mse
  bool allow_nonfinite = false;  // NaN/Inf in the input: report and exit 0 instead of failing
};

using Bytes = std::vector<uint8_t>;

// Host buffers and, on CUDA, their device twins (copied back by download()).
class Mirror {
 public:
  explicit Mirror(bool cuda) : cuda_(cuda) {}
  ~Mirror() {
    for (auto& [h, d] : items_) device_free(d);
  }
  template <typename T>
  Status map(Bytes& host, T** out) {
    if (!cuda_) {
      *out = reinterpret_cast<T*>(host.data());
      return Status::ok();
    }
    void* d = nullptr;
    NB_TRY(device_malloc(&d, host.size() ? host.size() : 1));
    items_.push_back({&host, d});
    NB_TRY(copy_bytes(d, Device::cuda, host.data(), Device::cpu, host.size()));
    *out = static_cast<T*>(d);
    return Status::ok();
  }
  Status download() {
    for (auto& [h, d] : items_) NB_TRY(copy_bytes(h->data(), Device::cpu, d, Device::cuda, h->size()));
    return Status::ok();
  }

 private:
  bool cuda_;
  std::vector<std::pair<Bytes*, void*>> items_;
};

// --tensor NAME, or the file's only tensor when --tensor is left out; otherwise the error lists the names.
Status pick_tensor(const QuantArgs& a, const SafeTensorsFile& f, const SafeTensor** out) {
  std::string names;
  for (auto& [n, t] : f.tensors) names += (names.empty() ? "" : ", ") + n;
  if (a.tensor.empty()) {
    if (f.tensors.size() == 1) {
      *out = &f.tensors.begin()->second;
      return Status::ok();
    }
    if (f.tensors.empty()) return errorf("%s holds no tensors", a.input.c_str());
    return errorf("%s holds %zu tensors; pick one with --tensor NAME: %s", a.input.c_str(), f.tensors.size(),
                  names.c_str());
  }
  auto it = f.tensors.find(a.tensor);
  if (it == f.tensors.end())
    return errorf("tensor '%s' is not in %s; it holds: %s", a.tensor.c_str(), a.input.c_str(), names.c_str());
  *out = &it->second;
  return Status::ok();
}

Status load_input(const QuantArgs& a, int64_t* rows, int64_t* cols, std::vector<bf16>* x) {
  if (!a.random.empty()) {
    long long m = 0, k = 0;
    char tail = 0;
    if (std::sscanf(a.random.c_str(), "%lld,%lld%c", &m, &k, &tail) != 2 || m <= 0 || k <= 0)
      return errorf("--random expects M,K with positive integers (e.g. 4096,4096); got '%s'", a.random.c_str());
    *rows = m;
    *cols = k;
    std::mt19937_64 rng(a.seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> unif(0.0f, 1.0f);
    x->resize(size_t(m * k));
    for (auto& v : *x) {
      float f = normal(rng);
      if (a.dist == "lognormal")
        f = std::exp(2.0f * f) * (unif(rng) < 0.5f ? -1.0f : 1.0f);
      else if (a.dist == "outliers" && unif(rng) < 0.01f)
        f *= 100.0f;
      v = f32_to_bf16(f);
    }
    return Status::ok();
  }
  if (a.input.empty()) return errorf("give --input FILE [--tensor NAME], or --random M,K");
  SafeTensorsFile f;
  NB_TRY(read_safetensors(a.input, &f));
  const SafeTensor* tp = nullptr;
  NB_TRY(pick_tensor(a, f, &tp));
  const SafeTensor& t = *tp;
  const char* name = a.tensor.empty() ? f.tensors.begin()->first.c_str() : a.tensor.c_str();
  if (t.shape.size() < 2)
    return errorf("tensor '%s' in %s has %zu dimension(s); quant needs a 2-D (or higher, flattened to 2-D) tensor",
                  name, a.input.c_str(), t.shape.size());
  *cols = t.shape.back();
  *rows = 1;
  for (size_t i = 0; i + 1 < t.shape.size(); ++i) *rows *= t.shape[i];
  const size_t n = size_t(*rows * *cols);
  x->resize(n);
  if (t.dtype == "BF16")
    std::memcpy(x->data(), t.bytes.data(), 2 * n);
  else if (t.dtype == "F16")
    for (size_t i = 0; i < n; ++i) {
      f16 h;
      std::memcpy(&h, &t.bytes[2 * i], 2);
      (*x)[i] = f32_to_bf16(f16_to_f32(h));
    }
  else if (t.dtype == "F32")
    for (size_t i = 0; i < n; ++i) {
      float v;
      std::memcpy(&v, &t.bytes[4 * i], 4);
      (*x)[i] = f32_to_bf16(v);
    }
  else
    return errorf("tensor '%s' in %s has dtype %s; quant reads BF16, F16 or F32", name, a.input.c_str(),
                  t.dtype.c_str());
  return Status::ok();
}

void put(SafeTensorsFile* f, const std::string& name, const char* dtype, std::vector<int64_t> shape, const Bytes& b) {
  f->tensors[name] = SafeTensor{dtype, std::move(shape), b};
}
template <typename T>
const T* as(const Bytes& b) {
  return reinterpret_cast<const T*>(b.data());
}

// One quantization of x: the host input, its device twin and the outputs every format shares. The
// per-format steps are members so each reads like the straight-line code it is.
struct FormatRun {
  const QuantArgs& a;
  bool cuda;
  int64_t rows, cols;
  size_t n;
  const std::vector<bf16>& x;
  SafeTensorsFile* file;
  std::vector<CopyStats>* st;
  std::vector<float> src;  // x as float
  Bytes xb, flag;          // host bytes the Mirror maps (members: their addresses must stay put)
  Mirror m;
  bf16* dx = nullptr;
  int32_t* dflag = nullptr;
  const std::string& f = a.format;

  FormatRun(const QuantArgs& args, bool on_cuda, int64_t r, int64_t c, const std::vector<bf16>& input,
            SafeTensorsFile* out_file, std::vector<CopyStats>* stats)
      : a(args),
        cuda(on_cuda),
        rows(r),
        cols(c),
        n(size_t(r * c)),
        x(input),
        file(out_file),
        st(stats),
        src(n),
        xb(2 * n),
        flag(4, 0),
        m(on_cuda) {
    for (size_t i = 0; i < n; ++i) src[i] = bf16_to_f32(x[i]);
    std::memcpy(xb.data(), x.data(), xb.size());
  }
  Status run();
  Status run_mxfp8();
  Status run_fp8();
  Status run_fp8_block();
  Status run_nvfp4();
};

Status FormatRun::run_mxfp8() {
  NB_TRY(mxfp8::check_shape(rows, cols));
  Bytes rd(n), rs(n / 32), cd(n), cs(n / 32);
  mxfp8::QuantizedView v{rows, cols, nullptr, nullptr, nullptr, nullptr, dflag};
  NB_TRY(m.map(rd, &v.row_data));
  NB_TRY(m.map(rs, &v.row_scales));
  NB_TRY(m.map(cd, &v.col_data));
  NB_TRY(m.map(cs, &v.col_scales));
  NB_TRY(cuda ? mxfp8::quantize_cuda(dx, {}, v) : mxfp8::quantize_ref(x.data(), {}, v));
  NB_TRY(m.download());
  std::vector<float> rh(n), ch(n);
  mxfp8::dequantize_ref(rd.data(), rs.data(), rows, cols, false, rh.data());
  mxfp8::dequantize_ref(cd.data(), cs.data(), rows, cols, true, ch.data());
  put(file, "row_data", "F8_E4M3", {rows, cols}, rd);
  put(file, "row_scales", "F8_E8M0", {rows, cols / 32}, rs);
  put(file, "col_data", "F8_E4M3", {rows, cols}, cd);
  put(file, "col_scales", "F8_E8M0", {rows / 32, cols}, cs);
  add_fp8_copy(st, "row-wise 1x32", src, rd, rh, 0x7E, false, rows, cols);
  add_fp8_copy(st, "column-wise 32x1", src, cd, ch, 0x7E, false, rows, cols);
  return Status::ok();
}

Status FormatRun::run_fp8() {
  const fp8::Format fmt = f == "fp8-e4m3" ? fp8::Format::e4m3 : fp8::Format::e5m2;
  NB_TRY(fp8::check_shape(rows, cols));
  Bytes d(n), dt(n), si(4), am(4);
  fp8::TensorView v{rows, cols, nullptr, nullptr, nullptr, nullptr, dflag};
  NB_TRY(m.map(d, &v.data));
  NB_TRY(m.map(dt, &v.data_t));
  NB_TRY(m.map(si, &v.scale_inv));
  NB_TRY(m.map(am, &v.amax));
  NB_TRY(cuda ? fp8::quantize_current_cuda(dx, fmt, false, v) : fp8::quantize_current_ref(x.data(), fmt, false, v));
  NB_TRY(m.download());
  const float scale_inv = *as<float>(si);
  std::vector<float> rh(n), th(n);
  fp8::dequantize_ref(d.data(), int64_t(n), fmt, scale_inv, rh.data());
  fp8::dequantize_ref(dt.data(), int64_t(n), fmt, scale_inv, th.data());
  const char* dt_name = fmt == fp8::Format::e4m3 ? "F8_E4M3" : "F8_E5M2";
  put(file, "row_data", dt_name, {rows, cols}, d);
  put(file, "col_data", dt_name, {cols, rows}, dt);
  put(file, "scale_inv", "F32", {1}, si);
  put(file, "amax", "F32", {1}, am);
  const uint32_t max_mag = fmt == fp8::Format::e4m3 ? 0x7E : 0x7B;
  add_fp8_copy(st, "row-wise", src, d, rh, max_mag, false, rows, cols);
  add_fp8_copy(st, "transposed", src, dt, th, max_mag, true, rows, cols);
  return Status::ok();
}

Status FormatRun::run_fp8_block() {
  fp8::BlockOptions opt;
  opt.kind = f == "fp8-block128" ? fp8::BlockKind::vec128 : fp8::BlockKind::blk128x128;
  NB_TRY(fp8::check_block_shape(opt.kind, rows, cols));
  const size_t nrs = size_t(fp8::block_scale_count(opt.kind, rows, cols, false)),
               ncs = size_t(fp8::block_scale_count(opt.kind, rows, cols, true));
  Bytes rd(n), cd(n), rs(4 * nrs), cs(4 * ncs);
  fp8::BlockView v{rows, cols, nullptr, nullptr, nullptr, nullptr, dflag};
  NB_TRY(m.map(rd, &v.row_data));
  NB_TRY(m.map(rs, &v.row_scale_inv));
  NB_TRY(m.map(cd, &v.col_data));
  NB_TRY(m.map(cs, &v.col_scale_inv));
  NB_TRY(cuda ? fp8::quantize_block_cuda(dx, opt, v) : fp8::quantize_block_ref(x.data(), opt, v));
  NB_TRY(m.download());
  std::vector<float> rh(n), th(n);
  fp8::dequantize_block_ref(rd.data(), as<float>(rs), opt.kind, rows, cols, false, rh.data());
  fp8::dequantize_block_ref(cd.data(), as<float>(cs), opt.kind, rows, cols, true, th.data());
  const bool vec = opt.kind == fp8::BlockKind::vec128;
  put(file, "row_data", "F8_E4M3", {rows, cols}, rd);
  put(file, "col_data", "F8_E4M3", {cols, rows}, cd);
  put(file, "row_scale_inv", "F32", {vec ? cols / 128 : rows / 128, vec ? fp8::round4(rows) : fp8::round4(cols / 128)},
      rs);
  put(file, "col_scale_inv", "F32", {vec ? rows / 128 : cols / 128, vec ? fp8::round4(cols) : fp8::round4(rows / 128)},
      cs);
  add_fp8_copy(st, "row-wise", src, rd, rh, 0x7E, false, rows, cols);
  add_fp8_copy(st, "transposed", src, cd, th, 0x7E, true, rows, cols);
  return Status::ok();
}

Status FormatRun::run_nvfp4() {
  nvfp4::Options opt;
  opt.two_d = a.two_d;
  opt.four_over_six = a.four_over_six;  // the amax outputs hold the true amax; decode with amax / (6*256)
  opt.err_mode = a.err_mode == "mse" ? nvfp4::ErrMode::mse : nvfp4::ErrMode::mae;
  opt.rht = a.rht;
  opt.sr = a.sr;
  opt.rng = RngKey{a.seed, 0, 0};
  NB_TRY(nvfp4::check_shape(rows, cols, opt));
  Bytes rd(n / 2), rs(n / 16), cd(n / 2), cs(n / 16), ra(4), ca(4);
  nvfp4::QuantizedView v{rows, cols};
  NB_TRY(m.map(rd, &v.row_data));
  NB_TRY(m.map(rs, &v.row_scales));
  NB_TRY(m.map(cd, &v.col_data));
  NB_TRY(m.map(cs, &v.col_scales));
  NB_TRY(m.map(ra, &v.row_amax));
  NB_TRY(m.map(ca, &v.col_amax));
  NB_TRY(m.map(flag, &v.nonfinite));
  NB_TRY(cuda ? nvfp4::quantize_cuda(dx, opt, v, nullptr) : nvfp4::quantize_ref(x.data(), opt, v));
  NB_TRY(m.download());
  std::vector<float> rh(n), th(n);
  nvfp4::dequantize_ref(rd.data(), rs.data(), *as<float>(ra), rows, cols, rh.data(), a.four_over_six);
  nvfp4::dequantize_ref(cd.data(), cs.data(), *as<float>(ca), cols, rows, th.data(), a.four_over_six);
  put(file, "row_data", "U8", {rows, cols / 2}, rd);
  put(file, "row_scales", "F8_E4M3", {rows, cols / 16}, rs);
  put(file, "col_data", "U8", {cols, rows / 2}, cd);
  put(file, "col_scales", "F8_E4M3", {cols, rows / 16}, cs);
  put(file, "row_amax", "F32", {1}, ra);
  put(file, "col_amax", "F32", {1}, ca);
  // How to read the amaxes: a 4/6 copy decodes with amax / (6*256) (TransformerEngine's nvfp4_e4m3_max).
  file->metadata["nvfp4_4over6"] = a.four_over_six ? nvfp4::err_mode_name(opt.err_mode) : "off";
  file->metadata["nvfp4_e4m3_max"] = a.four_over_six ? "256" : "448";
  auto nibbles = [](const Bytes& b) {
    std::vector<uint32_t> mag(b.size() * 2);
    for (size_t i = 0; i < b.size(); ++i) {
      mag[2 * i] = b[i] & 7u;
      mag[2 * i + 1] = (b[i] >> 4) & 7u;
    }
    return mag;
  };
  int64_t rsat = count_saturated(src, rh, nibbles(rd), 7);
  st->push_back({"row-wise 1x16" + std::string(a.two_d ? " (16x16 tiles)" : ""), src, rh, rsat});
  std::vector<float> col_ref = transpose(src, rows, cols);  // [cols, rows]
  if (a.rht)
    for (size_t i = 0; i < n; i += 16) {
      float y[16];
      nvfp4::rht16_ref(&col_ref[i], y);
      std::copy(y, y + 16, &col_ref[i]);
    }
  int64_t csat = count_saturated(col_ref, th, nibbles(cd), 7);
  st->push_back({std::string("column-wise") + (a.rht ? " (vs. RHT of the source)" : ""), transpose(col_ref, cols, rows),
                 transpose(th, cols, rows), csat});
  return Status::ok();
}

Status FormatRun::run() {
  NB_TRY(m.map(xb, &dx));
  NB_TRY(m.map(flag, &dflag));
  if ((a.two_d || a.rht || a.sr || a.four_over_six) && f != "nvfp4")
    return errorf("--2d, --rht, --sr and --4over6 apply to --format nvfp4 only");
  if (!a.err_mode.empty() && !a.four_over_six)
    return errorf("--fp4-4over6-err-mode picks the error metric of --4over6; add --4over6 or drop it");
  if (f == "mxfp8")
    NB_TRY(run_mxfp8());
  else if (f == "fp8-e4m3" || f == "fp8-e5m2")
    NB_TRY(run_fp8());
  else if (f == "fp8-block128" || f == "fp8-block128x128")
    NB_TRY(run_fp8_block());
  else if (f == "nvfp4")
    NB_TRY(run_nvfp4());
  else
    return errorf("unknown --format '%s'; use nvfp4, mxfp8, fp8-e4m3, fp8-e5m2, fp8-block128 or fp8-block128x128",
                  f.c_str());
  put(file, "nonfinite", "I32", {1}, flag);
  file->metadata["format"] = "pt";
  file->metadata["nibble_format"] = f;
  file->metadata["device"] = cuda ? "cuda" : "cpu";
  return Status::ok();
}

Status run_format(const QuantArgs& a, bool cuda, int64_t rows, int64_t cols, const std::vector<bf16>& x,
                  SafeTensorsFile* file, std::vector<CopyStats>* st) {
  FormatRun r(a, cuda, rows, cols, x, file, st);
  return r.run();
}

int run_quant(const QuantArgs& a) {
  bool cuda = false;
  std::string why;
  if (a.device == "cuda") {
    if (!cuda_device_available(&why)) {
      std::fprintf(stderr, "error: --device cuda: %s\n", why.c_str());
      return 1;
    }
    cuda = true;
  } else if (a.device == "auto") {
    cuda = cuda_device_available(&why);
  } else if (a.device != "cpu") {
    std::fprintf(stderr, "error: --device must be cpu, cuda or auto; got '%s'\n", a.device.c_str());
    return 1;
  }
  int64_t rows = 0, cols = 0;
  std::vector<bf16> x;
  SafeTensorsFile out;
  std::vector<CopyStats> st;
  Status s = load_input(a, &rows, &cols, &x);
  if (s) s = run_format(a, cuda, rows, cols, x, &out, &st);
  // Non-finite input is quantized and reported either way, but only written (and exit 0) when asked
  // for: a NaN tensor must not look like a clean run to a script that checks the exit status.
  const int64_t nonfinite = s ? count_nonfinite(x) : 0;
  const bool refuse = nonfinite > 0 && !a.allow_nonfinite;
  if (s && !refuse && !a.out.empty()) s = write_safetensors(a.out, out);
  if (!s) {
    std::fprintf(stderr, "error: %s\n", s.message().c_str());
    return 1;
  }
  std::printf("%s on %s: %lldx%lld BF16 -> %s\n", a.format.c_str(), cuda ? "cuda" : "cpu", (long long)rows,
              (long long)cols,
              a.out.empty() ? "(no --out file)"
              : refuse      ? "(--out not written)"
                            : a.out.c_str());
  if (nonfinite)
    std::printf("non-finite inputs: %lld of %lld (NaN or Inf); the statistics are over the finite ones\n",
                (long long)nonfinite, (long long)x.size());
  print_stats(st);
  if (refuse) {
    std::fprintf(stderr,
                 "error: the input holds %lld non-finite values (NaN or Inf); pass --allow-nonfinite to "
                 "quantize them anyway\n",
                 (long long)nonfinite);
    return 1;
  }
  return 0;
}

}  // namespace

void add_quant_command(CLI::App& app) {
  auto* cmd =
      app.add_subcommand("quant", "Quantize a tensor (safetensors or random) and report SQNR, flushes and saturation");
  auto a = std::make_shared<QuantArgs>();
  cmd->add_option("--input", a->input, "safetensors file to read");
  cmd->add_option("--tensor", a->tensor,
                  "name of the tensor in --input (BF16, F16 or F32; converted to BF16); optional when it holds one");
  cmd->add_option("--random", a->random, "make a random M,K tensor instead of reading one");
  cmd->add_option("--dist", a->dist, "distribution of --random")
      ->check(CLI::IsMember({"normal", "lognormal", "outliers"}));
  cmd->add_option("--seed", a->seed, "seed of --random and of stochastic rounding");
  cmd->add_option("--format", a->format, "nvfp4, mxfp8, fp8-e4m3, fp8-e5m2, fp8-block128 or fp8-block128x128")
      ->required();
  cmd->add_flag("--2d", a->two_d, "NVFP4: 16x16 weight tiles");
  cmd->add_flag("--rht", a->rht, "NVFP4: random Hadamard transform on the column-wise copy");
  cmd->add_flag("--sr", a->sr, "NVFP4: stochastic rounding");
  cmd->add_flag("--4over6", a->four_over_six,
                "NVFP4: 4/6 adaptive block scaling (each block to 4 or 6, lower error; TransformerEngine's 4over6)");
  cmd->add_option("--fp4-4over6-err-mode", a->err_mode,
                  "NVFP4 --4over6: the block error that picks 4 or 6, mae (default, as TransformerEngine) or mse")
      ->check(CLI::IsMember({"mae", "mse"}));
  cmd->add_option("--device", a->device, "cpu, cuda or auto (cuda when a GPU is usable)");
  cmd->add_option("--out", a->out, "safetensors file for the codes, scales and amax");
  cmd->add_flag("--allow-nonfinite", a->allow_nonfinite,
                "quantize NaN/Inf inputs, write --out and exit 0 (without it they are reported and the exit is 1)");
  cmd->callback([a] { exit_code() = run_quant(*a); });
}

}  // namespace nb::cli
