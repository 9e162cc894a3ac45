#pragma once

// The linear layer of the Qwen3 model code, shared by the engine and the trainer so that their
// arithmetic cannot drift (torch's side: include only from torch translation units).

#include <torch/torch.h>

#include <vector>

namespace bragg::engine {

// Rows per BLAS call in deterministic mode. A row's result must not depend on the rows it is
// batched with, nor on where among them it sits, and in a GEMM it can: OpenBLAS gives a row to
// one micro-kernel or another by its position. On AVX-512 tiles of 32 agreed; on a 2-core AMD
// EPYC without AVX-512 (Haswell/Zen kernels) rows 0-15 of a 32-row tile differ from rows
// 16-31 (single-threaded: blocks of 6), and of the tiles tried (2-32 rows, 5 weight shapes,
// 1 and 2 threads, OpenBLAS 0.3.21 pthread and OpenMP) 2 and 4 rows alone agree at every
// position and thread count. One row per call also agrees, but made the demo's smoke test
// pass its 15 minutes.
inline constexpr int64_t kDeterministicTile = 4;

// y = x W^T (+ b), x: [rows, in]. With `deterministic`, the rows go through BLAS in tiles of
// exactly kDeterministicTile (the last one zero-padded), so every row meets the same kernel,
// blocking and threading whatever it is batched with. Differentiable.
inline torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                            bool deterministic) {
  namespace F = torch::nn::functional;
  if (!deterministic) {
    return F::linear(x, w, b);
  }
  int64_t rows = x.size(0);
  int64_t tiles = (rows + kDeterministicTile - 1) / kDeterministicTile;
  torch::Tensor padded = x;
  if (tiles * kDeterministicTile != rows) {
    padded = torch::cat(
        {x, torch::zeros({tiles * kDeterministicTile - rows, x.size(1)}, x.options())}, 0);
  }
  std::vector<torch::Tensor> outs;
  outs.reserve(tiles);
  for (int64_t t = 0; t < tiles; ++t) {
    outs.push_back(F::linear(padded.narrow(0, t * kDeterministicTile, kDeterministicTile), w, b));
  }
  return torch::cat(outs, 0).narrow(0, 0, rows);
}

}  // namespace bragg::engine
