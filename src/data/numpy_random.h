// Bit-exact C++ copies of the two numpy generators Megatron's data pipeline depends on, so nibble
// draws the same document/sample orders and mock lengths as Megatron for the same seed.
//  - LegacyRandomState: numpy.random.RandomState(seed) = MT19937 seeded with init_genrand(seed);
//    shuffle() is numpy's legacy Fisher-Yates (i from n-1 down to 1, j = random_interval(i) using
//    mask rejection on 32-bit draws); permutation(n) = shuffle(arange(n)).
//  - Pcg64Generator: numpy.random.default_rng(seed) = PCG64 (XSL-RR 128/64) seeded through
//    SeedSequence(seed); integers_int32() is Generator.integers(low, high, dtype=int32), i.e. Lemire's
//    bounded method on buffered 32-bit halves of the 64-bit outputs.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace nb {

class LegacyRandomState {
 public:
  explicit LegacyRandomState(uint32_t seed);
  uint32_t next_u32();
  uint64_t next_u64();  // numpy: (hi32 << 32) | lo32 from two draws, hi first
  // Uniform integer in [0, max] by masked rejection (numpy random_interval).
  uint64_t interval(uint64_t max);
  // In-place shuffle with numpy's legacy order. The draws do not depend on the data, so they are made kAhead swaps
  // early and each one's element prefetched: a shuffle of millions of samples (Megatron's sample order) is bound by
  // those random reads. Same draws, same swaps, same order as numpy.
  template <typename T>
  void shuffle(T* data, int64_t n) {
    constexpr int64_t kAhead = 16;
    uint64_t ahead[kAhead];
    const int64_t first = n - 1;
    for (int64_t i = first; i >= 1 && first - i < kAhead; --i) ahead[(first - i) % kAhead] = draw_into(data, i);
    for (int64_t i = first; i >= 1; --i) {
      const uint64_t j = ahead[(first - i) % kAhead];
      if (i - kAhead >= 1) ahead[(first - i) % kAhead] = draw_into(data, i - kAhead);
      std::swap(data[i], data[j]);
    }
  }
  template <typename T>
  void shuffle(std::vector<T>& v) {
    shuffle(v.data(), static_cast<int64_t>(v.size()));
  }
  // RandomState.randint(low, high) for a single int64 value (legacy path: interval(high-low-1)).
  int64_t randint(int64_t low, int64_t high) { return low + static_cast<int64_t>(interval(uint64_t(high - low - 1))); }

 private:
  // The swap partner of position i, its element prefetched.
  template <typename T>
  uint64_t draw_into(const T* data, int64_t i) {
    const uint64_t j = interval(static_cast<uint64_t>(i));
    __builtin_prefetch(data + j);
    return j;
  }
  void twist();
  uint32_t key_[624];
  int pos_;
};

class Pcg64Generator {
 public:
  // Seeds like numpy.random.default_rng(seed) for a non-negative integer seed < 2^64.
  explicit Pcg64Generator(uint64_t seed);
  uint64_t next_u64();
  uint32_t next_u32();  // buffered: low half of a 64-bit draw first, then its high half
  // Generator.integers(low, high, size=n, dtype=numpy.int32): values in [low, high).
  std::vector<int32_t> integers_int32(int32_t low, int32_t high, int64_t n);

 private:
  unsigned __int128 state_ = 0, inc_ = 0;
  bool has_u32_ = false;
  uint32_t u32_ = 0;
};

}  // namespace nb
