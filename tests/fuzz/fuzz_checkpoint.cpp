// Fuzz target: the checkpoint loader. Input = [u16 length][trainer_state.json][model.safetensors].
// A state that parses as a JSON object gets its own CRC (and the model file's) fixed up first, so the
// fuzzer reaches what lies behind the checksums: the file list, the saved configuration, the model
// description, and reading the tensors of the tiny preset from the safetensors part in the loader's one
// pass (read_checkpoint_file, which checks the CRC on the way).
#include <nlohmann/json.hpp>
#include <string>
#include <vector>
#include "fuzz/fuzz_util.h"
#include "io/file_util.h"
#include "model/hf_layout.h"
#include "train/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string state_text, model;
  nb::fuzz::split(data, size, &state_text, &model);
  const std::string dir = nb::fuzz::scratch() + "/ck/iter_0000001";
  std::filesystem::create_directories(dir);
  nb::fuzz::write_file("ck/iter_0000001/model.safetensors", model);
  auto state = nlohmann::json::parse(state_text, nullptr, false);
  if (state.is_object()) {
    state["files"] = {
        {"model.safetensors", {{"bytes", model.size()}, {"crc32", nb::crc32_of(model.data(), model.size())}}}};
    state.erase("state_crc32");
    const std::string canonical = state.dump();
    state["state_crc32"] = nb::crc32_of(canonical.data(), canonical.size());
    state_text = state.dump();
  }
  nb::fuzz::write_file("ck/iter_0000001/trainer_state.json", state_text);
  nb::CheckpointRef ref{dir, 1};
  nb::TrainConfig cfg;
  nb::LlamaConfig m;
  nlohmann::json checked;
  if (!nb::read_checkpoint_state(ref, &checked, nb::FileCheck::size)) return 0;
  if (!nb::checkpoint_config_of(checked, dir + "/trainer_state.json", &cfg, &m)) return 0;
  static const auto layout = [] {
    nb::LlamaConfig tiny;
    (void)nb::llama_preset("tiny", &tiny);
    nb::ParamStore p;
    (void)p.allocate(tiny, nb::Device::cpu);
    return std::make_pair(nb::hf_tensors(p), p.total());
  }();
  std::vector<float> host(size_t(layout.second));
  (void)nb::read_checkpoint_file(ref, checked, "model.safetensors", layout.first, {{"", host.data()}});
  return 0;
}
