// StepGraphs on CUDA (see decode_graph.h): stream capture in thread-local mode (another thread's CUDA
// calls are not affected), instantiate, launch.
#include <cuda_runtime.h>
#include "core/cuda_check.h"
#include "infer/decode_graph.h"

namespace nb::infer {

void StepGraphs::clear() {
  for (auto& [key, e] : entries_)
    if (e.exec) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(e.exec));
  entries_.clear();
}

int64_t StepGraphs::graphs() const {
  int64_t n = 0;
  for (const auto& [key, e] : entries_) n += e.exec ? 1 : 0;
  return n;
}

Status StepGraphs::capture(Entry* e, Stream stream, const std::function<Status()>& record) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  const Status recorded = record();
  cudaGraph_t g = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(s, &g);
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = ended == cudaSuccess && g ? cudaGraphInstantiate(&exec, g, 0) : ended;
  if (g) cudaGraphDestroy(g);
  if (!recorded) {
    if (exec) cudaGraphExecDestroy(exec);
    return recorded;
  }
  if (made != cudaSuccess || !exec) {
    cudaGetLastError();  // the refused capture's error; this step and the next run eagerly instead
    e->eager = true;
    return record();
  }
  e->exec = exec;
  CUDA_CHECK(cudaGraphLaunch(exec, s));
  return Status::ok();
}

Status StepGraphs::run(Device dev, int64_t key, Stream stream, const std::function<Status()>& record) {
  if (dev != Device::cuda || !stream || !decode_graphs_enabled()) return record();
  Entry& e = entries_[key];
  if (e.exec) {
    CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(e.exec), static_cast<cudaStream_t>(stream)));
    return Status::ok();
  }
  if (e.eager || e.runs++ == 0) return record();
  return capture(&e, stream, record);
}

}  // namespace nb::infer
