// fused_cpu.h against qwen3.h's torch operators (what the deterministic mode and the trainer
// run) and against float64, over the shapes a decode step and a prefill give, and the inputs it
// must refuse.

#include "engine/model/fused_cpu.h"

#include <gtest/gtest.h>

#include <vector>

#include "engine/model/qwen3.h"

namespace bragg::engine::qwen3 {
namespace {

constexpr double kEps = 1e-6;

double MaxDiff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

TEST(FusedRmsNorm, EqualsTorchsOperators) {
  c10::InferenceMode guard;
  torch::manual_seed(1);
  for (int64_t n : {16, 64, 100, 256, 1024}) {
    for (int64_t rows : {1, 7, 32, 513}) {
      torch::Tensor h = torch::randn({rows, n}) * 3;
      torch::Tensor w = torch::randn({n});
      torch::Tensor got = FusedRmsNorm(h, w, kEps);
      // Only the sum of squares goes in another order: a few ulps at most.
      EXPECT_LT(MaxDiff(got, RmsNorm(h, w, kEps)), 1e-5) << rows << "x" << n;
      torch::Tensor exact = RmsNorm(h.to(torch::kFloat64), w.to(torch::kFloat64), kEps);
      EXPECT_LT(MaxDiff(got, exact), 1e-5) << rows << "x" << n;
    }
  }
}

TEST(AddRmsNorm, AddsInPlaceThenNorms) {
  c10::InferenceMode guard;
  torch::manual_seed(2);
  torch::Tensor h = torch::randn({33, 256});
  torch::Tensor d = torch::randn({33, 256});
  torch::Tensor w = torch::randn({256});
  torch::Tensor sum = h + d;  // torch's add rounds as the fused one does
  torch::Tensor got = AddRmsNorm(h, d, w, kEps);
  EXPECT_TRUE(torch::equal(h, sum));
  EXPECT_LT(MaxDiff(got, RmsNorm(sum, w, kEps)), 1e-5);
}

struct Shape {
  int64_t nh, kvh, hd, T;
};

TEST(QkNormRopeCache, EqualsTorchsOperatorsAndWritesTheCacheAtTheSlots) {
  c10::InferenceMode guard;
  torch::manual_seed(3);
  for (Shape s : {Shape{8, 2, 32, 1}, Shape{8, 2, 32, 32}, Shape{4, 1, 64, 9},
                  Shape{16, 16, 16, 300}, Shape{4, 2, 128, 5}}) {
    SCOPED_TRACE(testing::Message()
                 << s.nh << "/" << s.kvh << " heads of " << s.hd << ", " << s.T << " rows");
    const int64_t slots = 4 * s.T + 8;
    torch::Tensor qkv = torch::randn({s.T, (s.nh + 2 * s.kvh) * s.hd});
    torch::Tensor q_norm = torch::randn({s.hd}), k_norm = torch::randn({s.hd});
    torch::Tensor inv_freq =
        1.0 / torch::pow(torch::tensor(1e6f),
                         torch::arange(0, s.hd, 2).to(torch::kFloat32) / static_cast<double>(s.hd));
    torch::Tensor pos = torch::randint(0, 8192, {s.T}, torch::kInt64);
    auto [cos, sin] = RopeTables(pos, inv_freq, torch::kFloat32);
    torch::Tensor slot = torch::randperm(slots, torch::kInt64).narrow(0, 0, s.T).contiguous();
    torch::Tensor keys = torch::full({slots, s.kvh, s.hd}, 7.0f);
    torch::Tensor values = keys.clone();

    torch::Tensor q =
        QkNormRopeCache(qkv, q_norm, k_norm, cos, sin, keys, values, slot, s.nh, s.kvh, kEps);

    // qwen3.h's operators, as the unfused forward runs them.
    torch::Tensor rq = qkv.narrow(1, 0, s.nh * s.hd).reshape({s.T, s.nh, s.hd});
    torch::Tensor rk = qkv.narrow(1, s.nh * s.hd, s.kvh * s.hd).reshape({s.T, s.kvh, s.hd});
    torch::Tensor rv =
        qkv.narrow(1, (s.nh + s.kvh) * s.hd, s.kvh * s.hd).reshape({s.T, s.kvh, s.hd});
    rq = Rope(RmsNorm(rq, q_norm, kEps), cos, sin);
    rk = Rope(RmsNorm(rk, k_norm, kEps), cos, sin);
    ASSERT_EQ(q.sizes(), rq.sizes());
    EXPECT_LT(MaxDiff(q, rq), 1e-5);
    EXPECT_LT(MaxDiff(keys.index_select(0, slot), rk), 1e-5);
    EXPECT_TRUE(torch::equal(values.index_select(0, slot), rv));
    // Every other slot is untouched.
    torch::Tensor untouched = torch::ones({slots}, torch::kBool);
    untouched.index_fill_(0, slot, false);
    EXPECT_TRUE(keys.index({untouched}).eq(7.0f).all().item<bool>());
    EXPECT_TRUE(values.index({untouched}).eq(7.0f).all().item<bool>());
  }
}

TEST(Fused, RefusesWhatItCannotTake) {
  c10::InferenceMode guard;
  torch::Tensor h = torch::randn({4, 64});
  torch::Tensor w = torch::randn({64});
  EXPECT_FALSE(FusedCpuFits(h.to(torch::kBFloat16)));
  EXPECT_FALSE(FusedCpuFits(torch::Tensor()));
  EXPECT_TRUE(FusedCpuFits(h));
  EXPECT_THROW(FusedRmsNorm(h.to(torch::kBFloat16), w, kEps), c10::Error);
  EXPECT_THROW(FusedRmsNorm(h.t(), w, kEps), c10::Error);  // not contiguous
  EXPECT_THROW(FusedRmsNorm(h, torch::randn({63}), kEps), c10::Error);
  torch::Tensor d = torch::randn({4, 63});
  EXPECT_THROW(AddRmsNorm(h, d, w, kEps), c10::Error);

  const int64_t nh = 4, kvh = 2, hd = 16, T = 3;
  torch::Tensor qkv = torch::randn({T, (nh + 2 * kvh) * hd});
  torch::Tensor norm = torch::randn({hd});
  torch::Tensor cos = torch::randn({T, hd}), sin = torch::randn({T, hd});
  torch::Tensor keys = torch::zeros({10, kvh, hd}), values = torch::zeros({10, kvh, hd});
  torch::Tensor slot = torch::tensor(std::vector<int64_t>{0, 1, 2});
  EXPECT_NO_THROW(QkNormRopeCache(qkv, norm, norm, cos, sin, keys, values, slot, nh, kvh, kEps));
  // A width that is not (nh + 2 kvh) hd, tables of another length, a cache of other heads,
  // int32 slots, too few slots.
  EXPECT_THROW(QkNormRopeCache(qkv, norm, norm, cos, sin, keys, values, slot, nh + 1, kvh, kEps),
               c10::Error);
  torch::Tensor short_cos = torch::randn({T - 1, hd});
  EXPECT_THROW(QkNormRopeCache(qkv, norm, norm, short_cos, sin, keys, values, slot, nh, kvh, kEps),
               c10::Error);
  torch::Tensor other = torch::zeros({10, kvh + 1, hd});
  EXPECT_THROW(QkNormRopeCache(qkv, norm, norm, cos, sin, other, values, slot, nh, kvh, kEps),
               c10::Error);
  torch::Tensor slot32 = slot.to(torch::kInt32);
  EXPECT_THROW(QkNormRopeCache(qkv, norm, norm, cos, sin, keys, values, slot32, nh, kvh, kEps),
               c10::Error);
  torch::Tensor two = slot.narrow(0, 0, 2);
  EXPECT_THROW(QkNormRopeCache(qkv, norm, norm, cos, sin, keys, values, two, nh, kvh, kEps),
               c10::Error);
}

}  // namespace
}  // namespace bragg::engine::qwen3
