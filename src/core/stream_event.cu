// SideStream and StreamEvent on CUDA: a non-blocking stream (no implicit synchronization with the
// legacy default stream the model runs on) and events without timing. On the CPU device both are
// no-ops, as in CPU-only builds.
#include "core/cuda_check.h"
#include "core/stream_event.h"

namespace nb {

SideStream::~SideStream() {
  if (s_) cudaStreamDestroy(cudaStream_t(s_));
}
Status SideStream::create(Device dev) {
  if (dev != Device::cuda || s_) return Status::ok();
  cudaStream_t s = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  s_ = s;
  return Status::ok();
}

StreamEvent::~StreamEvent() {
  if (e_) cudaEventDestroy(cudaEvent_t(e_));
}
Status StreamEvent::create(Device dev) {
  if (dev != Device::cuda || e_) return Status::ok();
  cudaEvent_t e = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  e_ = e;
  return Status::ok();
}
void StreamEvent::record(Stream s) {
  recorded_ = true;
  if (e_) CUDA_CHECK(cudaEventRecord(cudaEvent_t(e_), cudaStream_t(s)));
}
void StreamEvent::wait_in(Stream s) {
  if (e_ && recorded_) CUDA_CHECK(cudaStreamWaitEvent(cudaStream_t(s), cudaEvent_t(e_), 0));
}

}  // namespace nb
