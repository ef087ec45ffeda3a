// The rendezvous store's server (store_wire.h): rank 0 serves every rank's requests, one thread per
// connection, and answers waits itself at their deadlines.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include "core/log.h"
#include "distributed/store_wire.h"
#include "distributed/tcp_store.h"

namespace nb::dist {

using namespace wire;  // NOLINT(google-build-using-namespace): the store's own internal vocabulary

Status StoreServer::start(int port, int size, std::unique_ptr<StoreServer>* out) {
  std::unique_ptr<StoreServer> s(new StoreServer);
  s->size_ = size;
  s->rank_closed_.assign(size_t(size), false);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(uint16_t(port));
  socklen_t len = sizeof addr;
  const int one = 1;
  const int fd = s->listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
      ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, SOMAXCONN) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 || ::pipe2(s->wake_, O_CLOEXEC) != 0)
    return errorf(
        "rank 0 could not serve the rendezvous store on port %d (%s): another job may hold the port; set "
        "NIBBLE_STORE_PORT (or MASTER_PORT) to a free one",
        port, std::strerror(errno));
  s->port_ = ntohs(addr.sin_port);
  s->acceptor_ = std::thread([p = s.get()] { p->accept_loop(); });
  *out = std::move(s);
  return Status::ok();
}

StoreServer::~StoreServer() {
  stop(milliseconds(0));
  for (int fd : {listen_fd_, wake_[0], wake_[1]})
    if (fd >= 0) ::close(fd);
}

void StoreServer::stop(milliseconds grace) {
  if (!acceptor_.joinable()) return;
  {
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait_for(lock, grace, [&] { return ranks_closed_ >= size_; });
    stopping_ = true;
    // Wakes threads blocked in recv or send; each thread still closes its own descriptor.
    for (int fd : open_fds_) ::shutdown(fd, SHUT_RDWR);
  }
  changed_.notify_all();
  const char byte = 1;
  while (::write(wake_[1], &byte, 1) < 0 && errno == EINTR) {}
  acceptor_.join();
  for (std::thread& t : threads_) t.join();  // the acceptor is gone: threads_ no longer grows
  threads_.clear();
}

void StoreServer::accept_loop() {
  for (;;) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (::poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      NB_LOG_ERROR("rendezvous store: poll failed (%s); no longer accepting connections", std::strerror(errno));
      return;
    }
    if (p[1].revents) return;
    if (!(p[0].revents & POLLIN)) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      // Out of descriptors: back off instead of spinning; the client retries its connect.
      if (errno == EMFILE || errno == ENFILE) std::this_thread::sleep_for(milliseconds(10));
      continue;
    }
    const int one = 1;  // replies go out at once, not after the client's delayed ACK
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {  // stop() has already shut the open connections down; this one would never end
      ::close(fd);
      continue;
    }
    open_fds_.insert(fd);
    threads_.emplace_back([this, fd] { serve(fd); });
  }
}

void StoreServer::serve(int fd) {
  const auto forever = Clock::time_point::max();
  int rank = -1;
  for (;;) {
    uint8_t h[kRequestHeader];
    if (transfer(fd, h, sizeof h, false, forever) != Io::ok) break;
    const uint32_t wait = uint32_t(get_le(h + 1, 4)), key_len = uint32_t(get_le(h + 5, 4));
    const uint64_t value_len = get_le(h + 9, 8);
    // Checked before allocating: a stray client (a port scan, an HTTP probe) cannot make us reserve gigabytes.
    if (key_len > TcpStore::kMaxKeyBytes || value_len > TcpStore::kMaxValueBytes) {
      NB_LOG_WARN("rendezvous store: closed a connection that announced a %u-byte key and a %llu-byte value", key_len,
                  (unsigned long long)value_len);
      break;
    }
    std::string key(key_len, '\0');
    std::vector<uint8_t> value(value_len);
    if (transfer(fd, key.data(), key_len, false, forever) != Io::ok) break;
    if (transfer(fd, value.data(), value_len, false, forever) != Io::ok) break;
    if (!answer(fd, h[0], wait, key, &value, &rank)) break;
  }
  std::lock_guard<std::mutex> lock(mu_);
  open_fds_.erase(fd);
  ::close(fd);
  if (rank >= 0 && !rank_closed_[size_t(rank)]) {
    rank_closed_[size_t(rank)] = true;
    ++ranks_closed_;
  }
  changed_.notify_all();
}

// Sleeps until every key is present, the deadline passes or the server stops; false when stopping.
bool StoreServer::wait_for(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys, uint32_t wait,
                           const std::string** missing) {
  auto find_missing = [&]() -> const std::string* {
    for (const std::string& k : keys)
      if (!kv_.count(k)) return &k;
    return nullptr;
  };
  changed_.wait_until(lock, Clock::now() + milliseconds(wait), [&] { return !find_missing() || stopping_; });
  *missing = find_missing();
  return !(*missing && stopping_);
}

bool StoreServer::answer(int fd, uint8_t op, uint32_t wait, const std::string& key, std::vector<uint8_t>* value,
                         int* rank) {
  uint8_t status = kOk;
  std::vector<uint8_t> payload;
  std::unique_lock<std::mutex> lock(mu_);
  if (op == kHello) {
    const uint64_t r = value->size() == 8 ? get_le(value->data(), 8) : UINT64_MAX;
    if (r < uint64_t(size_)) *rank = int(r);
    if (r >= uint64_t(size_)) {
      status = kBad;
      const std::string why =
          strprintf("a rank outside 0..%d connected: do all ranks agree on the world size?", size_ - 1);
      payload.assign(why.begin(), why.end());
    }
  } else if (op == kSet) {
    kv_[key] = std::move(*value);
    changed_.notify_all();
  } else if (op == kAdd) {
    auto it = kv_.find(key);
    if (value->size() != 8 || (it != kv_.end() && it->second.size() != 8)) {
      status = kBad;
      const std::string why = "key '" + key + "' is not an 8-byte counter";
      payload.assign(why.begin(), why.end());
    } else {
      put_le(&payload, get_le(value->data(), 8) + (it != kv_.end() ? get_le(it->second.data(), 8) : 0), 8);
      kv_[key] = payload;
      changed_.notify_all();
    }
  } else if (op == kGet || op == kWait) {
    std::vector<std::string> keys;
    if (op == kGet) keys.push_back(key);
    if (op == kWait && !decode_keys(*value, &keys)) return false;
    const std::string* missing = nullptr;
    if (!wait_for(lock, keys, wait, &missing)) return false;
    if (missing) status = kTimeout, payload.assign(missing->begin(), missing->end());
    if (!missing && op == kGet) payload = kv_[key];
  } else {
    return false;
  }
  lock.unlock();
  std::vector<uint8_t> reply;
  reply.reserve(kReplyHeader + payload.size());
  put_le(&reply, status, 1);
  put_le(&reply, payload.size(), 8);
  reply.insert(reply.end(), payload.begin(), payload.end());
  return transfer(fd, reply.data(), reply.size(), true, Clock::time_point::max()) == Io::ok;
}

}  // namespace nb::dist
