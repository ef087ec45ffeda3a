// Device helpers shared by the ops kernels: 16-byte vector loads/stores of BF16 or FP32 rows converted
// to FP32 registers, block-wide reductions in a fixed order (results do not depend on timing), and
// stream/scratch helpers. Included only by .cu files.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <atomic>
#include <cstdint>
#include "core/bf16.h"
#include "core/cuda_check.h"
#include "core/stream.h"

namespace nb::ops::cuda {

inline cudaStream_t as_cuda(Stream s) { return static_cast<cudaStream_t>(s); }

// Elements per 16-byte access.
template <typename T>
constexpr int kVec = 16 / int(sizeof(T));

NB_DEVICE float to_f32(float x) { return x; }
NB_DEVICE float to_f32(bf16 x) { return __uint_as_float(uint32_t(x.bits) << 16); }
template <typename T>
NB_DEVICE T from_f32(float x);
template <>
NB_DEVICE float from_f32<float>(float x) {
  return x;
}
template <>
NB_DEVICE bf16 from_f32<bf16>(float x) {
  return f32_to_bf16(x);
}  // RNE, same bits as the host

// Loads N consecutive elements as FP32; when N*sizeof(T) is a multiple of 16 bytes the access is made
// of 16-byte vector loads (the pointer must then be 16-byte aligned).
template <typename T, int N>
NB_DEVICE void load_vec(const T* p, float (&out)[N]) {
  constexpr int kBytes = N * int(sizeof(T));
  if constexpr (kBytes % 16 == 0) {
    constexpr int kPer = 16 / int(sizeof(T));
    NB_UNROLL for (int c = 0; c < kBytes / 16; ++c) {
      uint4 raw = reinterpret_cast<const uint4*>(p)[c];
      const T* e = reinterpret_cast<const T*>(&raw);
      NB_UNROLL for (int i = 0; i < kPer; ++i) out[c * kPer + i] = to_f32(e[i]);
    }
  } else {
    NB_UNROLL for (int i = 0; i < N; ++i) out[i] = to_f32(p[i]);
  }
}

template <typename T, int N>
NB_DEVICE void store_vec(T* p, const float (&in)[N]) {
  constexpr int kBytes = N * int(sizeof(T));
  if constexpr (kBytes % 16 == 0) {
    constexpr int kPer = 16 / int(sizeof(T));
    NB_UNROLL for (int c = 0; c < kBytes / 16; ++c) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
      NB_UNROLL for (int i = 0; i < kPer; ++i) e[i] = from_f32<T>(in[c * kPer + i]);
      reinterpret_cast<uint4*>(p)[c] = raw;
    }
  } else {
    NB_UNROLL for (int i = 0; i < N; ++i) p[i] = from_f32<T>(in[i]);
  }
}

// True when every row of `cols` elements starting at p can be read with kVec<T>-wide accesses.
template <typename T>
inline bool vec_ok(const void* p, int64_t cols) {
  return (reinterpret_cast<uintptr_t>(p) % 16 == 0) && (cols % kVec<T> == 0);
}

NB_DEVICE float warp_sum(float v) {
  NB_UNROLL for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
NB_DEVICE float warp_max(float v) {
  NB_UNROLL for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum; every thread gets the result. `shared` holds >= 32 floats. The butterfly order is
// fixed, so the result is the same on every run. Ends with a barrier so `shared` can be reused.
NB_DEVICE float block_sum(float v, float* shared) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float r = lane < nwarps ? shared[lane] : 0.f;
  r = warp_sum(r);
  __syncthreads();
  return r;
}

// The default pool returns freed memory to the driver at every synchronization unless told to keep
// some; keeping 64 MiB makes the per-call scratch below cheap. Only ever raises the threshold.
inline void keep_scratch_pool_warm() {
  static std::atomic<bool> done[64];
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 64 || done[dev].exchange(true)) return;
  cudaMemPool_t pool;
  CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  uint64_t current = 0, wanted = uint64_t(64) << 20;
  CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &current));
  if (current < wanted) CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &wanted));
}

// Stream-ordered scratch memory, freed on the same stream (no device-wide synchronization).
template <typename T>
T* scratch_alloc(size_t count, cudaStream_t s) {
  keep_scratch_pool_warm();
  void* p = nullptr;
  CUDA_CHECK(cudaMallocAsync(&p, count * sizeof(T) + 16, s));
  return static_cast<T*>(p);
}
inline void scratch_free(void* p, cudaStream_t s) { CUDA_CHECK(cudaFreeAsync(p, s)); }

inline int grid_for(int64_t work_items, int threads, int max_blocks = 65535 * 8) {
  int64_t b = (work_items + threads - 1) / threads;
  if (b < 1) b = 1;
  return int(b < max_blocks ? b : max_blocks);
}

}  // namespace nb::ops::cuda
