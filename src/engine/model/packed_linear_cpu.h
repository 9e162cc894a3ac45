#pragma once

// y = x W^T for the few rows of a decode step on the CPU, from a copy of W packed for it (torch
// side: include only from torch translation units). A BLAS GEMM packs its weight operand again
// on every call; for the lm_head of a decode step ([32000, 256] fp32 against 1-64 rows) that
// packing, a read and a write of the whole matrix, costs as much as the product. Packing once,
// at load and after each weight update, leaves the product alone: measured on 2 threads against
// OpenBLAS 0.3.21 (Cooperlake kernels) in the same run, caches flushed before each call, 32 rows
// 2.6-2.7 against 4.5-4.8 ms, one row 1.5-2.0 against 3.0 ms (docs/engine.md, "Where a decode
// step goes").

#include <torch/torch.h>

#include "engine/model/cpu_isa.h"

namespace bragg::engine::qwen3 {

// Output columns (rows of W) per packed block: three 16-float vectors.
inline constexpr int64_t kPackedLinearCols = 48;

// Most rows PackedLinear takes: from about 128 rows on, BLAS's blocking matches it.
inline constexpr int64_t kPackedLinearMaxRows = 64;

// Whether this CPU runs the kernel's `isa` instance (cpu_isa.h: the best this CPU runs unless a
// test or benchmark names another; where it runs none, the engine keeps torch's GEMM).
bool PackedLinearAvailable(CpuIsa isa = BestCpuIsa());

// W [out, in], fp32 on the CPU, any strides, as [ceil(out / kPackedLinearCols), in,
// kPackedLinearCols]: block b holds output columns [b * 48, b * 48 + 48), one 48-float row per
// input; the last block is zero-padded.
torch::Tensor PackLinearWeight(const torch::Tensor& w);

// Packs W again into `packed` (made by PackLinearWeight from a W of the same shape), in place:
// after a weight update copied new values into W.
void RepackLinearWeight(const torch::Tensor& w, torch::Tensor& packed);

// Whether PackedLinear can take x [rows, in]: fp32 on the CPU, 1 to kPackedLinearMaxRows rows,
// `in` the packed weight's, nothing needing a gradient, and the CPU runs `isa`.
bool PackedLinearFits(const torch::Tensor& x, const torch::Tensor& packed,
                      CpuIsa isa = BestCpuIsa());

// x W^T: [rows, out] (out: W's rows, as it was packed). Every output is one sum over `in` in
// order, so a row's result does not depend on the rows beside it; blocks of columns are spread
// over torch's threads.
torch::Tensor PackedLinear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out,
                           CpuIsa isa = BestCpuIsa());
// The same product written into y [rows, out] (fp32, contiguous, on the CPU), which the
// caller owns: a decode step's logits go straight to where the sampler reads them.
void PackedLinearInto(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& y,
                      CpuIsa isa = BestCpuIsa());

}  // namespace bragg::engine::qwen3
