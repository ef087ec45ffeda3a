// Stream: the execution queue an op runs on. On the CUDA backend it is a cudaStream_t (nullptr =
// the default stream); the CPU backend ignores it. Kept opaque so CPU-only code needs no CUDA headers.
#pragma once

namespace nb {
using Stream = void*;
}  // namespace nb
