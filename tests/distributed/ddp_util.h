// Helpers of the data- and model-parallel CLI tests (ddp_test.cpp, ddp_overlap_test.cpp, cp_train_test.cpp,
// tp_train_test.cpp): the tiny jobs they run, a run through `nibble train --nproc-per-node`, its metrics.jsonl,
// a split run compared with one rank's, and the largest weight difference between two of their checkpoints.
#pragma once
#include <gtest/gtest.h>
#include "distributed/spawn.h"
#include <thread>
#include <chrono>
#include <unistd.h>
#include <sys/wait.h>
#include <signal.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>
#include "common/nibble_binary.h"
#include "io/safetensors.h"
#include "train/resume_util.h"

namespace nb {

inline constexpr double kLr = 3e-3;
inline const std::string kJob =
    " train --model tiny --device cpu --seq-length 64 --micro-batch-size 2 --global-batch-size 16 --lr 3e-3 "
    "--lr-warmup-iters 1 --log-interval 1 --num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 0 ";

struct StepLog {
  double loss = 0, grad_norm = 0;
};

// The model-parallel tests' job (cp_train_test.cpp, tp_train_test.cpp): a global batch of 8, at which the same
// learning rate keeps five steps' rounding differences small (see cp_train_test.cpp).
inline const std::string kModelParallelBase =
    " train --model tiny --device cpu --seq-length 64 --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 "
    "--lr-warmup-iters 1 --log-interval 1 ";

inline std::vector<StepLog> read_metrics(const std::string& save) {
  std::vector<StepLog> out;
  std::ifstream in(save + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("lm_loss"))
      out.push_back({j["lm_loss"].get<double>(), j["grad_norm"].get<double>()});
  }
  return out;
}

// A split run against one rank's: step 1's loss and gradient norm within 1e-6 relative, every later loss 1e-5.
inline void expect_same_run(const std::vector<StepLog>& got, const std::vector<StepLog>& ref, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  ASSERT_FALSE(ref.empty()) << what;
  EXPECT_NEAR(got[0].loss, ref[0].loss, 1e-6 * ref[0].loss) << what;
  EXPECT_NEAR(got[0].grad_norm, ref[0].grad_norm, 1e-6 * ref[0].grad_norm) << what;
  for (size_t i = 1; i < got.size(); ++i)
    EXPECT_NEAR(got[i].loss, ref[i].loss, 1e-5 * ref[i].loss) << what << ", step " << i + 1;
}

// Largest absolute difference between the FP32 tensors of two checkpoints' model files.
inline double max_weight_difference(const std::string& a_dir, const std::string& b_dir, int64_t iteration) {
  char it[32];
  std::snprintf(it, sizeof(it), "/iter_%07lld/model.safetensors", (long long)iteration);
  SafeTensorsFile a, b;
  EXPECT_TRUE(read_safetensors(a_dir + it, &a).is_ok()) << a_dir + it;
  EXPECT_TRUE(read_safetensors(b_dir + it, &b).is_ok()) << b_dir + it;
  double worst = 0;
  for (const auto& [name, ta] : a.tensors) {
    const SafeTensor& tb = b.tensors.at(name);
    EXPECT_EQ(ta.dtype, "F32");
    EXPECT_EQ(ta.bytes.size(), tb.bytes.size()) << name;
    for (size_t i = 0; i + 4 <= ta.bytes.size(); i += 4) {
      float x, y;
      std::memcpy(&x, ta.bytes.data() + i, 4);
      std::memcpy(&y, tb.bytes.data() + i, 4);
      worst = std::max(worst, double(std::fabs(x - y)));
    }
  }
  return worst;
}

inline std::string train(const std::string& dir, const std::string& recipe, int ranks, int iters,
                         const std::string& extra = "") {
  const std::string save = dir + "/" + recipe + "_" + std::to_string(ranks);
  const test::CliRun r = test::run_nibble(kJob + "--recipe " + recipe + " --train-iters " + std::to_string(iters) +
                                          " --nproc-per-node " + std::to_string(ranks) + " --save " + save +
                                          " --save-interval " + std::to_string(iters) + " " + extra);
  EXPECT_EQ(r.code, 0) << r.out;
  if (ranks > 1) {
    EXPECT_NE(r.out.find("data parallel: " + std::to_string(ranks) + " ranks (gloo"), std::string::npos) << r.out;
  }
  return save;
}

// Two ranks of `job` launched by hand; rank 1 is killed after rank 0 logs step 1: rank 0 must stop with a sentence
// naming itself and Gloo, not hang.
inline void expect_a_dead_rank_stops_rank0(const std::string& job, const std::string& name) {
  const std::string dir = test::temp_folder(name);
  int port = 0;
  ASSERT_TRUE(dist::find_free_port_pair(&port).is_ok());
  pid_t pids[2];
  for (int rank = 0; rank < 2; ++rank) {
    const std::string env = "RANK=" + std::to_string(rank) + " WORLD_SIZE=2 LOCAL_RANK=" + std::to_string(rank) +
                            " LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " ";
    const std::string cmd = "exec env " + env + "'" + test::nibble_binary() + "'" + job +
                            "--train-iters 2000 --distributed-timeout-minutes 1 > " + dir + "/rank" +
                            std::to_string(rank) + ".log 2>&1";
    pids[rank] = fork();
    if (pids[rank] == 0) {
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
  }
  // Let both ranks reach the training loop (rank 0 logs its first step), then kill rank 1.
  const auto t0 = std::chrono::steady_clock::now();
  while (test::file_bytes(dir + "/rank0.log").find("iteration        1/") == std::string::npos &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_EQ(::kill(pids[1], SIGKILL), 0);
  const auto killed = std::chrono::steady_clock::now();
  int status = 0;
  pid_t done = 0;
  while ((done = ::waitpid(pids[0], &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() - killed < std::chrono::seconds(90))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (done == 0) ::kill(pids[0], SIGKILL);
  ::waitpid(pids[1], nullptr, 0);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  const std::string log = test::file_bytes(dir + "/rank0.log");
  ASSERT_NE(done, 0) << "rank 0 still ran 90 s after rank 1 died:\n" << log;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << log;
  EXPECT_NE(log.find("rank 0"), std::string::npos) << log;
  EXPECT_NE(log.find("Gloo"), std::string::npos) << log;
  std::printf("rank 0 stopped %.2f s after rank 1 was killed\n", seconds);
}

}  // namespace nb
