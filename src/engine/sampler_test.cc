#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

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

TEST(Sampler, LogProbIsTemperatureScaled) {
  std::vector<float> l = {1.0f, 3.0f};
  double t = 2.0;
  double want = 3.0 / t - std::log(std::exp(1.0 / t) + std::exp(3.0 / t));
  EXPECT_NEAR(LogProb(l, 2.0f, 1), want, 1e-6);
}

}  // namespace
}  // namespace bragg::engine
