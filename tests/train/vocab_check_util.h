// A Megatron dataset whose largest token id (300) is past the tiny model's vocabulary (256), and the
// job that must be refused before its first step on either backend.
#pragma once
#include <gtest/gtest.h>
#include "train/resume_util.h"

namespace nb::test {

inline std::string write_oversized_dataset(const std::string& dir) {
  const std::string prefix = dir + "/big_text_document";
  std::unique_ptr<IndexedDatasetWriter> w;
  EXPECT_TRUE(IndexedDatasetWriter::create(prefix, IndexedDtype::u16, &w).is_ok());
  for (int d = 0; d < 200; ++d) {
    std::vector<int32_t> doc(100);
    for (size_t i = 0; i < doc.size(); ++i) doc[i] = int32_t((d * 7 + i) % 200);
    if (d == 150) doc[40] = 300;  // one id, deep in the file
    EXPECT_TRUE(w->add_document(doc.data(), int64_t(doc.size())).is_ok());
  }
  EXPECT_TRUE(w->finalize().is_ok());
  return prefix;
}

inline void expect_refused_before_step_one(const std::string& device, const std::string& name) {
  const std::string dir = temp_folder(name);
  TrainConfig c = resume_job(device, "bf16_mixed", write_oversized_dataset(dir));
  TrainSummary s;
  Status st = run_training(c, &s);
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(s.steps, 0);
  EXPECT_TRUE(s.losses.empty());
  const std::string& m = st.message();
  EXPECT_NE(m.find("big_text_document.bin"), std::string::npos) << m;  // the file
  EXPECT_NE(m.find("token id 300"), std::string::npos) << m;           // the largest id
  EXPECT_NE(m.find("vocabulary of 256"), std::string::npos) << m;      // the vocabulary
  EXPECT_NE(m.find("--vocab-size 301"), std::string::npos) << m;       // what to do
}

}  // namespace nb::test
