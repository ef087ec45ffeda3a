// LlamaModel's Mixture of Representations board (llama_model.h): every MoR Linear's statistic cells in one buffer,
// read back and cleared once per decision, and the choices the trainer sets from it (train/trainer_mor.cpp).
#include <cstring>
#include "core/memory_ledger.h"
#include "model/llama_model.h"
#include "recipe/linear_device.h"

namespace nb {

namespace {
constexpr size_t kRoles = 3;  // input, weight, grad
}

int64_t LlamaModel::mor_board_bytes(int64_t mor_linears, int cells_per_linear) {
  return mor_linears * int64_t(size_t(cells_per_linear) * sizeof(mor::StatCell));
}

int LlamaModel::mor_cells_per_linear() const {
  for (const auto& layer : linears_)
    for (const auto& lin : layer)
      if (lin.mor()) return lin.mor_cell_count();
  return 0;
}

std::vector<recipe::Linear*> LlamaModel::mor_linears() {
  std::vector<recipe::Linear*> out;
  for (auto& layer : linears_)
    for (auto& lin : layer)
      if (lin.mor()) out.push_back(&lin);
  return out;
}

std::vector<int64_t> LlamaModel::mor_slots() const {
  std::vector<int64_t> out;
  for (size_t l = 0; l < linears_.size(); ++l)
    for (size_t i = 0; i < linears_[l].size(); ++i)
      if (linears_[l][i].mor()) out.push_back(int64_t(l) * 4 + int64_t(i));
  return out;
}

Status LlamaModel::init_mor_board() {
  const std::vector<recipe::Linear*> lins = mor_linears();
  if (lins.empty()) return Status::ok();
  MemoryScope scope(MemPart::quantized_copies);
  const int per = mor_cells_per_linear();
  NB_TRY(Buffer::allocate(&mor_board_, DType::u8, dev_, {mor_board_bytes(int64_t(lins.size()), per)})
             .context("the MoR statistics board"));
  auto* cells = static_cast<mor::StatCell*>(mor_board_.data());
  for (size_t k = 0; k < lins.size(); ++k) NB_TRY(lins[k]->set_mor_cells(cells + k * size_t(per)));
  return clear_mor_board();
}

Status LlamaModel::mor_board(std::vector<mor::StatCell>* cells) const {
  cells->assign(size_t(mor_board_.tensor().numel()) / sizeof(mor::StatCell), mor::StatCell{});
  if (cells->empty()) return Status::ok();
  const size_t bytes = cells->size() * sizeof(mor::StatCell);
  if (dev_ == Device::cuda) return recipe::detail::copy_to_host_cuda(cells->data(), mor_board_.data(), bytes, nullptr);
  std::memcpy(static_cast<void*>(cells->data()), mor_board_.data(), bytes);
  return Status::ok();
}

Status LlamaModel::set_mor_board(const std::vector<mor::StatCell>& cells) {
  const size_t n = size_t(mor_board_.tensor().numel()) / sizeof(mor::StatCell);
  if (cells.size() != n)
    return errorf("the MoR statistics hold %zu cells, but this model's MoR Linears have %zu", cells.size(), n);
  if (n == 0) return Status::ok();
  if (dev_ == Device::cuda)
    return recipe::detail::copy_to_device_cuda(mor_board_.data(), cells.data(), n * sizeof(mor::StatCell), nullptr);
  std::memcpy(mor_board_.data(), static_cast<const void*>(cells.data()), n * sizeof(mor::StatCell));
  return Status::ok();
}

Status LlamaModel::clear_mor_board() {
  const auto bytes = size_t(mor_board_.tensor().numel());
  if (bytes == 0) return Status::ok();
  if (dev_ == Device::cuda) return recipe::detail::memset_cuda(mor_board_.data(), 0, bytes, nullptr);
  std::memset(mor_board_.data(), 0, bytes);
  return Status::ok();
}

std::vector<uint8_t> LlamaModel::mor_choices() const {
  std::vector<uint8_t> out;
  for (const auto& layer : linears_)
    for (const auto& lin : layer)
      if (lin.mor())
        for (int r = 0; r < 3; ++r) out.push_back(uint8_t(lin.mor_rung(r)));
  return out;
}

Status LlamaModel::set_mor_choices(const std::vector<uint8_t>& choices) {
  const std::vector<recipe::Linear*> lins = mor_linears();
  if (choices.size() != lins.size() * kRoles)
    return errorf("%zu MoR choices given, but this model's %zu MoR Linears take %zu", choices.size(), lins.size(),
                  lins.size() * kRoles);
  for (size_t k = 0; k < lins.size(); ++k)
    for (int r = 0; r < 3; ++r) {
      const uint8_t c = choices[k * kRoles + size_t(r)];
      if (c > uint8_t(recipe::MorRung::nvfp4))
        return errorf("MoR choice %u is not 0 (bf16), 1 (e4m3) or 2 (nvfp4)", unsigned(c));
      NB_TRY(lins[k]->set_mor_rung(r, recipe::MorRung(c)));
    }
  return Status::ok();
}

void LlamaModel::pause_mor_stats(bool paused) {
  for (recipe::Linear* lin : mor_linears()) lin->pause_mor_stats(paused);
}

}  // namespace nb
