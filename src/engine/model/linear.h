#pragma once

// The linear layer of the Qwen3 model code, shared by the engine and the trainer so that their
// arithmetic cannot drift (torch's side: include only from torch translation units).

#include <torch/torch.h>

#include <vector>

namespace bragg::engine {

// Rows per BLAS call in deterministic mode.
inline constexpr int64_t kDeterministicTile = 32;

// y = x W^T (+ b), x: [rows, in]. With `deterministic`, the rows go through BLAS in tiles of
// exactly kDeterministicTile (the last one zero-padded), so every row meets the same kernel,
// blocking and threading whatever it is batched with: on OpenBLAS a row's result otherwise
// depends on the batch size (measured: 1-8 rows differ from larger batches). Differentiable.
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
