// Tensor: a non-owning view (pointer, dtype, device, shape, strides in elements), row-major by
// default, PyTorch dimension order. Buffer: owning host or device storage.
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include "core/dtype.h"
#include "core/status.h"

namespace nb {

enum class Device : uint8_t { cpu, cuda };
inline const char* device_name(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

constexpr int kMaxDims = 4;

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};  // in elements

  static Tensor make(void* data, DType dt, Device dev, std::initializer_list<int64_t> dims) {
    Tensor t;
    t.data = data;
    t.dtype = dt;
    t.device = dev;
    NB_CHECK(dims.size() <= size_t(kMaxDims), "at most %d dims", kMaxDims);
    for (int64_t d : dims) t.shape[t.ndim++] = d;
    int64_t s = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
      t.stride[i] = s;
      s *= t.shape[i];
    }
    return t;
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  int64_t bytes() const { return dtype_bytes(dtype, numel()); }
  int64_t size(int i) const { return shape[i < 0 ? ndim + i : i]; }
  bool is_contiguous() const {
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      if (shape[i] != 1 && stride[i] != s) return false;
      s *= shape[i];
    }
    return true;
  }
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
  std::string shape_str() const;
};

// Device memory primitives; the CPU-only build answers every device call with a clear Status.
Status device_malloc(void** p, size_t bytes);
void device_free(void* p);
// Page-locked host memory (fast, asynchronous device-to-host copies; plain malloc without CUDA).
Status pinned_host_malloc(void** p, size_t bytes);
void pinned_host_free(void* p);
Status copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes);
// The same, queued on `stream` (host memory must be page-locked for the copy to be asynchronous); on the
// CPU backend a plain memcpy that is done when it returns.
Status copy_bytes_async(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes, void* stream);
// `height` rows of `width` bytes from src (rows `src_pitch` bytes apart) to dst (`dst_pitch` apart), both on
// `dev`, queued on `stream` (cudaMemcpy2DAsync; on the CPU a loop done when it returns).
Status copy_2d_async(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t height,
                     Device dev, void* stream);
// Page-locks (and maps for the GPU) existing host memory, e.g. one piece of a large mmap'd array; a
// failure is a Status that names the size. No-ops without CUDA.
Status pin_host_range(void* p, size_t bytes);
void unpin_host_range(void* p);
// The host waits for the work queued on `stream` so far (no-op on the CPU backend).
void stream_synchronize(void* stream);
// True if a CUDA device is usable; otherwise `why` says why not (no driver, no GPU, CPU-only build).
bool cuda_device_available(std::string* why);
// Free and total bytes of the current GPU; both 0 without one.
void device_memory_info(size_t* free_bytes, size_t* total_bytes);
// Waits for all queued GPU work (no-op on the CPU backend).
void device_synchronize();

// Owning storage for one tensor; moves, never copies.
class Buffer {
 public:
  Buffer() = default;
  static Status allocate(Buffer* out, DType dt, Device dev, std::initializer_list<int64_t> dims);
  ~Buffer() { reset(); }
  Buffer(Buffer&& o) noexcept : t_(o.t_) { o.t_.data = nullptr; }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      t_ = o.t_;
      o.t_.data = nullptr;
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  const Tensor& tensor() const { return t_; }
  void* data() const { return t_.data; }
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(t_.data);
  }
  void reset();

 private:
  Tensor t_;
};

}  // namespace nb
