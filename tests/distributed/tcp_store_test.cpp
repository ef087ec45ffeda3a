// TcpStore: four ranks as four threads (each with its own World and connection) through set, get,
// wait, add and barrier; timeouts and their sentences; a 1 MiB value; an oversized request; and a
// rank 0 that shuts down promptly. Rank 0 serves on port 0 (a free port), so tests never collide.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <chrono>
#include <random>
#include <thread>
#include "distributed/tcp_store.h"

using namespace nb;
using namespace nb::dist;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

World world_of(int rank, int size, int port) {
  World w;
  w.rank = w.local_rank = rank;
  w.size = w.local_size = size;
  w.store_port = port;
  return w;
}

double store_seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

bool store_contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// What one rank does in the four-rank test; any failure comes back as its Status.
Status rank_body(TcpStore& s) {
  const int r = s.rank(), n = s.size();
  NB_TRY(s.set("rank" + std::to_string(r), {uint8_t(r), uint8_t(2 * r)}));
  for (int q = 0; q < n; ++q) {  // gets wait for keys other ranks have not set yet
    std::vector<uint8_t> v;
    NB_TRY(s.get("rank" + std::to_string(q), &v));
    if (v != std::vector<uint8_t>{uint8_t(q), uint8_t(2 * q)}) return errorf("rank %d read a wrong value", r);
  }
  if (r == 0) NB_TRY(s.set("nccl_id", std::vector<uint8_t>(128, 7)));
  NB_TRY(s.wait({"nccl_id", "rank3"}, 5s));
  for (int round = 0; round < 3; ++round) {  // one barrier name, used three times
    NB_TRY(s.set(strprintf("round%d/rank%d", round, r), {}));
    NB_TRY(s.barrier("step"));
    std::vector<std::string> keys;
    for (int q = 0; q < n; ++q) keys.push_back(strprintf("round%d/rank%d", round, q));
    NB_TRY(s.wait(keys, 0ms));  // after the barrier every rank's key of the round is there
  }
  int64_t total = 0;
  NB_TRY(s.add("counter", r + 1, &total));
  NB_TRY(s.barrier("end"));
  NB_TRY(s.add("counter", 0, &total));
  if (total != n * (n + 1) / 2) return errorf("rank %d read counter %lld", r, (long long)total);
  return Status::ok();
}

}  // namespace

TEST(TcpStore, FourRanksSetGetWaitBarrier) {
  constexpr int n = 4;
  std::vector<std::unique_ptr<TcpStore>> stores(n);
  ASSERT_TRUE(TcpStore::open(world_of(0, n, 0), 10s, &stores[0]));
  const int port = stores[0]->port();
  ASSERT_GT(port, 0);
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      Status s = r == 0 ? Status::ok() : TcpStore::open(world_of(r, n, port), 10s, &stores[r]);
      if (s) s = rank_body(*stores[r]);
      errors[r] = s.message();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  for (int r = n - 1; r >= 1; --r) stores[r].reset();
  const auto t0 = Clock::now();
  stores[0].reset();  // every rank has closed: no grace needed
  EXPECT_LT(store_seconds_since(t0), 1.0);
}

TEST(TcpStore, GetOfMissingKeyTimesOut) {
  std::unique_ptr<TcpStore> s;
  ASSERT_TRUE(TcpStore::open(world_of(0, 1, 0), 300ms, &s));
  std::vector<uint8_t> v;
  auto t0 = Clock::now();
  Status st = s->get("nccl_id", &v);
  ASSERT_FALSE(st);
  EXPECT_TRUE(store_contains(st.message(), "timed out after 0.3 s waiting for key 'nccl_id'")) << st.message();
  EXPECT_GE(store_seconds_since(t0), 0.29);
  EXPECT_LT(store_seconds_since(t0), 2.0);
  t0 = Clock::now();
  ASSERT_TRUE(s->set("a", {1}));
  st = s->wait({"a", "b"}, 200ms);
  ASSERT_FALSE(st);
  EXPECT_TRUE(store_contains(st.message(), "timed out after 0.2 s waiting for key 'b'")) << st.message();
  EXPECT_LT(store_seconds_since(t0), 2.0);
  ASSERT_TRUE(s->get("a", &v));  // the connection is still in step after a timeout
  EXPECT_EQ(v, std::vector<uint8_t>{1});
}

TEST(TcpStore, ClientWithoutServerCannotReach) {
  // A bound socket that never listens: connections to its port are refused, and nobody else takes it.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  std::unique_ptr<TcpStore> s;
  const auto t0 = Clock::now();
  const Status st = TcpStore::open(world_of(1, 2, port), 500ms, &s);
  ::close(fd);
  ASSERT_FALSE(st);
  EXPECT_TRUE(
      store_contains(st.message(), strprintf("rank 1 could not reach the rendezvous store at 127.0.0.1:%d within "
                                             "0.5 s",
                                             port)))
      << st.message();
  EXPECT_TRUE(store_contains(st.message(), "is rank 0 running, and is MASTER_ADDR right?")) << st.message();
  EXPECT_GE(store_seconds_since(t0), 0.49);
  EXPECT_LT(store_seconds_since(t0), 1.5);
}

TEST(TcpStore, OneMebibyteValueRoundTrips) {
  std::unique_ptr<TcpStore> s0, s1;
  ASSERT_TRUE(TcpStore::open(world_of(0, 2, 0), 5s, &s0));
  ASSERT_TRUE(TcpStore::open(world_of(1, 2, s0->port()), 5s, &s1));
  std::vector<uint8_t> big(1 << 20), got;
  std::mt19937 rng(7);
  for (uint8_t& b : big) b = uint8_t(rng());
  ASSERT_TRUE(s1->set("big", big));
  ASSERT_TRUE(s0->get("big", &got));
  EXPECT_EQ(got, big);
}

TEST(TcpStore, OversizedRequestClosesTheConnection) {
  std::unique_ptr<TcpStore> s0;
  ASSERT_TRUE(TcpStore::open(world_of(0, 1, 0), 5s, &s0));
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(uint16_t(s0->port()));
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  // A set (op 2) announcing a 1 TiB value: the server must hang up, not try to allocate it.
  uint8_t header[17] = {2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0};
  ASSERT_EQ(::send(fd, header, sizeof header, MSG_NOSIGNAL), ssize_t(sizeof header));
  uint8_t byte = 0;
  EXPECT_LE(::recv(fd, &byte, 1, 0), 0);
  ::close(fd);
  ASSERT_TRUE(s0->set("still", {1}));  // the store itself is unharmed
}

TEST(TcpStore, RankZeroGoingAwayEndsWaitsAndNeverHangs) {
  std::unique_ptr<TcpStore> s0, s1;
  ASSERT_TRUE(TcpStore::open(world_of(0, 3, 0), 300ms, &s0));  // rank 0's grace: 0.3 s
  ASSERT_TRUE(TcpStore::open(world_of(1, 3, s0->port()), 10s, &s1));
  Status waited;
  std::thread waiter([&] {
    std::vector<uint8_t> v;
    waited = s1->get("never", &v);
  });
  const auto t0 = Clock::now();
  s0.reset();  // rank 1 is still connected and rank 2 never came: serves on for the grace only
  EXPECT_LT(store_seconds_since(t0), 2.0);
  waiter.join();
  ASSERT_FALSE(waited);
  EXPECT_TRUE(store_contains(waited.message(), "went away")) << waited.message();
  EXPECT_TRUE(store_contains(waited.message(), "'never'")) << waited.message();
}

TEST(TcpStore, RefusedRequestsSayWhy) {
  std::unique_ptr<TcpStore> s0, s3;
  ASSERT_TRUE(TcpStore::open(world_of(0, 2, 0), 300ms, &s0));  // rank 1 never comes: a short grace
  // A rank that believes in a larger world than rank 0 does.
  Status st = TcpStore::open(world_of(3, 4, s0->port()), 2s, &s3);
  ASSERT_FALSE(st);
  EXPECT_TRUE(store_contains(st.message(), "do all ranks agree on the world size?")) << st.message();
  ASSERT_TRUE(s0->set("text", {1, 2, 3}));
  int64_t total = 0;
  st = s0->add("text", 1, &total);
  ASSERT_FALSE(st);
  EXPECT_TRUE(store_contains(st.message(), "key 'text' is not an 8-byte counter")) << st.message();
  ASSERT_TRUE(s0->add("n", 5, &total));  // the connection is still in step after a refusal
  EXPECT_EQ(total, 5);
}
