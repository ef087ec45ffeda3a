// Optimizer offload checks shared by the CPU and CUDA tests (--optimizer-cpu-offload): the same job with
// the optimizer state on the device, half of it in host memory, and all of it there, gives the same
// losses (as doubles) and byte-identical checkpoints; a run saved and resumed across the switch (on ->
// off -> on) equals the uninterrupted run without offload; and the same through the CLI on 2 ranks with
// the distributed optimizer. Chunks of 16,384 elements make the tiny model stream through many of them.
#pragma once
#include <gtest/gtest.h>
#include <string>
#include <vector>
#include "common/nibble_binary.h"
#include "train/resume_util.h"

namespace nb::test {

inline constexpr double kOffloadChunkMb = 0.0625;  // 16,384 FP32 elements per array

inline void set_offload(TrainConfig* c, double fraction) {
  c->optimizer_cpu_offload = fraction > 0;
  c->optimizer_offload_fraction = fraction > 0 ? fraction : 1.0;
  c->optimizer_state_offload_chunk_size_mb = kOffloadChunkMb;
}

inline void expect_same_checkpoint(const std::string& a, const std::string& b, int64_t iteration,
                                   const std::string& what) {
  char it[32];
  std::snprintf(it, sizeof(it), "/iter_%07lld/", (long long)iteration);
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string x = file_bytes(a + it + f), y = file_bytes(b + it + f);
    ASSERT_FALSE(x.empty()) << a + it + f;
    EXPECT_TRUE(x == y) << what << ": " << f << " differs";
  }
}

// 6 steps without offload, with half and with all of the state in host memory.
inline void expect_offload_bit_exact(const std::string& device, const std::string& recipe, const std::string& dir,
                                     const std::string& data_prefix) {
  std::vector<double> ref;
  double ref_val = 0;
  for (double fraction : {0.0, 0.5, 1.0}) {
    TrainConfig c = resume_job(device, recipe, data_prefix);
    set_offload(&c, fraction);
    c.save = dir + "/" + recipe + "_offload_" + std::to_string(fraction);
    c.save_interval = 6;
    TrainSummary s;
    Status st = run_training(c, &s);
    ASSERT_TRUE(st.is_ok()) << st.message();
    ASSERT_EQ(s.losses.size(), 6u);
    if (fraction == 0.0) {
      ref = s.losses;
      ref_val = s.final_val_loss;
      continue;
    }
    const std::string what = recipe + " on " + device + ", offload fraction " + std::to_string(fraction);
    EXPECT_EQ(s.losses, ref) << what;  // exact double equality
    EXPECT_EQ(s.final_val_loss, ref_val) << what;
    expect_same_checkpoint(dir + "/" + recipe + "_offload_0.000000", c.save, 6, what);
  }
}

// Steps 1-2 with offload, save; 3-4 without, save; 5-6 with again: equal to 6 steps without offload.
inline void expect_offload_switch_resume(const std::string& device, const std::string& recipe, const std::string& dir,
                                         const std::string& data_prefix) {
  TrainConfig whole = resume_job(device, recipe, data_prefix);
  whole.save = dir + "/switch_whole";
  whole.save_interval = 6;
  TrainSummary sw;
  Status st = run_training(whole, &sw);
  ASSERT_TRUE(st.is_ok()) << st.message();
  std::vector<double> joined;
  const std::string save = dir + "/switch_parts";
  for (int part = 0; part < 3; ++part) {
    TrainConfig c = resume_job(device, recipe, data_prefix);
    set_offload(&c, part == 1 ? 0.0 : (part == 0 ? 1.0 : 0.5));
    c.save = save;
    c.save_interval = 6;
    c.exit_interval = part < 2 ? 2 * (part + 1) : 0;
    if (part > 0) c.load = save;
    TrainSummary s;
    st = run_training(c, &s);
    ASSERT_TRUE(st.is_ok()) << "part " << part << ": " << st.message();
    ASSERT_EQ(s.start_iteration, 2 * part);
    joined.insert(joined.end(), s.losses.begin(), s.losses.end());
  }
  EXPECT_EQ(joined, sw.losses) << recipe << " on " << device << ": offload on -> off -> on";
  expect_same_checkpoint(whole.save, save, 6, recipe + " across the offload switch");
}

// Through the CLI: `ranks` ranks with the distributed optimizer, with and without offload.
// `sharding`: how the ranks shard the state (the distributed optimizer, or Megatron-FSDP's flags).
inline void expect_offload_bit_exact_ranks(const std::string& device, const std::string& recipe, int ranks,
                                           const std::string& dir,
                                           const std::string& sharding = "--use-distributed-optimizer") {
  const std::string job = " train --model tiny --device " + device +
                          " --seq-length 64 --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 1 "
                          "--log-interval 1 --num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0 "
                          "--train-iters 4 --save-interval 4 " +
                          sharding + " --nproc-per-node " + std::to_string(ranks) + " --recipe " + recipe;
  const std::string off = dir + "/ranks_off", on = dir + "/ranks_on";
  const CliRun a = run_nibble(job + " --save " + off);
  ASSERT_EQ(a.code, 0) << a.out;
  const CliRun b = run_nibble(job + " --save " + on + " --optimizer-cpu-offload --optimizer-offload-fraction 0.5 " +
                              "--optimizer-state-offload-chunk-size-mb " + std::to_string(kOffloadChunkMb));
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_NE(b.out.find("host memory: optimizer state offloaded 50%"), std::string::npos) << b.out;
  EXPECT_NE(b.out.find("optimizer state in host mem (GiB)"), std::string::npos) << "the state stayed on the device";
  const std::string ma = file_bytes(off + "/metrics.jsonl"), mb = file_bytes(on + "/metrics.jsonl");
  auto losses = [](const std::string& text) {
    std::vector<std::string> out;
    for (size_t at = text.find("\"lm_loss\":"); at != std::string::npos; at = text.find("\"lm_loss\":", at + 1))
      out.push_back(text.substr(at, text.find_first_of(",}", at) - at));
    return out;
  };
  ASSERT_EQ(losses(ma).size(), 4u) << ma;
  EXPECT_EQ(losses(ma), losses(mb)) << recipe << " on " << ranks << " ranks";
  expect_same_checkpoint(off, on, 4, recipe + " on " + std::to_string(ranks) + " ranks");
}

}  // namespace nb::test
