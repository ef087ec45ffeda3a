// SideStream and StreamEvent without the CUDA backend: every op has finished when it returns, so
// there is nothing to order.
#include "core/stream_event.h"
#include <chrono>

namespace nb::detail {
double host_now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace nb::detail

#if !defined(NIBBLE_HAVE_CUDA)
namespace nb {

SideStream::~SideStream() = default;
Status SideStream::create(Device, bool) { return Status::ok(); }
StreamEvent::~StreamEvent() = default;
Status StreamEvent::create(Device) { return Status::ok(); }
void StreamEvent::record(Stream) { recorded_ = true; }
void StreamEvent::wait_in(Stream) {}
TimedSpan::~TimedSpan() = default;
Status TimedSpan::create(Device) { return Status::ok(); }
void TimedSpan::begin(Stream) { host_begin_ = detail::host_now_ms(); }
void TimedSpan::end(Stream) {
  pending_ = true;
  host_ms_ = detail::host_now_ms() - host_begin_;
}
double TimedSpan::ms() {
  pending_ = false;
  return host_ms_;
}

}  // namespace nb
#endif
