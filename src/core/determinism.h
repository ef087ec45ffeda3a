// --deterministic-mode (Megatron's flag): a process-wide switch, read where a faster library choice would
// make a CUDA run differ from the next one with the same inputs. The Trainer sets it once per run, before
// any plan is built; the libraries' plan caches key on it, so a process may switch between runs.
// What it changes (docs/PERFORMANCE.md, "Deterministic mode"):
//   - cuDNN attention backward: dQ straight from the dS K product instead of an FP32 accumulator that
//     the key tiles add into with atomics (cudnn-frontend's set_deterministic_algorithm on Hopper), and
//     no engine that cuDNN itself marks nondeterministic;
//   - cuBLASLt: no split-K algorithms (one dot product per output element, in one order);
//   - NCCL (several ranks): NCCL_ALGO=Ring, NCCL_PROTO=Simple unless the environment sets them.
// The default mode reads this flag and nothing else changes, so it stays as fast as before.
#pragma once

namespace nb {

void set_deterministic_mode(bool on);
bool deterministic_mode();

}  // namespace nb
