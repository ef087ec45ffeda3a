// TcpStore: the wire format, the server (an accept thread and a thread per connection) and the client.
//
// Wire format, little-endian. A request is a 17-byte header {u8 op, u32 wait_ms, u32 key_len,
// u64 value_len}, then the key, then the value; a reply is {u8 status, u64 payload_len}, then the
// payload. Ops: hello (value: the rank, u64), set, get (waits for the key, replies its value), wait
// (value: the keys, each a u32 length and bytes), add (value: an i64 delta, replies the new i64). The
// server answers a wait itself at its deadline ("timeout" + the missing key), so every request gets
// exactly one reply. A header announcing a key or value above the limits closes that connection
// before anything is allocated for it.
#include "dist/tcp_store.h"
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <condition_variable>
#include <set>
#include <thread>
#include "core/log.h"

namespace nb::dist {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

enum Op : uint8_t { kHello = 1, kSet, kGet, kWait, kAdd };
enum Reply : uint8_t { kOk = 0, kTimeout = 1, kBad = 2 };
constexpr size_t kRequestHeader = 17, kReplyHeader = 9;

void put_le(std::vector<uint8_t>* b, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) b->push_back(uint8_t(v >> (8 * i)));
}
uint64_t get_le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}

int ms_until(Clock::time_point t) {  // for poll(): rounded up, never negative
  if (t == Clock::time_point::max()) return -1;
  const int64_t left = std::chrono::ceil<milliseconds>(t - Clock::now()).count();
  return int(std::clamp<int64_t>(left, 0, INT_MAX));
}

enum class Io { ok, timeout, closed, error };

// Moves exactly `n` bytes through a socket before `deadline`, through EINTR and partial transfers.
Io transfer(int fd, void* data, size_t n, bool sending, Clock::time_point deadline) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    pollfd pfd{fd, short(sending ? POLLOUT : POLLIN), 0};
    const int r = ::poll(&pfd, 1, ms_until(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return r == 0 ? Io::timeout : Io::error;
    const ssize_t got = sending ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (got < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (got < 0) return (errno == ECONNRESET || errno == EPIPE) ? Io::closed : Io::error;
    if (got == 0) return Io::closed;
    p += got;
    n -= size_t(got);
  }
  return Io::ok;
}

std::string seconds(milliseconds ms) { return strprintf("%g s", double(ms.count()) / 1000.0); }
uint32_t wait_ms(milliseconds ms) { return uint32_t(std::clamp<int64_t>(ms.count(), 0, UINT32_MAX)); }

// One non-blocking connection attempt to one address, bounded by `deadline`; the socket or -1.
int connect_one(const addrinfo* a, Clock::time_point deadline, std::string* why) {
  const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
  if (fd < 0) return *why = std::strerror(errno), -1;
  int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
  if (rc < 0 && (errno == EINPROGRESS || errno == EINTR)) {
    pollfd p{fd, POLLOUT, 0};
    do rc = ::poll(&p, 1, ms_until(deadline));
    while (rc < 0 && errno == EINTR);
    int err = rc == 0 ? ETIMEDOUT : rc < 0 ? errno : 0;
    socklen_t len = sizeof err;
    if (rc > 0) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    errno = err;
    rc = err ? -1 : 0;
  }
  if (rc < 0) {
    *why = std::strerror(errno);
    ::close(fd);
    return -1;
  }
  const int one = 1;  // requests are small and latency-bound
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

// Resolves `host` on every attempt (a node's name may only become resolvable once the job has started).
int try_connect(const std::string& host, int port, Clock::time_point deadline, std::string* why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &list); rc != 0) {
    *why = ::gai_strerror(rc);
    return -1;
  }
  int fd = -1;
  for (const addrinfo* a = list; a && fd < 0; a = a->ai_next) fd = connect_one(a, deadline, why);
  ::freeaddrinfo(list);
  return fd;
}

std::vector<uint8_t> encode_keys(const std::vector<std::string>& keys) {
  std::vector<uint8_t> out;
  for (const std::string& k : keys) {
    put_le(&out, k.size(), 4);
    out.insert(out.end(), k.begin(), k.end());
  }
  return out;
}

bool decode_keys(const std::vector<uint8_t>& v, std::vector<std::string>* keys) {
  size_t pos = 0;
  while (pos < v.size()) {
    // The count cap keeps 64 MiB of empty keys from costing gigabytes of std::string headers.
    if (v.size() - pos < 4 || keys->size() >= (1u << 16)) return false;
    const size_t len = get_le(v.data() + pos, 4);
    pos += 4;
    if (v.size() - pos < len) return false;
    keys->emplace_back(v.begin() + long(pos), v.begin() + long(pos + len));
    pos += len;
  }
  return true;
}

}  // namespace

// Serves the store: an accept thread, and one thread per connection that reads a request, answers
// it, and sleeps on a condition variable while a wait's keys are missing (the server enforces the
// deadline). A rendezvous has few connections and few requests, so threads keep this simple.
class StoreServer {
 public:
  static Status start(int port, int size, std::unique_ptr<StoreServer>* out);
  ~StoreServer();
  int port() const { return port_; }
  // Serves on until every rank has closed its connection or `grace` passes, then cuts the rest off.
  void stop(milliseconds grace);

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

TcpStore::TcpStore() = default;

Status TcpStore::open(const World& world, milliseconds timeout, std::unique_ptr<TcpStore>* out) {
  NB_CHECK(world.size >= 1 && world.rank >= 0 && world.rank < world.size, "rank %d of %d", world.rank, world.size);
  NB_CHECK(world.store_port >= (world.rank == 0 ? 0 : 1) && world.store_port <= 65535, "port %d", world.store_port);
  std::unique_ptr<TcpStore> s(new TcpStore);
  s->world_ = world;
  s->timeout_ = timeout;
  s->port_ = world.store_port;
  if (world.rank == 0) {
    NB_TRY(StoreServer::start(world.store_port, world.size, &s->server_));
    s->port_ = s->server_->port();
  }
  Status st = s->connect_to_server();
  if (st) {
    std::vector<uint8_t> hello, payload;
    put_le(&hello, uint64_t(world.rank), 8);
    uint8_t reply = 0;
    st = s->request(kHello, "", hello, 0, &reply, &payload);
  }
  if (!st) {
    s->server_.reset();  // nobody can use this store: stop serving at once
    return st;
  }
  *out = std::move(s);
  return Status::ok();
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
  if (server_) server_->stop(std::min<milliseconds>(timeout_, milliseconds(5000)));
}

std::string TcpStore::where() const {
  return strprintf("rank 0 at %s:%d", world_.rank == 0 ? "127.0.0.1" : world_.master_addr.c_str(), port_);
}

Status TcpStore::connect_to_server() {
  // Rank 0 reaches its own server on the loopback, whatever MASTER_ADDR resolves to on its node.
  const std::string host = world_.rank == 0 ? "127.0.0.1" : world_.master_addr;
  const auto deadline = Clock::now() + timeout_;
  std::string why = "no attempt";
  for (;;) {
    fd_ = try_connect(host, port_, deadline, &why);
    if (fd_ >= 0) return Status::ok();
    if (Clock::now() >= deadline)
      return errorf(
          "rank %d could not reach the rendezvous store at %s:%d within %s (last attempt: %s): is rank 0 running, and "
          "is MASTER_ADDR right?",
          world_.rank, host.c_str(), port_, seconds(timeout_).c_str(), why.c_str());
    std::this_thread::sleep_for(std::min<Clock::duration>(milliseconds(50), deadline - Clock::now()));
  }
}

Status TcpStore::request(uint8_t op, const std::string& key, const std::vector<uint8_t>& value, uint64_t wait,
                         uint8_t* reply_status, std::vector<uint8_t>* payload) {
  if (key.size() > kMaxKeyBytes || value.size() > kMaxValueBytes)
    return errorf("key '%.64s' (%zu bytes) or its value (%zu bytes) exceeds the rendezvous store's limits (%u, %llu)",
                  key.c_str(), key.size(), value.size(), kMaxKeyBytes, (unsigned long long)kMaxValueBytes);
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ < 0)
    return errorf("rank %d lost its connection to the rendezvous store (%s) after an earlier error", world_.rank,
                  where().c_str());
  std::vector<uint8_t> head;
  put_le(&head, op, 1);
  put_le(&head, wait, 4);
  put_le(&head, key.size(), 4);
  put_le(&head, value.size(), 8);
  head.insert(head.end(), key.begin(), key.end());
  // The server answers a wait at its deadline; `timeout_` more covers the network and a busy rank 0.
  const auto deadline = Clock::now() + milliseconds(wait) + timeout_;
  Io io = transfer(fd_, head.data(), head.size(), true, deadline);
  if (io == Io::ok) io = transfer(fd_, const_cast<uint8_t*>(value.data()), value.size(), true, deadline);
  uint8_t reply[kReplyHeader];
  if (io == Io::ok) io = transfer(fd_, reply, sizeof reply, false, deadline);
  if (io == Io::ok) {
    const uint64_t len = get_le(reply + 1, 8);
    if (len <= kMaxValueBytes) payload->resize(len);
    io = len <= kMaxValueBytes ? transfer(fd_, payload->data(), len, false, deadline) : Io::error;
    if (len > kMaxValueBytes) errno = EPROTO;  // not our server, or a corrupted stream
  }
  const int err = errno;
  if (io == Io::ok && reply[0] == kBad)
    return errorf("the rendezvous store (%s) refused a request: %s", where().c_str(),
                  std::string(payload->begin(), payload->end()).c_str());
  if (io == Io::ok) return *reply_status = reply[0], Status::ok();
  ::close(fd_);  // a request without its reply leaves the connection out of step: never reuse it
  fd_ = -1;
  if (io == Io::closed)
    return errorf("the rendezvous store (%s) went away: rank 0 has exited or crashed; see its log", where().c_str());
  if (io == Io::timeout)
    return errorf("the rendezvous store (%s) did not answer within %s: rank 0 may be stuck or unreachable",
                  where().c_str(), seconds(milliseconds(wait) + timeout_).c_str());
  return errorf("rank %d lost its connection to the rendezvous store (%s): %s", world_.rank, where().c_str(),
                std::strerror(err));
}

Status TcpStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  uint8_t st = 0;
  std::vector<uint8_t> payload;
  return request(kSet, key, value, 0, &st, &payload)
      .context(strprintf("rank %d setting key '%s'", rank(), key.c_str()));
}

Status TcpStore::get(const std::string& key, std::vector<uint8_t>* value) {
  uint8_t st = 0;
  NB_TRY(request(kGet, key, {}, wait_ms(timeout_), &st, value)
             .context(strprintf("rank %d waiting for key '%s'", rank(), key.c_str())));
  if (st == kTimeout)
    return errorf(
        "rank %d timed out after %s waiting for key '%s' from the rendezvous store (%s): did every rank "
        "start, and did none fail earlier?",
        rank(), seconds(timeout_).c_str(), key.c_str(), where().c_str());
  return Status::ok();
}

Status TcpStore::wait(const std::vector<std::string>& keys, milliseconds timeout) {
  uint8_t st = 0;
  std::vector<uint8_t> missing;
  NB_TRY(request(kWait, "", encode_keys(keys), wait_ms(timeout), &st, &missing)
             .context(strprintf("rank %d waiting for %zu keys", rank(), keys.size())));
  if (st == kTimeout)
    return errorf(
        "rank %d timed out after %s waiting for key '%s' from the rendezvous store (%s): did every rank "
        "start, and did none fail earlier?",
        rank(), seconds(timeout).c_str(), std::string(missing.begin(), missing.end()).c_str(), where().c_str());
  return Status::ok();
}

Status TcpStore::add(const std::string& key, int64_t delta, int64_t* result) {
  uint8_t st = 0;
  std::vector<uint8_t> value, payload;
  put_le(&value, uint64_t(delta), 8);
  NB_TRY(request(kAdd, key, value, 0, &st, &payload)
             .context(strprintf("rank %d adding to key '%s'", rank(), key.c_str())));
  *result = int64_t(get_le(payload.data(), 8));
  return Status::ok();
}

// Round r of barrier `name` is the counter "barrier/<name>/<r>": the last rank to arrive sets
// ".../done", which everyone waits for. Counting rounds per name lets a name be reused.
Status TcpStore::barrier(const std::string& name) {
  int64_t round = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    round = ++barrier_rounds_[name];
  }
  const std::string key = strprintf("barrier/%s/%lld", name.c_str(), (long long)round);
  int64_t arrived = 0;
  NB_TRY(add(key, 1, &arrived));
  if (arrived == size()) NB_TRY(set(key + "/done", {}));
  uint8_t st = 0;
  std::vector<uint8_t> missing;
  NB_TRY(request(kWait, "", encode_keys({key + "/done"}), wait_ms(timeout_), &st, &missing)
             .context(strprintf("rank %d at barrier '%s'", rank(), name.c_str())));
  if (st == kTimeout)
    return errorf(
        "rank %d timed out after %s at barrier '%s' (%lld of %d ranks had arrived when it did): a rank is "
        "missing, slow or failed earlier; see the other ranks' logs",
        rank(), seconds(timeout_).c_str(), name.c_str(), (long long)arrived, size());
  return Status::ok();
}

}  // namespace nb::dist
