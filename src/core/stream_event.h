// A second execution queue beside the default stream, and events that order work between the two:
// what lets data-parallel collectives run while the model computes (docs/DISTRIBUTED.md, overlap). On
// the CPU backend every op finishes before it returns, so the side stream is the default one (nullptr)
// and events are no-ops.
#pragma once
#include "core/status.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace nb {

// An owned stream that does not synchronize implicitly with the default stream (CUDA's non-blocking
// flag); on the CPU backend it is the default stream.
class SideStream {
 public:
  SideStream() = default;
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  // high_priority: the scheduler starts this stream's blocks before those of normal streams (small
  // kernels that other work waits for, such as a streamed optimizer update beside the forward's GEMMs).
  Status create(Device dev, bool high_priority = false);
  Stream get() const { return s_; }

 private:
  Stream s_ = nullptr;
};

// A marker in one stream's work that another stream (or the host) can wait for. Timing is disabled:
// these events only order work.
class StreamEvent {
 public:
  StreamEvent() = default;
  ~StreamEvent();
  StreamEvent(StreamEvent&& o) noexcept : e_(o.e_) { o.e_ = nullptr; }
  StreamEvent& operator=(StreamEvent&&) = delete;
  StreamEvent(const StreamEvent&) = delete;
  Status create(Device dev);
  void record(Stream s);   // marks the work queued on s so far
  void wait_in(Stream s);  // work queued on s after this call waits for the marked work
  bool recorded() const { return recorded_; }

 private:
  void* e_ = nullptr;
  bool recorded_ = false;
};

namespace detail {
double host_now_ms();  // steady clock
}  // namespace detail

// The device time between two points of one stream's work (timed events on CUDA; the host clock on the
// CPU backend, where every op is done when it returns). ms() waits for the end point.
class TimedSpan {
 public:
  TimedSpan() = default;
  ~TimedSpan();
  TimedSpan(const TimedSpan&) = delete;
  TimedSpan& operator=(const TimedSpan&) = delete;
  Status create(Device dev);
  void begin(Stream s);
  void end(Stream s);
  bool pending() const { return pending_; }
  double ms();  // the span's length; clears pending

 private:
  void* b_ = nullptr;
  void* e_ = nullptr;
  double host_begin_ = 0, host_ms_ = 0;
  bool pending_ = false;
};

}  // namespace nb
