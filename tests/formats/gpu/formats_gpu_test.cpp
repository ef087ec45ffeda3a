// CUDA == CPU reference, bit for bit, for the MXFP8, FP8 per-tensor and FP8 sub-channel quantizers
// on random and adversarial inputs, at small shapes (partial tiles, odd sizes) and at 8192x4096.
#include <gtest/gtest.h>
#include <cstring>
#include <vector>
#include "common/gpu.h"
#include "core/tensor.h"
#include "formats/fp8/fp8.h"
#include "formats/fp8/fp8_block.h"
#include "formats/fp8_test_inputs.h"
#include "formats/mor/mor_block.h"
#include "formats/mor/mor_stat.h"
#include "formats/mxfp8/mxfp8.h"
#include "formats/nvfp4/nvfp4.h"

using namespace nb;
using fmt_test::Dist;

namespace {

// Device allocation that frees itself; contents copied back with host().
struct Dev {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Dev(size_t n) : bytes(n) { NB_CHECK(device_malloc(&p, n ? n : 1).is_ok()); }
  ~Dev() { device_free(p); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
  template <typename T>
  std::vector<T> host() const {
    std::vector<T> v(bytes / sizeof(T));
    NB_CHECK(copy_bytes(v.data(), Device::cpu, p, Device::cuda, bytes).is_ok());
    return v;
  }
};

template <typename T>
Dev upload(const std::vector<T>& v) {
  Dev d(v.size() * sizeof(T));
  NB_CHECK(copy_bytes(d.p, Device::cuda, v.data(), Device::cpu, d.bytes).is_ok());
  return d;
}

// Compares bit patterns and reports the first difference.
template <typename T>
void expect_same_bits(const std::vector<T>& cpu, const std::vector<T>& gpu, const char* what) {
  ASSERT_EQ(cpu.size(), gpu.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < cpu.size(); ++i)
    if (std::memcmp(&cpu[i], &gpu[i], sizeof(T)) != 0 && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << cpu.size() << " differ, first at " << first << " (cpu "
                     << double(cpu[first]) << ", gpu " << double(gpu[first]) << ")";
}

const Dist kDists[] = {Dist::normal, Dist::lognormal, Dist::outliers, Dist::adversarial};

void check_mxfp8(int64_t rows, int64_t cols, Dist dist, bool nonfinite) {
  SCOPED_TRACE(testing::Message() << "MXFP8 " << rows << "x" << cols << " dist " << int(dist));
  auto x = fmt_test::make_input(rows, cols, dist, 42 + rows + cols, nonfinite);
  const size_t n = size_t(rows * cols);
  std::vector<uint8_t> rd(n), rs(n / 32), cd(n), cs(n / 32);
  int32_t bad = -1;
  ASSERT_TRUE(
      mxfp8::quantize_ref(x.data(), {}, {rows, cols, rd.data(), rs.data(), cd.data(), cs.data(), &bad}).is_ok());
  Dev dx = upload(x), drd(n), drs(n / 32), dcd(n), dcs(n / 32), dbad(4);
  mxfp8::QuantizedView v{
      rows, cols, drd.as<uint8_t>(), drs.as<uint8_t>(), dcd.as<uint8_t>(), dcs.as<uint8_t>(), dbad.as<int32_t>()};
  ASSERT_TRUE(mxfp8::quantize_cuda(dx.as<bf16>(), {}, v).is_ok());
  expect_same_bits(rd, drd.host<uint8_t>(), "row data");
  expect_same_bits(rs, drs.host<uint8_t>(), "row scales");
  expect_same_bits(cd, dcd.host<uint8_t>(), "col data");
  expect_same_bits(cs, dcs.host<uint8_t>(), "col scales");
  EXPECT_EQ(dbad.host<int32_t>()[0], bad);
  EXPECT_EQ(bad, nonfinite ? 1 : 0);
}

void check_fp8(int64_t rows, int64_t cols, Dist dist, fp8::Format fmt, bool pow2, bool nonfinite, bool delayed) {
  SCOPED_TRACE(testing::Message() << "FP8 " << fp8::format_name(fmt) << " " << rows << "x" << cols << " dist "
                                  << int(dist) << (pow2 ? " pow2" : "") << (delayed ? " delayed" : " current"));
  auto x = fmt_test::make_input(rows, cols, dist, 7 + rows * 3 + cols, nonfinite);
  const size_t n = size_t(rows * cols);
  std::vector<uint8_t> d(n), dt(n);
  float scale_inv = 0, amax = 0;
  int32_t bad = -1;
  const float scale = 3.7f;  // an arbitrary delayed-scaling scale: products are rounded, not exact
  fp8::TensorView hv{rows, cols, d.data(), dt.data(), &scale_inv, &amax, &bad};
  if (delayed)
    ASSERT_TRUE(fp8::quantize_with_scale_ref(x.data(), fmt, scale, hv).is_ok());
  else
    ASSERT_TRUE(fp8::quantize_current_ref(x.data(), fmt, pow2, hv).is_ok());
  Dev dx = upload(x), dd(n), ddt(n), dsi(4), dam(4), dbad(4), dscale = upload(std::vector<float>{scale});
  fp8::TensorView v{
      rows, cols, dd.as<uint8_t>(), ddt.as<uint8_t>(), dsi.as<float>(), dam.as<float>(), dbad.as<int32_t>()};
  if (delayed)
    ASSERT_TRUE(fp8::quantize_with_scale_cuda(dx.as<bf16>(), fmt, dscale.as<float>(), v).is_ok());
  else
    ASSERT_TRUE(fp8::quantize_current_cuda(dx.as<bf16>(), fmt, pow2, v).is_ok());
  expect_same_bits(d, dd.host<uint8_t>(), "data");
  expect_same_bits(dt, ddt.host<uint8_t>(), "transposed data");
  expect_same_bits(std::vector<float>{scale_inv}, dsi.host<float>(), "scale_inv");
  expect_same_bits(std::vector<float>{amax}, dam.host<float>(), "amax");
  EXPECT_EQ(dbad.host<int32_t>()[0], bad);
  EXPECT_EQ(bad, nonfinite ? 1 : 0);

  // Mixture of Representations: the statistic the quantizer adds while it encodes (tiled path) or in its own pass
  // (other shapes) equals the host sum over the reference's codes, which is what the CPU quantizer adds.
  mor::StatCell want, ref_cell;
  mor::add_fp8_stat_host(x.data(), d.data(), scale_inv, int64_t(n), fmt, &want);
  hv.mor_stat = &ref_cell;
  ASSERT_TRUE((delayed ? fp8::quantize_with_scale_ref(x.data(), fmt, scale, hv)
                       : fp8::quantize_current_ref(x.data(), fmt, pow2, hv))
                  .is_ok());
  Dev dcell = upload(std::vector<mor::StatCell>(1));
  v.mor_stat = dcell.as<mor::StatCell>();
  ASSERT_TRUE((delayed ? fp8::quantize_with_scale_cuda(dx.as<bf16>(), fmt, dscale.as<float>(), v)
                       : fp8::quantize_current_cuda(dx.as<bf16>(), fmt, pow2, v))
                  .is_ok());
  expect_same_bits(d, dd.host<uint8_t>(), "data, quantized with the MoR statistic");
  const mor::StatCell got = dcell.host<mor::StatCell>()[0];
  for (const mor::StatCell* c : {static_cast<const mor::StatCell*>(&ref_cell), &got}) {
    EXPECT_EQ(c->err_fixed, want.err_fixed) << (c == &got ? "gpu" : "cpu quantizer");
    EXPECT_EQ(c->nonzero, want.nonzero) << (c == &got ? "gpu" : "cpu quantizer");
    EXPECT_EQ(c->nonfinite, want.nonfinite) << (c == &got ? "gpu" : "cpu quantizer");
  }
  EXPECT_EQ(want.nonfinite > 0, nonfinite);
  // The NVFP4 ladder's E4M3 statistic without a copy, from the amax: on finite data with current, non-pow2 scaling it
  // is the quantizer's statistic (check_nvfp4_stat checks the GPU's against it).
  if (delayed || pow2 || nonfinite) return;
  mor::StatCell from_amax;
  mor::add_fp8_stat_from_amax_host(x.data(), int64_t(n), amax, fmt, &from_amax);
  EXPECT_EQ(from_amax.err_fixed, want.err_fixed) << "from the amax";
  EXPECT_EQ(from_amax.nonzero, want.nonzero) << "from the amax";
}

// The NVFP4 ladder's statistic on the GPU equals the host's bit for bit over the same reference row copy (1x16
// with RNE and SR, 16x16 tiles; non-finite inputs counted).
void check_nvfp4_stat(int64_t rows, int64_t cols, Dist dist, bool nonfinite, bool sr, bool two_d) {
  SCOPED_TRACE(testing::Message() << "NVFP4 statistic " << rows << "x" << cols << " dist " << int(dist)
                                  << (sr ? " sr" : "") << (two_d ? " 2D" : ""));
  auto x = fmt_test::make_input(rows, cols, dist, 11 + rows + 3 * cols, nonfinite);
  const size_t n = size_t(rows * cols);
  std::vector<uint8_t> data(n / 2), scales(n / 16);
  float amax = 0;
  int bad = 0;
  nvfp4::Options opt;
  opt.colwise = false;
  opt.sr = sr;
  opt.two_d = two_d;
  opt.rng = RngKey{3, 4, 5};
  ASSERT_TRUE(nvfp4::quantize_ref(x.data(), opt,
                                  {rows, cols, data.data(), scales.data(), nullptr, nullptr, &amax, nullptr, &bad})
                  .is_ok());
  mor::StatCell want;
  mor::add_nvfp4_stat_host(x.data(), rows, cols, data.data(), scales.data(), amax, &want);
  Dev dx = upload(x), dd = upload(data), ds = upload(scales), da = upload(std::vector<float>{amax});
  // Alone, and with the E4M3 statistic from the same amax in the same pass (the ladder's measured step).
  mor::StatCell want_e4m3;
  mor::add_fp8_stat_from_amax_host(x.data(), int64_t(n), amax, fp8::Format::e4m3, &want_e4m3);
  for (bool with_e4m3 : {false, true}) {
    Dev dcell = upload(std::vector<mor::StatCell>(1)), dcell8 = upload(std::vector<mor::StatCell>(1));
    ASSERT_TRUE(mor::add_nvfp4_stat_cuda(dx.as<bf16>(), rows, cols, dd.as<uint8_t>(), ds.as<uint8_t>(), da.as<float>(),
                                         dcell.as<mor::StatCell>(), with_e4m3 ? dcell8.as<mor::StatCell>() : nullptr,
                                         nullptr)
                    .is_ok());
    const mor::StatCell got = dcell.host<mor::StatCell>()[0], got8 = dcell8.host<mor::StatCell>()[0];
    EXPECT_EQ(got.err_fixed, want.err_fixed) << with_e4m3;
    EXPECT_EQ(got.nonzero, want.nonzero) << with_e4m3;
    EXPECT_EQ(got.nonfinite, want.nonfinite) << with_e4m3;
    if (!with_e4m3) continue;
    EXPECT_EQ(got8.err_fixed, want_e4m3.err_fixed) << "E4M3 in the same pass";
    EXPECT_EQ(got8.nonzero, want_e4m3.nonzero) << "E4M3 in the same pass";
    EXPECT_EQ(got8.nonfinite, want_e4m3.nonfinite) << "E4M3 in the same pass";
  }
  EXPECT_EQ(want.nonfinite > 0, nonfinite);
}

TEST(FormatsGpu, Nvfp4MorStatisticMatchesTheHost) {
  NB_REQUIRE_GPU();
  for (Dist d : kDists) {
    check_nvfp4_stat(32, 64, d, false, false, false);
    check_nvfp4_stat(48, 160, d, d == Dist::outliers, true, false);
    check_nvfp4_stat(64, 128, d, false, false, true);
  }
  check_nvfp4_stat(4096, 2048, Dist::normal, false, true, false);
}

// MoR's per-row ("per-channel") FP8 statistic: the GPU pass equals add_fp8_rowwise_stat_host bit for bit. offset: x
// starts that many elements into its buffer (1: not 16-byte aligned, so the scalar path).
void check_rowwise_stat(int64_t rows, int64_t cols, Dist dist, bool nonfinite, size_t offset = 0,
                        fp8::Format fmt = fp8::Format::e4m3) {
  SCOPED_TRACE(testing::Message() << "per-row statistic " << fp8::format_name(fmt) << " " << rows << "x" << cols
                                  << " dist " << int(dist) << " offset " << offset);
  const auto x = fmt_test::make_input(rows, cols, dist, 13 + rows + 5 * cols, nonfinite);
  mor::StatCell want;
  mor::add_fp8_rowwise_stat_host(x.data(), rows, cols, fmt, &want);
  std::vector<bf16> placed(offset, f32_to_bf16(0.0f));
  placed.insert(placed.end(), x.begin(), x.end());
  Dev dx = upload(placed), dcell = upload(std::vector<mor::StatCell>(1));
  ASSERT_TRUE(
      mor::add_fp8_rowwise_stat_cuda(dx.as<bf16>() + offset, rows, cols, fmt, dcell.as<mor::StatCell>(), nullptr)
          .is_ok());
  const mor::StatCell got = dcell.host<mor::StatCell>()[0];
  EXPECT_EQ(got.err_fixed, want.err_fixed);
  EXPECT_EQ(got.nonzero, want.nonzero);
  EXPECT_EQ(got.nonfinite, want.nonfinite);
  EXPECT_EQ(want.nonfinite > 0, nonfinite);
  EXPECT_GT(want.nonzero, 0u);
}

TEST(FormatsGpu, MorRowwiseStatisticMatchesTheHost) {
  NB_REQUIRE_GPU();
  for (Dist d : kDists) {
    check_rowwise_stat(7, 40, d, false);                 // a warp per row, 16-byte loads
    check_rowwise_stat(33, 45, d, d == Dist::outliers);  // odd columns: one element per load
    check_rowwise_stat(16, 4104, d, true);               // long rows: a block per row
    check_rowwise_stat(9, 2051, d, false);               // long odd rows
  }
  check_rowwise_stat(65536, 64, Dist::normal, false);    // many rows: the grid strides over them
  check_rowwise_stat(64, 28672, Dist::lognormal, true);  // the longest rows an 8B MLP's gradient has
  check_rowwise_stat(40, 48, Dist::outliers, false, 1);  // misaligned
  check_rowwise_stat(24, 200, Dist::lognormal, false, 0, fp8::Format::e5m2);
}

// MoR's block rule in training (mor_block.h): the BF16 operand, the E4M3 statistic and the block counts.
void check_mor_block_rule(int64_t rows, int64_t cols, Dist dist, bool nonfinite, const mor::BlockRule& rule) {
  SCOPED_TRACE(testing::Message() << "MoR block rule " << rows << "x" << cols << " dist " << int(dist) << " "
                                  << mor::scale_mode_name(rule.mode) << (rule.three_way ? " three-way" : ""));
  auto x = fmt_test::make_input(rows, cols, dist, 7 + rows + 13 * cols, nonfinite);
  std::vector<bf16> want(x.size());
  mor::StatCell want_stat;
  mor::BlockCounts want_counts;
  ASSERT_TRUE(mor::apply_block_rule_ref(x.data(), rows, cols, rule, want.data(), &want_stat, &want_counts).is_ok());
  Dev dx = upload(x), dout(x.size() * 2), dcell = upload(std::vector<mor::StatCell>(1)),
      dcounts = upload(std::vector<mor::BlockCounts>(1)), dscratch(4);
  ASSERT_TRUE(mor::apply_block_rule_cuda(dx.as<bf16>(), rows, cols, rule, dout.as<bf16>(), dcell.as<mor::StatCell>(),
                                         dcounts.as<mor::BlockCounts>(), dscratch.as<float>(), nullptr)
                  .is_ok());
  const std::vector<bf16> got = dout.host<bf16>();
  int mismatches = 0;
  for (size_t i = 0; i < x.size(); ++i) mismatches += got[i].bits != want[i].bits;
  EXPECT_EQ(mismatches, 0);
  const mor::StatCell stat = dcell.host<mor::StatCell>()[0];
  const mor::BlockCounts counts = dcounts.host<mor::BlockCounts>()[0];
  EXPECT_EQ(stat.err_fixed, want_stat.err_fixed);
  EXPECT_EQ(stat.nonzero, want_stat.nonzero);
  EXPECT_EQ(stat.nonfinite, want_stat.nonfinite);
  EXPECT_EQ(counts.e4m3, want_counts.e4m3);
  EXPECT_EQ(counts.e5m2, want_counts.e5m2);
  EXPECT_EQ(counts.bf16, want_counts.bf16);
  EXPECT_EQ(counts.nonfinite, want_counts.nonfinite);
}

// The NVFP4 ladder per block (apply_block_ladder_*): the operand, both statistics and the counts.
void check_mor_block_ladder(int64_t rows, int64_t cols, Dist dist, bool nonfinite, const mor::BlockRule& rule,
                            const mor::BlockLadder& top) {
  SCOPED_TRACE(testing::Message() << "MoR block ladder " << rows << "x" << cols << " dist " << int(dist) << " "
                                  << mor::scale_mode_name(rule.mode) << (top.sr ? " sr" : "") << " t "
                                  << top.threshold);
  auto x = fmt_test::make_input(rows, cols, dist, 3 + rows + 11 * cols, nonfinite);
  std::vector<bf16> want(x.size());
  mor::StatCell want_e4m3, want_nvfp4;
  mor::BlockCounts want_counts;
  ASSERT_TRUE(
      mor::apply_block_ladder_ref(x.data(), rows, cols, rule, top, want.data(), {&want_e4m3, &want_nvfp4, &want_counts})
          .is_ok());
  Dev dx = upload(x), dout(x.size() * 2), dcells = upload(std::vector<mor::StatCell>(2)),
      dcounts = upload(std::vector<mor::BlockCounts>(1)), dscratch(8);
  mor::StatCell* cells = dcells.as<mor::StatCell>();
  ASSERT_TRUE(mor::apply_block_ladder_cuda(dx.as<bf16>(), rows, cols, rule, top, dout.as<bf16>(),
                                           {cells, cells + 1, dcounts.as<mor::BlockCounts>()}, dscratch.as<float>(),
                                           nullptr)
                  .is_ok());
  const std::vector<bf16> got = dout.host<bf16>();
  int mismatches = 0;
  for (size_t i = 0; i < x.size(); ++i) mismatches += got[i].bits != want[i].bits;
  EXPECT_EQ(mismatches, 0);
  const std::vector<mor::StatCell> stats = dcells.host<mor::StatCell>();
  for (int k = 0; k < 2; ++k) {
    const mor::StatCell& w = k == 0 ? want_e4m3 : want_nvfp4;
    EXPECT_EQ(stats[size_t(k)].err_fixed, w.err_fixed) << k;
    EXPECT_EQ(stats[size_t(k)].nonzero, w.nonzero) << k;
    EXPECT_EQ(stats[size_t(k)].nonfinite, w.nonfinite) << k;
  }
  const mor::BlockCounts counts = dcounts.host<mor::BlockCounts>()[0];
  EXPECT_EQ(counts.nvfp4, want_counts.nvfp4);
  EXPECT_EQ(counts.e4m3, want_counts.e4m3);
  EXPECT_EQ(counts.e5m2, want_counts.e5m2);
  EXPECT_EQ(counts.bf16, want_counts.bf16);
  EXPECT_EQ(counts.nonfinite, want_counts.nonfinite);
}

void check_block(int64_t rows, int64_t cols, Dist dist, fp8::BlockKind kind, bool pow2, bool nonfinite) {
  SCOPED_TRACE(testing::Message() << "FP8 block " << (kind == fp8::BlockKind::vec128 ? "1x128 " : "128x128 ") << rows
                                  << "x" << cols << " dist " << int(dist) << (pow2 ? " pow2" : ""));
  auto x = fmt_test::make_input(rows, cols, dist, 99 + rows + 5 * cols, nonfinite);
  const size_t n = size_t(rows * cols);
  const size_t nrs = size_t(fp8::block_scale_count(kind, rows, cols, false)),
               ncs = size_t(fp8::block_scale_count(kind, rows, cols, true));
  std::vector<uint8_t> rd(n), cd(n);
  std::vector<float> rs(nrs), cs(ncs);
  int32_t bad = -1;
  fp8::BlockOptions opt{kind, pow2};
  ASSERT_TRUE(
      fp8::quantize_block_ref(x.data(), opt, {rows, cols, rd.data(), rs.data(), cd.data(), cs.data(), &bad}).is_ok());
  Dev dx = upload(x), drd(n), dcd(n), drs(nrs * 4), dcs(ncs * 4), dbad(4);
  fp8::BlockView v{
      rows, cols, drd.as<uint8_t>(), drs.as<float>(), dcd.as<uint8_t>(), dcs.as<float>(), dbad.as<int32_t>()};
  ASSERT_TRUE(fp8::quantize_block_cuda(dx.as<bf16>(), opt, v).is_ok());
  expect_same_bits(rd, drd.host<uint8_t>(), "row data");
  expect_same_bits(rs, drs.host<float>(), "row scale_inv");
  expect_same_bits(cd, dcd.host<uint8_t>(), "transposed data");
  expect_same_bits(cs, dcs.host<float>(), "transposed scale_inv");
  EXPECT_EQ(dbad.host<int32_t>()[0], bad);
}

}  // namespace

TEST(FormatsGpu, MorBlockRuleMatchesTheHost) {
  NB_REQUIRE_GPU();
  for (mor::ScaleMode mode : {mor::ScaleMode::amax, mor::ScaleMode::gam, mor::ScaleMode::pow2})
    for (bool three : {false, true})
      for (Dist d : kDists) {
        const mor::BlockRule rule{three, mode, d == Dist::outliers ? 0.02 : 0.045};
        check_mor_block_rule(256, 384, d, d == Dist::adversarial, rule);
        check_mor_block_rule(200, 300, d, d == Dist::normal, rule);
      }
  check_mor_block_rule(4096, 2048, Dist::outliers, false, mor::BlockRule{false, mor::ScaleMode::gam, 0.045});
}

TEST(FormatsGpu, MorBlockLadderMatchesTheHost) {
  NB_REQUIRE_GPU();
  const RngKey key{21, 4, 0x1302};
  for (mor::ScaleMode mode : {mor::ScaleMode::amax, mor::ScaleMode::gam, mor::ScaleMode::pow2})
    for (bool sr : {false, true})
      for (Dist d : kDists) {
        const mor::BlockRule rule{false, mode, 0.045};
        for (mor::Nvfp4Blocks b : {mor::Nvfp4Blocks::tiles, mor::Nvfp4Blocks::rows, mor::Nvfp4Blocks::cols}) {
          // 0.2: inside the normal blocks' errors
          const mor::BlockLadder top{d == Dist::normal ? 0.2 : 0.3, sr, key, b};
          check_mor_block_ladder(256, 384, d, d == Dist::adversarial, rule, top);
          check_mor_block_ladder(208, 304, d, d == Dist::normal && sr, rule, top);  // clipped blocks
        }
      }
  check_mor_block_ladder(128, 256, Dist::lognormal, false, mor::BlockRule{true, mor::ScaleMode::gam, 0.045},
                         mor::BlockLadder{0.3, false, key});  // three-way below the NVFP4 rung
  check_mor_block_ladder(4096, 2048, Dist::outliers, false, mor::BlockRule{false, mor::ScaleMode::gam, 0.045},
                         mor::BlockLadder{0.3, true, key});
  check_mor_block_ladder(4096, 2048, Dist::outliers, false, mor::BlockRule{false, mor::ScaleMode::gam, 0.045},
                         mor::BlockLadder{0.3, true, key, mor::Nvfp4Blocks::cols});
}

TEST(FormatsGpu, Mxfp8MatchesReferenceSmall) {
  NB_REQUIRE_GPU();
  for (auto [r, c] : {std::pair<int64_t, int64_t>{32, 32}, {96, 160}, {64, 64}, {160, 96}, {64, 544}})
    for (Dist d : kDists) check_mxfp8(r, c, d, false);
  check_mxfp8(96, 160, Dist::normal, true);
}

TEST(FormatsGpu, Mxfp8MatchesReferenceLarge) {
  NB_REQUIRE_GPU();
  check_mxfp8(8192, 4096, Dist::outliers, false);
  check_mxfp8(8192, 4096, Dist::adversarial, false);
}

TEST(FormatsGpu, Fp8PerTensorMatchesReferenceSmall) {
  NB_REQUIRE_GPU();
  for (auto [r, c] : {std::pair<int64_t, int64_t>{1, 1}, {37, 53}, {64, 64}, {130, 7}, {72, 136}, {8, 8}})
    for (Dist d : kDists)
      for (auto f : {fp8::Format::e4m3, fp8::Format::e5m2}) {
        check_fp8(r, c, d, f, false, false, false);
        check_fp8(r, c, d, f, false, false, true);
      }
  check_fp8(37, 53, Dist::lognormal, fp8::Format::e4m3, true, false, false);
  check_fp8(37, 53, Dist::normal, fp8::Format::e4m3, false, true, false);
  check_fp8(37, 53, Dist::normal, fp8::Format::e5m2, false, true, true);
  check_fp8(72, 136, Dist::normal, fp8::Format::e4m3, false, true, false);  // non-finite on the tiled path
}

TEST(FormatsGpu, Fp8PerTensorMatchesReferenceLarge) {
  NB_REQUIRE_GPU();
  check_fp8(8192, 4096, Dist::outliers, fp8::Format::e4m3, false, false, false);
  check_fp8(8192, 4096, Dist::adversarial, fp8::Format::e5m2, false, false, false);
  check_fp8(8192, 4096, Dist::normal, fp8::Format::e4m3, false, false, true);
}

TEST(FormatsGpu, Fp8BlockMatchesReferenceSmall) {
  NB_REQUIRE_GPU();
  for (auto kind : {fp8::BlockKind::vec128, fp8::BlockKind::blk128x128})
    for (auto [r, c] : {std::pair<int64_t, int64_t>{128, 128}, {256, 384}, {384, 128}})
      for (Dist d : kDists) {
        check_block(r, c, d, kind, false, false);
        check_block(r, c, d, kind, true, false);
      }
  check_block(256, 384, Dist::normal, fp8::BlockKind::vec128, false, true);
}

TEST(FormatsGpu, Fp8BlockMatchesReferenceLarge) {
  NB_REQUIRE_GPU();
  check_block(8192, 4096, Dist::outliers, fp8::BlockKind::vec128, false, false);
  check_block(8192, 4096, Dist::adversarial, fp8::BlockKind::blk128x128, true, false);
}
