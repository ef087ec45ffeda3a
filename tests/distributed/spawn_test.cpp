// spawn_local_ranks with `/bin/sh -c` children: each rank's environment (written to a file per rank),
// a failing rank that stops the sleeping others promptly, SIGKILL after the grace, and SIGTERM sent
// to the parent reaching the children. Sleeping children `exec sleep` so that a signal reaches the
// sleep itself and no orphan outlives the test.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include "distributed/spawn.h"

using namespace nb;
using namespace nb::dist;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  std::string path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "nibble_spawn_XXXXXX").string();
    path = ::mkdtemp(tmpl.data()) ? tmpl : "";
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// `sh -c SCRIPT DIR`: the script sees the folder as $0.
std::vector<std::string> sh(const std::string& script, const std::string& dir) {
  return {"/bin/sh", "-c", script, dir};
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST(Spawn, EveryRankSeesItsOwnEnvironment) {
  ::unsetenv("MASTER_PORT");
  ::unsetenv("NIBBLE_STORE_PORT");
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  const char* script =
      "echo \"$RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $NIBBLE_STORE_PORT\" "
      "> \"$0/rank$RANK\"";
  int code = -1;
  const Status st = spawn_local_ranks(3, sh(script, dir.path), 1s, &code);
  ASSERT_TRUE(st) << st.message();
  EXPECT_EQ(code, 0);
  int master_port = 0;
  for (int r = 0; r < 3; ++r) {
    std::istringstream in(read_file(dir.path + "/rank" + std::to_string(r)));
    int rank = -1, local_rank = -1, size = 0, local_size = 0, port = 0, store_port = 0;
    std::string addr;
    in >> rank >> local_rank >> size >> local_size >> addr >> port >> store_port;
    EXPECT_EQ(rank, r);
    EXPECT_EQ(local_rank, r);
    EXPECT_EQ(size, 3);
    EXPECT_EQ(local_size, 3);
    EXPECT_EQ(addr, "127.0.0.1");
    EXPECT_GT(port, 0);
    EXPECT_EQ(store_port, port + 1);
    if (r == 0) master_port = port;
    EXPECT_EQ(port, master_port);  // one rendezvous for all
  }
}

TEST(Spawn, KeepsAMasterPortThatIsAlreadySet) {
  ::setenv("MASTER_PORT", "23456", 1);
  ::unsetenv("NIBBLE_STORE_PORT");
  TempDir dir;
  int code = -1;
  const Status st =
      spawn_local_ranks(1, sh("echo \"$MASTER_PORT $NIBBLE_STORE_PORT\" > \"$0/ports\"", dir.path), 1s, &code);
  ::unsetenv("MASTER_PORT");
  ASSERT_TRUE(st) << st.message();
  EXPECT_EQ(read_file(dir.path + "/ports"), "23456 23457\n");
}

TEST(Spawn, OneFailingRankStopsTheOthers) {
  TempDir dir;
  const char* script = "if [ \"$RANK\" = 1 ]; then sleep 0.2; exit 3; fi; exec sleep 30";
  int code = -1;
  const auto t0 = Clock::now();
  const Status st = spawn_local_ranks(3, sh(script, dir.path), 5s, &code);
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.message(), "rank 1 exited with code 3")) << st.message();
  EXPECT_EQ(code, 3);
  EXPECT_LT(seconds_since(t0), 3.0);  // SIGTERM ended the 30 s sleeps
}

TEST(Spawn, KilledRankIsNamedAndStubbornRanksGetSigkill) {
  TempDir dir;
  // The others ignore SIGTERM (an ignored signal stays ignored across exec), so only SIGKILL ends them.
  const char* script = "if [ \"$RANK\" = 0 ]; then sleep 0.2; kill -9 $$; fi; trap '' TERM; exec sleep 30";
  int code = -1;
  const auto t0 = Clock::now();
  const Status st = spawn_local_ranks(3, sh(script, dir.path), 300ms, &code);
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.message(), "rank 0 was killed by signal 9")) << st.message();
  EXPECT_EQ(code, 128 + 9);
  EXPECT_GE(seconds_since(t0), 0.45);  // 0.2 s before the kill, then the 0.3 s grace
  EXPECT_LT(seconds_since(t0), 3.0);
}

TEST(Spawn, SigtermToTheParentReachesTheRanks) {
  TempDir dir;
  const char* script = "touch \"$0/started$RANK\"; exec sleep 30";
  std::thread sender([&] {
    // Sent once both ranks run, so the parent's forwarding handler is installed by then.
    for (int i = 0; i < 500; ++i) {
      if (fs::exists(dir.path + "/started0") && fs::exists(dir.path + "/started1")) {
        ::kill(::getpid(), SIGTERM);
        return;
      }
      std::this_thread::sleep_for(10ms);
    }
  });
  int code = -1;
  const auto t0 = Clock::now();
  const Status st = spawn_local_ranks(2, sh(script, dir.path), 5s, &code);
  sender.join();
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.message(), "SIGTERM was forwarded")) << st.message();
  EXPECT_TRUE(contains(st.message(), "was killed by signal 15")) << st.message();
  EXPECT_EQ(code, 128 + 15);
  EXPECT_LT(seconds_since(t0), 3.0);
}

TEST(Spawn, BadArgumentsAreErrors) {
  int code = 0;
  Status st = spawn_local_ranks(0, {"/bin/true"}, 1s, &code);
  EXPECT_FALSE(st);
  EXPECT_TRUE(contains(st.message(), "--nproc-per-node 0")) << st.message();
  st = spawn_local_ranks(2, {"/no/such/nibble"}, 1s, &code);
  EXPECT_FALSE(st);
  EXPECT_TRUE(contains(st.message(), "/no/such/nibble")) << st.message();
}

TEST(Spawn, FreePortPair) {
  int port = 0;
  ASSERT_TRUE(find_free_port_pair(&port));
  EXPECT_GT(port, 0);
  EXPECT_LT(port, 65535);
}
