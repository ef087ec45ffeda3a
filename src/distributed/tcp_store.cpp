// TcpStore, the rendezvous store's client (tcp_store.h); the wire format and the server live in
// store_wire.h and tcp_store_server.cpp.
#include "distributed/tcp_store.h"
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include "distributed/store_wire.h"

namespace nb::dist {

using namespace wire;  // NOLINT(google-build-using-namespace): the store's own internal vocabulary

namespace {

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

}  // namespace

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
