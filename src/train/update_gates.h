// The next forward's waits on a streamed AdamW update (--optimizer-cpu-offload on one rank; see
// optim/adamw_stream.h): each layer's forward waits only for the state chunks that hold its parameters,
// so the step's first forward runs behind the stream instead of after it. The final norm's gate waits
// for the whole update: the LM head's backward follows at once and writes gradients the update reads.
#pragma once
#include <string>
#include <vector>
#include "model/llama_model.h"
#include "optim/adamw_stream.h"

namespace nb {

class UpdateGates final : public LlamaModel::StepHooks {
 public:
  // One rank, no sharding: the optimizer's local elements are the flat elements.
  UpdateGates(const ParamStore& params, optim::AdamWStreamer& streamer) : params_(params), streamer_(streamer) {}
  Status weights_needed(const std::vector<std::string>& names) override {
    for (const std::string& name : names) {
      if (name == "model.norm.weight") {
        streamer_.wait_all();
        return Status::ok();
      }
      const ParamInfo& p = params_.info(name);
      streamer_.wait_for(p.offset, p.offset + p.numel);
    }
    return Status::ok();
  }
  Status grads_final(const std::vector<std::string>&) override { return Status::ok(); }

 private:
  const ParamStore& params_;
  optim::AdamWStreamer& streamer_;
};

}  // namespace nb
