#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/hash.h"

namespace bragg::engine {
namespace {

// Uniform in [0, 1) from (seed, step).
double Uniform(uint64_t seed, int64_t step) {
  uint64_t r = SplitMix64(SplitMix64(seed) ^ static_cast<uint64_t>(step));
  return static_cast<double>(r >> 11) * 0x1.0p-53;
}

// max and log-sum-exp of logits / t, in index order.
double LogSumExp(std::span<const float> logits, double t, double* max_out) {
  double m = -INFINITY;
  for (float x : logits) {
    m = std::max(m, static_cast<double>(x) / t);
  }
  double s = 0;
  for (float x : logits) {
    s += std::exp(static_cast<double>(x) / t - m);
  }
  *max_out = m;
  return m + std::log(s);
}

}  // namespace

float LogProb(std::span<const float> logits, float temperature, int32_t token) {
  double t = temperature > 0 ? temperature : 1.0;
  double m = 0;
  double lse = LogSumExp(logits, t, &m);
  return static_cast<float>(static_cast<double>(logits[token]) / t - lse);
}

Sampled Sample(std::span<const float> logits, const SamplingParams& p, uint64_t seed, int64_t step,
               bool want_logprob) {
  Sampled out;
  const int64_t n = static_cast<int64_t>(logits.size());
  if (p.temperature <= 0 || p.top_k == 1) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; ++i) {
      if (logits[i] > logits[best]) {
        best = i;
      }
    }
    out.token = static_cast<int32_t>(best);
    if (want_logprob) {
      out.logprob = LogProb(logits, p.temperature > 0 ? p.temperature : 1.0f, out.token);
    }
    return out;
  }
  double t = p.temperature;
  double m = 0;
  double lse = LogSumExp(logits, t, &m);
  // Candidates by probability, highest first (ties: lower id first), then cut by top_k, top_p
  // and min_p (SGLang's order), and drawn from in that order.
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  int64_t k = p.top_k > 0 ? std::min<int64_t>(p.top_k, n) : n;
  auto by_prob = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  if (k < n) {
    std::partial_sort(order.begin(), order.begin() + k, order.end(), by_prob);
    order.resize(k);
  } else {
    std::sort(order.begin(), order.end(), by_prob);
  }
  std::vector<double> prob(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    prob[i] = std::exp(static_cast<double>(logits[order[i]]) / t - lse);
  }
  size_t keep = order.size();
  if (p.top_p < 1.0f) {
    double total = std::accumulate(prob.begin(), prob.end(), 0.0);
    double cum = 0;
    for (size_t i = 0; i < keep; ++i) {
      if (cum > static_cast<double>(p.top_p) * total) {
        keep = i;
        break;
      }
      cum += prob[i];
    }
    keep = std::max<size_t>(keep, 1);
  }
  if (p.min_p > 0) {
    double floor = prob[0] * static_cast<double>(p.min_p);
    size_t i = 1;
    while (i < keep && prob[i] >= floor) {
      ++i;
    }
    keep = i;
  }
  double total = 0;
  for (size_t i = 0; i < keep; ++i) {
    total += prob[i];
  }
  double u = Uniform(seed, step) * total;
  size_t pick = keep - 1;
  double cum = 0;
  for (size_t i = 0; i < keep; ++i) {
    cum += prob[i];
    if (u < cum) {
      pick = i;
      break;
    }
  }
  out.token = order[pick];
  out.logprob = static_cast<float>(static_cast<double>(logits[out.token]) / t - lse);
  return out;
}

}  // namespace bragg::engine
