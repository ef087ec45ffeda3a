// LoRA adapters in PEFT's format: target parsing, a bit-exact FP32 round trip, the files as PEFT reads
// them (JSON fields, tensor names and shapes, read back independently of nibble's reader), the fused
// q/k/v and gate/up split, merging against an FP64 reference, and each refused input with its sentence.
#include <gtest/gtest.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <nlohmann/json.hpp>
#include "core/bf16.h"
#include "io/peft_adapter.h"
#include "io/safetensors.h"
#include "io_test_util.h"

using namespace nb;
using nb::test::small_config;
using nb::test::write_text;
namespace fs = std::filesystem;

namespace {
// small_config: hidden 32, q_dim 32, kv_dim 16, ffn 64, 2 layers.
LoraAdapter random_adapter(const LlamaConfig& c, const LoraSpec& spec, uint32_t seed) {
  LoraAdapter ad;
  lora_allocate(c, spec, &ad);
  ad.base_model_name_or_path = "/models/small";
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (LoraLinear& L : ad.linears) {
    for (float& v : L.a) v = u(rng);
    for (float& v : L.b) v = u(rng);
  }
  return ad;
}

LoraSpec spec_of(int64_t rank, double alpha, std::vector<LoraTarget> targets) {
  LoraSpec s;
  s.rank = rank;
  s.alpha = alpha;
  s.targets = std::move(targets);
  return s;
}

std::string peft_name(int64_t layer, const std::string& module, const char* ab) {
  return "base_model.model.model.layers." + std::to_string(layer) + "." + module + ".lora_" + ab + ".weight";
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// The safetensors header parsed by hand: the u64 length, then the JSON.
nlohmann::json read_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uint8_t len[8];
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(len[i]) << (8 * i);
  std::string text(n, '\0');
  in.read(text.data(), std::streamsize(n));
  return nlohmann::json::parse(text);
}

std::vector<float> as_floats(const SafeTensor& t) {
  std::vector<float> v(t.bytes.size() / 4);
  std::memcpy(v.data(), t.bytes.data(), t.bytes.size());
  return v;
}

// A float that FP16 represents exactly (normal range) as its IEEE half bits.
uint16_t exact_f16(float f) {
  if (f == 0.0f) return 0;
  int e = 0;
  const float m = std::frexp(std::fabs(f), &e);  // f = m * 2^e, m in [0.5, 1)
  return uint16_t((f < 0 ? 0x8000 : 0) | ((e - 1 + 15) << 10) | int((m * 2.0f - 1.0f) * 1024.0f));
}

void expect_has(const Status& st, std::initializer_list<const char*> parts) {
  ASSERT_FALSE(st);
  for (const char* p : parts) EXPECT_NE(st.message().find(p), std::string::npos) << st.message();
}

class PeftAdapter : public nb::test::TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    cfg_ = small_config();
  }
  std::string write(const std::string& name, const LoraAdapter& ad, const std::string& dtype = "fp32") {
    PeftWriteOptions opt;
    opt.dtype = dtype;
    Status st = write_peft_adapter(path(name), cfg_, ad, opt);
    EXPECT_TRUE(st) << st.message();
    return path(name);
  }
  // Rewrites DIR/adapter_model.safetensors after `edit` changed its tensors.
  static void edit_weights(const std::string& dir, const std::function<void(SafeTensorsFile&)>& edit) {
    SafeTensorsFile f;
    ASSERT_TRUE(read_safetensors(dir + "/adapter_model.safetensors", &f));
    edit(f);
    ASSERT_TRUE(write_safetensors(dir + "/adapter_model.safetensors", f));
  }
  static void edit_config(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = read_json(dir + "/adapter_config.json");
    edit(j);
    write_text(dir + "/adapter_config.json", j.dump(2));
  }
  Status read(const std::string& dir, LoraAdapter* out = nullptr) {
    LoraAdapter tmp;
    return read_peft_adapter(dir, cfg_, out ? out : &tmp);
  }

  LlamaConfig cfg_;
};
}  // namespace

TEST(PeftTargets, ParseNamesAndErrors) {
  std::vector<LoraTarget> t;
  ASSERT_TRUE(parse_lora_targets(" linear_fc2 , linear_qkv", &t));
  EXPECT_EQ(t, (std::vector<LoraTarget>{LoraTarget::linear_qkv, LoraTarget::linear_fc2}));
  ASSERT_TRUE(parse_lora_targets("all-linear", &t));
  EXPECT_EQ(t.size(), 4u);
  ASSERT_TRUE(parse_lora_targets("linear_qkv,linear_proj,linear_fc1,linear_fc2", &t));
  EXPECT_EQ(t, LoraSpec().targets);
  expect_has(parse_lora_targets("linear_qkv,q_proj", &t), {"'q_proj'", "linear_qkv, linear_proj", "all-linear"});
  expect_has(parse_lora_targets("linear_fc1,linear_fc1", &t), {"linear_fc1 twice"});
  expect_has(parse_lora_targets("", &t), {"empty name"});
  expect_has(parse_lora_targets("linear_qkv,", &t), {"empty name"});
  EXPECT_STREQ(lora_target_name(LoraTarget::linear_proj), "linear_proj");
}

TEST(PeftTargets, ShapesDefaultsAndScale) {
  const LlamaConfig c = small_config();
  int64_t in = 0, out = 0;
  lora_target_shape(c, LoraTarget::linear_qkv, &in, &out);
  EXPECT_EQ(in, 32);
  EXPECT_EQ(out, 32 + 2 * 16);
  lora_target_shape(c, LoraTarget::linear_proj, &in, &out);
  EXPECT_EQ(in, 32);
  EXPECT_EQ(out, 32);
  lora_target_shape(c, LoraTarget::linear_fc1, &in, &out);
  EXPECT_EQ(in, 32);
  EXPECT_EQ(out, 128);
  lora_target_shape(c, LoraTarget::linear_fc2, &in, &out);
  EXPECT_EQ(in, 64);
  EXPECT_EQ(out, 32);
  const LoraSpec d;  // Megatron-Bridge's defaults
  EXPECT_EQ(d.rank, 32);
  EXPECT_EQ(d.alpha, 32.0);
  EXPECT_EQ(d.dropout, 0.0);
  EXPECT_EQ(d.scale(), 1.0);
  LoraSpec rs = spec_of(16, 8, {LoraTarget::linear_qkv});
  EXPECT_EQ(rs.scale(), 0.5);
  rs.use_rslora = true;
  EXPECT_EQ(rs.scale(), 2.0);
  expect_has(validate(spec_of(0, 8, {LoraTarget::linear_qkv})), {"rank 0"});
  expect_has(validate(spec_of(8, -1, {LoraTarget::linear_qkv})), {"alpha"});
  expect_has(validate(spec_of(8, 8, {})), {"no targets"});
}

TEST_F(PeftAdapter, RoundTripFp32IsBitExact) {
  LoraSpec spec = spec_of(8, 16, LoraSpec().targets);
  spec.dropout = 0.05;
  const LoraAdapter ad = random_adapter(cfg_, spec, 1);
  const std::string dir = write("a", ad);
  EXPECT_FALSE(fs::exists(path("a.partial")));
  LoraAdapter back;
  Status st = read(dir, &back);
  ASSERT_TRUE(st) << st.message();
  EXPECT_EQ(back.spec.rank, 8);
  EXPECT_EQ(back.spec.alpha, 16.0);
  EXPECT_EQ(back.spec.dropout, 0.05);
  EXPECT_FALSE(back.spec.use_rslora);
  EXPECT_EQ(back.spec.targets, spec.targets);
  EXPECT_EQ(back.base_model_name_or_path, "/models/small");
  ASSERT_EQ(back.linears.size(), ad.linears.size());
  for (size_t i = 0; i < ad.linears.size(); ++i) {
    const LoraLinear &x = ad.linears[i], &y = back.linears[i];
    EXPECT_EQ(x.layer, y.layer);
    EXPECT_EQ(x.target, y.target);
    ASSERT_EQ(x.a.size(), y.a.size());
    ASSERT_EQ(x.b.size(), y.b.size());
    EXPECT_EQ(std::memcmp(x.a.data(), y.a.data(), x.a.size() * 4), 0) << i;
    EXPECT_EQ(std::memcmp(x.b.data(), y.b.data(), x.b.size() * 4), 0) << i;
  }
}

TEST_F(PeftAdapter, FilesAreWhatPeftReads) {
  const std::string dir = write("a", random_adapter(cfg_, spec_of(8, 32, LoraSpec().targets), 2));
  const nlohmann::json j = read_json(dir + "/adapter_config.json");
  EXPECT_EQ(j["peft_type"], "LORA");
  EXPECT_EQ(j["task_type"], "CAUSAL_LM");
  EXPECT_EQ(j["r"], 8);
  EXPECT_TRUE(j["lora_alpha"].is_number_integer());
  EXPECT_EQ(j["lora_alpha"], 32);
  EXPECT_EQ(j["lora_dropout"], 0.0);
  EXPECT_EQ(j["target_modules"],
            nlohmann::json({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}));
  EXPECT_EQ(j["bias"], "none");
  EXPECT_EQ(j["fan_in_fan_out"], false);
  EXPECT_EQ(j["use_rslora"], false);
  EXPECT_EQ(j["use_dora"], false);
  EXPECT_EQ(j["init_lora_weights"], true);
  EXPECT_TRUE(j["modules_to_save"].is_null());
  EXPECT_EQ(j["rank_pattern"], nlohmann::json::object());
  EXPECT_EQ(j["base_model_name_or_path"], "/models/small");

  const nlohmann::json h = read_header(dir + "/adapter_model.safetensors");
  EXPECT_EQ(h["__metadata__"]["format"], "pt");
  const std::map<std::string, std::vector<int64_t>> modules_b = {
      {"self_attn.q_proj", {32, 8}}, {"self_attn.k_proj", {16, 8}}, {"self_attn.v_proj", {16, 8}},
      {"self_attn.o_proj", {32, 8}}, {"mlp.gate_proj", {64, 8}},    {"mlp.up_proj", {64, 8}},
      {"mlp.down_proj", {32, 8}}};
  size_t count = 0;
  for (int64_t l = 0; l < 2; ++l)
    for (const auto& [m, b_shape] : modules_b) {
      const std::vector<int64_t> a_shape = {8, m == "self_attn.o_proj" ? 32 : m == "mlp.down_proj" ? 64 : 32};
      for (const auto& [ab, shape] : {std::pair{"A", a_shape}, std::pair{"B", b_shape}}) {
        const std::string n = peft_name(l, m, ab);
        ASSERT_TRUE(h.contains(n)) << n;
        EXPECT_EQ(h[n]["dtype"], "F32") << n;
        EXPECT_EQ(h[n]["shape"].get<std::vector<int64_t>>(), shape) << n;
        ++count;
      }
    }
  EXPECT_EQ(h.size(), count + 1);  // nothing but the 28 tensors and __metadata__
}

TEST_F(PeftAdapter, FusedRowsLandInTheirModules) {
  const int64_t r = 4;
  LoraAdapter ad = random_adapter(cfg_, spec_of(r, 4, LoraSpec().targets), 3);
  for (LoraLinear& L : ad.linears)
    for (int64_t i = 0; i < L.out; ++i)
      for (int64_t k = 0; k < r; ++k) L.b[size_t(i * r + k)] = float(i * 100 + k);  // row i of the fused B
  const std::string dir = write("a", ad);
  SafeTensorsFile f;
  ASSERT_TRUE(read_safetensors(dir + "/adapter_model.safetensors", &f));
  struct Case {
    const char* module;
    LoraTarget target;
    int64_t row0, rows;
  };
  const Case cases[] = {
      {"self_attn.q_proj", LoraTarget::linear_qkv, 0, 32},  {"self_attn.k_proj", LoraTarget::linear_qkv, 32, 16},
      {"self_attn.v_proj", LoraTarget::linear_qkv, 48, 16}, {"self_attn.o_proj", LoraTarget::linear_proj, 0, 32},
      {"mlp.gate_proj", LoraTarget::linear_fc1, 0, 64},     {"mlp.up_proj", LoraTarget::linear_fc1, 64, 64},
      {"mlp.down_proj", LoraTarget::linear_fc2, 0, 32}};
  for (const Case& cs : cases) {
    const std::vector<float> b = as_floats(f.tensors.at(peft_name(1, cs.module, "B")));
    ASSERT_EQ(b.size(), size_t(cs.rows * r)) << cs.module;
    for (int64_t i = 0; i < cs.rows; ++i)
      for (int64_t k = 0; k < r; ++k) ASSERT_EQ(b[size_t(i * r + k)], float((cs.row0 + i) * 100 + k)) << cs.module;
    const std::vector<float> a = as_floats(f.tensors.at(peft_name(1, cs.module, "A")));
    EXPECT_EQ(a, lora_find(ad, 1, cs.target)->a) << cs.module;  // each module holds a copy of the fused A
  }
}

namespace {
// The linear whose fused B rows HF tensor `name` takes (from *row0 on), or nullptr when it is not adapted.
const LoraLinear* adapted_by(const LoraAdapter& ad, const LlamaConfig& c, const std::string& name, int64_t* row0) {
  for (const LoraLinear& x : ad.linears)
    for (const PeftModule& pm : peft_modules(c, x.target))
      if (name == "model.layers." + std::to_string(x.layer) + "." + pm.path + ".weight") {
        *row0 = pm.row0;
        return &x;
      }
  return nullptr;
}

// Every merged element is the FP32 nearest to W + scale * (B A) computed in FP64.
void expect_merged(const LoraAdapter& ad, const LoraLinear& L, int64_t row0, const HfTensor& t,
                   const std::vector<float>& w, const std::vector<float>& merged) {
  const int64_t rows = t.shape[0], in = t.shape[1], r = ad.spec.rank;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < in; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < r; ++k) acc += double(L.b[size_t((row0 + i) * r + k)]) * double(L.a[size_t(k * in + j)]);
      const double ref = double(w[size_t(i * in + j)]) + ad.spec.scale() * acc;
      const float got = merged[size_t(i * in + j)];
      const double ulp = std::max(std::nextafter(got, INFINITY) - got, got - std::nextafter(got, -INFINITY));
      ASSERT_LE(std::fabs(double(got) - ref), 0.5 * ulp) << t.name << " [" << i << ", " << j << "]";
    }
}
}  // namespace

TEST_F(PeftAdapter, MergeMatchesFp64ReferenceAndLeavesOthersAlone) {
  for (const std::vector<LoraTarget>& targets :
       {LoraSpec().targets, std::vector<LoraTarget>{LoraTarget::linear_qkv, LoraTarget::linear_fc2}}) {
    const LoraAdapter ad = random_adapter(cfg_, spec_of(8, 12, targets), 4);
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> u(-0.1f, 0.1f);
    size_t merged = 0;
    for (const HfTensor& t : hf_expected_tensors(cfg_)) {
      std::vector<float> w(size_t(t.numel));
      for (float& v : w) v = u(rng);
      std::vector<float> m = w;
      Status st = lora_merge_into(ad, cfg_, t, m.data());
      ASSERT_TRUE(st) << st.message();
      int64_t row0 = 0;
      const LoraLinear* L = adapted_by(ad, cfg_, t.name, &row0);
      if (L) {
        ++merged;
        expect_merged(ad, *L, row0, t, w, m);
      } else {
        EXPECT_EQ(std::memcmp(m.data(), w.data(), w.size() * 4), 0) << t.name << " changed but is not adapted";
      }
    }
    EXPECT_EQ(merged, targets.size() == 4 ? 14u : 8u);  // 7 or 4 modules in each of 2 layers
  }
}

TEST_F(PeftAdapter, MergeOfALargeLinearSplitsRowsCorrectly) {
  LlamaConfig c = small_config();
  c.hidden = 512, c.ffn = 1024, c.heads = 8, c.kv_heads = 4, c.head_dim = 64, c.layers = 1;
  const LoraAdapter ad = random_adapter(c, spec_of(16, 16, {LoraTarget::linear_fc1}), 6);
  const HfTensor t{"model.layers.0.mlp.up_proj.weight", {1024, 512}, 0, 1024 * 512};
  std::vector<float> m(size_t(t.numel), 0.25f);
  ASSERT_TRUE(lora_merge_into(ad, c, t, m.data()));
  const LoraLinear& L = ad.linears[0];
  for (int64_t i : {0, 1, 511, 512, 777, 1023})
    for (int64_t j : {0, 3, 511}) {
      double acc = 0;
      for (int64_t k = 0; k < 16; ++k)
        acc += double(L.b[size_t((1024 + i) * 16 + k)]) * double(L.a[size_t(k * 512 + j)]);
      EXPECT_EQ(m[size_t(i * 512 + j)], float(0.25 + acc)) << i << ", " << j;
    }
  const HfTensor wrong{"model.layers.0.mlp.up_proj.weight", {512, 512}, 0, 512 * 512};
  expect_has(lora_merge_into(ad, c, wrong, m.data()), {"up_proj", "differ in shape"});
}

TEST_F(PeftAdapter, ReadsBf16AndF16AndRsLora) {
  LoraSpec spec = spec_of(4, 8, {LoraTarget::linear_proj});
  spec.use_rslora = true;
  LoraAdapter ad = random_adapter(cfg_, spec, 7);
  LoraAdapter back;
  ASSERT_TRUE(read(write("bf16", ad, "bf16"), &back));
  EXPECT_TRUE(back.spec.use_rslora);
  EXPECT_EQ(back.spec.scale(), 4.0);
  for (size_t i = 0; i < ad.linears.size(); ++i) {
    for (size_t e = 0; e < ad.linears[i].a.size(); ++e)
      ASSERT_EQ(back.linears[i].a[e], round_to_bf16(ad.linears[i].a[e]));
    for (size_t e = 0; e < ad.linears[i].b.size(); ++e)
      ASSERT_EQ(back.linears[i].b[e], round_to_bf16(ad.linears[i].b[e]));
  }
  // FP16 as other tools save it: values FP16 holds exactly.
  for (LoraLinear& L : ad.linears) {
    for (size_t e = 0; e < L.a.size(); ++e) L.a[e] = float(int(e % 61) - 30) / 64.0f;
    for (size_t e = 0; e < L.b.size(); ++e) L.b[e] = float(int(e % 37) - 18) / 8.0f;
  }
  const std::string dir = write("f16", ad);
  edit_weights(dir, [](SafeTensorsFile& f) {
    for (auto& [name, t] : f.tensors) {
      const std::vector<float> v = as_floats(t);
      t.dtype = "F16";
      t.bytes.resize(v.size() * 2);
      for (size_t e = 0; e < v.size(); ++e) {
        const uint16_t h = exact_f16(v[e]);
        std::memcpy(t.bytes.data() + 2 * e, &h, 2);
      }
    }
  });
  ASSERT_TRUE(read(dir, &back));
  for (size_t i = 0; i < ad.linears.size(); ++i) {
    EXPECT_EQ(back.linears[i].a, ad.linears[i].a);
    EXPECT_EQ(back.linears[i].b, ad.linears[i].b);
  }
}

TEST_F(PeftAdapter, MissingWrongShapeUnexpectedAndUnequalTensors) {
  const LoraAdapter ad = random_adapter(cfg_, spec_of(8, 8, LoraSpec().targets), 8);
  const std::string missing = write("missing", ad);
  edit_weights(missing, [](SafeTensorsFile& f) { f.tensors.erase(peft_name(1, "mlp.up_proj", "B")); });
  expect_has(read(missing), {peft_name(1, "mlp.up_proj", "B").c_str(), "has no tensor", "[64, 8]"});

  const std::string shape = write("shape", ad);
  edit_weights(shape, [](SafeTensorsFile& f) { f.tensors[peft_name(0, "self_attn.q_proj", "A")].shape = {32, 8}; });
  expect_has(read(shape), {peft_name(0, "self_attn.q_proj", "A").c_str(), "[32, 8]", "[8, 32]"});

  const std::string extra = write("extra", ad);
  edit_weights(extra, [](SafeTensorsFile& f) {
    f.tensors["base_model.model.lm_head.lora_A.weight"] = {"F32", {8, 32}, std::vector<uint8_t>(8 * 32 * 4)};
  });
  expect_has(read(extra), {"lm_head.lora_A.weight", "does not expect"});

  const std::string unequal = write("unequal", ad);
  edit_weights(unequal, [](SafeTensorsFile& f) {
    float v = 0;
    SafeTensor& t = f.tensors[peft_name(1, "self_attn.k_proj", "A")];
    std::memcpy(&v, t.bytes.data() + 4 * 37, 4);
    v = std::nextafter(v, 2.0f);
    std::memcpy(t.bytes.data() + 4 * 37, &v, 4);
  });
  expect_has(read(unequal), {"self_attn.k_proj.lora_A", "self_attn.q_proj", "[1, 5]", "one fused linear (linear_qkv)",
                             "must be equal"});
  const std::string gate = write("gate", ad);
  edit_weights(gate, [](SafeTensorsFile& f) { f.tensors[peft_name(0, "mlp.up_proj", "A")].bytes[0] ^= 1; });
  expect_has(read(gate), {"mlp.up_proj.lora_A", "gate_proj and up_proj", "linear_fc1"});
}

TEST_F(PeftAdapter, ConfigRefusals) {
  const LoraAdapter ad = random_adapter(cfg_, spec_of(8, 8, LoraSpec().targets), 9);
  struct Case {
    const char* name;
    std::function<void(nlohmann::json&)> edit;
    std::vector<const char*> parts;
  };
  const std::vector<Case> cases = {
      {"dora", [](auto& j) { j["use_dora"] = true; }, {"use_dora", "DoRA", "merge_and_unload"}},
      {"ranks",
       [](auto& j) {
         j["rank_pattern"] = {{"q_proj", 4}};
       },
       {"rank_pattern", "one rank"}},
      {"layers", [](auto& j) { j["layers_to_transform"] = {0}; }, {"layers_to_transform", "every layer"}},
      {"save", [](auto& j) { j["modules_to_save"] = {"lm_head"}; }, {"modules_to_save"}},
      {"pissa", [](auto& j) { j["init_lora_weights"] = "pissa_niter_4"; }, {"pissa_niter_4", "changes the base"}},
      {"ia3", [](auto& j) { j["peft_type"] = "IA3"; }, {"peft_type is \"IA3\"", "LORA"}},
      {"no_r", [](auto& j) { j.erase("r"); }, {"no field \"r\""}},
      {"qv",
       [](auto& j) {
         j["target_modules"] = {"q_proj", "v_proj", "o_proj"};
       },
       {"q_proj, v_proj but not k_proj", "linear_qkv"}},
      {"up", [](auto& j) { j["target_modules"] = {"up_proj"}; }, {"up_proj but not gate_proj", "linear_fc1"}},
      {"head",
       [](auto& j) {
         j["target_modules"] = {"q_proj", "k_proj", "v_proj", "lm_head"};
       },
       {"\"lm_head\""}},
      {"regex", [](auto& j) { j["target_modules"] = ".*proj"; }, {"pattern", "all-linear"}},
      {"json", [](auto& j) { j = "not an object"; }, {"JSON object"}}};
  for (const Case& cs : cases) {
    const std::string dir = write(cs.name, ad);
    edit_config(dir, cs.edit);
    Status st = read(dir);
    ASSERT_FALSE(st) << cs.name;
    EXPECT_NE(st.message().find("adapter_config.json"), std::string::npos) << st.message();
    for (const char* p : cs.parts)
      EXPECT_NE(st.message().find(p), std::string::npos) << cs.name << ": " << st.message();
  }
  // all-linear is PEFT's shorthand for every projection (the LM head excluded).
  const std::string all = write("all", ad);
  edit_config(all, [](auto& j) { j["target_modules"] = "all-linear"; });
  EXPECT_TRUE(read(all));
}

TEST_F(PeftAdapter, WriteRefusals) {
  const LoraAdapter ad = random_adapter(cfg_, spec_of(8, 8, LoraSpec().targets), 10);
  write_text(path("full/file.txt"), "x");
  expect_has(write_peft_adapter(path("full"), cfg_, ad), {"full", "not an empty folder"});
  EXPECT_TRUE(fs::exists(path("full/file.txt")));
  fs::create_directories(path("empty"));
  EXPECT_TRUE(write_peft_adapter(path("empty"), cfg_, ad));
  PeftWriteOptions opt;
  opt.dtype = "fp8";
  expect_has(write_peft_adapter(path("b"), cfg_, ad, opt), {"'fp8'", "fp32", "bf16"});
  LoraAdapter short_ad = ad;
  short_ad.linears.pop_back();
  expect_has(write_peft_adapter(path("c"), cfg_, short_ad), {"holds 7 linears", "need 8"});
  LlamaConfig other = cfg_;
  other.ffn = 96;
  expect_has(write_peft_adapter(path("d"), other, ad), {"linear_fc1", "another model or rank"});
  EXPECT_FALSE(fs::exists(path("b")) || fs::exists(path("c")) || fs::exists(path("d")));
  expect_has(read(path("nothing")), {"adapter_config.json", "save_pretrained"});
}
