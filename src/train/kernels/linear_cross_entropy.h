#pragma once

// Fused linear cross-entropy: each label's log-probability and the entropy of the softmax of
// hidden W^T / temperature, computed chunk by chunk so that the [T, V] logits never exist at once
// (forward and backward). torch's side: include only from torch translation units.

#include <torch/torch.h>

#include <cstdint>

#include "common/status.h"

namespace bragg::train {

struct LinearCrossEntropyOptions {
  // Rows per chunk; a multiple of engine::kDeterministicTile in deterministic mode.
  int64_t token_chunk = 1024;
  // 0: the whole vocabulary per chunk; else columns per chunk (online log-sum-exp). Must be 0 in
  // deterministic mode.
  int64_t vocab_chunk = 0;
  // Logits are divided by it, as the engine's sampler does. It is used as a float (the type of
  // the engine's SamplingParams::temperature), so that 0.7 here means what 0.7 meant there.
  double temperature = 1.0;
  // Bitwise equal to the engine's LogProb (src/engine/sampler.cc) on logits from
  // engine::Linear(hs, lm_head, {}, /*deterministic=*/true): whole-vocabulary chunks, logits
  // through that same Linear, max and log-sum-exp in double in index order.
  bool deterministic = false;
};

struct LinearCrossEntropyOutput {
  torch::Tensor logprobs;  // [T] float32: log softmax(hidden W^T / temperature)[label]
  torch::Tensor entropy;   // [T] float32: -sum_i p_i log p_i of that softmax
};

// hidden [T, H] (float32 or bfloat16, CPU), weight [V, H] of the same dtype, labels [T] int64 in
// [0, V). Never holds [T, V]: the extra memory is about 2 x token_chunk x (vocab_chunk or V) x 4
// bytes in forward and in backward (plus, for bfloat16 inputs, a float32 copy of weight and the
// float32 grad_weight accumulator in backward).
//
// Differentiable with respect to hidden and weight (a torch::autograd::Function; labels get no
// gradient): backward recomputes each chunk's logits and accumulates grad_hidden and grad_weight
// in float32 from both outputs' gradients (either may be undefined: taken as zero). Double
// backward is not supported.
//
// Throws c10::Error (TORCH_CHECK) naming what is wrong on bad shapes, dtypes, labels or options
// (the message of ValidateLinearCrossEntropy); use TryLinearCrossEntropy for a Status instead.
// Thread-safety: none of its own state; torch's intra-op threads do the work.
LinearCrossEntropyOutput LinearCrossEntropy(const torch::Tensor& hidden,
                                            const torch::Tensor& weight,
                                            const torch::Tensor& labels,
                                            const LinearCrossEntropyOptions& options = {});

// OK, or InvalidArgument saying what is wrong and how to fix it ("labels[17] = 300 is outside
// the vocabulary (V = 256)"). Reads labels once (a pass over T values).
[[nodiscard]] Status ValidateLinearCrossEntropy(const torch::Tensor& hidden,
                                                const torch::Tensor& weight,
                                                const torch::Tensor& labels,
                                                const LinearCrossEntropyOptions& options);

// ValidateLinearCrossEntropy, then LinearCrossEntropy; any torch error (out of memory, ...) comes
// back as a Status (Internal, or ResourceExhausted for an allocation failure) instead of an
// exception.
[[nodiscard]] Result<LinearCrossEntropyOutput> TryLinearCrossEntropy(
    const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& labels,
    const LinearCrossEntropyOptions& options = {});

}  // namespace bragg::train
