#pragma once

// The linear layer of the Qwen3 model code, shared by the engine and the trainer so that their
// arithmetic cannot drift (torch's side: include only from torch translation units). Header
// only: the trainer's torch operator (python/bragg_train_lce) is compiled from its sources alone.

#include <torch/torch.h>

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

namespace linear_internal {

// x W^T (+ b) with the rows through BLAS in tiles of exactly kDeterministicTile (the last one
// zero-padded), each tile's product written in place into the result: one GEMM call per tile
// and nothing recorded for autograd. Each tile's call is the one torch's linear makes for a
// kDeterministicTile-row input (addmm with a bias, mm without), on a contiguous result of the
// same shape and strides, so the bits are those of that call.
inline torch::Tensor TiledProduct(const torch::Tensor& x, const torch::Tensor& w,
                                  const torch::Tensor& b) {
  constexpr int64_t kTile = kDeterministicTile;
  const int64_t rows = x.size(0), full = rows / kTile, rest = rows % kTile;
  torch::Tensor out = torch::empty({rows, w.size(0)}, x.options());
  const torch::Tensor wt = w.t();
  auto tile = [&](torch::Tensor dst, const torch::Tensor& src) {
    if (b.defined()) {
      at::addmm_out(dst, b, src, wt);
    } else {
      at::mm_out(dst, src, wt);
    }
  };
  for (int64_t t = 0; t < full; ++t) {
    tile(out.narrow(0, t * kTile, kTile), x.narrow(0, t * kTile, kTile));
  }
  if (rest > 0) {
    torch::Tensor padded = torch::zeros({kTile, x.size(1)}, x.options());
    padded.narrow(0, 0, rest).copy_(x.narrow(0, full * kTile, rest));
    torch::Tensor last = torch::empty({kTile, w.size(0)}, x.options());
    tile(last, padded);
    out.narrow(0, full * kTile, rest).copy_(last.narrow(0, 0, rest));
  }
  return out;
}

// TiledProduct for autograd. Only the forward must be batch invariant (it is what the engine
// computes and what log-probs are taken from), so backward is the plain product's: two whole
// GEMMs and a sum, instead of a graph of one node per tile.
class TiledLinear : public torch::autograd::Function<TiledLinear> {
 public:
  // Without a bias (autograd's custom functions take no undefined tensor).
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["bias"] = false;
    return TiledProduct(x, w, torch::Tensor());
  }
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w, const torch::Tensor& b) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["bias"] = true;
    return TiledProduct(x, w, b);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &w = saved[1], &gy = grads[0];
    torch::autograd::variable_list out(ctx->saved_data["bias"].toBool() ? 3 : 2);
    if (ctx->needs_input_grad(0)) {
      out[0] = gy.mm(w);
    }
    if (ctx->needs_input_grad(1)) {
      out[1] = gy.t().mm(x);
    }
    if (out.size() == 3 && ctx->needs_input_grad(2)) {
      out[2] = gy.sum(0);
    }
    return out;
  }
};

}  // namespace linear_internal

// y = x W^T (+ b), x: [rows, in]. With `deterministic`, the rows go through BLAS in tiles of
// exactly kDeterministicTile (the last one zero-padded), so every row meets the same kernel,
// blocking and threading whatever it is batched with. Differentiable.
inline torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                            bool deterministic) {
  namespace F = torch::nn::functional;
  if (!deterministic) {
    return F::linear(x, w, b);
  }
  const bool graph = torch::GradMode::is_enabled() &&
                     (x.requires_grad() || w.requires_grad() || (b.defined() && b.requires_grad()));
  if (!graph) {
    return linear_internal::TiledProduct(x, w, b);
  }
  return b.defined() ? linear_internal::TiledLinear::apply(x, w, b)
                     : linear_internal::TiledLinear::apply(x, w);
}

}  // namespace bragg::engine
