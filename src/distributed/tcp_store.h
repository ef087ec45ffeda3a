// The rendezvous: a small key-value store over TCP, served by rank 0 and reached by every rank
// (rank 0 included) through one connection each. It hands out NCCL's unique id and is the store
// behind Gloo. Waits happen on the server, which answers "timed out" itself at the deadline, so a
// client's connection never holds a stale reply. Protocol and limits: store_wire.h.
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>
#include "core/status.h"
#include "distributed/world.h"

namespace nb::dist {

class StoreServer;  // store_wire.h, tcp_store_server.cpp

class TcpStore {
 public:
  // Rank 0 serves on world.store_port (all interfaces, SO_REUSEADDR; port 0 picks a free one, see
  // port()) and is also a client of itself; every rank connects to master_addr:store_port, retrying
  // until `timeout` passes. `timeout` is also the limit of every later get, wait and barrier.
  static Status open(const World& world, std::chrono::milliseconds timeout, std::unique_ptr<TcpStore>* out);
  // Rank 0 keeps serving until every rank has connected and closed its connection, or for at most
  // min(timeout, 5 s), so that ranks still reading their last keys are not cut off, and it never hangs.
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  Status set(const std::string& key, const std::vector<uint8_t>& value);
  // Waits until the key is set, up to the timeout.
  Status get(const std::string& key, std::vector<uint8_t>* value);
  Status wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  // Atomically adds `delta` to the 8-byte counter `key` (created at 0) and returns the new value.
  Status add(const std::string& key, int64_t delta, int64_t* result);
  // Returns once every rank has called barrier(name) as often as this one has.
  Status barrier(const std::string& name);

  int rank() const { return world_.rank; }
  int size() const { return world_.size; }
  int port() const { return port_; }  // the port actually served on (rank 0 with store_port 0)

  // A message whose key or value is larger than this is refused: the server closes that connection.
  static constexpr uint64_t kMaxValueBytes = 64ull << 20;
  static constexpr uint32_t kMaxKeyBytes = 64u << 10;

 private:
  TcpStore();
  Status connect_to_server();
  // One request and its reply; the reply's payload goes to *payload. `wait_ms` bounds a server wait.
  Status request(uint8_t op, const std::string& key, const std::vector<uint8_t>& value, uint64_t wait_ms,
                 uint8_t* reply_status, std::vector<uint8_t>* payload);
  std::string where() const;

  World world_;
  std::chrono::milliseconds timeout_{0};
  int port_ = 0;
  int fd_ = -1;
  std::mutex mu_;  // one request at a time on the connection
  std::map<std::string, int64_t> barrier_rounds_;
  std::unique_ptr<StoreServer> server_;  // rank 0 only
};

}  // namespace nb::dist
