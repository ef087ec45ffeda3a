// Collectives over the data-parallel ranks of one job: Gloo on the CPU backend, NCCL on CUDA. Nothing
// here implements a collective algorithm; each call forwards to the library (docs/DISTRIBUTED.md says
// why Gloo and not MPI: it works under every launcher, through the same TCP store as NCCL's id).
#pragma once
#include <chrono>
#include <memory>
#include <vector>
#include "core/status.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "distributed/tcp_store.h"
#include "distributed/world.h"

namespace nb::dist {

enum class ReduceOp { sum, max };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend() const = 0;  // "gloo" or "nccl"

  // Contiguous tensors on the backend's device (f32; bf16 too on NCCL; u8 for all_gather), queued on `stream` (CUDA;
  // the CPU backend runs them at once). Every rank calls the same collectives in the same order.
  // In place: every rank ends with the element-wise reduction over all ranks.
  virtual Status all_reduce(const Tensor& t, ReduceOp op, Stream stream) = 0;
  // `in` holds size() * n elements, `out` n: slice rank() of the sum over ranks. `in` may be
  // overwritten (Gloo reduces it in place and copies the slice out).
  virtual Status reduce_scatter(const Tensor& in, const Tensor& out, Stream stream) = 0;
  // `in` holds n elements, `out` size() * n: rank r's input lands at r * n. `in` may alias its slot.
  virtual Status all_gather(const Tensor& in, const Tensor& out, Stream stream) = 0;
  virtual Status broadcast(const Tensor& t, int root, Stream stream) = 0;
  // A few host scalars per step (loss sums, flags), reduced and returned on every rank (synchronizes).
  virtual Status all_reduce_host(double* values, int n, ReduceOp op) = 0;
  // Waits for the collectives queued on `stream`, for at most the timeout: a dead or hung peer becomes
  // an error naming this rank instead of a host thread blocked forever in a later synchronization.
  virtual Status wait(Stream stream) = 0;

  // Collective over this communicator's ranks (every rank calls it, in the same order): the ranks passing
  // the same color (>= 0) become one new communicator, ranked by key, ties by their rank here; the child's
  // rank() and size() are within its group. `name` ("cp", "tp", "dp_cp") labels the group in messages
  // (and, on Gloo, in the store keys, with a count of this communicator's splits, so splits never meet).
  virtual Status split(int color, int key, const char* name, std::unique_ptr<Communicator>* out) = 0;
  // One step of a ring: `send` goes to rank `to` while `recv` fills from rank `from` (ranks of this
  // communicator), so every rank of a ring may call it at once. Contiguous f32, bf16 or u8 on the backend's
  // device, moved as bytes: `recv` holds exactly what `from` sends. to == from == rank() copies `send`
  // into `recv`. Gloo tells consecutive calls apart by counting them: every rank makes the same calls.
  virtual Status send_recv(const Tensor& send, int to, const Tensor& recv, int from, Stream stream) = 0;
  // Point-to-point transfers posted as one group (pipeline parallelism): each op sends its tensor to, or fills it
  // from, `peer` (a rank of this communicator, never this one), as bytes. The group's ops progress together, so two
  // neighbours that send to each other at once do not deadlock. Between two ranks, the k-th send one posts matches
  // the k-th receive the other posts (each direction counted apart), whatever else either rank does meanwhile.
  struct P2POp {
    Tensor tensor;
    int peer = 0;
    bool send = false;
  };
  virtual Status p2p(const std::vector<P2POp>& ops, Stream stream) = 0;
};

// The communicator of `world` for `dev`: Gloo (CPU) or NCCL (CUDA, on the current device), meeting
// through `store`. Every collective gives up after `timeout` with a sentence naming this rank. Gloo's
// split() meets through `store` again, so the store outlives the communicator and its children.
Status make_communicator(const World& world, Device dev, TcpStore* store, std::chrono::milliseconds timeout,
                         std::unique_ptr<Communicator>* out);

// For implementations: `whole` must hold `ranks` slices the size and dtype of `slice` (reduce-scatter's
// input, all-gather's output); else one sentence naming `op`.
Status check_slices(const char* op, const Tensor& whole, const Tensor& slice, int ranks);
// For implementations: the peers of send_recv are ranks of `comm`, and sending to itself goes with
// receiving from itself, of as many bytes; else one sentence.
Status check_send_recv(const Communicator& comm, const Tensor& send, int to, const Tensor& recv, int from);

// Implementations (gloo_comm.cpp; nccl_comm.cu, only in CUDA builds).
Status make_gloo_communicator(const World& world, TcpStore* store, std::chrono::milliseconds timeout,
                              std::unique_ptr<Communicator>* out);
Status make_nccl_communicator(const World& world, TcpStore* store, std::chrono::milliseconds timeout,
                              std::unique_ptr<Communicator>* out);

}  // namespace nb::dist
