// Linear's input slots (linear.h, set_input_slots): two micro-batches between their forward and their backward, as
// a pipeline stage runs them, give the same dx and dW bit for bit as the two run one after the other; without
// switching slots the second forward overwrites the first's copy and dW differs; the slots' bytes are counted.
#include <gtest/gtest.h>
#include <string>
#include <vector>
#include "recipe/workspace_test_util.h"

namespace nb::recipe::testing {
namespace {

constexpr int64_t kM = 128, kK = 256, kN = 128;

struct MicroBatch {
  Buffer x, dy, dx;
};

struct Operands {
  Buffer w, y, dw;
  MicroBatch a, b;
};

Status make_operands(Operands* o) {
  NB_TRY(upload_values(&o->w, random_bf16_values(kN * kK, 0.05, 1), kN, kK, Device::cpu));
  NB_TRY(Buffer::allocate(&o->y, DType::f32, Device::cpu, {kM, kN}));
  NB_TRY(upload_values(&o->dw, std::vector<float>(size_t(kN * kK), 0.f), kN, kK, Device::cpu));
  uint32_t seed = 10;
  for (MicroBatch* mb : {&o->a, &o->b}) {
    NB_TRY(upload_values(&mb->x, random_bf16_values(kM * kK, 1.0, seed++), kM, kK, Device::cpu));
    NB_TRY(upload_values(&mb->dy, random_bf16_values(kM * kN, 1e-3, seed++), kM, kN, Device::cpu));
    NB_TRY(Buffer::allocate(&mb->dx, DType::f32, Device::cpu, {kM, kK}));
  }
  return Status::ok();
}

Status forward(Linear& l, Operands& o, MicroBatch& mb) {
  return l.forward(mb.x.tensor(), o.w.tensor(), o.y.tensor(), 0.f, nullptr);
}
Status backward(Linear& l, Operands& o, MicroBatch& mb) {
  return l.backward(mb.dy.tensor(), mb.x.tensor(), o.w.tensor(), mb.dx.tensor(), 0.f, o.dw.tensor(), nullptr);
}

std::vector<float> values(const Buffer& b) {
  return std::vector<float>(b.ptr<float>(), b.ptr<float>() + b.tensor().numel());
}

// A recipe and, for Mixture of Representations, the input's rung (-1: the preset's top rung): the NVFP4 ladder with
// its input on E4M3 reads that rung's own column copy in Wgrad, which each slot must keep too.
struct SlotCase {
  std::string recipe;
  int input_rung = -1;
};
const std::vector<SlotCase> kCases = {{"bf16_with_nvfp4_mixed"},
                                      {"bf16_with_fp8_current_scaling_mixed"},
                                      {"bf16_with_mxfp8_mixed"},
                                      {"bf16_with_fp8_subchannel_scaling_mixed"},
                                      {"bf16_with_mor_fp8_mixed"},
                                      {"bf16_with_mor_nvfp4_mixed"},
                                      {"bf16_with_mor_nvfp4_mixed", int(MorRung::fp8)},
                                      {"bf16_with_mor_fp8_mixed", int(MorRung::bf16)}};

TEST(LinearInputSlots, TwoMicroBatchesInFlightEqualThemOneAfterTheOther) {
  for (const SlotCase& k : kCases) {
    SCOPED_TRACE(k.recipe + " input rung " + std::to_string(k.input_rung));
    Recipe r;
    ASSERT_TRUE(recipe_preset(k.recipe, &r).is_ok());
    Operands seq, slots, one_slot;
    for (Operands* o : {&seq, &slots, &one_slot}) ASSERT_TRUE(make_operands(o).is_ok());
    Linear a, b, c;
    for (Linear* l : {&a, &b, &c}) {
      ASSERT_TRUE(l->init(r, false, "l", 3, kM, kK, kN, Device::cpu).is_ok());
      if (k.input_rung >= 0) ASSERT_TRUE(l->set_mor_rung(0, MorRung(k.input_rung)).is_ok());
      l->new_step(1);
    }
    // One after the other: forward A, backward A, forward B, backward B.
    ASSERT_TRUE(forward(a, seq, seq.a).is_ok());
    ASSERT_TRUE(backward(a, seq, seq.a).is_ok());
    const std::vector<float> dw_of_a = values(seq.dw);
    ASSERT_TRUE(forward(a, seq, seq.b).is_ok());
    ASSERT_TRUE(backward(a, seq, seq.b).is_ok());
    // In flight, as 1F1B's warm-up runs them: forward A (slot 0), forward B (slot 1), backward A, backward B.
    ASSERT_TRUE(b.set_input_slots(2).is_ok());
    ASSERT_TRUE(b.use_input_slot(0).is_ok());
    ASSERT_TRUE(forward(b, slots, slots.a).is_ok());
    ASSERT_TRUE(b.use_input_slot(1).is_ok());
    ASSERT_TRUE(forward(b, slots, slots.b).is_ok());
    ASSERT_TRUE(b.use_input_slot(0).is_ok());
    ASSERT_TRUE(backward(b, slots, slots.a).is_ok());
    ASSERT_TRUE(b.use_input_slot(1).is_ok());
    ASSERT_TRUE(backward(b, slots, slots.b).is_ok());
    EXPECT_EQ(values(slots.a.dx), values(seq.a.dx));
    EXPECT_EQ(values(slots.b.dx), values(seq.b.dx));
    EXPECT_EQ(values(slots.dw), values(seq.dw));
    // The same order in one slot: A's backward reads B's input copy, so A's dW differs; unless MoR keeps the input in
    // BF16, when Wgrad reads the x it is given.
    ASSERT_TRUE(forward(c, one_slot, one_slot.a).is_ok());
    ASSERT_TRUE(forward(c, one_slot, one_slot.b).is_ok());
    ASSERT_TRUE(backward(c, one_slot, one_slot.a).is_ok());
    if (k.input_rung == int(MorRung::bf16))
      EXPECT_EQ(values(one_slot.dw), dw_of_a);
    else
      EXPECT_NE(values(one_slot.dw), dw_of_a);
  }
}

TEST(LinearInputSlots, ABackwardInASlotWithoutItsForwardIsAnError) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  Operands o;
  ASSERT_TRUE(make_operands(&o).is_ok());
  Linear l;
  ASSERT_TRUE(l.init(r, false, "model.layers.0.mlp.down_proj", 3, kM, kK, kN, Device::cpu).is_ok());
  ASSERT_TRUE(l.set_input_slots(2).is_ok());
  ASSERT_TRUE(forward(l, o, o.a).is_ok());
  ASSERT_TRUE(l.use_input_slot(1).is_ok());
  const Status st = backward(l, o, o.a);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("needs the forward of the same micro-batch first"), std::string::npos) << st.message();
  EXPECT_FALSE(l.use_input_slot(2).is_ok());
  EXPECT_FALSE(l.set_input_slots(3).is_ok());  // once
}

TEST(LinearInputSlots, RefusedWhereThereIsNoInputCopyOfItsOwn) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  Linear frozen, shared;
  ASSERT_TRUE(frozen.init(r, false, "f", 1, kM, kK, kN, Device::cpu, nullptr, /*frozen=*/true).is_ok());
  EXPECT_NE(frozen.set_input_slots(2).message().find("frozen"), std::string::npos);
  auto ws = std::make_shared<LinearWorkspace>(Device::cpu);
  ASSERT_TRUE(shared.init(r, false, "s", 2, kM, kK, kN, Device::cpu, ws, false, /*input_col_slot=*/0).is_ok());
  EXPECT_NE(shared.set_input_slots(2).message().find("shared workspace slot"), std::string::npos);
  Linear bf16;  // a BF16 layer keeps nothing: a no-op
  ASSERT_TRUE(bf16.init(r, /*bf16_layer=*/true, "b", 4, kM, kK, kN, Device::cpu).is_ok());
  EXPECT_TRUE(bf16.set_input_slots(4).is_ok());
  EXPECT_TRUE(bf16.use_input_slot(3).is_ok());
}

// The ladder's extra slot also holds its E4M3 rung's input column copy: K x M codes, a scale piece that per-tensor
// scaling leaves empty (allocated as the smallest block, 256 bytes), and that copy's state floats.
TEST(LinearInputSlots, PlanBytesCountTheLaddersE4m3Copy) {
  Recipe nvfp4, ladder;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &nvfp4).is_ok());
  ASSERT_TRUE(recipe_preset("bf16_with_mor_nvfp4_mixed", &ladder).is_ok());
  size_t extra[2] = {0, 0};
  for (int k = 0; k < 2; ++k) {
    size_t one = 0, two = 0;
    const Recipe& r = k ? ladder : nvfp4;
    ASSERT_TRUE(Linear::plan_bytes(r, false, kM, kK, kN, Device::cpu, nullptr, false, -1, &one, nullptr, 1).is_ok());
    ASSERT_TRUE(Linear::plan_bytes(r, false, kM, kK, kN, Device::cpu, nullptr, false, -1, &two, nullptr, 2).is_ok());
    extra[k] = two - one;
  }
  const auto a256 = [](size_t n) { return (n + 255) / 256 * 256; };
  EXPECT_EQ(extra[1] - extra[0], a256(kM * kK) + a256(1) + a256(5 * sizeof(float)));
}

// Each extra slot: the input's column copy (NVFP4: K x M / 2 codes and K x M / 16 E4M3 scales) and the state's floats,
// each piece rounded up to 256 bytes as the allocator holds it.
TEST(LinearInputSlots, PlanBytesCountsEachExtraSlot) {
  Recipe r;
  ASSERT_TRUE(recipe_preset("bf16_with_nvfp4_mixed", &r).is_ok());
  size_t one = 0, three = 0;
  ASSERT_TRUE(Linear::plan_bytes(r, false, kM, kK, kN, Device::cpu, nullptr, false, -1, &one, nullptr, 1).is_ok());
  ASSERT_TRUE(Linear::plan_bytes(r, false, kM, kK, kN, Device::cpu, nullptr, false, -1, &three, nullptr, 3).is_ok());
  const auto a256 = [](size_t n) { return (n + 255) / 256 * 256; };
  EXPECT_EQ(three - one, 2 * (a256(kM * kK / 2) + a256(kM * kK / 16) + a256(5 * sizeof(float))));
}

}  // namespace
}  // namespace nb::recipe::testing
