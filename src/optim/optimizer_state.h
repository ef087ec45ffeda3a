// Where AdamW's state lives: the FP32 master weights and moments m, v of one ParamStore shard, indexed
// by the shard's local element space [0, len). Without offload all three arrays are device buffers.
// With --optimizer-cpu-offload a share F (--optimizer-offload-fraction) lives in page-locked host
// memory instead: [0, resident) on the device, [resident, len) on the host, resident = len - F x len
// rounded to whole pages. The host arrays are one virtual range each of `len` elements (mmap), so a
// checkpoint can be written straight from them: their first `resident` elements are a staging area that
// stage_resident_for_save() fills (pageable, touched only by saves and loads), and only the live part
// [resident, len) is page-locked, in pieces of whole streaming chunks (one allocation of 80 GiB fails
// on the GPU machines; pieces do not). The update streams that part through the GPU (adamw_stream.h).
// Every transfer goes through read/write here, so a load can never leave a stale copy behind.
#pragma once
#include <cstdint>
#include <vector>
#include "core/status.h"
#include "core/stream_event.h"
#include "core/tensor.h"

namespace nb::optim {

enum class StateArray { master = 0, m = 1, v = 2 };
inline constexpr StateArray kStateArrays[3] = {StateArray::master, StateArray::m, StateArray::v};

struct Placement {
  double offload_fraction = 0;  // share of the state in host memory (0 = none)
  int64_t chunk_elems = 0;      // streaming chunk per array; a multiple of kPageElems
};

class OptimizerState {
 public:
  static constexpr int64_t kPageElems = 1024;  // 4 KiB of FP32: host pieces start on page boundaries
  OptimizerState() = default;
  ~OptimizerState();
  OptimizerState(const OptimizerState&) = delete;
  OptimizerState& operator=(const OptimizerState&) = delete;

  // The elements of a shard of `len` that a placement keeps on the host, and the resident rest.
  static int64_t offloaded_elems(int64_t len, const Placement& p);
  // The streaming chunk allocate() uses for a shard of `len`: the placement's, page-rounded, no longer than
  // the host part (the staging windows are sized from it; the memory estimate calls this too).
  static int64_t chunk_for(int64_t len, const Placement& p);
  Status allocate(Device dev, int64_t len, const Placement& p);
  void reset();

  Device device() const { return dev_; }
  int64_t len() const { return len_; }
  int64_t resident() const { return resident_; }
  bool offloaded() const { return resident_ < len_; }
  int64_t chunk_elems() const { return chunk_; }
  // The device part [0, resident) of one array: the whole array without offload.
  Tensor device_part(StateArray a) const;
  // The host array (len elements; only [resident, len) is live state), nullptr without offload.
  float* host_array(StateArray a) const { return host_[int(a)]; }

  Status fill_zero();
  // Element transfers between the state (either part) and host memory in local order.
  Status write(StateArray a, int64_t begin, const float* src, int64_t n);
  Status read(StateArray a, int64_t begin, float* dst, int64_t n) const;
  // The same into device memory (e.g. a rank's slice before a gather).
  Status read_to_device(StateArray a, int64_t begin, void* dst, int64_t n) const;
  // Copies the device part into the host arrays' staging area: afterwards host_array(a)[0, len) is the
  // whole state (checkpoint saves). The caller makes sure no update is in flight.
  Status stage_resident_for_save();

  // The queues that move the host part: copies in and copies out (adamw_stream.h queues on them).
  Stream copy_in_stream() const { return in_.get(); }
  Stream copy_out_stream() const { return out_.get(); }
  // The host waits until every queued copy out has landed; read/write/stage call it themselves.
  void settle() const;
  // The streamer is about to write the host arrays (fill_zero can no longer assume fresh zero pages).
  void note_host_written() { host_fresh_ = false; }

  size_t device_bytes() const { return size_t(resident_) * 12; }
  size_t host_bytes() const { return size_t(len_ - resident_) * 12; }

 private:
  int64_t device_elems(int64_t begin, int64_t n) const;
  Status map_host_arrays();
  Status pin_live_part();
  Device dev_ = Device::cpu;
  int64_t len_ = 0, resident_ = 0, chunk_ = 0;
  Buffer dev_arrays_[3];
  float* host_[3] = {nullptr, nullptr, nullptr};
  std::vector<void*> pinned_pieces_;
  SideStream in_, out_;
  bool host_fresh_ = false;  // the host arrays are untouched anonymous pages, i.e. zero
};

// Host memory this process may take for page-locked state: MemAvailable from /proc/meminfo, or
// NIBBLE_HOST_MEMORY_GIB when set (tests fake a small host with it). 0 when unknown.
double host_memory_available_bytes();

}  // namespace nb::optim
