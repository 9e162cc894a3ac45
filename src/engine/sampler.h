#pragma once

// Per-request sampling over one row of logits, in plain C++ with a fixed order of operations
// (so the same logits always give the same token and log-prob, whatever the batch), and a
// counter-based random stream: the draw for output token i depends on (seed, i) alone, so a
// request that is retracted and resumed, or batched differently, samples the same tokens.

#include <cstdint>
#include <span>

#include "engine/engine.h"

namespace bragg::engine {

struct Sampled {
  int32_t token = 0;
  float logprob = 0;  // log-softmax of logits / temperature (raw logits when greedy) at token
};

// temperature 0 (or top_k 1): argmax, lowest id on ties. Otherwise a draw from softmax(logits /
// temperature): with top_k, top_p or min_p, over the candidates left by the cuts in order of
// probability; with none, over the vocabulary in index order.
// The log-prob is computed only when `want_logprob` (it costs an exp per vocabulary entry).
Sampled Sample(std::span<const float> logits, const SamplingParams& params, uint64_t seed,
               int64_t step, bool want_logprob = true);

// log-softmax of `logits` / temperature at `token` (temperature <= 0 means 1), summed in double
// in index order.
float LogProb(std::span<const float> logits, float temperature, int32_t token);

}  // namespace bragg::engine
