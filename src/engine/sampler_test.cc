#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>

#include "common/hash.h"

namespace bragg::engine {
namespace {

TEST(Sampler, GreedyTakesTheArgmaxAndTheLowestIdOnTies) {
  std::vector<float> l = {0.5f, 2.0f, 2.0f, -1.0f};
  SamplingParams p;
  p.temperature = 0;
  Sampled s = Sample(l, p, 1, 0);
  EXPECT_EQ(s.token, 1);
  double lse = std::log(std::exp(0.5) + 2 * std::exp(2.0) + std::exp(-1.0));
  EXPECT_NEAR(s.logprob, 2.0 - lse, 1e-6);
}

// Greedy takes the first index of the largest value, as a plain scan does (NaN is never larger,
// -0 equals 0), at every length around the vector width and with values drawn to tie often.
TEST(Sampler, GreedyIsThePlainScanAtEveryLengthWithTiesNansAndInfinities) {
  std::mt19937 rng(7);
  SamplingParams p;
  p.temperature = 0;
  auto scan = [](const std::vector<float>& x) {
    size_t best = 0;
    for (size_t i = 1; i < x.size(); ++i) {
      if (x[i] > x[best]) {
        best = i;
      }
    }
    return static_cast<int32_t>(best);
  };
  const float specials[] = {std::nanf(""), -INFINITY, INFINITY, -0.0f, 0.0f};
  for (int trial = 0; trial < 3000; ++trial) {
    const size_t n = trial < 2000 ? 1 + trial % 100 : 32000;
    std::vector<float> x(n);
    for (float& v : x) {
      const int r = static_cast<int>(rng() % 40);
      v = r < 5 && trial % 3 == 0 ? specials[r] : static_cast<float>(rng() % 8) - 4.0f;
    }
    if (trial % 7 == 0) {
      x[0] = std::nanf("");  // nothing beats a NaN at 0 in the scan
    }
    ASSERT_EQ(Sample(x, p, 1, 0).token, scan(x)) << "trial " << trial << ", " << n << " values";
  }
}

TEST(Sampler, SameSeedAndStepSameTokenAndTheDistributionIsRight) {
  std::vector<float> l = {std::log(0.1f), std::log(0.2f), std::log(0.7f)};
  SamplingParams p;
  EXPECT_EQ(Sample(l, p, 42, 5).token, Sample(l, p, 42, 5).token);
  std::map<int, int> counts;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    counts[Sample(l, p, 9, i).token]++;
  }
  EXPECT_NEAR(counts[0] / double(n), 0.1, 0.015);
  EXPECT_NEAR(counts[1] / double(n), 0.2, 0.015);
  EXPECT_NEAR(counts[2] / double(n), 0.7, 0.015);
}

TEST(Sampler, TopKTopPAndMinPCutTheTail) {
  std::vector<float> l = {std::log(0.05f), std::log(0.15f), std::log(0.3f), std::log(0.5f)};
  for (int i = 0; i < 2000; ++i) {
    SamplingParams k;
    k.top_k = 2;
    int32_t t = Sample(l, k, 1, i).token;
    EXPECT_TRUE(t == 2 || t == 3) << t;
    SamplingParams tp;
    tp.top_p = 0.6f;  // 0.5 then 0.3 reaches it
    t = Sample(l, tp, 2, i).token;
    EXPECT_TRUE(t == 2 || t == 3) << t;
    SamplingParams mp;
    mp.min_p = 0.5f;  // keeps p >= 0.25
    t = Sample(l, mp, 3, i).token;
    EXPECT_TRUE(t == 2 || t == 3) << t;
  }
}

// The sampler's rule written the plain way: every candidate sorted by probability, cut, drawn
// from in that order, with the same (seed, step) stream; with no cut, drawn in index order.
int32_t FullSortSample(const std::vector<float>& logits, const SamplingParams& p, uint64_t seed,
                       int64_t step) {
  const int64_t n = static_cast<int64_t>(logits.size());
  const double t = p.temperature;
  double m = -INFINITY;
  for (float x : logits) m = std::max(m, static_cast<double>(x) / t);
  double s = 0;
  for (float x : logits) s += std::exp(static_cast<double>(x) / t - m);
  const double lse = m + std::log(s);
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  if ((p.top_k > 0 && p.top_k < n) || p.top_p < 1 || p.min_p > 0) {
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
  }
  order.resize(p.top_k > 0 ? std::min<int64_t>(p.top_k, n) : n);
  std::vector<double> prob;
  for (int32_t i : order) prob.push_back(std::exp(static_cast<double>(logits[i]) / t - lse));
  size_t keep = order.size();
  if (p.top_p < 1.0f) {
    const double total = std::accumulate(prob.begin(), prob.end(), 0.0);
    double cum = 0;
    for (size_t i = 0; i < keep; ++i) {
      if (cum > p.top_p * total) {
        keep = i;
        break;
      }
      cum += prob[i];
    }
    keep = std::max<size_t>(keep, 1);
  }
  if (p.min_p > 0) {
    size_t i = 1;
    while (i < keep && prob[i] >= prob[0] * p.min_p) ++i;
    keep = i;
  }
  const double total = std::accumulate(prob.begin(), prob.begin() + keep, 0.0);
  const uint64_t r = SplitMix64(SplitMix64(seed) ^ static_cast<uint64_t>(step));
  const double u = static_cast<double>(r >> 11) * 0x1.0p-53 * total;
  double cum = 0;
  for (size_t i = 0; i < keep; ++i) {
    cum += prob[i];
    if (u < cum) return order[i];
  }
  return order[keep - 1];
}

TEST(Sampler, SortingOnlyAsFarAsNeededDrawsWhatAFullSortDraws) {
  // A vocabulary of 32,000: peaked logits (the first candidates decide), flat ones (most draws
  // fall past the first 256, so the sorted part grows), ties, and every cut on either side of
  // the first 256 and 2,048 candidates.
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0, 1);
  for (float spread : {8.0f, 1.0f, 0.01f, 0.0f}) {
    std::vector<float> l(32000);
    for (float& x : l) x = spread * normal(rng);
    for (int i = 0; i < 64; ++i) l[rng() % l.size()] = l[rng() % l.size()];  // ties
    struct Cut {
      float temperature, top_p, min_p;
      int top_k;
    };
    for (Cut c : {Cut{1, 1, 0, 0}, Cut{0.7f, 1, 0, 0}, Cut{1, 0.9f, 0, 0}, Cut{1, 0.999f, 0, 0},
                  Cut{1, 1, 0.05f, 0}, Cut{1, 1, 0.999f, 0}, Cut{1, 0.95f, 0.01f, 0},
                  Cut{1, 1, 0, 300}, Cut{1, 0.5f, 0, 5000}, Cut{1.3f, 0.99f, 0.001f, 20000}}) {
      SCOPED_TRACE(::testing::Message()
                   << "spread " << spread << " t " << c.temperature << " top_p " << c.top_p
                   << " min_p " << c.min_p << " top_k " << c.top_k);
      SamplingParams p;
      p.temperature = c.temperature;
      p.top_p = c.top_p;
      p.min_p = c.min_p;
      p.top_k = c.top_k;
      for (int step = 0; step < 20; ++step) {
        ASSERT_EQ(Sample(l, p, 17, step).token, FullSortSample(l, p, 17, step)) << "step " << step;
      }
    }
  }
}

TEST(Sampler, LogProbIsTemperatureScaled) {
  std::vector<float> l = {1.0f, 3.0f};
  double t = 2.0;
  double want = 3.0 / t - std::log(std::exp(1.0 / t) + std::exp(3.0 / t));
  EXPECT_NEAR(LogProb(l, 2.0f, 1), want, 1e-6);
}

}  // namespace
}  // namespace bragg::engine
