// SideStream and StreamEvent on CUDA: a non-blocking stream (no implicit synchronization with the
// legacy default stream the model runs on) and events without timing. On the CPU device both are
// no-ops, as in CPU-only builds.
#include "core/cuda_check.h"
#include "core/stream_event.h"

namespace nb {

SideStream::~SideStream() {
  if (s_) cudaStreamDestroy(cudaStream_t(s_));
}
Status SideStream::create(Device dev, bool high_priority) {
  if (dev != Device::cuda || s_) return Status::ok();
  int least = 0, greatest = 0;
  CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t s = nullptr;
  CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, high_priority ? greatest : least));
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

TimedSpan::~TimedSpan() {
  if (b_) cudaEventDestroy(cudaEvent_t(b_));
  if (e_) cudaEventDestroy(cudaEvent_t(e_));
}
Status TimedSpan::create(Device dev) {
  if (dev != Device::cuda || b_) return Status::ok();
  cudaEvent_t b = nullptr, e = nullptr;
  CUDA_CHECK(cudaEventCreate(&b));
  CUDA_CHECK(cudaEventCreate(&e));
  b_ = b;
  e_ = e;
  return Status::ok();
}
void TimedSpan::begin(Stream s) {
  if (b_)
    CUDA_CHECK(cudaEventRecord(cudaEvent_t(b_), cudaStream_t(s)));
  else
    host_begin_ = detail::host_now_ms();
}
void TimedSpan::end(Stream s) {
  pending_ = true;
  if (e_)
    CUDA_CHECK(cudaEventRecord(cudaEvent_t(e_), cudaStream_t(s)));
  else
    host_ms_ = detail::host_now_ms() - host_begin_;
}
double TimedSpan::ms() {
  pending_ = false;
  if (!e_) return host_ms_;
  float ms = 0;
  CUDA_CHECK(cudaEventSynchronize(cudaEvent_t(e_)));
  CUDA_CHECK(cudaEventElapsedTime(&ms, cudaEvent_t(b_), cudaEvent_t(e_)));
  return double(ms);
}

}  // namespace nb
