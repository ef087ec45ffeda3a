// Arena implementation; device memory comes from device_malloc so both backends share this code.
#include "core/arena.h"
#include <cstdlib>
#include "core/memory_ledger.h"

namespace nb {

Arena::~Arena() {
  if (!base_) return;
  if (device_ == Device::cpu) {
    ledger_remove(Device::cpu, base_);
    std::free(base_);
  } else {
    device_free(base_);
  }
}

Status Arena::reserve(Device device, size_t capacity) {
  NB_CHECK(base_ == nullptr, "arena reserved twice");
  capacity = (capacity + 255) / 256 * 256;
  device_ = device;
  if (device == Device::cpu) {
    base_ = static_cast<uint8_t*>(std::aligned_alloc(256, capacity ? capacity : 256));
    if (!base_) return errorf("out of host memory reserving a %.2f GiB arena", capacity / 1073741824.0);
    ledger_add(Device::cpu, base_, capacity ? capacity : 256);
  } else {
    void* p = nullptr;
    NB_TRY(device_malloc(&p, capacity));
    base_ = static_cast<uint8_t*>(p);
  }
  capacity_ = capacity;
  return Status::ok();
}

void* Arena::alloc(size_t bytes, Status* st) {
  size_t need = (bytes + 255) / 256 * 256;
  if (used_ + need > capacity_) {
    *st = errorf("arena on %s is full: %.1f MiB in use, %.1f MiB asked, capacity %.1f MiB", device_name(device_),
                 used_ / 1048576.0, bytes / 1048576.0, capacity_ / 1048576.0);
    return nullptr;
  }
  void* p = base_ + used_;
  used_ += need;
  if (used_ > peak_) peak_ = used_;
  return p;
}

Status Arena::alloc_tensor(Tensor* t, DType dt, std::initializer_list<int64_t> dims) {
  *t = Tensor::make(nullptr, dt, device_, dims);
  Status st;
  t->data = alloc(size_t(t->bytes()), &st);
  return st;
}

}  // namespace nb
