// SideStream and StreamEvent without the CUDA backend: every op has finished when it returns, so
// there is nothing to order.
#include "core/stream_event.h"

#if !defined(NIBBLE_HAVE_CUDA)
namespace nb {

SideStream::~SideStream() = default;
Status SideStream::create(Device) { return Status::ok(); }
StreamEvent::~StreamEvent() = default;
Status StreamEvent::create(Device) { return Status::ok(); }
void StreamEvent::record(Stream) { recorded_ = true; }
void StreamEvent::wait_in(Stream) {}

}  // namespace nb
#endif
