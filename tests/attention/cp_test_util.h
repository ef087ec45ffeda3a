// Shared by the context-parallel attention tests (CPU and GPU): ranks as threads passing K/V through host memory,
// a rank's rows of whole-sequence tensors (chunks r and 2C-1-r of every row, ops/cp_ring.h's global_position), a
// rank's tokens and segment table of packed rows, and the largest error relative to the reference's largest
// magnitude.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <vector>
#include "ops/cp_ring.h"

namespace nb::ops {

// The ranks' exchange: each writes what it sends, all wait, each reads its previous rank's, all wait again.
struct RingMailbox {
  explicit RingMailbox(int n) : slots(size_t(n)), sync(n) {}
  std::vector<std::vector<char>> slots;
  std::barrier<> sync;
};

// A ring link of threads. On CUDA the copies (cudaMemcpy, legacy default stream) wait for the kernels before them.
class ThreadRingLink : public cp::RingLink {
 public:
  ThreadRingLink(int rank, int size, RingMailbox* box) : rank_(rank), size_(size), box_(box) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Status pass(const Tensor& send, const Tensor& recv, Stream) override {
    sent += send.bytes();
    auto& mine = box_->slots[size_t(rank_)];
    mine.resize(size_t(send.bytes()));
    NB_TRY(copy_bytes(mine.data(), Device::cpu, send.data, send.device, mine.size()));
    box_->sync.arrive_and_wait();
    const auto& prev = box_->slots[size_t((rank_ + size_ - 1) % size_)];
    NB_TRY(copy_bytes(recv.data, recv.device, prev.data(), Device::cpu, size_t(recv.bytes())));
    box_->sync.arrive_and_wait();
    return Status::ok();
  }
  int64_t sent = 0;  // bytes this rank passed on

 private:
  int rank_, size_;
  RingMailbox* box_;
};

// Rank r's rows of `width` floats from a whole-sequence [B, S, width] host tensor: [B, S/C, width].
inline std::vector<float> cp_rows(const std::vector<float>& whole, int64_t B, int64_t S, int64_t width, int r, int C) {
  const int64_t Sl = S / C;
  std::vector<float> out;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Sl; ++i) {
      const float* row = whole.data() + (b * S + cp::global_position(i, Sl, r, C)) * width;
      out.insert(out.end(), row, row + width);
    }
  return out;
}

// Rank r's entries of lse [B, H, S]: [B, H, S/C].
inline std::vector<float> cp_lse(const std::vector<float>& lse, int64_t B, int64_t H, int64_t S, int r, int C) {
  const int64_t Sl = S / C;
  std::vector<float> out;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Sl; ++i) out.push_back(lse[size_t((b * H + h) * S + cp::global_position(i, Sl, r, C))]);
  return out;
}

// Packed rows: the `width` floats of each of `tokens` (indices into whole [T, width]), e.g. a rank's tokens from
// cp::shard_tokens; with width = Hq this also gathers a token-major lse.
inline std::vector<float> cp_tokens(const std::vector<float>& whole, const std::vector<int64_t>& tokens,
                                    int64_t width) {
  std::vector<float> out;
  for (int64_t t : tokens) out.insert(out.end(), whole.begin() + t * width, whole.begin() + (t + 1) * width);
  return out;
}

// A rank's local segment table of packed rows whose segments are multiples of 2C: each segment's share, in order.
inline std::vector<int32_t> cp_local_starts(const std::vector<int32_t>& whole, int C) {
  std::vector<int32_t> local;
  for (int32_t s : whole) local.push_back(s / C);
  return local;
}

// max |a - b| over max |b|: FP32 rounding of O(1) values stays near 1e-7; a wrong merge or mask is O(1e-1).
inline double max_rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(double(a[i]) - double(b[i])));
    scale = std::max(scale, std::fabs(double(b[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

}  // namespace nb::ops
