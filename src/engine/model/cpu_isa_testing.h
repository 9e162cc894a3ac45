#pragma once

// For the kernels' tests: the instruction sets to run each case on.

#include <gtest/gtest.h>

#include <vector>

#include "engine/model/cpu_isa.h"

namespace bragg::engine::qwen3 {

inline void SkipWithoutAnIsa() {
  GTEST_SKIP() << "this CPU runs neither AVX2 nor AVX-512F: the engine keeps torch's operators";
}

// Every instruction set this CPU runs, best first; none marks the calling test skipped.
inline std::vector<CpuIsa> TestedIsas() {
  std::vector<CpuIsa> isas = CpuIsas();
  if (isas.empty()) {
    SkipWithoutAnIsa();
  }
  return isas;
}

}  // namespace bragg::engine::qwen3
