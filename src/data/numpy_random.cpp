// MT19937 / RandomState and SeedSequence / PCG64 as numpy implements them (see numpy_random.h).
#include "data/numpy_random.h"

namespace nb {

LegacyRandomState::LegacyRandomState(uint32_t seed) {
  // init_genrand: key[i] = 1812433253 * (key[i-1] ^ (key[i-1] >> 30)) + i.
  key_[0] = seed;
  for (int i = 1; i < 624; ++i) key_[i] = 1812433253u * (key_[i - 1] ^ (key_[i - 1] >> 30)) + static_cast<uint32_t>(i);
  pos_ = 624;
}

void LegacyRandomState::twist() {
  constexpr uint32_t kUpper = 0x80000000u, kLower = 0x7fffffffu, kMatrix = 0x9908b0dfu;
  int i = 0;
  for (; i < 624 - 397; ++i) {
    uint32_t y = (key_[i] & kUpper) | (key_[i + 1] & kLower);
    key_[i] = key_[i + 397] ^ (y >> 1) ^ ((y & 1u) ? kMatrix : 0u);
  }
  for (; i < 623; ++i) {
    uint32_t y = (key_[i] & kUpper) | (key_[i + 1] & kLower);
    key_[i] = key_[i + 397 - 624] ^ (y >> 1) ^ ((y & 1u) ? kMatrix : 0u);
  }
  uint32_t y = (key_[623] & kUpper) | (key_[0] & kLower);
  key_[623] = key_[396] ^ (y >> 1) ^ ((y & 1u) ? kMatrix : 0u);
  pos_ = 0;
}

uint32_t LegacyRandomState::next_u32() {
  if (pos_ == 624) twist();
  uint32_t y = key_[pos_++];
  y ^= (y >> 11);
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  y ^= (y >> 18);
  return y;
}

uint64_t LegacyRandomState::next_u64() {
  uint64_t hi = next_u32();
  return (hi << 32) | next_u32();
}

uint64_t LegacyRandomState::interval(uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max;
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  mask |= mask >> 32;
  uint64_t value;
  if (max <= 0xffffffffull) {
    while ((value = (next_u32() & mask)) > max) {}
  } else {
    while ((value = (next_u64() & mask)) > max) {}
  }
  return value;
}

// ---- SeedSequence (numpy/random/bit_generator.pyx), pool size 4, 32-bit words. ----
namespace {
constexpr uint32_t kInitA = 0x43b0d7e5u, kMultA = 0x931e8875u, kInitB = 0x8b51f9ddu, kMultB = 0x58f38dedu;
constexpr uint32_t kMixMultL = 0xca01f9ddu, kMixMultR = 0x4973f715u;

uint32_t hashmix(uint32_t value, uint32_t* hash_const) {
  value ^= *hash_const;
  *hash_const *= kMultA;
  value *= *hash_const;
  value ^= value >> 16;
  return value;
}
uint32_t mix(uint32_t x, uint32_t y) {
  uint32_t r = kMixMultL * x - kMixMultR * y;
  r ^= r >> 16;
  return r;
}

// generate_state(n_words32) for SeedSequence(entropy = seed as little-endian uint32 words).
std::vector<uint32_t> seed_sequence_state(uint64_t seed, int n_words) {
  std::vector<uint32_t> entropy;
  if (seed == 0) entropy.push_back(0);
  while (seed > 0) {
    entropy.push_back(static_cast<uint32_t>(seed));
    seed >>= 32;
  }
  uint32_t pool[4];
  uint32_t hc = kInitA;
  for (int i = 0; i < 4; ++i) pool[i] = hashmix(i < int(entropy.size()) ? entropy[i] : 0u, &hc);
  for (int s = 0; s < 4; ++s)
    for (int d = 0; d < 4; ++d)
      if (s != d) pool[d] = mix(pool[d], hashmix(pool[s], &hc));
  for (size_t s = 4; s < entropy.size(); ++s)
    for (int d = 0; d < 4; ++d) pool[d] = mix(pool[d], hashmix(entropy[s], &hc));
  std::vector<uint32_t> out(n_words);
  uint32_t hb = kInitB;
  for (int i = 0; i < n_words; ++i) {
    uint32_t v = pool[i % 4];
    v ^= hb;
    hb *= kMultB;
    v *= hb;
    v ^= v >> 16;
    out[i] = v;
  }
  return out;
}

const unsigned __int128 kPcgMult =
    (static_cast<unsigned __int128>(0x2360ED051FC65DA4ull) << 64) | 0x4385DF649FCCF645ull;
}  // namespace

Pcg64Generator::Pcg64Generator(uint64_t seed) {
  std::vector<uint32_t> w = seed_sequence_state(seed, 8);
  uint64_t v[4];
  for (size_t i = 0; i < 4; ++i) v[i] = uint64_t(w[2 * i]) | (uint64_t(w[2 * i + 1]) << 32);  // view as uint64 (LE)
  unsigned __int128 initstate = (static_cast<unsigned __int128>(v[0]) << 64) | v[1];
  unsigned __int128 initseq = (static_cast<unsigned __int128>(v[2]) << 64) | v[3];
  // pcg_setseq_128_srandom_r
  state_ = 0;
  inc_ = (initseq << 1) | 1;
  state_ = state_ * kPcgMult + inc_;
  state_ += initstate;
  state_ = state_ * kPcgMult + inc_;
}

uint64_t Pcg64Generator::next_u64() {
  state_ = state_ * kPcgMult + inc_;
  uint64_t x = static_cast<uint64_t>(state_ >> 64) ^ static_cast<uint64_t>(state_);
  unsigned rot = static_cast<unsigned>(state_ >> 122);
  return (x >> rot) | (x << ((64 - rot) & 63));
}

uint32_t Pcg64Generator::next_u32() {
  if (has_u32_) {
    has_u32_ = false;
    return u32_;
  }
  uint64_t next = next_u64();
  has_u32_ = true;
  u32_ = static_cast<uint32_t>(next >> 32);
  return static_cast<uint32_t>(next);
}

std::vector<int32_t> Pcg64Generator::integers_int32(int32_t low, int32_t high, int64_t n) {
  std::vector<int32_t> out(static_cast<size_t>(n));
  const uint32_t rng = static_cast<uint32_t>(high - 1 - low);  // inclusive range, as numpy passes it
  for (int64_t i = 0; i < n; ++i) {
    uint32_t r;
    if (rng == 0) {
      r = 0;
    } else if (rng == 0xffffffffu) {
      r = next_u32();
    } else {
      // buffered_bounded_lemire_uint32
      const uint32_t rng_excl = rng + 1;
      uint64_t m = uint64_t(next_u32()) * rng_excl;
      uint32_t leftover = static_cast<uint32_t>(m);
      if (leftover < rng_excl) {
        const uint32_t threshold = (0xffffffffu - rng) % rng_excl;
        while (leftover < threshold) {
          m = uint64_t(next_u32()) * rng_excl;
          leftover = static_cast<uint32_t>(m);
        }
      }
      r = static_cast<uint32_t>(m >> 32);
    }
    out[static_cast<size_t>(i)] = static_cast<int32_t>(static_cast<uint32_t>(low) + r);
  }
  return out;
}

}  // namespace nb
