#include "engine/sampler.h"

#include <immintrin.h>

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

// max and log-sum-exp of logits / t, in index order; *sum_out (if not null): the sum of
// exp(logits / t - max); exps (if not null, logits.size() long): each of those exps.
double LogSumExp(std::span<const float> logits, double t, double* max_out,
                 double* sum_out = nullptr, double* exps = nullptr) {
  double m = -INFINITY;
  for (float x : logits) {
    m = std::max(m, static_cast<double>(x) / t);
  }
  double s = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    const double e = std::exp(static_cast<double>(logits[i]) / t - m);
    if (exps != nullptr) {
      exps[i] = e;
    }
    s += e;
  }
  *max_out = m;
  if (sum_out != nullptr) {
    *sum_out = s;
  }
  return m + std::log(s);
}

// The first index of the largest value (NaN never counts as larger; a NaN at 0 stays): the
// scalar scan, and the same answer 16 lanes at a time where AVX-512 runs.
int64_t ArgMaxScalar(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i) {
    if (x[i] > x[best]) {
      best = i;
    }
  }
  return best;
}

__attribute__((target("avx512f"))) int64_t ArgMaxAvx512(const float* x, int64_t n) {
  if (n < 32 || std::isnan(x[0])) {
    return ArgMaxScalar(x, n);
  }
  // The largest value, NaNs skipped (a lane keeps its value unless a larger one comes), then
  // its first index.
  __m512 mv = _mm512_set1_ps(x[0]);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    mv = _mm512_mask_mov_ps(mv, _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ), v);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, mv);
  float m = lanes[0];
  for (float l : lanes) {
    m = l > m ? l : m;
  }
  for (; i < n; ++i) {
    m = x[i] > m ? x[i] : m;
  }
  const __m512 mb = _mm512_set1_ps(m);
  for (i = 0; i + 16 <= n; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), mb, _CMP_EQ_OQ);
    if (eq != 0) {
      return i + __builtin_ctz(eq);
    }
  }
  for (; i < n; ++i) {
    if (x[i] == m) {
      return i;
    }
  }
  return 0;  // not reached: m is one of the values
}

int64_t ArgMax(std::span<const float> x) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  const int64_t n = static_cast<int64_t>(x.size());
  return avx512 ? ArgMaxAvx512(x.data(), n) : ArgMaxScalar(x.data(), n);
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
    out.token = static_cast<int32_t>(ArgMax(logits));
    if (want_logprob) {
      out.logprob = LogProb(logits, p.temperature > 0 ? p.temperature : 1.0f, out.token);
    }
    return out;
  }
  double t = p.temperature;
  if ((p.top_k <= 0 || p.top_k >= n) && p.top_p >= 1.0f && p.min_p <= 0) {
    // Nothing cut: the draw walks the vocabulary in index order (as torch.multinomial does),
    // over the exps the log-sum-exp made, so a row costs one pass of exp and sorts nothing.
    std::vector<double> e(static_cast<size_t>(n));
    double m = 0, s = 0;
    const double lse = LogSumExp(logits, t, &m, &s, e.data());
    const double u = Uniform(seed, step) * s;
    int64_t pick = n - 1;
    double cum = 0;
    for (int64_t i = 0; i < n; ++i) {
      cum += e[i];
      if (u < cum) {
        pick = i;
        break;
      }
    }
    out.token = static_cast<int32_t>(pick);
    out.logprob = static_cast<float>(static_cast<double>(logits[pick]) / t - lse);
    return out;
  }
  double m = 0, sum = 0;
  double lse = LogSumExp(logits, t, &m, &sum);
  // With a cut: candidates by probability, highest first (ties: lower id first), then cut by
  // top_k, top_p and min_p (SGLang's order), and drawn from in that order. The cuts and the draw
  // walk the list from the top, so it is sorted only as far as they need: the first `sorted`
  // candidates, from 256 and 8 times more while undecided (a full sort of a 32,000-entry vocabulary
  // took 4 ms a row; the first 256 usually decide).
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  const int64_t k = p.top_k > 0 ? std::min<int64_t>(p.top_k, n) : n;
  auto by_prob = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  auto prob_of = [&](int32_t i) { return std::exp(static_cast<double>(logits[i]) / t - lse); };
  // The k candidates' total: needed by top_p, and by the draw when nothing is cut. For the whole
  // vocabulary it is 1 up to rounding: the sum the log-sum-exp made, scaled as prob_of scales.
  double total_k = k == n ? sum * std::exp(m - lse) : 0;
  std::vector<double> prob;
  int64_t sorted = k < n ? k : std::min<int64_t>(n, 256);
  for (;;) {
    if (sorted < n) {
      std::nth_element(order.begin(), order.begin() + sorted, order.end(), by_prob);
    }
    std::sort(order.begin(), order.begin() + sorted, by_prob);
    prob.resize(static_cast<size_t>(sorted));
    for (int64_t i = 0; i < sorted; ++i) {
      prob[i] = prob_of(order[i]);
    }
    if (k < n) {
      total_k = std::accumulate(prob.begin(), prob.end(), 0.0);
    }
    const bool all = sorted == k;
    // keep: candidates left after the cuts; -1 while a cut lies past the sorted ones.
    int64_t keep = k;
    if (p.top_p < 1.0f) {
      keep = all ? k : -1;
      double cum = 0;
      for (int64_t i = 0; i < sorted; ++i) {
        if (cum > static_cast<double>(p.top_p) * total_k) {
          keep = i;
          break;
        }
        cum += prob[i];
      }
      if (keep >= 0) {
        keep = std::max<int64_t>(keep, 1);
      }
    }
    if (p.min_p > 0 && keep != -1) {
      const double floor = prob[0] * static_cast<double>(p.min_p);
      int64_t i = 1;
      while (i < keep && i < sorted && prob[i] >= floor) {
        ++i;
      }
      keep = i < keep && i == sorted ? -1 : i;  // ran off the sorted ones before the end
    }
    if (keep == -1) {
      sorted = std::min(k, sorted * 8);
      continue;
    }
    double total = total_k;
    if (keep < k) {
      total = 0;
      for (int64_t i = 0; i < keep; ++i) {
        total += prob[i];
      }
    }
    const double u = Uniform(seed, step) * total;
    int64_t pick = -1;
    double cum = 0;
    for (int64_t i = 0; i < std::min(keep, sorted); ++i) {
      cum += prob[i];
      if (u < cum) {
        pick = i;
        break;
      }
    }
    if (pick == -1 && keep > sorted) {  // the draw falls past the sorted candidates
      sorted = std::min(k, sorted * 8);
      continue;
    }
    if (pick == -1) {
      pick = keep - 1;
    }
    out.token = order[pick];
    break;
  }
  out.logprob = static_cast<float>(static_cast<double>(logits[out.token]) / t - lse);
  return out;
}

}  // namespace bragg::engine
