// SR origin column segments (SrOrigin::col_segments, nvfp4.h): a tensor-parallel rank's shard of a fused
// projection's output (qkv: three column ranges of the whole; gate_up: two) quantized with the whole
// tensor's amaxes and its segments gives exactly the whole tensor's bytes for its columns, in both copies,
// with SR, SR + RHT and SR + 4/6. Controls: the same shard with a single origin gets other SR bytes, a
// one-segment origin equals the plain col0 origin, and the folded counters the CUDA kernels use
// (sr_block_index) follow the header's rule block by block. Bad segment lists are refused.
#include <gtest/gtest.h>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>
#include "formats/nvfp4/nvfp4.h"
#include "formats/nvfp4/nvfp4_math.h"
#include "formats/scalar_codecs.h"
#include "nvfp4/nvfp4_test_util.h"

namespace nb::nvfp4 {
// A named namespace: the tests of this folder compile as unity sources, so helper names must not clash.
namespace sr_segments_test {
using testing::HostQuantized;

// A run of the whole tensor's columns [start, start + width).
struct ColRange {
  int64_t start, width;
};

// Gaussian values with an outlier every 89 elements, so block scales vary and some blocks saturate.
std::vector<bf16> make_input(int64_t rows, int64_t cols, uint32_t seed) {
  auto x = testing::random_normal_bf16(rows * cols, seed);
  for (size_t i = 7; i < x.size(); i += 89) x[i] = f32_to_bf16(bf16_to_f32(x[i]) * 50.0f);
  return x;
}

// Rows [row0, row0 + rows) of the whole [*, whole_cols] input, its column ranges placed side by side.
std::vector<bf16> gather_columns(const std::vector<bf16>& x, int64_t whole_cols, int64_t row0, int64_t rows,
                                 const std::vector<ColRange>& ranges) {
  std::vector<bf16> out;
  for (int64_t r = row0; r < row0 + rows; ++r)
    for (const ColRange& g : ranges)
      out.insert(out.end(), x.begin() + (r * whole_cols + g.start), x.begin() + (r * whole_cols + g.start + g.width));
  return out;
}

// The segments of a shard made of `ranges`: the i-th range starts at the sum of the earlier widths.
SrOrigin shard_origin(int64_t row0, int64_t whole_rows, int64_t whole_cols, const std::vector<ColRange>& ranges) {
  SrOrigin o;
  o.row0 = row0;
  o.whole_rows = whole_rows;
  o.whole_cols = whole_cols;
  int64_t local = 0;
  for (const ColRange& g : ranges) {
    o.col_segments[o.n_col_segments++] = SrColSegment{local, g.start};
    local += g.width;
  }
  return o;
}

int64_t total_width(const std::vector<ColRange>& ranges) {
  int64_t w = 0;
  for (const ColRange& g : ranges) w += g.width;
  return w;
}

// The whole tensor's bytes of a shard (rows [row0, row0 + rows), columns `ranges`), sliced by hand: row copy
// lines are rows, each the ranges' bytes side by side (per_byte elements per byte); column copy lines are the
// ranges' columns in order, each the bytes of rows row0...
std::vector<uint8_t> row_copy_slice(const std::vector<uint8_t>& whole, int64_t whole_cols, int per_byte, int64_t row0,
                                    int64_t rows, const std::vector<ColRange>& ranges) {
  const int64_t pitch = whole_cols / per_byte;
  std::vector<uint8_t> s;
  for (int64_t r = row0; r < row0 + rows; ++r)
    for (const ColRange& g : ranges)
      s.insert(s.end(), whole.begin() + (r * pitch + g.start / per_byte),
               whole.begin() + (r * pitch + (g.start + g.width) / per_byte));
  return s;
}
std::vector<uint8_t> col_copy_slice(const std::vector<uint8_t>& whole, int64_t whole_rows, int per_byte, int64_t row0,
                                    int64_t rows, const std::vector<ColRange>& ranges) {
  const int64_t pitch = whole_rows / per_byte;
  std::vector<uint8_t> s;
  for (const ColRange& g : ranges)
    for (int64_t c = g.start; c < g.start + g.width; ++c)
      s.insert(s.end(), whole.begin() + (c * pitch + row0 / per_byte),
               whole.begin() + (c * pitch + (row0 + rows) / per_byte));
  return s;
}

// The shard quantized with the whole tensor's amaxes under opts (with the origin the caller chose).
HostQuantized quantize_shard(const std::vector<bf16>& x, int64_t whole_cols, const HostQuantized& whole,
                             const Options& opts, int64_t row0, int64_t rows, const std::vector<ColRange>& ranges) {
  const std::vector<bf16> local = gather_columns(x, whole_cols, row0, rows, ranges);
  HostQuantized q{rows, total_width(ranges)};
  q.row_amax = whole.row_amax;
  q.col_amax = whole.col_amax;
  const Status st = quantize_ref_with_amax(local.data(), opts, q.view());
  EXPECT_TRUE(st) << st.message();
  return q;
}

void expect_shard_matches(const HostQuantized& whole, const HostQuantized& p, int64_t row0,
                          const std::vector<ColRange>& ranges, const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t wr = whole.rows, wc = whole.cols, rows = p.rows;
  EXPECT_EQ(p.row_data, row_copy_slice(whole.row_data, wc, 2, row0, rows, ranges));
  EXPECT_EQ(p.row_scales, row_copy_slice(whole.row_scales, wc, 16, row0, rows, ranges));
  EXPECT_EQ(p.col_data, col_copy_slice(whole.col_data, wr, 2, row0, rows, ranges));
  EXPECT_EQ(p.col_scales, col_copy_slice(whole.col_scales, wr, 16, row0, rows, ranges));
}

// Rank r of T's columns of the fused qkv output [*, q + 2kv]: its q, k and v columns.
std::vector<ColRange> qkv_ranges(int64_t q, int64_t kv, int64_t t, int64_t r) {
  return {{r * q / t, q / t}, {q + r * kv / t, kv / t}, {q + kv + r * kv / t, kv / t}};
}

constexpr int64_t kM = 64, kQ = 128, kKv = 64, kN = kQ + 2 * kKv;

TEST(Nvfp4SrSegments, QkvShardsReproduceTheWholeTensorsBytes) {
  const auto x = make_input(kM, kN, 3);
  for (const testing::SrMode& mode : testing::sr_modes(RngKey{77, 5, 9})) {
    HostQuantized whole{kM, kN};
    ASSERT_TRUE(quantize_ref(x.data(), mode.opts, whole.view()));
    for (int64_t t : {2, 4})
      for (int64_t r = 0; r < t; ++r) {
        const auto ranges = qkv_ranges(kQ, kKv, t, r);
        const std::string what = std::string(mode.name) + " qkv rank " + std::to_string(r) + " of " + std::to_string(t);
        Options o = mode.opts;
        o.sr_origin = shard_origin(0, kM, kN, ranges);
        expect_shard_matches(whole, quantize_shard(x, kN, whole, o, 0, kM, ranges), 0, ranges, what);
        // Sequence parallelism's row chunk of the same shard: segments with a row origin.
        o.sr_origin = shard_origin(kM / 2, kM, kN, ranges);
        expect_shard_matches(whole, quantize_shard(x, kN, whole, o, kM / 2, kM / 2, ranges), kM / 2, ranges,
                             what + ", second half of the rows");
      }
  }
}

TEST(Nvfp4SrSegments, GateUpShardsReproduceTheWholeTensorsBytes) {
  const int64_t m = 48, f = 128, n = 2 * f;  // 48 rows: three 16-row blocks per column
  const auto x = make_input(m, n, 4);
  for (const testing::SrMode& mode : testing::sr_modes(RngKey{77, 5, 9})) {
    HostQuantized whole{m, n};
    ASSERT_TRUE(quantize_ref(x.data(), mode.opts, whole.view()));
    for (int64_t t : {2, 4})
      for (int64_t r = 0; r < t; ++r) {
        const std::vector<ColRange> ranges{{r * f / t, f / t}, {f + r * f / t, f / t}};
        Options o = mode.opts;
        o.sr_origin = shard_origin(0, m, n, ranges);
        expect_shard_matches(
            whole, quantize_shard(x, n, whole, o, 0, m, ranges), 0, ranges,
            std::string(mode.name) + " gate_up rank " + std::to_string(r) + " of " + std::to_string(t));
      }
  }
}

TEST(Nvfp4SrSegments, SingleOriginShardGetsOtherBytesAndOneSegmentIsCol0) {
  const auto x = make_input(kM, kN, 5);
  for (const testing::SrMode& mode : testing::sr_modes(RngKey{77, 5, 9})) {
    SCOPED_TRACE(mode.name);
    HostQuantized whole{kM, kN};
    ASSERT_TRUE(quantize_ref(x.data(), mode.opts, whole.view()));
    const auto ranges = qkv_ranges(kQ, kKv, 2, 1);
    // col0 = the q range's start: right for the q columns, wrong for k and v.
    Options o = mode.opts;
    o.sr_origin = SrOrigin{0, ranges[0].start, kM, kN};
    const HostQuantized p = quantize_shard(x, kN, whole, o, 0, kM, ranges);
    EXPECT_NE(p.row_data, row_copy_slice(whole.row_data, kN, 2, 0, kM, ranges));
    EXPECT_NE(p.col_data, col_copy_slice(whole.col_data, kM, 2, 0, kM, ranges));
    // One segment {0, col0} is the plain col0 origin.
    const std::vector<ColRange> one{{kQ / 2, kQ}};
    o.sr_origin = SrOrigin{0, kQ / 2, kM, kN};
    const HostQuantized by_col0 = quantize_shard(x, kN, whole, o, 0, kM, one);
    o.sr_origin = shard_origin(0, kM, kN, one);
    const HostQuantized by_segment = quantize_shard(x, kN, whole, o, 0, kM, one);
    EXPECT_EQ(by_col0.row_data, by_segment.row_data);
    EXPECT_EQ(by_col0.col_data, by_segment.col_data);
    expect_shard_matches(whole, by_segment, 0, one, "one segment");
  }
}

// whole_col(c) of the header's rule, written independently of the library.
int64_t whole_col_of(const SrOrigin& o, int64_t c) {
  int64_t w = o.col0 + c;
  for (int i = 0; i < o.n_col_segments; ++i)
    if (o.col_segments[i].local <= c) w = o.col_segments[i].whole + c - o.col_segments[i].local;
  return w;
}

TEST(Nvfp4SrSegments, ShardFollowsTheHeadersIndexRule) {
  // Element (r, c): row copy e = (row0 + r) * W_c + whole_col(c) with the key, column copy e = whole_col(c) *
  // W_r + row0 + r with stream ^ 1, checked element by element from the codec.
  const int64_t row0 = 16, rows = 32;
  const auto ranges = qkv_ranges(kQ, kKv, 4, 2);
  const auto whole_x = make_input(kM, kN, 6);
  const auto x = gather_columns(whole_x, kN, row0, rows, ranges);
  const int64_t cols = total_width(ranges);
  Options opts;
  opts.sr = true;
  opts.rng = RngKey{9, 2, 6};
  opts.sr_origin = shard_origin(row0, kM, kN, ranges);
  HostQuantized q{rows, cols};
  compute_amax_ref(whole_x.data(), kM, kN, false, &q.row_amax, &q.col_amax);
  ASSERT_TRUE(quantize_ref_with_amax(x.data(), opts, q.view()));
  const float s_enc = global_encode_scale(q.row_amax);
  RngKey kc = opts.rng;
  kc.stream ^= 1;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float v = bf16_to_f32(x[size_t(r * cols + c)]);
      const float enc_r = block_encode_scale(q.row_scales[size_t(r * (cols / 16) + c / 16)], s_enc);
      const int64_t e = (row0 + r) * kN + whole_col_of(opts.sr_origin, c);
      ASSERT_EQ(q.row_code(r, c), f32_to_e2m1_sr(v * enc_r, philox_byte(philox_block(opts.rng, e / 16), e % 16)));
      const float enc_c = block_encode_scale(q.col_scales[size_t(c * (rows / 16) + r / 16)], s_enc);
      const int64_t ec = whole_col_of(opts.sr_origin, c) * kM + row0 + r;
      ASSERT_EQ(q.col_code(c, r), f32_to_e2m1_sr(v * enc_c, philox_byte(philox_block(kc, ec / 16), ec % 16)));
    }
}

TEST(Nvfp4SrSegments, KernelCountersFollowTheHeadersRule) {
  // sr_block_index (nvfp4_math.h, the CUDA kernels' folded form) against the rule for every block of both
  // copies: qkv and gate_up shards, a plain col0 origin and the default one.
  std::vector<std::pair<SrOrigin, int64_t>> cases;  // origin, local cols; 32 rows of a 64 x 256 whole
  for (int64_t r = 0; r < 4; ++r) cases.push_back({shard_origin(32, kM, kN, qkv_ranges(kQ, kKv, 4, r)), 64});
  cases.push_back({shard_origin(0, kM, kN, {{32, 64}, {160, 64}}), 128});
  cases.push_back({SrOrigin{16, 48, kM, kN}, 160});
  cases.push_back({SrOrigin{}, 256});
  for (const auto& [o, cols] : cases) {
    const int64_t rows = 32, wr = o.whole_rows ? o.whole_rows : rows, wc = o.whole_cols ? o.whole_cols : cols;
    ASSERT_TRUE(check_shape(rows, cols, Options{.sr = true, .sr_origin = o}));
    const SrBlocks rb = sr_blocks(o, rows, cols, false), cb = sr_blocks(o, rows, cols, true);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; c += 16)
        ASSERT_EQ(sr_block_index(rb, r, c / 16), ((o.row0 + r) * wc + whole_col_of(o, c)) / 16) << r << ", " << c;
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t r = 0; r < rows; r += 16)
        ASSERT_EQ(sr_block_index(cb, c, r / 16), (whole_col_of(o, c) * wr + o.row0 + r) / 16) << c << ", " << r;
  }
}

TEST(Nvfp4SrSegments, CheckShapeRefusesBadSegments) {
  Options o;
  o.sr = true;
  o.sr_origin = shard_origin(0, kM, kN, qkv_ranges(kQ, kKv, 2, 1));
  EXPECT_TRUE(check_shape(kM, 128, o));
  const Options good = o;
  // Applies `edit` to the good origin and expects a refusal that names the segments; returns the message.
  auto refused = [&](const char* what, int64_t cols, auto edit) {
    Options bad = good;
    edit(bad.sr_origin);
    const Status st = check_shape(kM, cols, bad);
    EXPECT_FALSE(st) << what;
    if (!st) { EXPECT_NE(st.message().find("column segments"), std::string::npos) << what << ": " << st.message(); }
    return st ? std::string() : st.message();
  };
  const std::string five = refused("five segments", 128, [](SrOrigin& s) { s.n_col_segments = 5; });
  EXPECT_NE(five.find("at most 4 segments"), std::string::npos) << five;
  refused("negative count", 128, [](SrOrigin& s) { s.n_col_segments = -1; });
  refused("first local not 0", 128, [](SrOrigin& s) { s.col_segments[0].local = 16; });
  refused("unsorted", 128, [](SrOrigin& s) { std::swap(s.col_segments[1], s.col_segments[2]); });
  refused("empty segment", 128, [](SrOrigin& s) { s.col_segments[2].local = s.col_segments[1].local; });
  refused("segment past the tensor's columns", 96, [](SrOrigin&) {});
  refused("local not a multiple of 16", 128, [](SrOrigin& s) { s.col_segments[1].local = 72; });
  const std::string w16 =
      refused("whole not a multiple of 16", 128, [](SrOrigin& s) { s.col_segments[1].whole = 168; });
  EXPECT_NE(w16.find("(64, 168)"), std::string::npos) << w16;
  refused("negative whole", 128, [](SrOrigin& s) { s.col_segments[0].whole = -16; });
  refused("mapped past the whole", 128, [](SrOrigin& s) { s.col_segments[2].whole = kN - 16; });
  refused("col0 with segments", 128, [](SrOrigin& s) { s.col0 = 16; });

  // The quantizer refuses a bad list too, with or without SR.
  Options bad = good;
  bad.sr = false;
  bad.sr_origin.col_segments[1].local = 8;
  const std::vector<bf16> x(size_t(kM * 128));
  HostQuantized q{kM, 128};
  q.row_amax = q.col_amax = 1.0f;
  EXPECT_FALSE(quantize_ref_with_amax(x.data(), bad, q.view()));
}

}  // namespace sr_segments_test
}  // namespace nb::nvfp4
