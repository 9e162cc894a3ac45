#include "pack/cost_model.h"

#include <vector>

#include "gtest/gtest.h"

namespace bragg::pack {
namespace {

TEST(CostModelTest, CostIsLinearPlusQuadratic) {
  CostModel m{.a = 2, .b = 0.5};
  EXPECT_DOUBLE_EQ(m.Cost(0), 0);
  EXPECT_DOUBLE_EQ(m.Cost(4), 2 * 4 + 0.5 * 16);
}

TEST(CostModelTest, FromModelSize) {
  auto m = CostModel::FromModelSize(4096, 32);
  ASSERT_TRUE(m.ok());
  // Attention overtakes the dense layers at s = 12*h.
  EXPECT_NEAR(m->a / m->b, 12.0 * 4096, 1e-6);
  EXPECT_FALSE(CostModel::FromModelSize(0, 32).ok());
  EXPECT_FALSE(CostModel::FromModelSize(4096, -1).ok());
}

TEST(FitCostModelTest, RecoversCoefficientsExactly) {
  std::vector<StepSample> samples;
  for (double s : {512.0, 1024.0, 4096.0, 16384.0}) {
    for (int n : {1, 3}) {
      const double lin = n * s, quad = n * s * s;
      samples.push_back({lin, quad, 3e-6 * lin + 2e-10 * quad});
    }
  }
  auto fit = FitCostModel(samples);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_NEAR(fit->model.a, 3e-6, 1e-12);
  EXPECT_NEAR(fit->model.b, 2e-10, 1e-15);
  EXPECT_NEAR(fit->r_squared, 1.0, 1e-9);
}

TEST(FitCostModelTest, NoisyFitReportsLowerRSquared) {
  std::vector<StepSample> samples;
  for (int i = 1; i <= 20; ++i) {
    const double s = 256.0 * i;
    const double noise = (i % 2 == 0 ? 1.3 : 0.7);
    samples.push_back({s, s * s, (1e-6 * s + 1e-10 * s * s) * noise});
  }
  auto fit = FitCostModel(samples);
  ASSERT_TRUE(fit.ok());
  EXPECT_LT(fit->r_squared, 0.99);
  EXPECT_GT(fit->r_squared, 0.0);
  EXPECT_GE(fit->model.a, 0);
  EXPECT_GE(fit->model.b, 0);
}

TEST(FitCostModelTest, NegativeCoefficientIsClampedToZero) {
  // Time falls with the quadratic sum: the unconstrained fit would give b < 0.
  std::vector<StepSample> samples = {{100, 10000, 2.0}, {100, 1, 2.1}, {200, 40000, 3.9}};
  auto fit = FitCostModel(samples);
  ASSERT_TRUE(fit.ok());
  EXPECT_GE(fit->model.b, 0);
  EXPECT_GE(fit->model.a, 0);
}

TEST(FitCostModelTest, RejectsBadSamples) {
  EXPECT_FALSE(FitCostModel({}).ok());
  std::vector<StepSample> one = {{1, 1, 1}};
  EXPECT_FALSE(FitCostModel(one).ok());
  std::vector<StepSample> zero = {{0, 0, 1}, {0, 0, 2}};
  EXPECT_FALSE(FitCostModel(zero).ok());
  std::vector<StepSample> neg = {{1, 1, -1}, {2, 4, 1}};
  EXPECT_FALSE(FitCostModel(neg).ok());
  std::vector<StepSample> nan = {{1, 1, std::nan("")}, {2, 4, 1}};
  EXPECT_FALSE(FitCostModel(nan).ok());
}

}  // namespace
}  // namespace bragg::pack
