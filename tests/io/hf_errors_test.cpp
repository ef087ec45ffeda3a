// Malformed HF folders are refused before anything is loaded, each with the file and tensor named:
// missing tensor, wrong shape, unexpected tensor, truncated shard, missing shard, an index that lies,
// and a config of another shape.
#include <gtest/gtest.h>
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
class HfErrors : public nb::test::TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    cfg_ = small_config();
    ASSERT_TRUE(params_.allocate(cfg_, Device::cpu));
    ASSERT_TRUE(params_.initialize(3));
    host_.resize(size_t(params_.total()));
    ASSERT_TRUE(params_.get_flat(params_.flat_master(), host_.data()));
  }
  // Writes folder `name` (one file, or shards when shard_bytes > 0) and returns its path.
  std::string export_to(const std::string& name, int64_t shard_bytes = 0) {
    HfExportOptions opt;
    if (shard_bytes > 0) opt.max_shard_bytes = shard_bytes;
    Status st = write_hf_folder(path(name), cfg_, hf_tensors(params_), host_.data(), opt);
    EXPECT_TRUE(st) << st.message();
    return path(name);
  }
  // Rewrites DIR/model.safetensors after `edit` changed its tensors.
  void rewrite(const std::string& dir, const std::function<void(SafeTensorsFile&)>& edit) {
    SafeTensorsFile f;
    ASSERT_TRUE(read_safetensors(dir + "/model.safetensors", &f));
    edit(f);
    ASSERT_TRUE(write_safetensors(dir + "/model.safetensors", f));
  }
  Status load(const std::string& dir) { return load_hf_weights(dir, cfg_, params_); }
  static void expect_has(const Status& st, std::initializer_list<const char*> parts) {
    ASSERT_FALSE(st);
    for (const char* p : parts) EXPECT_NE(st.message().find(p), std::string::npos) << st.message();
  }

  LlamaConfig cfg_;
  ParamStore params_;
  std::vector<float> host_;
};
}  // namespace

TEST_F(HfErrors, MissingWrongShapeAndExtraTensors) {
  const std::string d = export_to("a");
  rewrite(d, [](SafeTensorsFile& f) { f.tensors.erase("model.layers.1.mlp.gate_proj.weight"); });
  expect_has(load(d), {"model.layers.1.mlp.gate_proj.weight", "has no tensor", "[64, 32]"});

  const std::string e = export_to("b");
  rewrite(e, [](SafeTensorsFile& f) { f.tensors["model.layers.0.self_attn.k_proj.weight"].shape = {32, 16}; });
  expect_has(load(e), {"model.layers.0.self_attn.k_proj.weight", "[32, 16]", "[16, 32]", "model.safetensors"});

  const std::string x = export_to("c");
  rewrite(x, [](SafeTensorsFile& f) {
    f.tensors["model.layers.0.self_attn.q_proj.bias"] = {"BF16", {32}, std::vector<uint8_t>(64)};
  });
  expect_has(load(x), {"model.layers.0.self_attn.q_proj.bias", "no place"});

  // transformers' own leftovers are ignored.
  const std::string ok = export_to("d");
  rewrite(ok, [](SafeTensorsFile& f) {
    f.tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = {"F32", {4}, std::vector<uint8_t>(16)};
  });
  Status st = load(ok);
  EXPECT_TRUE(st) << st.message();

  const std::string q = export_to("e");
  rewrite(q, [](SafeTensorsFile& f) { f.tensors["model.norm.weight"].dtype = "I16"; });
  expect_has(load(q), {"model.norm.weight", "I16"});
}

TEST_F(HfErrors, TiedModelIgnoresLmHead) {
  cfg_ = small_config(/*tied=*/true);
  params_ = ParamStore();
  ASSERT_TRUE(params_.allocate(cfg_, Device::cpu));
  ASSERT_TRUE(params_.initialize(3));
  host_.assign(size_t(params_.total()), 0.0f);
  ASSERT_TRUE(params_.get_flat(params_.flat_master(), host_.data()));
  const std::string d = export_to("tied");
  SafeTensorsFile f;
  ASSERT_TRUE(read_safetensors(d + "/model.safetensors", &f));
  EXPECT_EQ(f.tensors.count("lm_head.weight"), 0u);
  rewrite(d, [](SafeTensorsFile& g) { g.tensors["lm_head.weight"] = g.tensors["model.embed_tokens.weight"]; });
  Status st = load(d);
  EXPECT_TRUE(st) << st.message();
}

TEST_F(HfErrors, TruncatedAndMissingShards) {
  const std::string d = export_to("s", 12000);
  std::ifstream in(d + "/model.safetensors.index.json");
  nlohmann::json index = nlohmann::json::parse(in);
  const std::string shard2 = index["weight_map"]["model.layers.0.self_attn.v_proj.weight"];
  const std::string p2 = d + "/" + shard2;
  fs::resize_file(p2, fs::file_size(p2) - 10);
  expect_has(load(d), {shard2.c_str(), "truncated"});
  fs::remove(p2);
  expect_has(load(d), {shard2.c_str(), "does not exist"});

  // An index that maps a tensor to a shard that does not hold it.
  const std::string e = export_to("t", 12000);
  std::ifstream in2(e + "/model.safetensors.index.json");
  nlohmann::json idx = nlohmann::json::parse(in2);
  idx["weight_map"]["model.norm.weight"] = idx["weight_map"]["model.embed_tokens.weight"];
  std::ofstream(e + "/model.safetensors.index.json") << idx.dump();
  expect_has(load(e), {"model.norm.weight", "does not hold it"});

  idx["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors";
  std::ofstream(e + "/model.safetensors.index.json") << idx.dump();
  expect_has(load(e), {"not a file in the folder"});

  fs::create_directories(path("empty"));
  write_text(path("empty/config.json"), hf_config_json(cfg_, "bfloat16", -1, -1));
  expect_has(load(path("empty")), {"neither model.safetensors"});
}

TEST_F(HfErrors, ConfigOfAnotherShape) {
  const std::string d = export_to("m");
  LlamaConfig other = cfg_;
  other.layers = 3;
  other.name = "three";
  ParamStore p;
  ASSERT_TRUE(p.allocate(other, Device::cpu));
  expect_has(load_hf_weights(d, other, p), {"config.json", "num_hidden_layers is 2", "'three' has 3"});
  other = cfg_;
  other.kv_heads = 4;
  ParamStore p2;
  ASSERT_TRUE(p2.allocate(other, Device::cpu));
  expect_has(load_hf_weights(d, other, p2), {"num_key_value_heads is 2", "has 4"});
}
