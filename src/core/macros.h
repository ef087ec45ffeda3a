// Portability macros shared by host-only and CUDA translation units.
// NB_HD marks scalar math that must give identical bits on CPU and GPU: the same source compiles
// for both, and the build disables FMA contraction on both sides (see CMakeLists.txt).
#pragma once

#if defined(__CUDACC__)
#define NB_UNROLL _Pragma("unroll")
#define NB_HD __host__ __device__ __forceinline__
#define NB_DEVICE __device__ __forceinline__
#else
#define NB_UNROLL
#define NB_HD inline
#define NB_DEVICE inline
#endif
