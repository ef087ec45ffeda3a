// What every communicator shares: the choice of backend and the argument rules of the slice collectives
// and of send_recv.
#include "distributed/communicator.h"

namespace nb::dist {

Status check_slices(const char* op, const Tensor& whole, const Tensor& slice, int ranks) {
  if (whole.dtype != slice.dtype || whole.numel() != slice.numel() * ranks)
    return errorf("%s: %lld elements do not split into %d slices of %lld", op, (long long)whole.numel(), ranks,
                  (long long)slice.numel());
  return Status::ok();
}

Status check_send_recv(const Communicator& comm, const Tensor& send, int to, const Tensor& recv, int from) {
  const int me = comm.rank(), n = comm.size();
  if (to < 0 || to >= n || from < 0 || from >= n)
    return errorf("send_recv: rank %d sends to %d and receives from %d, but the communicator has ranks 0..%d", me, to,
                  from, n - 1);
  // A message to itself has no other receiver, and one from itself no other sender.
  if ((to == me) != (from == me))
    return errorf("send_recv: rank %d sends to %d but receives from %d; a rank talks to itself both ways or neither",
                  me, to, from);
  if (to == me && send.bytes() != recv.bytes())
    return errorf("send_recv: rank %d copies %lld bytes to itself into a buffer of %lld", me, (long long)send.bytes(),
                  (long long)recv.bytes());
  return Status::ok();
}

Status make_communicator(const World& world, Device dev, TcpStore* store, std::chrono::milliseconds timeout,
                         std::unique_ptr<Communicator>* out) {
  if (dev == Device::cpu) return make_gloo_communicator(world, store, timeout, out);
#if NIBBLE_HAVE_CUDA
  return make_nccl_communicator(world, store, timeout, out);
#else
  return errorf("this nibble was built without CUDA, so it has no NCCL communicator");
#endif
}

}  // namespace nb::dist
