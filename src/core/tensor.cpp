// Tensor helpers and the host side of Buffer; device primitives live in device_memory.{cu,cpp}.
#include "core/tensor.h"
#include <cstdlib>
#include "core/memory_ledger.h"
#include <cstring>

namespace nb {

std::string Tensor::shape_str() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

Status Buffer::allocate(Buffer* out, DType dt, Device dev, std::initializer_list<int64_t> dims) {
  out->reset();
  Tensor t = Tensor::make(nullptr, dt, dev, dims);
  size_t bytes = size_t(t.bytes());
  size_t padded = (bytes + 255) / 256 * 256;
  if (padded == 0) padded = 256;
  if (dev == Device::cpu) {
    t.data = std::aligned_alloc(256, padded);
    if (!t.data) return errorf("out of host memory allocating %zu bytes for a %s tensor", bytes, t.shape_str().c_str());
    ledger_add(Device::cpu, t.data, padded);
  } else {
    NB_TRY(device_malloc(&t.data, padded));
  }
  out->t_ = t;
  return Status::ok();
}

void Buffer::reset() {
  if (!t_.data) return;
  if (t_.device == Device::cpu) {
    ledger_remove(Device::cpu, t_.data);
    std::free(t_.data);
  } else {
    device_free(t_.data);
  }
  t_.data = nullptr;
}

}  // namespace nb
