// Communicator::split and send_recv on the CPU backend (Gloo): ranks are threads of this process, each
// with its own store connection and communicator, as in amax_reduce_test.cpp.
//
// split: four ranks split by blocks (rank / 2) and by stride (rank % 2), again with reversed and with equal
// keys (the same names, so only the split count keeps their store keys apart), and into uneven groups of
// three and one. All children live at once; each child's rank and size are checked, and an all-reduce over
// the child sums 2^(parent rank), a mask of exactly its members.
// send_recv: rings over four ranks and over each two-rank child move each rank's own values (naming the
// ring, the sender and the round) to the next rank, three rounds back to back (the last one backwards),
// in f32 and in u8 with a different byte count per rank. A ring of one copies; bad peers are refused.
#include <gtest/gtest.h>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>
#include "distributed/communicator.h"
#include "distributed/tcp_store.h"

namespace nb {
namespace {

using namespace std::chrono_literals;

constexpr std::chrono::milliseconds kSplitTimeout = 30s;  // a hang fails the test instead of stalling it
using SplitRankFn = std::function<Status(dist::Communicator&)>;

dist::World split_world(int rank, int size, int port) {
  dist::World w;
  w.rank = w.local_rank = rank;
  w.size = w.local_size = size;
  w.store_port = port;
  return w;
}

// Runs `fn` on `ranks` threads, each with its own store connection and Gloo communicator of the whole
// world; returns each rank's error ("" when it succeeded).
std::vector<std::string> split_run_ranks(int ranks, const SplitRankFn& fn) {
  std::vector<std::unique_ptr<dist::TcpStore>> stores(static_cast<size_t>(ranks));
  std::vector<std::string> errors(static_cast<size_t>(ranks));
  if (Status s = dist::TcpStore::open(split_world(0, ranks, 0), kSplitTimeout, &stores[0]); !s) {
    errors[0] = s.message();
    return errors;
  }
  const int port = stores[0]->port();
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      const dist::World w = split_world(r, ranks, port);
      Status s = r == 0 ? Status::ok() : dist::TcpStore::open(w, kSplitTimeout, &stores[size_t(r)]);
      std::unique_ptr<dist::Communicator> comm;
      if (s) s = dist::make_gloo_communicator(w, stores[size_t(r)].get(), kSplitTimeout, &comm);
      if (s) s = fn(*comm);
      comm.reset();
      errors[size_t(r)] = s.message();
    });
  for (auto& t : threads) t.join();
  for (int r = ranks - 1; r >= 0; --r) stores[size_t(r)].reset();  // rank 0 serves the others: last
  return errors;
}

void expect_split_ranks_ok(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// One split of four ranks: each rank's color and key, and what its child must be.
struct SplitCase {
  const char* name;
  int color[4], key[4];
  int child_rank[4], child_size[4];
  int members[4];  // the mask of parent ranks in the rank's group
};

const SplitCase kSplitCases[] = {
    {"tp", {0, 0, 1, 1}, {0, 1, 2, 3}, {0, 1, 0, 1}, {2, 2, 2, 2}, {3, 3, 12, 12}},     // blocks
    {"dp", {0, 1, 0, 1}, {0, 1, 2, 3}, {0, 0, 1, 1}, {2, 2, 2, 2}, {5, 10, 5, 10}},     // stride
    {"tp", {0, 0, 1, 1}, {0, -1, -2, -3}, {1, 0, 1, 0}, {2, 2, 2, 2}, {3, 3, 12, 12}},  // keys reversed
    {"dp", {0, 1, 0, 1}, {7, 7, 7, 7}, {0, 0, 1, 1}, {2, 2, 2, 2}, {5, 10, 5, 10}},     // ties: parent rank
    {"cp", {0, 0, 0, 1}, {3, 2, 1, 0}, {2, 1, 0, 0}, {3, 3, 3, 1}, {7, 7, 7, 8}},       // uneven
};
constexpr int kSplitCount = int(sizeof(kSplitCases) / sizeof(kSplitCases[0]));

struct SplitSeen {
  int rank = -1, size = -1;
  float sum = -1;
};

Status split_all_cases(dist::Communicator& comm, std::vector<SplitSeen>* seen) {
  const int r = comm.rank();
  std::vector<std::unique_ptr<dist::Communicator>> children(kSplitCount);
  for (int i = 0; i < kSplitCount; ++i) {
    const SplitCase& c = kSplitCases[i];
    NB_TRY(comm.split(c.color[r], c.key[r], c.name, &children[size_t(i)]));
  }
  // Reduced only once every group exists, so that groups living side by side are checked too.
  for (int i = 0; i < kSplitCount; ++i) {
    float v = float(1 << r);
    NB_TRY(
        children[size_t(i)]->all_reduce(Tensor::make(&v, DType::f32, Device::cpu, {1}), dist::ReduceOp::sum, nullptr));
    seen->push_back({children[size_t(i)]->rank(), children[size_t(i)]->size(), v});
  }
  double all = double(1 << r);  // the parent still reduces over everyone
  NB_TRY(comm.all_reduce_host(&all, 1, dist::ReduceOp::sum));
  seen->push_back({comm.rank(), comm.size(), float(all)});
  return Status::ok();
}

TEST(CommSplit, GroupsByColorRankedByKey) {
  std::vector<SplitSeen> seen[4];
  expect_split_ranks_ok(split_run_ranks(4, [&](dist::Communicator& c) { return split_all_cases(c, &seen[c.rank()]); }));
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(seen[r].size(), size_t(kSplitCount + 1)) << "rank " << r;
    for (int i = 0; i < kSplitCount; ++i) {
      const SplitCase& c = kSplitCases[i];
      const SplitSeen& s = seen[r][size_t(i)];
      EXPECT_EQ(s.rank, c.child_rank[r]) << "rank " << r << ", split " << i << " (" << c.name << ")";
      EXPECT_EQ(s.size, c.child_size[r]) << "rank " << r << ", split " << i << " (" << c.name << ")";
      EXPECT_EQ(s.sum, float(c.members[r])) << "rank " << r << ", split " << i << " (" << c.name << ")";
    }
    EXPECT_EQ(seen[r].back().sum, 15.0f) << "rank " << r << ": the parent after its splits";
  }
}

// What rank `sender` of ring `ring` sends in round `round`: f32 values naming all three, and u8 values of
// a length that differs per sender (send and receive sizes differ on every rank).
std::vector<float> split_ring_floats(int ring, int sender, int round) {
  std::vector<float> v(5);
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(10000 * ring + 1000 * round + 100 * sender) + float(i);
  return v;
}
std::vector<uint8_t> split_ring_bytes(int ring, int sender, int round) {
  std::vector<uint8_t> v(size_t(3 + sender));
  for (size_t i = 0; i < v.size(); ++i) v[i] = uint8_t(64 * round + 16 * sender + 4 * ring + int(i));
  return v;
}

// Three rounds of ring steps over `comm` (forward, forward, backward); "" when every rank received what
// its source sent, else the first difference.
Status split_ring_rounds(dist::Communicator& comm, int ring, std::string* diff) {
  const int r = comm.rank(), n = comm.size();
  for (int round = 0; round < 3; ++round) {
    const int to = round < 2 ? (r + 1) % n : (r + n - 1) % n, from = round < 2 ? (r + n - 1) % n : (r + 1) % n;
    std::vector<float> f_send = split_ring_floats(ring, r, round), f_recv(f_send.size(), -1.0f);
    std::vector<uint8_t> b_send = split_ring_bytes(ring, r, round),
                         b_recv(split_ring_bytes(ring, from, round).size(), 0);
    NB_TRY(comm.send_recv(Tensor::make(f_send.data(), DType::f32, Device::cpu, {int64_t(f_send.size())}), to,
                          Tensor::make(f_recv.data(), DType::f32, Device::cpu, {int64_t(f_recv.size())}), from,
                          nullptr));
    NB_TRY(comm.send_recv(Tensor::make(b_send.data(), DType::u8, Device::cpu, {int64_t(b_send.size())}), to,
                          Tensor::make(b_recv.data(), DType::u8, Device::cpu, {int64_t(b_recv.size())}), from,
                          nullptr));
    if (diff->empty() && f_recv != split_ring_floats(ring, from, round))
      *diff = "ring " + std::to_string(ring) + " round " + std::to_string(round) + ": wrong f32 values";
    if (diff->empty() && b_recv != split_ring_bytes(ring, from, round))
      *diff = "ring " + std::to_string(ring) + " round " + std::to_string(round) + ": wrong u8 values";
  }
  return Status::ok();
}

TEST(CommSplit, RingsMoveEachRanksBytesToTheNext) {
  std::string diff[4];
  expect_split_ranks_ok(split_run_ranks(4, [&](dist::Communicator& c) {
    const int r = c.rank();
    NB_TRY(split_ring_rounds(c, 0, &diff[r]));
    std::unique_ptr<dist::Communicator> child;  // ranks {0, 2} and {1, 3}: rings of two, one per color
    NB_TRY(c.split(r % 2, r, "cp", &child));
    if (child->size() != 2 || child->rank() != r / 2) return errorf("rank %d: wrong child", r);
    NB_TRY(split_ring_rounds(*child, 1 + r % 2, &diff[r]));
    return split_ring_rounds(c, 3, &diff[r]);  // the parent's slots still line up after the child's
  }));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(diff[r], "") << "rank " << r;
}

// to == from == rank(): a copy, whether the communicator is a world of one or a child of one.
Status split_ring_of_one(dist::Communicator& comm, int salt, std::string* diff) {
  if (comm.size() != 1) return errorf("a ring of one has %d ranks", comm.size());
  std::vector<float> f_send = {1.5f + float(salt), -2.0f, 3.25f}, f_recv(3, 0.0f);
  std::vector<uint8_t> b_send = {7, uint8_t(salt), 255, 0}, b_recv(4, 9);
  NB_TRY(comm.send_recv(Tensor::make(f_send.data(), DType::f32, Device::cpu, {3}), 0,
                        Tensor::make(f_recv.data(), DType::f32, Device::cpu, {3}), 0, nullptr));
  NB_TRY(comm.send_recv(Tensor::make(b_send.data(), DType::u8, Device::cpu, {4}), 0,
                        Tensor::make(b_recv.data(), DType::u8, Device::cpu, {4}), 0, nullptr));
  if (f_recv != f_send || b_recv != b_send) *diff = "salt " + std::to_string(salt) + ": the copy differs";
  // A copy to itself moves exactly its bytes: a smaller buffer is refused.
  if (comm.send_recv(Tensor::make(f_send.data(), DType::f32, Device::cpu, {3}), 0,
                     Tensor::make(f_recv.data(), DType::f32, Device::cpu, {2}), 0, nullptr))
    *diff = "a copy into a smaller buffer was accepted";
  return Status::ok();
}

TEST(CommSplit, RingOfOneCopies) {
  std::string diff[2];
  expect_split_ranks_ok(split_run_ranks(1, [&](dist::Communicator& c) { return split_ring_of_one(c, 0, &diff[0]); }));
  EXPECT_EQ(diff[0], "");
  diff[0].clear();
  expect_split_ranks_ok(split_run_ranks(2, [&](dist::Communicator& c) {
    std::unique_ptr<dist::Communicator> alone;
    NB_TRY(c.split(c.rank(), 0, "solo", &alone));
    return split_ring_of_one(*alone, 1 + c.rank(), &diff[c.rank()]);
  }));
  for (int r = 0; r < 2; ++r) EXPECT_EQ(diff[r], "") << "rank " << r;
}

// Refusals come before any traffic, so every rank gets its sentence and none waits for a peer.
TEST(CommSplit, BadArgumentsAreRefused) {
  std::string bad_peer[2], half_self[2], bad_color[2];
  expect_split_ranks_ok(split_run_ranks(2, [&](dist::Communicator& c) {
    const int r = c.rank();
    float x = 0, y = 0;
    const Tensor tx = Tensor::make(&x, DType::f32, Device::cpu, {1}),
                 ty = Tensor::make(&y, DType::f32, Device::cpu, {1});
    bad_peer[r] = c.send_recv(tx, 2, ty, 1 - r, nullptr).message();
    half_self[r] = c.send_recv(tx, r, ty, 1 - r, nullptr).message();
    std::unique_ptr<dist::Communicator> child;
    bad_color[r] = c.split(-1, 0, "cp", &child).message();
    // Nothing crossed the wire above: without this, a rank could close its connections while its peer is
    // still making them, which fails the peer's connect instead of testing anything.
    double one = 1;
    return c.all_reduce_host(&one, 1, dist::ReduceOp::sum);
  }));
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(bad_peer[r].find("ranks 0..1"), std::string::npos) << bad_peer[r];
    EXPECT_NE(half_self[r].find("both ways or neither"), std::string::npos) << half_self[r];
    EXPECT_NE(bad_color[r].find("color >= 0"), std::string::npos) << bad_color[r];
  }
}

}  // namespace
}  // namespace nb
