// Counter-based Philox4x32-10 (Salmon et al., SC'11), identical bits on host and device.
// nibble keys every random draw by (seed, step, stream, index) so that the CPU reference and the
// CUDA kernels produce the same stochastic-rounding codes, and a resumed run reproduces them.
//   key     = {seed low 32 bits, seed high 32 bits}
//   counter = {index low 32, index high 32, stream, step}
// One call yields 16 random bytes; quantizers use byte (e % 16) of block (e / 16) for element e.
#pragma once
#include <cstdint>
#include "core/macros.h"

namespace nb {

struct Philox4x32 {
  uint32_t v[4];
};

NB_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  uint64_t p = uint64_t(a) * uint64_t(b);
  *hi = uint32_t(p >> 32);
  *lo = uint32_t(p);
}

NB_HD Philox4x32 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  NB_UNROLL
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kM0, c0, &hi0, &lo0);
    philox_mulhilo(kM1, c2, &hi1, &lo1);
    uint32_t n0 = hi1 ^ c1 ^ k0;
    uint32_t n1 = lo1;
    uint32_t n2 = hi0 ^ c3 ^ k1;
    uint32_t n3 = lo0;
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += kW0;
    k1 += kW1;
  }
  return {{c0, c1, c2, c3}};
}

// Where a stream of random bits comes from: one per (seed, step, stream).
struct RngKey {
  uint64_t seed = 0;
  uint32_t step = 0;
  uint32_t stream = 0;  // e.g. tensor id * 2 + copy (row-wise 0, column-wise 1)
};

// 16 random bytes for block `block` (elements 16*block .. 16*block+15) of a stream.
NB_HD Philox4x32 philox_block(const RngKey& key, uint64_t block) {
  return philox4x32_10(uint32_t(block), uint32_t(block >> 32), key.stream, key.step, uint32_t(key.seed),
                       uint32_t(key.seed >> 32));
}

// The random byte of element `j` (0..15) within a block's 16 bytes.
NB_HD uint32_t philox_byte(const Philox4x32& r, int j) { return (r.v[j >> 2] >> (8 * (j & 3))) & 0xFFu; }

}  // namespace nb
