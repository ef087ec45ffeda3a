// config.json: both transformers spellings parsed to the same LlamaConfig, unsupported values refused
// with the file and field named, and the written config read back (both spellings present in it).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include "io/hf_llama.h"
#include "io_test_util.h"

using namespace nb;
using nb::test::TempDirTest;
using nb::test::write_text;

namespace {
// The Hub's Llama 3.1 8B config.json (transformers 4.x spelling).
const char* kLlama31V4 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
  "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": false,
  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true,
  "vocab_size": 128256})";

// The same model as transformers 5.x saves it.
const char* kLlama31V5 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "bos_token_id": 128000, "dtype": "bfloat16",
  "eos_token_id": 128001, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32,
  "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_parameters": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_theta": 500000.0, "rope_type": "llama3"},
  "tie_word_embeddings": false, "vocab_size": 128256})";

void expect_llama31_8b(const LlamaConfig& c) {
  EXPECT_EQ(c.hidden, 4096);
  EXPECT_EQ(c.ffn, 14336);
  EXPECT_EQ(c.layers, 32);
  EXPECT_EQ(c.heads, 32);
  EXPECT_EQ(c.kv_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.vocab, 128256);
  EXPECT_EQ(c.max_seq, 131072);
  EXPECT_EQ(c.norm_eps, 1e-5f);
  EXPECT_FALSE(c.tied_embeddings);
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_factor, 8.0);
  EXPECT_EQ(c.rope_low_freq_factor, 1.0);
  EXPECT_EQ(c.rope_high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_original_max_pos, 8192);
}

std::string edited(const char* base, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = nlohmann::json::parse(base);
  edit(j);
  return j.dump();
}
}  // namespace

class HfConfig : public TempDirTest {};

TEST_F(HfConfig, ReadsBothSpellings) {
  write_text(path("Llama-3.1-8B/config.json"), kLlama31V4);
  write_text(path("v5/config.json"), kLlama31V5);
  LlamaConfig a, b;
  Status st = read_hf_config(path("Llama-3.1-8B"), &a);
  ASSERT_TRUE(st) << st.message();
  expect_llama31_8b(a);
  EXPECT_EQ(a.name, "hf:Llama-3.1-8B");
  st = read_hf_config(path("v5") + "/", &b);  // a trailing slash still names the folder
  ASSERT_TRUE(st) << st.message();
  expect_llama31_8b(b);
  EXPECT_EQ(b.name, "hf:v5");
}

TEST_F(HfConfig, DefaultRopeAndDefaults) {
  LlamaConfig c;
  // rope_scaling null (4.x), and rope_parameters with rope_type default (5.x): no scaling.
  auto v4 = edited(kLlama31V4, [](nlohmann::json& j) {
    j["rope_scaling"] = nullptr;
    j["rope_theta"] = 10000.0;
  });
  ASSERT_TRUE(parse_hf_config(v4, "v4", &c));
  EXPECT_EQ(c.rope_factor, 1.0);
  EXPECT_EQ(c.rope_theta, 10000.0);
  auto v5 = edited(kLlama31V5, [](nlohmann::json& j) {
    j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 20000.0}};
    j.erase("head_dim");
    j.erase("num_key_value_heads");
    j.erase("tie_word_embeddings");
  });
  ASSERT_TRUE(parse_hf_config(v5, "v5", &c));
  EXPECT_EQ(c.rope_factor, 1.0);
  EXPECT_EQ(c.rope_theta, 20000.0);
  EXPECT_EQ(c.head_dim, 4096 / 32);  // hidden / heads
  EXPECT_EQ(c.kv_heads, 32);         // defaults to heads
  EXPECT_FALSE(c.tied_embeddings);
  // Both spellings at once: rope_scaling wins (transformers 5.x does the same), theta from the top level.
  auto both = edited(kLlama31V4, [](nlohmann::json& j) {
    j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1.0}};
  });
  ASSERT_TRUE(parse_hf_config(both, "both", &c));
  expect_llama31_8b(c);
}

TEST_F(HfConfig, RefusesUnsupportedWithFieldNamed) {
  struct Case {
    std::function<void(nlohmann::json&)> edit;
    std::vector<std::string> expect;
  };
  const Case cases[] = {
      {[](nlohmann::json& j) { j["model_type"] = "mistral"; }, {"model_type", "mistral"}},
      {[](nlohmann::json& j) { j["architectures"] = {"MistralForCausalLM"}; }, {"architectures", "MistralForCausalLM"}},
      {[](nlohmann::json& j) { j["hidden_act"] = "gelu"; }, {"hidden_act", "gelu"}},
      {[](nlohmann::json& j) { j["attention_bias"] = true; }, {"attention_bias", "true"}},
      {[](nlohmann::json& j) { j["mlp_bias"] = true; }, {"mlp_bias", "true"}},
      {[](nlohmann::json& j) { j["rope_scaling"]["rope_type"] = "yarn"; }, {"rope_scaling.rope_type", "yarn"}},
      {[](nlohmann::json& j) {
         j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
       },
       {"rope_scaling.type", "linear"}},
      {[](nlohmann::json& j) { j["rope_scaling"].erase("low_freq_factor"); }, {"low_freq_factor"}},
      {[](nlohmann::json& j) { j.erase("hidden_size"); }, {"hidden_size"}},
      {[](nlohmann::json& j) { j["num_hidden_layers"] = -2; }, {"num_hidden_layers", "-2"}},
      {[](nlohmann::json& j) { j["partial_rotary_factor"] = 0.5; }, {"partial_rotary_factor", "0.5"}},
  };
  for (const Case& c : cases) {
    write_text(path("bad/config.json"), edited(kLlama31V4, c.edit));
    LlamaConfig out;
    Status st = read_hf_config(path("bad"), &out);
    ASSERT_FALSE(st);
    EXPECT_NE(st.message().find("config.json"), std::string::npos) << st.message();
    for (const auto& e : c.expect) EXPECT_NE(st.message().find(e), std::string::npos) << st.message();
  }
  LlamaConfig out;
  EXPECT_NE(read_hf_config(path("nowhere"), &out).message().find("config.json"), std::string::npos);
  write_text(path("junk/config.json"), "{not json");
  EXPECT_NE(read_hf_config(path("junk"), &out).message().find("not valid JSON"), std::string::npos);
}

TEST_F(HfConfig, WrittenConfigCarriesBothSpellingsAndReadsBack) {
  for (bool scaled : {true, false}) {
    LlamaConfig c = nb::test::small_config(/*tied=*/!scaled);
    if (!scaled) c.rope_factor = 1.0;
    const std::string text = hf_config_json(c, "bfloat16", 1, 2);
    const nlohmann::json j = nlohmann::json::parse(text);
    EXPECT_EQ(j["rope_theta"], 10000.0);
    EXPECT_EQ(j["torch_dtype"], "bfloat16");
    EXPECT_EQ(j["dtype"], "bfloat16");
    EXPECT_EQ(j["rms_norm_eps"].dump(), "1e-05");  // not 9.99999974737875e-06
    EXPECT_EQ(j["architectures"][0], "LlamaForCausalLM");
    EXPECT_EQ(j["bos_token_id"], 1);
    EXPECT_EQ(j["rope_parameters"]["rope_theta"], 10000.0);
    if (scaled) {
      EXPECT_EQ(j["rope_scaling"]["rope_type"], "llama3");
      EXPECT_EQ(j["rope_parameters"]["rope_type"], "llama3");
      EXPECT_EQ(j["rope_parameters"]["original_max_position_embeddings"], 64);
    } else {
      EXPECT_TRUE(j["rope_scaling"].is_null());
      EXPECT_EQ(j["rope_parameters"]["rope_type"], "default");
    }
    LlamaConfig back;
    Status st = parse_hf_config(text, "written", &back);
    ASSERT_TRUE(st) << st.message();
    EXPECT_EQ(back.hidden, c.hidden);
    EXPECT_EQ(back.kv_heads, c.kv_heads);
    EXPECT_EQ(back.head_dim, c.head_dim);
    EXPECT_EQ(back.tied_embeddings, c.tied_embeddings);
    EXPECT_EQ(back.rope_factor, c.rope_factor);
    if (scaled) {  // unused without scaling
      EXPECT_EQ(back.rope_original_max_pos, c.rope_original_max_pos);
    }
    EXPECT_EQ(back.norm_eps, c.norm_eps);
    EXPECT_EQ(back.max_seq, c.max_seq);
    // Each spelling alone (as 4.x and 5.x tools would see it) gives the same model.
    nlohmann::json only4 = j, only5 = j;
    only4.erase("rope_parameters");
    only5.erase("rope_scaling");
    only5.erase("rope_theta");
    for (const auto& v : {only4, only5}) {
      LlamaConfig one;
      ASSERT_TRUE(parse_hf_config(v.dump(), "one", &one));
      EXPECT_EQ(one.rope_factor, c.rope_factor);
      EXPECT_EQ(one.rope_theta, c.rope_theta);
      EXPECT_EQ(one.rope_high_freq_factor, c.rope_high_freq_factor);
    }
  }
}
