// `nibble export --load-hf BASE --adapter AD --merge-lora` end to end on the CPU: every adapted HF
// weight is W + scale * B A computed here from the PEFT file's own lora_A/lora_B tensors (FP64 sum over
// the rank in order, rounded once to FP32, as lora_merge_into documents), every other tensor is the
// base's bit for bit, a BF16 export is the RNE rounding of the FP32 merge, and the flag errors.
#include <gtest/gtest.h>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include "common/nibble_binary.h"
#include "core/bf16.h"
#include "io/hf_llama.h"
#include "io/peft_adapter.h"
#include "io/safetensors.h"
#include "io_test_util.h"

using namespace nb;
namespace fs = std::filesystem;

namespace {

class ExportLora : public nb::test::TempDirTest {
 protected:
  // A random FP32 HF folder at path("base") and a PEFT adapter (rank 4, alpha 12: scale 3) on
  // linear_qkv and linear_fc2 at path("ad"), so o_proj, gate_proj and up_proj stay unadapted.
  void SetUp() override {
    TempDirTest::SetUp();
    cfg_ = nb::test::small_config();
    std::mt19937 rng(21);
    std::uniform_real_distribution<float> u(-0.1f, 0.1f);
    for (const HfTensor& t : hf_expected_tensors(cfg_)) {
      std::vector<float>& w = base_[t.name];
      w.resize(size_t(t.numel));
      for (float& v : w) v = u(rng);
    }
    HfExportOptions opt;
    opt.dtype = "fp32";
    auto source = [this](const HfTensor& t, float* dst) {
      std::memcpy(dst, base_.at(t.name).data(), size_t(t.numel) * 4);
      return Status::ok();
    };
    Status st = write_hf_folder(path("base"), cfg_, hf_expected_tensors(cfg_), source, opt);
    ASSERT_TRUE(st) << st.message();

    LoraSpec spec;
    spec.rank = 4;
    spec.alpha = 12;
    spec.targets = {LoraTarget::linear_qkv, LoraTarget::linear_fc2};
    LoraAdapter ad;
    lora_allocate(cfg_, spec, &ad);
    std::uniform_real_distribution<float> ab(-1.f, 1.f);
    for (LoraLinear& L : ad.linears) {
      for (float& v : L.a) v = ab(rng);
      for (float& v : L.b) v = ab(rng);
    }
    st = write_peft_adapter(path("ad"), cfg_, ad);
    ASSERT_TRUE(st) << st.message();
  }

  // HF tensor name -> the PEFT names of its lora_A / lora_B ("" when the module is not adapted).
  static std::string peft_name(const std::string& hf_name, const char* ab) {
    const std::string suffix = ".weight";
    return "base_model.model." + hf_name.substr(0, hf_name.size() - suffix.size()) + ".lora_" + ab + ".weight";
  }

  static std::vector<float> floats(const SafeTensor& t) {
    EXPECT_EQ(t.dtype, "F32");
    std::vector<float> v(t.bytes.size() / 4);
    std::memcpy(v.data(), t.bytes.data(), t.bytes.size());
    return v;
  }

  // The expected merged FP32 weight of every tensor (the base where unadapted); counts adapted ones.
  std::map<std::string, std::vector<float>> expected(size_t* adapted) const {
    SafeTensorsFile ad;
    EXPECT_TRUE(read_safetensors(path("ad/adapter_model.safetensors"), &ad));
    const double scale = 12.0 / 4.0;
    std::map<std::string, std::vector<float>> want = base_;
    *adapted = 0;
    for (const HfTensor& t : hf_expected_tensors(cfg_)) {
      auto ia = ad.tensors.find(peft_name(t.name, "A")), ib = ad.tensors.find(peft_name(t.name, "B"));
      EXPECT_EQ(ia == ad.tensors.end(), ib == ad.tensors.end()) << t.name;
      if (ia == ad.tensors.end()) continue;
      ++*adapted;
      const std::vector<float> A = floats(ia->second), B = floats(ib->second);
      const int64_t rows = t.shape[0], in = t.shape[1], r = ia->second.shape[0];
      EXPECT_EQ(ia->second.shape, (std::vector<int64_t>{r, in})) << t.name;
      EXPECT_EQ(ib->second.shape, (std::vector<int64_t>{rows, r})) << t.name;
      std::vector<float>& w = want[t.name];
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < in; ++j) {
          double acc = 0;
          for (int64_t k = 0; k < r; ++k) acc += double(B[size_t(i * r + k)]) * double(A[size_t(k * in + j)]);
          w[size_t(i * in + j)] = float(double(w[size_t(i * in + j)]) + scale * acc);
        }
    }
    return want;
  }

  LlamaConfig cfg_;
  std::map<std::string, std::vector<float>> base_;
};

TEST_F(ExportLora, MergedWeightsAreBasePlusScaledBA) {
  auto r = nb::test::run_nibble("export --hf " + path("out") + " --load-hf " + path("base") + " --adapter " +
                                path("ad") + " --merge-lora --dtype fp32");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* part : {"merged LoRA adapter", "rank 4", "alpha 12 (scale 3)", "targets linear_qkv,linear_fc2",
                           "layers 0-1", "8 tensors"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << " missing from: " << r.out;

  size_t adapted = 0;
  const auto want = expected(&adapted);
  EXPECT_EQ(adapted, 8u);  // q, k, v and down_proj in each of 2 layers
  HfCheckpointReader out;
  ASSERT_TRUE(out.open(path("out")));
  size_t changed = 0;
  for (const HfTensor& t : hf_expected_tensors(cfg_)) {
    ASSERT_TRUE(out.has(t.name)) << t.name;
    EXPECT_EQ(out.dtype(t.name), "F32");
    std::vector<float> got(size_t(t.numel));
    ASSERT_TRUE(out.read_f32(t.name, got.data()));
    const std::vector<float>& w = want.at(t.name);
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(f32_bits(got[i]), f32_bits(w[i])) << t.name << "[" << i << "]: " << got[i] << " vs " << w[i];
    changed += std::memcmp(got.data(), base_.at(t.name).data(), got.size() * 4) != 0;
  }
  EXPECT_EQ(changed, adapted);  // exactly the adapted weights differ from the base

  // The default BF16 export rounds the FP32 merge once (RNE).
  r = nb::test::run_nibble("export --hf " + path("bf") + " --load-hf " + path("base") + " --adapter " + path("ad") +
                           " --merge-lora");
  ASSERT_EQ(r.code, 0) << r.out;
  HfCheckpointReader bf;
  ASSERT_TRUE(bf.open(path("bf")));
  for (const HfTensor& t : hf_expected_tensors(cfg_)) {
    EXPECT_EQ(bf.dtype(t.name), "BF16");
    std::vector<float> got(size_t(t.numel));
    ASSERT_TRUE(bf.read_f32(t.name, got.data()));
    const std::vector<float>& w = want.at(t.name);
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], round_to_bf16(w[i])) << t.name << "[" << i << "]";
  }
}

TEST_F(ExportLora, AdapterAndMergeLoraComeTogether) {
  auto r = nb::test::run_nibble("export --hf " + path("out") + " --load-hf " + path("base") + " --merge-lora");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--merge-lora needs --adapter DIR"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(path("out")));

  r = nb::test::run_nibble("export --hf " + path("out") + " --load-hf " + path("base") + " --adapter " + path("ad"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("nibble writes merged models only; pass --merge-lora"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(path("out")));

  // An adapter folder that is not one fails with read_peft_adapter's sentence and writes nothing.
  r = nb::test::run_nibble("export --hf " + path("out") + " --load-hf " + path("base") + " --adapter " +
                           path("nothing") + " --merge-lora");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("error:"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(path("out")));
}

}  // namespace
