// Arena: one large allocation carved by a bump pointer with stack-like release, tracking current
// and peak use. Training allocates activations per micro-batch from it, so peak memory is known
// exactly, and allocation costs nothing on the hot path.
#pragma once
#include <cstddef>
#include <cstdint>
#include "core/tensor.h"

namespace nb {

class Arena {
 public:
  Arena() = default;
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Reserves `capacity` bytes on `device`; out of memory is returned, not thrown.
  Status reserve(Device device, size_t capacity);
  // Returns nullptr with `st` set when the arena is full; alignment is 256 bytes (cuBLASLt's preference).
  void* alloc(size_t bytes, Status* st);
  Status alloc_tensor(Tensor* t, DType dt, std::initializer_list<int64_t> dims);

  size_t mark() const { return used_; }
  void release(size_t mark) {
    NB_CHECK(mark <= used_, "release past the current mark");
    used_ = mark;
  }
  size_t used() const { return used_; }
  size_t peak() const { return peak_; }
  size_t capacity() const { return capacity_; }
  Device device() const { return device_; }
  void reset_peak() { peak_ = used_; }

 private:
  Device device_ = Device::cpu;
  uint8_t* base_ = nullptr;
  size_t capacity_ = 0, used_ = 0, peak_ = 0;
};

}  // namespace nb
