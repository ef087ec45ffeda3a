// What every communicator shares: the choice of backend and the shape rules of the slice collectives.
#include "distributed/communicator.h"

namespace nb::dist {

Status check_slices(const char* op, const Tensor& whole, const Tensor& slice, int ranks) {
  if (whole.dtype != slice.dtype || whole.numel() != slice.numel() * ranks)
    return errorf("%s: %lld elements do not split into %d slices of %lld", op, (long long)whole.numel(), ranks,
                  (long long)slice.numel());
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
