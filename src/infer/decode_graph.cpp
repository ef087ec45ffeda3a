// StepGraphs' switch, and the whole class without the CUDA backend (every step runs eagerly).
#include <cstdlib>
#include <cstring>
#include "infer/decode_graph.h"

namespace nb::infer {

bool decode_graphs_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("NIBBLE_DECODE_GRAPHS");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return on;
}

#if !defined(NIBBLE_HAVE_CUDA)
void StepGraphs::clear() { entries_.clear(); }
int64_t StepGraphs::graphs() const { return 0; }
Status StepGraphs::capture(Entry*, Stream, const std::function<Status()>& record) { return record(); }
Status StepGraphs::run(Device, int64_t, Stream, const std::function<Status()>& record) { return record(); }
#endif

}  // namespace nb::infer
