// The CUDA backend's communicator: NCCL on the current device. Rank 0 makes the unique id and hands it
// out through the TCP store; collectives are queued on the caller's stream. A collective that cannot
// finish (a dead or hung peer) is caught by polling ncclCommGetAsyncError while waiting for the host
// scalars each step reads, and the communicator is aborted instead of hanging. split() is ncclCommSplit
// (blocking, NCCL >= 2.18); send_recv is a grouped ncclSend/ncclRecv of bytes on the caller's stream.
#include <cuda_runtime.h>
#include <nccl.h>
#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>
#include "distributed/communicator.h"

namespace nb::dist {

namespace {

Status nccl_status(ncclResult_t r, int rank, const char* what) {
  if (r == ncclSuccess || r == ncclInProgress) return Status::ok();
  return errorf("rank %d: NCCL %s failed: %s (%s)", rank, what, ncclGetErrorString(r), ncclGetLastError(nullptr));
}

bool nccl_type(DType dt, ncclDataType_t* out) {
  if (dt == DType::f32)
    *out = ncclFloat32;
  else if (dt == DType::bf16)
    *out = ncclBfloat16;
  else if (dt == DType::u8)
    *out = ncclUint8;  // quantized weights (all_gather only: the reductions refuse it below)
  else
    return false;
  return true;
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int size, std::chrono::milliseconds timeout)
      : comm_(comm), rank_(rank), size_(size), timeout_(timeout) {}
  ~NcclCommunicator() override {
    if (scratch_) cudaFree(scratch_);
    if (comm_) aborted_ ? void(0) : void(ncclCommDestroy(comm_));
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "nccl"; }

  Status all_reduce(const Tensor& t, ReduceOp op, Stream stream) override {
    ncclDataType_t ty;
    NB_TRY(check(t, "all_reduce", &ty));
    if (t.dtype == DType::u8) return errorf("all_reduce: bytes are gathered, never reduced");
    return nccl_status(ncclAllReduce(t.data, t.data, size_t(t.numel()), ty, op == ReduceOp::sum ? ncclSum : ncclMax,
                                     comm_, cudaStream_t(stream)),
                       rank_, "all_reduce");
  }
  Status reduce_scatter(const Tensor& in, const Tensor& out, Stream stream) override {
    ncclDataType_t ty;
    NB_TRY(check(in, "reduce_scatter", &ty));
    if (in.dtype == DType::u8) return errorf("reduce_scatter: bytes are gathered, never reduced");
    NB_TRY(check(out, "reduce_scatter", &ty));
    NB_TRY(check_slices("reduce_scatter", in, out, size_));
    return nccl_status(
        ncclReduceScatter(in.data, out.data, size_t(out.numel()), ty, ncclSum, comm_, cudaStream_t(stream)), rank_,
        "reduce_scatter");
  }
  Status all_gather(const Tensor& in, const Tensor& out, Stream stream) override {
    ncclDataType_t ty;
    NB_TRY(check(in, "all_gather", &ty));
    NB_TRY(check(out, "all_gather", &ty));
    NB_TRY(check_slices("all_gather", out, in, size_));
    return nccl_status(ncclAllGather(in.data, out.data, size_t(in.numel()), ty, comm_, cudaStream_t(stream)), rank_,
                       "all_gather");
  }
  Status broadcast(const Tensor& t, int root, Stream stream) override {
    ncclDataType_t ty;
    NB_TRY(check(t, "broadcast", &ty));
    return nccl_status(ncclBroadcast(t.data, t.data, size_t(t.numel()), ty, root, comm_, cudaStream_t(stream)), rank_,
                       "broadcast");
  }
  Status wait(Stream stream) override { return wait_stream(cudaStream_t(stream)); }
  // On the default stream, after the work queued before it; waits with a bounded poll (see the header). The device
  // scratch grows to the longest array reduced so far (a step's few scalars; MoR's statistics, 96 bytes per Linear;
  // the pipeline stages' delayed-scaling histories at a save), so it is allocated once per size, not per call.
  Status all_reduce_host(double* values, int n, ReduceOp op) override {
    if (n < 0) return errorf("all_reduce_host: %d values", n);
    if (n == 0) return Status::ok();
    if (n > scratch_values_) {
      if (scratch_) cudaFree(scratch_);
      scratch_ = nullptr;
      scratch_values_ = 0;
      if (cudaMalloc(&scratch_, sizeof(double) * size_t(std::max(n, kScratch))) != cudaSuccess)
        return errorf("rank %d: no device memory for the communicator's scratch of %d values", rank_, n);
      scratch_values_ = std::max(n, kScratch);
    }
    cudaMemcpy(scratch_, values, sizeof(double) * size_t(n), cudaMemcpyHostToDevice);
    NB_TRY(nccl_status(ncclAllReduce(scratch_, scratch_, size_t(n), ncclFloat64,
                                     op == ReduceOp::sum ? ncclSum : ncclMax, comm_, nullptr),
                       rank_, "all_reduce"));
    NB_TRY(wait_stream(nullptr));
    if (cudaMemcpy(values, scratch_, sizeof(double) * size_t(n), cudaMemcpyDeviceToHost) != cudaSuccess)
      return errorf("rank %d: copying reduced scalars to the host failed", rank_);
    return Status::ok();
  }

  // NCCL's split orders ties of key by parent rank, as the interface asks. It has no timeout: a dead peer
  // hangs it (the Gloo backend's split gives up after the timeout).
  Status split(int color, int key, const char* name, std::unique_ptr<Communicator>* out) override {
    if (color < 0) return errorf("rank %d: split \"%s\" needs a color >= 0, not %d", rank_, name, color);
    const std::string what = std::string("split \"") + name + "\"";
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    ncclComm_t child = nullptr;
    NB_TRY(nccl_status(ncclCommSplit(comm_, color, key, &child, &config), rank_, what.c_str()));
    int child_rank = 0, child_size = 0;
    ncclResult_t r = ncclCommUserRank(child, &child_rank);
    if (r == ncclSuccess) r = ncclCommCount(child, &child_size);
    if (r != ncclSuccess) {
      ncclCommDestroy(child);
      return nccl_status(r, rank_, what.c_str());
    }
    *out = std::make_unique<NcclCommunicator>(child, child_rank, child_size, timeout_);
    return Status::ok();
  }

  Status send_recv(const Tensor& send, int to, const Tensor& recv, int from, Stream stream) override {
    ncclDataType_t ty;
    NB_TRY(check(send, "send_recv", &ty));
    NB_TRY(check(recv, "send_recv", &ty));
    NB_TRY(check_send_recv(*this, send, to, recv, from));
    const cudaStream_t s = cudaStream_t(stream);
    if (to == rank_) {  // a ring of one
      if (cudaMemcpyAsync(recv.data, send.data, size_t(send.bytes()), cudaMemcpyDeviceToDevice, s) != cudaSuccess)
        return errorf("rank %d: send_recv's copy to itself failed", rank_);
      return Status::ok();
    }
    // One group: NCCL progresses the send and the receive together, so a ring that calls this at once
    // does not deadlock. The group is closed even when a call in it failed.
    NB_TRY(nccl_status(ncclGroupStart(), rank_, "send_recv"));
    const ncclResult_t sent = ncclSend(send.data, size_t(send.bytes()), ncclUint8, to, comm_, s);
    const ncclResult_t received = ncclRecv(recv.data, size_t(recv.bytes()), ncclUint8, from, comm_, s);
    const ncclResult_t ended = ncclGroupEnd();
    NB_TRY(nccl_status(sent, rank_, "send_recv's send"));
    NB_TRY(nccl_status(received, rank_, "send_recv's receive"));
    return nccl_status(ended, rank_, "send_recv");
  }
  // One group of ncclSend / ncclRecv of bytes; NCCL matches each pair's messages in the order they are posted.
  Status p2p(const std::vector<P2POp>& ops, Stream stream) override {
    for (const P2POp& op : ops) {
      ncclDataType_t ty;
      NB_TRY(check(op.tensor, "p2p", &ty));
      if (op.peer < 0 || op.peer >= size_ || op.peer == rank_)
        return errorf("rank %d: p2p peer %d is not another rank of this group of %d", rank_, op.peer, size_);
    }
    const cudaStream_t s = cudaStream_t(stream);
    NB_TRY(nccl_status(ncclGroupStart(), rank_, "p2p"));
    ncclResult_t first = ncclSuccess;
    for (const P2POp& op : ops) {
      if (op.tensor.bytes() == 0) continue;
      const ncclResult_t r = op.send
                                 ? ncclSend(op.tensor.data, size_t(op.tensor.bytes()), ncclUint8, op.peer, comm_, s)
                                 : ncclRecv(op.tensor.data, size_t(op.tensor.bytes()), ncclUint8, op.peer, comm_, s);
      if (first == ncclSuccess) first = r;
    }
    const ncclResult_t ended = ncclGroupEnd();  // closed even when a call in it failed
    NB_TRY(nccl_status(first, rank_, "p2p"));
    return nccl_status(ended, rank_, "p2p");
  }

 private:
  static constexpr int kScratch = 64;  // the least scratch allocated (a step's scalars)
  Status check(const Tensor& t, const char* op, ncclDataType_t* ty) const {
    if (t.device != Device::cuda) return errorf("%s: the NCCL communicator takes device tensors", op);
    if (!nccl_type(t.dtype, ty))
      return errorf("%s: the NCCL communicator takes f32 or bf16 (u8 to gather), not %s", op,
                    std::string(dtype_name(t.dtype)).c_str());
    if (!t.is_contiguous()) return errorf("%s: the tensor %s is not contiguous", op, t.shape_str().c_str());
    return Status::ok();
  }
  // Polls the stream and NCCL's asynchronous error until done or `timeout_`; aborts the communicator
  // on an error or at the deadline, so that no rank waits forever on a dead peer.
  Status wait_stream(cudaStream_t s) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      cudaError_t q = cudaStreamQuery(s);
      if (q == cudaSuccess) return Status::ok();
      if (q != cudaErrorNotReady)
        return errorf("rank %d: CUDA error while waiting for NCCL: %s", rank_, cudaGetErrorString(q));
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        abort_comm();
        return errorf("rank %d: NCCL reported %s; another rank has probably died, see its messages", rank_,
                      ncclGetErrorString(async));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        abort_comm();
        return errorf(
            "rank %d: a collective did not finish within %lld s: another rank has died or hangs; "
            "stopping (raise NIBBLE_DIST_TIMEOUT if steps are legitimately this slow)",
            rank_, (long long)(timeout_.count() / 1000));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  void abort_comm() {
    if (!aborted_) ncclCommAbort(comm_);
    aborted_ = true;
  }
  ncclComm_t comm_ = nullptr;
  int rank_ = 0, size_ = 1;
  std::chrono::milliseconds timeout_;
  void* scratch_ = nullptr;
  int scratch_values_ = 0;  // doubles scratch_ holds
  bool aborted_ = false;
};

}  // namespace

Status make_nccl_communicator(const World& world, TcpStore* store, std::chrono::milliseconds timeout,
                              std::unique_ptr<Communicator>* out) {
  ncclUniqueId id{};
  if (world.rank == 0) {
    NB_TRY(nccl_status(ncclGetUniqueId(&id), 0, "ncclGetUniqueId"));
    NB_TRY(store->set("nccl_id", std::vector<uint8_t>(id.internal, id.internal + sizeof(id.internal))));
  } else {
    std::vector<uint8_t> v;
    NB_TRY(store->get("nccl_id", &v));
    if (v.size() != sizeof(id.internal))
      return errorf("rank %d: the NCCL id from rank 0 has the wrong size", world.rank);
    std::copy(v.begin(), v.end(), id.internal);
  }
  ncclComm_t comm = nullptr;
  NB_TRY(nccl_status(ncclCommInitRank(&comm, world.size, id, world.rank), world.rank, "ncclCommInitRank"));
  *out = std::make_unique<NcclCommunicator>(comm, world.rank, world.size, timeout);
  return Status::ok();
}

}  // namespace nb::dist
