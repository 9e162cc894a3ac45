#pragma once

// The small operations around a layer's matrix products, fused for the engine's fp32 CPU path
// (torch side: include only from torch translation units). Written with torch's operators, a
// layer's RMSNorms, q/k norms, rotary embedding and cache writes are about thirty operator
// calls, each a dispatch and a fresh tensor over a few kilobytes: at one request most of a
// decode step's time outside the products. Here each is one pass over the rows. The engine's
// deterministic mode keeps torch's operators (the trainer runs the same ones).

#include <torch/torch.h>

namespace bragg::engine::qwen3 {

// Whether the fused functions can take tensors of this dtype and device: fp32 on the CPU.
bool FusedCpuFits(const torch::Tensor& t);

// RmsNorm(h, w, eps) of qwen3.h: h [T, n] fp32 contiguous, w [n]. Returns a new [T, n].
torch::Tensor FusedRmsNorm(const torch::Tensor& h, const torch::Tensor& w, double eps);

// h += delta (in place), then returns FusedRmsNorm(h, w, eps): a residual add and the next
// norm in one pass. h, delta: [T, n] fp32 contiguous.
torch::Tensor AddRmsNorm(torch::Tensor& h, const torch::Tensor& delta, const torch::Tensor& w,
                         double eps);

// The attention's inputs from one product's output qkv [T, (nh + 2 kvh) * hd] (q's heads, then
// k's, then v's): q = Rope(RmsNorm(q, q_norm)) and k = Rope(RmsNorm(k, k_norm)) per head as
// qwen3.h's functions compute them, with cos and sin [T, hd] from RopeTables; row t's k and v
// are written to keys[slot[t]] and values[slot[t]] ([slots, kvh, hd] fp32 contiguous; slot
// int64 [T], each in range: the caller's block tables are checked). Returns q [T, nh, hd].
torch::Tensor QkNormRopeCache(const torch::Tensor& qkv, const torch::Tensor& q_norm,
                              const torch::Tensor& k_norm, const torch::Tensor& cos,
                              const torch::Tensor& sin, torch::Tensor& keys, torch::Tensor& values,
                              const torch::Tensor& slot, int64_t nh, int64_t kvh, double eps);

}  // namespace bragg::engine::qwen3
