// Helpers for GPU tests: skip with a visible reason when no GPU is usable.
#pragma once
#include <gtest/gtest.h>
#include <string>
#include "core/tensor.h"

#define NB_REQUIRE_GPU()                                                                \
  do {                                                                                  \
    std::string nb_why_;                                                                \
    if (!::nb::cuda_device_available(&nb_why_)) GTEST_SKIP() << "skipped: " << nb_why_; \
  } while (0)
