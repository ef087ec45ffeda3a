// The rendezvous store's internals shared by its server (tcp_store_server.cpp) and client
// (tcp_store.cpp): the wire format, socket transfers with deadlines, and the server class.
//
// Wire format, little-endian. A request is a 17-byte header {u8 op, u32 wait_ms, u32 key_len,
// u64 value_len}, then the key, then the value; a reply is {u8 status, u64 payload_len}, then the
// payload. Ops: hello (value: the rank, u64), set, get (waits for the key, replies its value), wait
// (value: the keys, each a u32 length and bytes), add (value: an i64 delta, replies the new i64). The
// server answers a wait itself at its deadline ("timeout" + the missing key), so every request gets
// exactly one reply. A header announcing a key or value above the limits closes that connection
// before anything is allocated for it.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>
#include "core/status.h"

namespace nb::dist {

namespace wire {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

enum Op : uint8_t { kHello = 1, kSet, kGet, kWait, kAdd };
enum Reply : uint8_t { kOk = 0, kTimeout = 1, kBad = 2 };
constexpr size_t kRequestHeader = 17, kReplyHeader = 9;

void put_le(std::vector<uint8_t>* b, uint64_t v, int bytes);
uint64_t get_le(const uint8_t* p, int bytes);

int ms_until(Clock::time_point t);  // for poll(): rounded up, never negative

enum class Io { ok, timeout, closed, error };

// Moves exactly `n` bytes through a socket before `deadline`, through EINTR and partial transfers.
Io transfer(int fd, void* data, size_t n, bool sending, Clock::time_point deadline);

std::string seconds(milliseconds ms);
uint32_t wait_ms(milliseconds ms);

std::vector<uint8_t> encode_keys(const std::vector<std::string>& keys);

bool decode_keys(const std::vector<uint8_t>& v, std::vector<std::string>* keys);

}  // namespace wire

// Serves the store: an accept thread, and one thread per connection that reads a request, answers
// it, and sleeps on a condition variable while a wait's keys are missing (the server enforces the
// deadline). A rendezvous has few connections and few requests, so threads keep this simple.
class StoreServer {
 public:
  static Status start(int port, int size, std::unique_ptr<StoreServer>* out);
  ~StoreServer();
  int port() const { return port_; }
  // Serves on until every rank has closed its connection or `grace` passes, then cuts the rest off.
  void stop(std::chrono::milliseconds grace);

 private:
  StoreServer() = default;
  void accept_loop();
  void serve(int fd);
  // Answers one request; false closes the connection (a malformed request, or stopping).
  bool answer(int fd, uint8_t op, uint32_t wait, const std::string& key, std::vector<uint8_t>* value, int* rank);
  bool wait_for(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys, uint32_t wait,
                const std::string** missing);

  int listen_fd_ = -1, wake_[2] = {-1, -1}, port_ = 0, size_ = 1;
  std::thread acceptor_;
  std::mutex mu_;                    // guards everything below
  std::condition_variable changed_;  // a key was set, a connection closed, or the server is stopping
  std::map<std::string, std::vector<uint8_t>> kv_;
  std::set<int> open_fds_;
  std::vector<bool> rank_closed_;
  int ranks_closed_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace nb::dist
