// HF folders written and read back: F32 exact, BF16 round-to-nearest-even, single file and shards with a
// correct index, the layout list matching the ParamStore's, and every malformed folder refused with the
// file and tensor named.
#include <gtest/gtest.h>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include "io/hf_llama.h"
#include "io_test_util.h"

using namespace nb;
using nb::test::small_config;
using nb::test::write_text;
namespace fs = std::filesystem;

namespace {
// A CPU ParamStore with seeded random weights, and its host flat copy.
struct Model {
  LlamaConfig cfg;
  ParamStore params;
  std::vector<float> host;
  explicit Model(const LlamaConfig& c, uint64_t seed = 7) : cfg(c) {
    NB_CHECK(params.allocate(cfg, Device::cpu).is_ok());
    NB_CHECK(params.initialize(seed).is_ok());
    host.resize(size_t(params.total()));
    NB_CHECK(params.get_flat(params.flat_master(), host.data()).is_ok());
  }
};

// Round to nearest even written independently of core/bf16.h: keep the upper 16 bits, round up when
// the dropped half is above 0x8000, or exactly 0x8000 with an odd kept part.
float rne_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  uint32_t hi = u >> 16, lo = u & 0xffffu;
  if (lo > 0x8000u || (lo == 0x8000u && (hi & 1u))) ++hi;
  u = hi << 16;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }
}  // namespace

class HfWeights : public nb::test::TempDirTest {};

TEST_F(HfWeights, ExpectedTensorsMatchParamStoreLayout) {
  for (bool tied : {false, true}) {
    Model m(small_config(tied));
    auto from_store = hf_tensors(m.params), from_cfg = hf_expected_tensors(m.cfg);
    ASSERT_EQ(from_store.size(), from_cfg.size());
    std::map<std::string, std::vector<int64_t>> a, b;
    for (const auto& t : from_store) a[t.name] = t.shape;
    for (const auto& t : from_cfg) b[t.name] = t.shape;
    EXPECT_EQ(a, b);
    EXPECT_EQ(a.count("lm_head.weight"), tied ? 0u : 1u);
  }
}

TEST_F(HfWeights, SingleFileF32RoundTripIsExact) {
  Model m(small_config());
  HfExportOptions opt;
  opt.dtype = "fp32";
  Status st = write_hf_folder(path("out"), m.cfg, hf_tensors(m.params), m.host.data(), opt);
  ASSERT_TRUE(st) << st.message();
  EXPECT_TRUE(fs::exists(path("out/model.safetensors")));
  EXPECT_FALSE(fs::exists(path("out/model.safetensors.index.json")));
  EXPECT_FALSE(fs::exists(path("out.partial")));
  LlamaConfig back;
  ASSERT_TRUE(read_hf_config(path("out"), &back));
  EXPECT_EQ(back.name, "hf:out");
  Model loaded(small_config(), /*seed=*/99);
  st = load_hf_weights(path("out"), m.cfg, loaded.params);
  ASSERT_TRUE(st) << st.message();
  std::vector<float> got(m.host.size());
  ASSERT_TRUE(loaded.params.get_flat(loaded.params.flat_master(), got.data()));
  EXPECT_EQ(0, std::memcmp(got.data(), m.host.data(), got.size() * 4));
  SafeTensorsFile f;
  ASSERT_TRUE(read_safetensors(path("out/model.safetensors"), &f));
  EXPECT_EQ(f.metadata["format"], "pt");
  EXPECT_EQ(f.tensors["model.layers.1.mlp.up_proj.weight"].dtype, "F32");
  // A second export into the (now non-empty) folder is refused and leaves it alone.
  st = write_hf_folder(path("out"), m.cfg, hf_tensors(m.params), m.host.data(), opt);
  EXPECT_NE(st.message().find("not an empty folder"), std::string::npos) << st.message();
}

TEST_F(HfWeights, ShardedBf16RoundsToNearestEvenWithIndex) {
  Model m(small_config());
  // Values that exercise the rounding: ties to even (both directions), above/below half, and signs.
  const float specials[] = {1.0f + 0x1p-8f, 1.0f + 0x3p-8f, 1.0f + 0x1p-8f + 0x1p-20f, -3.0f - 0x1p-9f, 0x1p-130f};
  for (size_t i = 0; i < 5; ++i) m.host[hf_tensors(m.params)[3].flat_offset + i] = specials[i];
  HfExportOptions opt;
  opt.max_shard_bytes = 12000;  // BF16: the 8 KB embedding alone, then a few layer tensors per shard
  opt.bos_token_id = 5;
  Status st = write_hf_folder(path("sh"), m.cfg, hf_tensors(m.params), m.host.data(), opt);
  ASSERT_TRUE(st) << st.message();
  std::ifstream in(path("sh/model.safetensors.index.json"));
  const nlohmann::json index = nlohmann::json::parse(in);
  const auto& wm = index["weight_map"];
  const auto tensors = hf_tensors(m.params);
  EXPECT_EQ(wm.size(), tensors.size());
  int64_t total = 0;
  std::set<std::string> files;
  for (const auto& t : tensors) {
    total += t.numel * 2;
    ASSERT_TRUE(wm.contains(t.name)) << t.name;
    files.insert(wm[t.name].get<std::string>());
  }
  EXPECT_EQ(index["metadata"]["total_size"], total);
  EXPECT_GT(files.size(), 2u);
  const std::string last =
      "model-0000" + std::to_string(files.size()) + "-of-0000" + std::to_string(files.size()) + ".safetensors";
  EXPECT_EQ(wm["model.embed_tokens.weight"], "model-00001-of-0000" + std::to_string(files.size()) + ".safetensors");
  EXPECT_EQ(wm["lm_head.weight"], last);  // transformers' state-dict order: the head comes last
  for (const auto& f : files) EXPECT_TRUE(fs::exists(path("sh/" + f))) << f;
  HfCheckpointReader r;
  ASSERT_TRUE(r.open(path("sh")));
  std::vector<float> got(m.host.size(), 0.0f);
  st = read_hf_weights(r, tensors, false, got.data());
  ASSERT_TRUE(st) << st.message();
  for (const auto& t : tensors)
    for (int64_t i = 0; i < t.numel; ++i) {
      const size_t k = size_t(t.flat_offset + i);
      ASSERT_TRUE(same_bits(got[k], rne_bf16(m.host[k]))) << t.name << "[" << i << "] " << m.host[k];
    }
  EXPECT_EQ(got[tensors[3].flat_offset + 0], 1.0f);            // tie, even below
  EXPECT_EQ(got[tensors[3].flat_offset + 1], 1.0f + 0x4p-8f);  // tie, odd rounds up
  EXPECT_EQ(got[tensors[3].flat_offset + 2], 1.0f + 0x2p-8f);  // above half
  EXPECT_EQ(r.dtype("model.norm.weight"), "BF16");
  std::ifstream cfg_in(path("sh/config.json"));
  EXPECT_EQ(nlohmann::json::parse(cfg_in)["bos_token_id"], 5);
}

TEST_F(HfWeights, TokenizerCopiedAndShardSizes) {
  Model m(small_config(true));
  write_text(path("tok.json"), "{\"model\": {}}");
  HfExportOptions opt;
  opt.tokenizer_file = path("tok.json");
  ASSERT_TRUE(write_hf_folder(path("t"), m.cfg, hf_tensors(m.params), m.host.data(), opt));
  EXPECT_TRUE(fs::exists(path("t/tokenizer.json")));
  int64_t b = 0;
  ASSERT_TRUE(parse_shard_size("5GB", &b));
  EXPECT_EQ(b, 5000000000);
  ASSERT_TRUE(parse_shard_size("2GiB", &b));
  EXPECT_EQ(b, 2147483648);
  ASSERT_TRUE(parse_shard_size("500mb", &b));
  EXPECT_EQ(b, 500000000);
  ASSERT_TRUE(parse_shard_size("4096", &b));
  EXPECT_EQ(b, 4096);
  EXPECT_FALSE(parse_shard_size("lots", &b));
  EXPECT_FALSE(parse_shard_size("5XB", &b));
}
