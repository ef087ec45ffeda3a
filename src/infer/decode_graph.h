// StepGraphs: a decode step recorded once as a CUDA graph and replayed. At batch 1 a Llama decode step is
// ~170 small kernels whose launch costs (host API time, a cuBLASLt call's plan lookup) add up to more than
// the ~0.5 ms its weights take to read; a graph launches them all with one call and the GPU runs them back
// to back. A step's kernels take nothing that changes between steps as an argument (positions and ids
// live on the device), so one graph per (batch size, variant) serves every step.
//
// run(key, ...) calls `record` (which queues one step's work on `stream`) eagerly the first time a key is
// seen, so that lazy set-up (GEMM plans, workspace, module loading) happens outside a capture; the second
// time it captures the work into a graph, instantiates and launches it; after that it launches the graph.
// A capture the driver refuses falls back to eager steps for that key. clear() drops every graph (the
// buffers they point at moved). On the CPU backend, in a CPU-only build, and with NIBBLE_DECODE_GRAPHS=0
// in the environment (for comparisons), run() always calls `record`.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include "core/status.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace nb::infer {

class StepGraphs {
 public:
  StepGraphs() = default;
  ~StepGraphs() { clear(); }
  StepGraphs(const StepGraphs&) = delete;
  StepGraphs& operator=(const StepGraphs&) = delete;
  Status run(Device dev, int64_t key, Stream stream, const std::function<Status()>& record);
  void clear();
  int64_t graphs() const;  // instantiated graphs (tests)

 private:
  struct Entry {
    int runs = 0;          // steps seen for this key
    bool eager = false;    // capture refused: stay eager
    void* exec = nullptr;  // cudaGraphExec_t
  };
  Status capture(Entry* e, Stream stream, const std::function<Status()>& record);
  std::map<int64_t, Entry> entries_;
};

// Whether decode steps use CUDA graphs in this process (NIBBLE_DECODE_GRAPHS=0 turns them off).
bool decode_graphs_enabled();

}  // namespace nb::infer
