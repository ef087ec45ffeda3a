// Shared by the MoR Linear tests (CPU and GPU): the FP64 model of one Linear's three GEMMs when role `bf16_role`
// (-1: none) is decided BF16: that role's operands are its BF16 values, the others' their FP8 copies.
#pragma once
#include <vector>
#include "recipe/recipe_test_util.h"

namespace nb::recipe::testing {

struct MixedModel {
  std::vector<double> y, dx, dw;                    // the GEMMs on the mixed operands
  std::vector<double> mag_y, mag_dx, mag_dw;        // sum |a b| of each output
  std::vector<double> exact_y, exact_dx, exact_dw;  // on the unquantized values
};

inline MixedModel mixed_model(int bf16_role, const std::vector<float>& x, const std::vector<float>& w,
                              const std::vector<float>& dy, const QuantizedBytes q[3], int64_t m, int64_t k,
                              int64_t n) {
  const std::vector<double> xd = to_double(x), wd = to_double(w), dyd = to_double(dy);
  // Row operands [rows, K] and column operands, as spec §6 assigns them; the BF16 role's are its values.
  std::vector<double> a_y = dequant_copy(q[0], false), b_y = dequant_copy(q[1], false);
  std::vector<double> a_dx = dequant_copy(q[2], false), b_dx = dequant_copy(q[1], true);
  std::vector<double> a_dw = dequant_copy(q[2], true), b_dw = dequant_copy(q[0], true);
  if (bf16_role == 0) {
    a_y = xd;
    b_dw = transpose(xd, m, k);
  } else if (bf16_role == 1) {
    b_y = wd;
    b_dx = transpose(wd, n, k);
  } else if (bf16_role == 2) {
    a_dx = dyd;
    a_dw = transpose(dyd, m, n);
  }
  MixedModel r;
  std::vector<double> unused;
  product_nt(a_y, b_y, m, n, k, &r.y, &r.mag_y);
  product_nt(a_dx, b_dx, m, k, n, &r.dx, &r.mag_dx);
  product_nt(a_dw, b_dw, n, k, m, &r.dw, &r.mag_dw);
  product_nt(xd, wd, m, n, k, &r.exact_y, &unused);
  product_nt(dyd, transpose(wd, n, k), m, k, n, &r.exact_dx, &unused);
  product_nt(transpose(dyd, m, n), transpose(xd, m, k), n, k, m, &r.exact_dw, &unused);
  return r;
}

}  // namespace nb::recipe::testing
