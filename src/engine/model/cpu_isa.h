#pragma once

// The vector instruction sets the engine's own CPU kernels (packed_linear_cpu, attention_cpu,
// moe_cpu) are built for, and which of them this CPU runs.

#include <vector>

namespace bragg::engine::qwen3 {

enum class CpuIsa {
  kNone,    // neither: the engine keeps torch's operators
  kAvx2,    // AVX2 with FMA (x86-64-v3: Haswell on, AMD Zen 1-3): 8-float registers
  kAvx512,  // AVX-512F (Skylake-SP on, AMD Zen 4 on): 16-float registers
};

// The most the kernels may use, read once: "avx512", "avx2" or "none" (torch's operators
// alone), to compare them or to rule one out; unset, the best the CPU runs.
inline constexpr char kCpuIsaVariable[] = "BRAGG_ENGINE_CPU_ISA";

// The best of them this CPU runs, at most what kCpuIsaVariable allows; asked once.
CpuIsa BestCpuIsa();

// Whether this CPU runs `isa` (kNone: always).
bool CpuRuns(CpuIsa isa);

// Every one but kNone this CPU runs, best first: what the kernels' tests and benchmarks compare.
std::vector<CpuIsa> CpuIsas();

// "avx512", "avx2" or "none".
const char* CpuIsaName(CpuIsa isa);

}  // namespace bragg::engine::qwen3
