// Helpers for the HF import/export tests: a per-test temporary folder, a small GQA Llama config with
// Llama 3.1 RoPE scaling, and file writers for hand-made config.json files.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <string>
#include "model/llama_config.h"

namespace nb::test {

class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           ("nibble_io_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::filesystem::path dir_;
};

inline void write_text(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path) << text;
}

// hidden 32, 2 layers, 4 heads / 2 KV heads of dim 8, ffn 64, vocab 128, llama3 RoPE scaling.
inline LlamaConfig small_config(bool tied = false) {
  LlamaConfig c;
  c.name = "small";
  c.hidden = 32;
  c.ffn = 64;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.vocab = 128;
  c.rope_theta = 10000.0;
  c.rope_factor = 8.0;
  c.rope_low_freq_factor = 1.0;
  c.rope_high_freq_factor = 4.0;
  c.rope_original_max_pos = 64;
  c.max_seq = 128;
  c.norm_eps = 1e-5f;
  c.tied_embeddings = tied;
  return c;
}

}  // namespace nb::test
