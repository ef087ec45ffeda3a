// The CPU backend's communicator: Gloo (Debian's libgloo-dev) over TCP, meeting through nibble's TCP
// store. Gloo's ring all-reduce gives every rank the same bits. Its reduce-scatter is an all-reduce of
// the whole buffer followed by a copy of this rank's slice: twice the traffic of a true reduce-scatter,
// which only matters for speed, and the CPU backend is the reference, not the fast path. BF16 tensors
// (--grad-reduce-in-bf16) are summed in FP32 and rounded to BF16 once; NCCL rounds after each partial
// sum, which gives the same bits for two ranks and may differ in the last bit for more. A split's groups
// meet through the same store, each under a key prefix of its own, and share the parent's TCP device (so
// the same address rule); send_recv is a pair of Gloo's unbound-buffer transfers, one slot per call.
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <unistd.h>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>
#include "core/bf16.h"
#include "distributed/communicator.h"

namespace nb::dist {

namespace {

// Gloo's rendezvous store interface over nibble's TcpStore (Gloo reports failure by throwing).
class GlooStore : public gloo::rendezvous::Store {
 public:
  GlooStore(TcpStore* s, std::string prefix, std::chrono::milliseconds timeout)
      : prefix(std::move(prefix)), s_(s), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    check(s_->set(prefix + key, std::vector<uint8_t>(data.begin(), data.end())));
  }
  std::vector<char> get(const std::string& key) override {
    std::vector<uint8_t> v;
    check(s_->get(prefix + key, &v));
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix + k);
    check(s_->wait(full, timeout));
  }
  const std::string prefix;  // "gloo/" for a world's communicator, longer for the groups of its splits

 private:
  static void check(const Status& st) {
    if (!st) throw gloo::IoException(st.message());
  }
  TcpStore* s_;
  std::chrono::milliseconds timeout_;
};

template <typename T>
void sum_fn(void* c, const void* a, const void* b, size_t n) {
  gloo::sum<T>(c, a, b, n);
}
template <typename T>
void max_fn(void* c, const void* a, const void* b, size_t n) {
  gloo::max<T>(c, a, b, n);
}

// `rank` of `size` connected to every other rank through the store keys under `prefix` (Gloo throws on
// failure). Groups of a split reuse their parent's device: one listening socket and event loop per process.
std::shared_ptr<gloo::Context> connect_mesh(int rank, int size, TcpStore* store, const std::string& prefix,
                                            std::shared_ptr<gloo::transport::Device> device,
                                            std::chrono::milliseconds timeout) {
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
  ctx->setTimeout(timeout);
  GlooStore gs(store, prefix, timeout);
  ctx->connectFullMesh(gs, device);
  return ctx;
}

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::Context> ctx, TcpStore* store, std::string prefix,
                   std::chrono::milliseconds timeout)
      : ctx_(std::move(ctx)), store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}
  int rank() const override { return ctx_->rank; }
  int size() const override { return ctx_->size; }
  const char* backend() const override { return "gloo"; }

  Status all_reduce(const Tensor& t, ReduceOp op, Stream) override {
    NB_TRY(check_tensor(t, "all_reduce", true));
    if (t.dtype == DType::bf16)
      return guarded("all_reduce", [&] {
        std::vector<float> wide = widen(t);
        run_all_reduce(wide.data(), false, wide.size(), op);
        narrow(wide.data(), t);
      });
    return guarded("all_reduce", [&] { run_all_reduce(t.data, false, size_t(t.numel()), op); });
  }

  Status reduce_scatter(const Tensor& in, const Tensor& out, Stream) override {
    NB_TRY(check_tensor(in, "reduce_scatter", true));
    NB_TRY(check_tensor(out, "reduce_scatter", true));
    NB_TRY(check_slices("reduce_scatter", in, out, size()));
    if (in.dtype == DType::bf16)
      return guarded("reduce_scatter", [&] {
        std::vector<float> wide = widen(in);
        run_all_reduce(wide.data(), false, wide.size(), ReduceOp::sum);
        narrow(wide.data() + out.numel() * rank(), out);
      });
    return guarded("reduce_scatter", [&] {
      run_all_reduce(in.data, false, size_t(in.numel()), ReduceOp::sum);
      const size_t bytes = size_t(out.bytes());
      std::memmove(out.data, static_cast<const char*>(in.data) + bytes * size_t(rank()), bytes);
    });
  }

  Status all_gather(const Tensor& in, const Tensor& out, Stream) override {
    NB_TRY(check_tensor(in, "all_gather", false, true));
    NB_TRY(check_tensor(out, "all_gather", false, true));
    NB_TRY(check_slices("all_gather", out, in, size()));
    return guarded("all_gather", [&] {
      // Gloo copies the input into its slot first; a private copy keeps that copy from overlapping itself.
      std::vector<char> mine(static_cast<const char*>(in.data), static_cast<const char*>(in.data) + in.bytes());
      gloo::AllgatherOptions o(ctx_);
      o.setInput(mine.data(), mine.size());
      o.setOutput(static_cast<char*>(out.data), size_t(out.bytes()));
      o.setTimeout(timeout_);
      gloo::allgather(o);
    });
  }

  Status broadcast(const Tensor& t, int root, Stream) override {
    NB_TRY(check_tensor(t, "broadcast"));
    return guarded("broadcast", [&] {
      gloo::BroadcastOptions o(ctx_);
      o.setOutput(static_cast<char*>(t.data), size_t(t.bytes()));
      o.setRoot(root);
      o.setTimeout(timeout_);
      gloo::broadcast(o);
    });
  }

  Status wait(Stream) override { return Status::ok(); }  // Gloo's calls return when they are done
  Status all_reduce_host(double* values, int n, ReduceOp op) override {
    return guarded("all_reduce_host", [&] { run_all_reduce(values, true, size_t(n), op); });
  }

  Status split(int color, int key, const char* name, std::unique_ptr<Communicator>* out) override {
    const int64_t index = splits_++;  // counted before any refusal, so that the ranks' counts stay equal
    if (color < 0) return errorf("rank %d: split \"%s\" needs a color >= 0, not %d", rank(), name, color);
    int group_rank = 0, group_size = 0;
    NB_TRY(find_group(color, key, name, &group_rank, &group_size));
    // The parent's prefix keeps apart the groups of sibling communicators, the count this one's splits.
    const std::string prefix = prefix_ + name + "." + std::to_string(index) + ".c" + std::to_string(color) + "/";
    try {
      auto ctx = connect_mesh(group_rank, group_size, store_, prefix, ctx_->getDevice(), timeout_);
      *out = std::make_unique<GlooCommunicator>(std::move(ctx), store_, prefix, timeout_);
      return Status::ok();
    } catch (const std::exception& e) {
      return errorf("rank %d: could not connect the Gloo group of split \"%s\" (color %d, %d ranks): %s", rank(), name,
                    color, group_size, e.what());
    }
  }

  Status send_recv(const Tensor& send, int to, const Tensor& recv, int from, Stream) override {
    const uint64_t slot = next_slot_++;  // counted before any refusal, like the splits
    NB_TRY(check_tensor(send, "send_recv", true, true));
    NB_TRY(check_tensor(recv, "send_recv", true, true));
    NB_TRY(check_send_recv(*this, send, to, recv, from));
    if (to == rank()) {  // a ring of one
      if (send.bytes() > 0) std::memmove(recv.data, send.data, size_t(send.bytes()));
      return Status::ok();
    }
    const std::string op = "send_recv (to rank " + std::to_string(to) + ", from rank " + std::to_string(from) + ")";
    return guarded(op.c_str(), [&] { exchange(send, to, recv, from, slot); });
  }

  // Each direction of each pair counts its messages: the k-th send to a peer and that peer's k-th receive from this
  // rank share slot kP2PSlots + k, apart from send_recv's slots.
  Status p2p(const std::vector<P2POp>& ops, Stream) override {
    for (const P2POp& op : ops) {
      NB_TRY(check_tensor(op.tensor, "p2p", true, true));
      if (op.peer < 0 || op.peer >= size() || op.peer == rank())
        return errorf("rank %d: p2p peer %d is not another rank of this group of %d", rank(), op.peer, size());
    }
    sent_.resize(size_t(size()), 0);
    received_.resize(size_t(size()), 0);
    return guarded("p2p", [&] {
      std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> bufs;
      for (const P2POp& op : ops) {
        if (op.tensor.bytes() == 0) continue;
        auto& count = op.send ? sent_[size_t(op.peer)] : received_[size_t(op.peer)];
        const uint64_t slot = kP2PSlots + count++;
        bufs.push_back(ctx_->createUnboundBuffer(op.tensor.data, size_t(op.tensor.bytes())));
        if (op.send)
          bufs.back()->send(op.peer, slot);
        else
          bufs.back()->recv(op.peer, slot);
      }
      size_t b = 0;
      for (const P2POp& op : ops) {
        if (op.tensor.bytes() == 0) continue;
        auto& buf = bufs[b++];
        if (!(op.send ? buf->waitSend(timeout_) : buf->waitRecv(timeout_)))
          throw std::runtime_error(op.send ? "a send was aborted" : "a receive was aborted");
      }
    });
  }

 private:
  // Every rank's (color, key), gathered by summing arrays of zeros in which each rank fills its own two
  // entries (doubles hold any int exactly); then this rank's place in its group, by key and then by rank.
  Status find_group(int color, int key, const char* name, int* group_rank, int* group_size) {
    std::vector<double> pairs(size_t(2 * size()), 0.0);
    pairs[size_t(2 * rank())] = color;
    pairs[size_t(2 * rank() + 1)] = key;
    const std::string op = std::string("split \"") + name + "\"";
    NB_TRY(guarded(op.c_str(), [&] { run_all_reduce(pairs.data(), true, pairs.size(), ReduceOp::sum); }));
    *group_rank = *group_size = 0;
    for (int r = 0; r < size(); ++r) {
      const int c = int(pairs[size_t(2 * r)]), k = int(pairs[size_t(2 * r + 1)]);
      if (c != color) continue;
      ++*group_size;
      if (k < key || (k == key && r < rank())) ++*group_rank;
    }
    return Status::ok();
  }
  // Both transfers are posted before either is waited for, so a ring whose ranks all call this at once
  // cannot block on itself. An empty side moves nothing: its peer's matching side is empty too.
  void exchange(const Tensor& send, int to, const Tensor& recv, int from, uint64_t slot) {
    std::unique_ptr<gloo::transport::UnboundBuffer> in, out;
    if (recv.bytes() > 0) {
      in = ctx_->createUnboundBuffer(recv.data, size_t(recv.bytes()));
      in->recv(from, slot);
    }
    if (send.bytes() > 0) {
      out = ctx_->createUnboundBuffer(send.data, size_t(send.bytes()));
      out->send(to, slot);
    }
    if (in && !in->waitRecv(timeout_)) throw std::runtime_error("the receive was aborted");
    if (out && !out->waitSend(timeout_)) throw std::runtime_error("the send was aborted");
  }
  void run_all_reduce(void* data, bool is_double, size_t n, ReduceOp op) {
    gloo::AllreduceOptions o(ctx_);
    o.setTimeout(timeout_);
    if (is_double) {
      o.setOutput(static_cast<double*>(data), n);
      o.setReduceFunction(op == ReduceOp::sum ? &sum_fn<double> : &max_fn<double>);
    } else {
      o.setOutput(static_cast<float*>(data), n);
      o.setReduceFunction(op == ReduceOp::sum ? &sum_fn<float> : &max_fn<float>);
    }
    gloo::allreduce(o);
  }
  static std::vector<float> widen(const Tensor& t) {
    const bf16* p = static_cast<const bf16*>(t.data);
    std::vector<float> out(size_t(t.numel()));
    for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_to_f32(p[i]);
    return out;
  }
  static void narrow(const float* src, const Tensor& dst) {
    bf16* p = static_cast<bf16*>(dst.data);
    for (int64_t i = 0; i < dst.numel(); ++i) p[i] = f32_to_bf16(src[i]);
  }
  // bytes_ok: u8 tensors (quantized weights), which are gathered but never reduced.
  static Status check_tensor(const Tensor& t, const char* op, bool bf16_ok = false, bool bytes_ok = false) {
    if (t.device != Device::cpu) return errorf("%s: the Gloo communicator takes host tensors", op);
    if (t.dtype != DType::f32 && !(bf16_ok && t.dtype == DType::bf16) && !(bytes_ok && t.dtype == DType::u8))
      return errorf("%s: the Gloo communicator takes f32 tensors, not %s", op,
                    std::string(dtype_name(t.dtype)).c_str());
    if (!t.is_contiguous()) return errorf("%s: the tensor %s is not contiguous", op, t.shape_str().c_str());
    return Status::ok();
  }
  // Gloo throws on a dead peer or a timeout; the caller gets one sentence naming this rank.
  template <typename F>
  Status guarded(const char* op, F&& f) {
    try {
      f();
      return Status::ok();
    } catch (const std::exception& e) {
      return errorf("rank %d: Gloo %s failed (a peer died, hung past %lld s, or the network broke): %s", rank(), op,
                    (long long)(timeout_.count() / 1000), e.what());
    }
  }
  std::shared_ptr<gloo::Context> ctx_;
  TcpStore* store_;     // where the groups of a split meet
  std::string prefix_;  // this communicator's store keys
  std::chrono::milliseconds timeout_;
  int64_t splits_ = 0;
  // send_recv's Gloo slots: small numbers, below the collectives' slots (whose top byte names the collective).
  uint64_t next_slot_ = 0;
  static constexpr uint64_t kP2PSlots = uint64_t(1) << 48;
  std::vector<uint64_t> sent_, received_;  // p2p messages per peer, each direction
};

// One rank on one host binds to the loopback address; across hosts, to this host's name (which the
// other hosts must resolve), or NIBBLE_GLOO_HOSTNAME when that is not the right interface.
std::string gloo_hostname(const World& world) {
  if (const char* h = std::getenv("NIBBLE_GLOO_HOSTNAME"); h && *h) return h;
  if (world.local_size == world.size) return "127.0.0.1";
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  return name;
}

}  // namespace

Status make_gloo_communicator(const World& world, TcpStore* store, std::chrono::milliseconds timeout,
                              std::unique_ptr<Communicator>* out) {
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = gloo_hostname(world);
    const std::string prefix = "gloo/";
    auto ctx = connect_mesh(world.rank, world.size, store, prefix, gloo::transport::tcp::CreateDevice(attr), timeout);
    *out = std::make_unique<GlooCommunicator>(std::move(ctx), store, prefix, timeout);
    return Status::ok();
  } catch (const std::exception& e) {
    return errorf("rank %d of %d: could not connect the Gloo ranks (host %s): %s", world.rank, world.size,
                  gloo_hostname(world).c_str(), e.what());
  }
}

}  // namespace nb::dist
