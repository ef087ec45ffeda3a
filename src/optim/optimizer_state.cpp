// OptimizerState (see optimizer_state.h): the split of master, m and v between device and host, the
// page-locked host arrays, and every transfer in and out of them.
#include "optim/optimizer_state.h"
#include <sys/mman.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include "ops/elementwise.h"

namespace nb::optim {
namespace {
constexpr double kGiB = 1073741824.0;
constexpr size_t kPinPieceBytes = size_t(4) << 30;  // page-lock in pieces of at most 4 GiB
}  // namespace

OptimizerState::~OptimizerState() { reset(); }

void OptimizerState::reset() {
  settle();
  for (void* p : pinned_pieces_) unpin_host_range(p);
  pinned_pieces_.clear();
  for (float*& h : host_) {
    if (h) munmap(h, size_t(len_) * 4);
    h = nullptr;
  }
  for (Buffer& b : dev_arrays_) b.reset();
  len_ = resident_ = 0;
}

int64_t OptimizerState::offloaded_elems(int64_t len, const Placement& p) {
  if (!(p.offload_fraction > 0) || len <= 0) return 0;
  // The resident part ends on a page, so the host part starts on one; the share 1.0 is the whole array.
  if (p.offload_fraction >= 1) return len;
  const int64_t want = int64_t(p.offload_fraction * double(len));
  return want == 0 ? 0 : len - (len - want) / kPageElems * kPageElems;
}

int64_t OptimizerState::chunk_for(int64_t len, const Placement& p) {
  const int64_t chunk = std::max<int64_t>(kPageElems, (p.chunk_elems + kPageElems - 1) / kPageElems * kPageElems);
  // No chunk longer than the host part (page-rounded): the staging windows are 3 chunks each.
  const int64_t host = offloaded_elems(len, p);
  return std::min(chunk, std::max<int64_t>(kPageElems, (host + kPageElems - 1) / kPageElems * kPageElems));
}

Status OptimizerState::allocate(Device dev, int64_t len, const Placement& p) {
  reset();
  dev_ = dev;
  len_ = len;
  resident_ = len - offloaded_elems(len, p);
  chunk_ = chunk_for(len, p);
  for (Buffer& b : dev_arrays_) NB_TRY(Buffer::allocate(&b, DType::f32, dev, {std::max<int64_t>(1, resident_)}));
  if (!offloaded()) return Status::ok();
  NB_TRY(in_.create(dev));
  NB_TRY(out_.create(dev));
  NB_TRY(map_host_arrays());
  return pin_live_part();
}

// One anonymous mapping per array: pages cost memory only once touched, so the staging area of the
// device part costs nothing until a save or load uses it.
Status OptimizerState::map_host_arrays() {
  const size_t bytes = size_t(len_) * 4;
  for (float*& h : host_) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      return errorf(
          "cannot reserve %.2f GiB of host address space for the offloaded optimizer state; lower "
          "--optimizer-offload-fraction",
          double(bytes) / kGiB);
    h = static_cast<float*>(p);
  }
  host_fresh_ = true;
  return Status::ok();
}

// Page-locks [resident, len) of each array in pieces of whole chunks (so no streamed copy crosses two
// registrations), with progress: pinning takes about half a second per GiB.
Status OptimizerState::pin_live_part() {
  if (dev_ != Device::cuda) return Status::ok();
  const size_t chunk_bytes = size_t(chunk_) * 4;
  const size_t piece = std::max<size_t>(1, kPinPieceBytes / chunk_bytes) * chunk_bytes;
  const size_t live = size_t(len_ - resident_) * 4, total = 3 * live;
  size_t done = 0;
  int last_tenth = -1;
  for (float* h : host_) {
    for (size_t at = 0; at < live; at += piece) {
      void* p = reinterpret_cast<char*>(h + resident_) + at;
      const size_t n = std::min(piece, live - at);
      Status st = pin_host_range(p, n);
      if (!st)
        return errorf(
            "the offloaded optimizer state needs %.2f GiB of page-locked host memory, and page-locking failed "
            "after %.2f GiB (%s); lower --optimizer-offload-fraction or free host memory",
            double(total) / kGiB, double(done) / kGiB, st.message().c_str());
      pinned_pieces_.push_back(p);
      done += n;
      const int tenth = int(10 * done / total);
      if (total > (size_t(8) << 30) && tenth != last_tenth) {
        std::printf("page-locking the offloaded optimizer state: %.1f of %.1f GiB\n", double(done) / kGiB,
                    double(total) / kGiB);
        std::fflush(stdout);
        last_tenth = tenth;
      }
    }
  }
  return Status::ok();
}

Tensor OptimizerState::device_part(StateArray a) const {
  return Tensor::make(dev_arrays_[int(a)].data(), DType::f32, dev_, {resident_});
}

void OptimizerState::settle() const {
  if (dev_ == Device::cuda && out_.get()) stream_synchronize(out_.get());
}

Status OptimizerState::fill_zero() {
  settle();
  for (StateArray a : kStateArrays) {
    if (resident_ > 0) ops::fill(device_part(a), 0.0f, nullptr);
    // Fresh anonymous pages read as zero: the 8B's 90 GiB need no memset (seconds at start).
    if (host_[int(a)] && !host_fresh_) std::memset(host_[int(a)] + resident_, 0, size_t(len_ - resident_) * 4);
  }
  return Status::ok();
}

// How many of the elements [begin, begin + n) lie in the device part (the rest are on the host), after
// checking the range and waiting for the copy-outs in flight.
int64_t OptimizerState::device_elems(int64_t begin, int64_t n) const {
  NB_CHECK(begin >= 0 && n >= 0 && begin + n <= len_, "internal: state range [%lld, +%lld) of %lld", (long long)begin,
           (long long)n, (long long)len_);
  settle();
  return std::clamp<int64_t>(resident_ - begin, 0, n);
}

Status OptimizerState::write(StateArray a, int64_t begin, const float* src, int64_t n) {
  const int64_t on_dev = device_elems(begin, n);
  if (n > on_dev) host_fresh_ = false;
  if (on_dev > 0)
    NB_TRY(copy_bytes(dev_arrays_[int(a)].ptr<float>() + begin, dev_, src, Device::cpu, size_t(on_dev) * 4));
  if (n > on_dev) {
    // Formed only when part of the range is on the host: with none, host_[a] may be null (UB to offset).
    float* dst = host_[int(a)] + begin + on_dev;
    if (dst != src + on_dev) std::memcpy(dst, src + on_dev, size_t(n - on_dev) * 4);
  }
  return Status::ok();
}

Status OptimizerState::read(StateArray a, int64_t begin, float* dst, int64_t n) const {
  const int64_t on_dev = device_elems(begin, n);
  if (on_dev > 0)
    NB_TRY(copy_bytes(dst, Device::cpu, dev_arrays_[int(a)].ptr<float>() + begin, dev_, size_t(on_dev) * 4));
  if (n > on_dev) std::memcpy(dst + on_dev, host_[int(a)] + begin + on_dev, size_t(n - on_dev) * 4);
  return Status::ok();
}

Status OptimizerState::read_to_device(StateArray a, int64_t begin, void* dst, int64_t n) const {
  float* out = static_cast<float*>(dst);
  const int64_t on_dev = device_elems(begin, n);
  if (on_dev > 0) NB_TRY(copy_bytes(out, dev_, dev_arrays_[int(a)].ptr<float>() + begin, dev_, size_t(on_dev) * 4));
  if (n > on_dev)
    NB_TRY(copy_bytes(out + on_dev, dev_, host_[int(a)] + begin + on_dev, Device::cpu, size_t(n - on_dev) * 4));
  return Status::ok();
}

Status OptimizerState::stage_resident_for_save() {
  settle();
  if (!offloaded()) return Status::ok();
  for (StateArray a : kStateArrays) NB_TRY(read(a, 0, host_[int(a)], resident_));
  return Status::ok();
}

double host_memory_available_bytes() {
  if (const char* fake = std::getenv("NIBBLE_HOST_MEMORY_GIB"); fake && *fake) return std::atof(fake) * kGiB;
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("MemAvailable:", 0) == 0) return std::atof(line.c_str() + 13) * 1024.0;  // in kB
  return 0;
}

}  // namespace nb::optim
