#pragma once

// The MoE experts on the CPU: a decode step's few rows per expert, where a BLAS call per expert
// costs more in packing and dispatch than its arithmetic, and (with AVX-512) a prefill chunk's
// tens to hundreds (torch side: include only from torch translation units).

#include <torch/torch.h>

#include <vector>

namespace bragg::engine::qwen3 {

// Most rows one expert may get for SmallBatchExperts to take a call: with AVX-512 its tiles
// take a prefill chunk's experts as well (a 512-token chunk gives an expert at most 512 rows;
// on the benchmark's model they beat a BLAS call per expert there too: a 4,096-token prompt's
// first token 0.47 -> 0.39 s); without it, a decode step's few rows.
inline constexpr int64_t kTiledExpertRows = 512;
inline constexpr int64_t kSmallBatchExpertRows = 32;

// Whether SmallBatchExperts can take this call: inference (nothing needs a gradient), fp32 on
// the CPU, every expert's weights in the [in, out] layout of TransposeLinearWeights (gate_up
// [2I, H] and down [H, I] as transposed views of contiguous memory), and at most
// kTiledExpertRows rows for any expert where the CPU has AVX-512, else kSmallBatchExpertRows
// (`counts`: rows per expert).
bool SmallBatchExpertsFit(const torch::Tensor& x, const std::vector<torch::Tensor>& gate_up,
                          const std::vector<torch::Tensor>& down, const int64_t* counts);

// sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])) for e = idx[t, j]: the experts' part
// of Moe for x [T, H], idx and w [T, k]. Each expert's weights are read once for all of its
// rows, and the experts are spread over torch's threads. Not batch-invariant (the engine's
// deterministic mode keeps to Linear's tiles).
torch::Tensor SmallBatchExperts(const torch::Tensor& x, const torch::Tensor& idx,
                                const torch::Tensor& w, const std::vector<torch::Tensor>& gate_up,
                                const std::vector<torch::Tensor>& down);

// Whether RouterTopK can take this call: inference, fp32 on the CPU, x [T, H] and the router
// [E, H] in TransposeLinearWeights' layout (a transposed view of [H, E] memory), 1 <= k <= E.
bool RouterTopKFits(const torch::Tensor& x, const torch::Tensor& router, int64_t k);

// A MoE layer's routing as Moe's torch operators compute it, in one pass over the rows instead
// of a dozen operators: p = softmax(x router^T) over the E experts in float32, its k largest in
// descending order (the lower expert first among equal ones), their weights p, divided by their
// sum where `normalize` (Qwen3's norm_topk_prob). idx: int64 [T, k]; w: fp32 [T, k];
// counts[e]: the rows routed to expert e.
void RouterTopK(const torch::Tensor& x, const torch::Tensor& router, int64_t k, bool normalize,
                torch::Tensor* idx, torch::Tensor* w, std::vector<int64_t>* counts);

}  // namespace bragg::engine::qwen3
