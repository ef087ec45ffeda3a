// `nibble export` and `nibble eval` end to end on the CPU: eval of an exported folder equals the
// in-process forward pass bit for bit, and a BF16 re-export with small shards loads back as the RNE
// rounding of the original.
#include <gtest/gtest.h>
#include <cstring>
#include <filesystem>
#include "common/nibble_binary.h"
#include "core/bf16.h"
#include "io/hf_llama.h"
#include "io_test_util.h"
#include "model/llama_model.h"

using namespace nb;
namespace fs = std::filesystem;

class HfCli : public nb::test::TempDirTest {};

TEST_F(HfCli, EvalAndExportRoundTrip) {
  const LlamaConfig cfg = nb::test::small_config();
  const int64_t B = 2, S = 9;
  LlamaModel model;
  ASSERT_TRUE(model.init(cfg, Device::cpu, {B, S}, Recompute::none, 11));
  std::vector<float> host(size_t(model.params().total()));
  ASSERT_TRUE(model.params().get_flat(model.params().flat_master(), host.data()));
  HfExportOptions opt;
  opt.dtype = "fp32";
  ASSERT_TRUE(write_hf_folder(path("hf"), cfg, hf_tensors(model.params()), host.data(), opt));

  // tokens [B, S + 1]
  SafeTensorsFile tok;
  std::vector<int32_t> all(size_t(B * (S + 1))), in, labels;
  for (size_t i = 0; i < all.size(); ++i) all[i] = int32_t((i * 37 + 5) % size_t(cfg.vocab));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      in.push_back(all[size_t(b * (S + 1) + s)]);
      labels.push_back(all[size_t(b * (S + 1) + s + 1)]);
    }
  tok.tensors["tokens"] = {"I32", {B, S + 1}, std::vector<uint8_t>(all.size() * 4)};
  std::memcpy(tok.tensors["tokens"].bytes.data(), all.data(), all.size() * 4);
  ASSERT_TRUE(write_safetensors(path("tokens.safetensors"), tok));

  auto r = nb::test::run_nibble("eval --load-hf " + path("hf") + " --tokens " + path("tokens.safetensors") + " --out " +
                                path("out.safetensors") + " --device cpu");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("mean loss"), std::string::npos) << r.out;
  std::vector<float> logits(size_t(B * S * cfg.vocab));
  double loss_sum = 0;
  ASSERT_TRUE(model.forward_logits(in.data(), labels.data(), logits.data(), &loss_sum));
  SafeTensorsFile out;
  ASSERT_TRUE(read_safetensors(path("out.safetensors"), &out));
  EXPECT_EQ(out.tensors["logits"].shape, (std::vector<int64_t>{B, S, cfg.vocab}));
  EXPECT_EQ(0, std::memcmp(out.tensors["logits"].bytes.data(), logits.data(), logits.size() * 4));
  float loss = 0;
  std::memcpy(&loss, out.tensors["loss"].bytes.data(), 4);
  EXPECT_EQ(loss, float(loss_sum / double(B * S)));

  r = nb::test::run_nibble("export --hf " + path("bf") + " --load-hf " + path("hf") +
                           " --dtype bf16 --max-shard-size 20KB");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(path("bf/model.safetensors.index.json")));
  ParamStore p;
  ASSERT_TRUE(p.allocate(cfg, Device::cpu));
  Status st = load_hf_weights(path("bf"), cfg, p);
  ASSERT_TRUE(st) << st.message();
  std::vector<float> got(host.size());
  ASSERT_TRUE(p.get_flat(p.flat_master(), got.data()));
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], round_to_bf16(host[i])) << i;

  r = nb::test::run_nibble("export --hf " + path("x") + " --load-hf " + path("nothing"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("config.json"), std::string::npos) << r.out;
  r = nb::test::run_nibble("eval --tokens " + path("tokens.safetensors") + " --out " + path("o2.safetensors"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("exactly one of --load"), std::string::npos) << r.out;
}
