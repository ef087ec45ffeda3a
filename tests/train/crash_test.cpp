// Nothing lost: SIGKILL at random moments of saves while the real binary saves a checkpoint every step (20
// times; each time the newest complete checkpoint loads and the next run resumes from it), truncated
// or bit-flipped checkpoint files refused by their checksums in one sentence, SIGTERM saves and exits
// cleanly, and a full disk or an unwritable folder during a save reported with earlier checkpoints kept.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <tuple>
#include <nlohmann/json.hpp>
#include "common/nibble_binary.h"
#include "io/file_util.h"
#include "train/checkpoint.h"
#include "train/resume_util.h"

extern char** environ;
using namespace nb;
namespace fs = std::filesystem;

namespace {

const std::string kJob = " train --model tiny --device cpu --seq-length 64 --log-interval 1000 --lr-warmup-iters 1 ";

// Starts `nibble ARGS...` (stdout/stderr to `log`) and returns its pid.
pid_t spawn_nibble(const std::string& args, const std::string& log) {
  const std::string cmd = "exec '" + test::nibble_binary() + "' " + args + " > '" + log + "' 2>&1";
  const char* argv[] = {"sh", "-c", cmd.c_str(), nullptr};
  pid_t pid = -1;
  EXPECT_EQ(posix_spawn(&pid, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ), 0);
  return pid;
}

// The tracker's checkpoint, fully verified (every checksum, every tensor read); -1 when none yet.
int64_t verified_latest(const std::string& dir) {
  CheckpointRef ref;
  bool found = false;
  Status st = find_checkpoint(dir, -1, &ref, &found);
  EXPECT_TRUE(st.is_ok()) << st.message();
  if (!st || !found) return -1;
  TrainConfig cfg;
  LlamaConfig model;
  st = checkpoint_config(ref, &cfg, &model);
  EXPECT_TRUE(st.is_ok()) << st.message();
  return st ? ref.iteration : -2;
}

bool has_partial_save(const std::string& dir) {
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().find(".tmp") != std::string::npos) return true;
  return false;
}

std::string slurp(const std::string& path) { return test::file_bytes(path); }

int count_saves(const std::string& log) {
  int n = 0;
  for (size_t at = log.find("saving checkpoint"); at != std::string::npos; at = log.find("saving checkpoint", at + 1))
    ++n;
  return n;
}

}  // namespace

// The job's extra flags: none, or the optimizer state in host memory (saves are written straight from it).
const char* const kOffload = "--optimizer-cpu-offload --optimizer-offload-fraction 0.5 ";
class CrashSafetyState : public ::testing::TestWithParam<const char*> {};

TEST_P(CrashSafetyState, SigkillDuringSavesAlwaysLeavesALoadableNewestCheckpoint) {
  const std::string kJob = ::kJob + GetParam();
  const std::string dir = test::temp_folder(std::string("sigkill") + (*GetParam() ? "_offload" : "")),
                    save = dir + "/run";
  std::mt19937 rng(2026);
  int64_t newest = -1, kills_mid_save = 0;
  for (int round = 0; round < 20; ++round) {
    const int64_t before = newest;  // what this round must resume from
    pid_t pid = spawn_nibble(
        kJob + "--train-iters 100000 --save " + save + " --load " + save + " --save-interval 1 --save-keep 2",
        dir + "/log.txt");
    // Kill at a random moment of a save, however slow this build runs (sanitizers): wait for the k-th
    // "saving checkpoint" line of this round (k = 1..3; the background write starts then), then a random
    // 0-40 ms, which lands in the middle of the write or just after it.
    const int k = 1 + int(rng() % 3);
    for (int waited = 0; waited < 60000 && count_saves(slurp(dir + "/log.txt")) < k; ++waited)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 40000));
    ASSERT_EQ(::kill(pid, SIGKILL), 0);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "round " << round << ": the run ended before the kill:\n"
                                     << slurp(dir + "/log.txt");
    if (fs::exists(save) && has_partial_save(save)) ++kills_mid_save;
    const int64_t latest = verified_latest(save);
    ASSERT_GE(latest, newest) << "round " << round << ": the newest checkpoint went backwards";
    newest = latest;
    // A round that got as far as saving had loaded first: it resumed from the newest checkpoint that
    // existed when it started (earlier rounds may have died before their first save completed).
    const std::string log = slurp(dir + "/log.txt");
    if (before >= 0 && log.find("saving checkpoint") != std::string::npos) {
      EXPECT_NE(log.find("resuming after iteration " + std::to_string(before) + ","), std::string::npos) << log;
    }
  }
  std::printf("20 kills: %lld landed while a save was being written; newest checkpoint iteration %lld\n",
              (long long)kills_mid_save, (long long)newest);
  EXPECT_GT(kills_mid_save, 0) << "no kill landed during a save; the test did not exercise what it should";
  ASSERT_GT(newest, 0);
  const test::CliRun r = test::run_nibble(kJob + "--train-iters " + std::to_string(newest + 2) + " --save " + save +
                                          " --load " + save + " --save-interval 1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resuming after iteration " + std::to_string(newest)), std::string::npos) << r.out;
}

INSTANTIATE_TEST_SUITE_P(CrashSafety, CrashSafetyState, ::testing::Values("", kOffload),
                         [](const auto& info) { return std::string(*info.param ? "offload" : "device"); });

TEST(CrashSafety, SigtermSavesAndExitsCleanly) {
  const std::string dir = test::temp_folder("sigterm"), save = dir + "/run";
  std::string job = kJob;
  job.replace(job.find("--log-interval 1000"), 19, "--log-interval 1");
  pid_t pid = spawn_nibble(job + "--train-iters 100000 --save " + save, dir + "/log.txt");
  // Signal once the loop runs (its first log line), however slowly this build starts (sanitizers, a
  // loaded machine): before that the handler is not installed yet and SIGTERM's default action applies.
  for (int i = 0; i < 1200 && slurp(dir + "/log.txt").find(" iteration ") == std::string::npos; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const std::string log = slurp(dir + "/log.txt");
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << log;
  EXPECT_NE(log.find("SIGTERM received"), std::string::npos) << log;
  EXPECT_GT(verified_latest(save), 0);
}

class DamagedCheckpoint : public ::testing::TestWithParam<std::tuple<const char*, const char*>> {};

TEST_P(DamagedCheckpoint, IsRefusedByItsChecksumInOneSentence) {
  const std::string what = std::get<0>(GetParam()), kJob = ::kJob + std::get<1>(GetParam());
  const std::string dir = test::temp_folder("damaged_" + what + (*std::get<1>(GetParam()) ? "_offload" : "")),
                    save = dir + "/run";
  ASSERT_EQ(test::run_nibble(kJob + "--train-iters 2 --save " + save + " --save-interval 1").code, 0);
  const std::string file = save + "/iter_0000002/" +
                           (what == "truncate"     ? "model.safetensors"
                            : what == "flip_state" ? "trainer_state.json"
                                                   : "optimizer.safetensors");
  std::string bytes = slurp(file);
  if (what == "truncate")
    bytes.resize(bytes.size() - 1000);
  else
    bytes[bytes.size() / 2] ^= 0x10;  // one bit
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  const test::CliRun r = test::run_nibble(kJob + "--train-iters 4 --load " + save);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("fails its checksum"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--ckpt-step"), std::string::npos) << r.out;  // what to do
  // The older checkpoint is untouched and still loads.
  const test::CliRun older = test::run_nibble(kJob + "--train-iters 3 --load " + save + " --ckpt-step 1");
  EXPECT_EQ(older.code, 0) << older.out;
}

INSTANTIATE_TEST_SUITE_P(Damage, DamagedCheckpoint,
                         ::testing::Combine(::testing::Values("truncate", "flip_model", "flip_state"),
                                            ::testing::Values("", kOffload)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param)) + (*std::get<1>(info.param) ? "_offload" : "");
                         });

// A state whose checksum is right but whose FP8 scale does not fit a float (written by hand, or by a
// bug) is refused in one sentence: converting such a double to float would be undefined behaviour.
TEST(CrashSafety, ChecksumValidStateWithAnOutOfRangeScaleIsRefused) {
  const std::string dir = test::temp_folder("float_range"), save = dir + "/run";
  const std::string job = kJob + "--recipe bf16_with_fp8_delayed_scaling_mixed ";
  ASSERT_EQ(test::run_nibble(job + "--train-iters 1 --save " + save + " --save-interval 1").code, 0);
  const std::string path = save + "/iter_0000001/trainer_state.json";
  auto state = nlohmann::json::parse(slurp(path));
  ASSERT_FALSE(state["fp8_delayed_scaling"].empty());
  state["fp8_delayed_scaling"][0]["roles"][0]["scale"] = 1e300;
  state.erase("state_crc32");  // the checksum covers the state as dumped without it
  const std::string canonical = state.dump();
  state["state_crc32"] = crc32_of(canonical.data(), canonical.size());
  std::ofstream(path, std::ios::trunc) << state.dump();
  const test::CliRun r = test::run_nibble(job + "--train-iters 2 --load " + save);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("outside float's range"), std::string::npos) << r.out;
}

// nibble train with `flags` under a file-size limit, which makes a checkpoint's write fail the way a full disk does
// (works for root too; SIGXFSZ is ignored so the write returns the error instead of killing the process). Returns the
// output; *status the exit status.
namespace {
std::string run_with_full_disk(const std::string& flags, int* status) {
  const std::string cmd =
      "sh -c \"trap '' XFSZ; ulimit -f 512; exec '" + test::nibble_binary() + "' " + kJob + flags + "\" 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return "popen failed";
  std::string out;
  char buf[4096];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, got);
  *status = pclose(p);
  return out;
}
}  // namespace

TEST(CrashSafety, FullDiskDuringASaveIsReportedAndKeepsTheEarlierCheckpoint) {
  const std::string dir = test::temp_folder("fulldisk"), save = dir + "/run";
  ASSERT_EQ(test::run_nibble(kJob + "--train-iters 2 --save " + save + " --save-interval 2").code, 0);
  int status = 0;
  const std::string out =
      run_with_full_disk("--train-iters 4 --save " + save + " --load " + save + " --save-interval 2", &status);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << out;
  EXPECT_NE(out.find("cannot write"), std::string::npos) << out;
  EXPECT_NE(out.find("the checkpoint of iteration 2"), std::string::npos) << out;
  EXPECT_EQ(verified_latest(save), 2);
  EXPECT_FALSE(has_partial_save(save));  // the failed save's folder was removed
}

// A stop's checkpoint (--exit-interval, as SIGTERM's) that fails to write is an error, never "saved, exiting": a
// script that continues paused runs (scripts/convergence.sh) reads that line. Before, the line came before the
// background write had finished, so it followed a failed save too.
TEST(CrashSafety, FullDiskDuringAStopsSaveDoesNotSaySaved) {
  const std::string dir = test::temp_folder("fulldisk_stop"), save = dir + "/run";
  ASSERT_EQ(test::run_nibble(kJob + "--train-iters 2 --save " + save + " --save-interval 2").code, 0);
  int status = 0;
  const std::string out =
      run_with_full_disk("--train-iters 6 --save " + save + " --load " + save + " --exit-interval 4", &status);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << out;
  EXPECT_NE(out.find("cannot write"), std::string::npos) << out;
  EXPECT_EQ(out.find("saved, exiting"), std::string::npos) << out;
  EXPECT_EQ(verified_latest(save), 2);
}

TEST(CrashSafety, UnwritableFolderDuringASaveIsReportedAndKeepsTheEarlierCheckpoint) {
  if (::geteuid() == 0)
    GTEST_SKIP() << "skipped: running as root, which writes into read-only folders anyway "
                    "(the full-disk test covers the failing-write path)";
  const std::string dir = test::temp_folder("readonly"), save = dir + "/run";
  ASSERT_EQ(test::run_nibble(kJob + "--train-iters 2 --save " + save + " --save-interval 2").code, 0);
  fs::permissions(save, fs::perms::owner_write | fs::perms::group_write | fs::perms::others_write,
                  fs::perm_options::remove);
  const test::CliRun r =
      test::run_nibble(kJob + "--train-iters 4 --save " + save + " --load " + save + " --save-interval 2");
  fs::permissions(save, fs::perms::owner_write, fs::perm_options::add);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("the checkpoint of iteration 2"), std::string::npos) << r.out;
  EXPECT_EQ(verified_latest(save), 2);
}

TEST(CrashSafety, SaveFolderThatIsAFileIsRefusedAtStart) {
  const std::string dir = test::temp_folder("savefile");
  std::ofstream(dir + "/taken") << "x";
  const test::CliRun r = test::run_nibble(kJob + "--train-iters 2 --save " + dir + "/taken/run --save-interval 1");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("cannot create the --save folder"), std::string::npos) << r.out;
}
