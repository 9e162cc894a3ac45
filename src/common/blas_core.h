#pragma once

// OpenBLAS's kernels on CPUs newer than it. OpenBLAS picks its kernels for the CPU when it is
// loaded, and Debian 12's (0.3.21) does not know CPUs newer than it (Sapphire and Emerald
// Rapids): it falls back to its Prescott (SSE3) kernels, and torch's fp32 GEMMs run 1.6-3x
// slower (docs/engine.md, "CPUs newer than OpenBLAS"). Every process that computes with torch
// must use the same kernels, or the trainer's log-probs stop equalling the engine's bit for bit.

#include <string>

namespace bragg {

// The OpenBLAS core type this process should have been started with: when the OpenBLAS loaded
// here fell back to Prescott on a CPU that runs a known core's kernels (AVX-512: Cooperlake
// with BF16, else SkylakeX; AVX2 and FMA: Haswell) and OPENBLAS_CORETYPE is not set, that core's
// name; otherwise (no OpenBLAS, a core it knows, a CPU without them, the variable set) "".
std::string KnownBlasCore();

// The same without looking at OPENBLAS_CORETYPE: the core the loaded OpenBLAS should run, where
// it runs its Prescott fallback on a CPU that runs a known core's kernels; else "". Where the
// variable is set and this still names a core, the variable came too late: OpenBLAS reads it
// once, when a process first loads it.
std::string BlasFallbackCore();

// For the first thing a torch program's main does: when KnownBlasCore() names a core, sets
// OPENBLAS_CORETYPE to it and executes the program again (/proc/self/exe, same argv, same
// process); otherwise, or if that fails, returns. A user's own OPENBLAS_CORETYPE is kept.
void ReexecForKnownBlasCore(char** argv);

}  // namespace bragg
