// The rendezvous store's wire helpers (store_wire.h): little-endian fields, deadline-bounded socket
// transfers, key lists.
#include "distributed/store_wire.h"
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

namespace nb::dist::wire {

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

}  // namespace nb::dist::wire
