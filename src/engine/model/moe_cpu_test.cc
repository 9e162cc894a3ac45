// SmallBatchExperts and RouterTopK against the experts and routing computed with torch's own
// operators, on the weight layout the engine serves from, and the calls they must refuse.

#include "engine/model/moe_cpu.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "engine/model/cpu_isa.h"

namespace bragg::engine::qwen3 {
namespace {

namespace F = torch::nn::functional;

struct Experts {
  std::vector<torch::Tensor> gate_up;  // [2I, H], views of [H, 2I] memory
  std::vector<torch::Tensor> down;     // [H, I], views of [I, H] memory
};

// Random experts in the engine's CPU serving layout (qwen3::TransposeLinearWeights).
Experts MakeExperts(int64_t E, int64_t H, int64_t I) {
  Experts ex;
  for (int64_t e = 0; e < E; ++e) {
    ex.gate_up.push_back(torch::randn({2 * I, H}).mul(0.05).t().contiguous().t());
    ex.down.push_back(torch::randn({H, I}).mul(0.05).t().contiguous().t());
  }
  return ex;
}

torch::Tensor Reference(const torch::Tensor& x, const torch::Tensor& idx, const torch::Tensor& w,
                        const Experts& ex) {
  torch::Tensor out = torch::zeros_like(x);
  for (int64_t t = 0; t < x.size(0); ++t) {
    for (int64_t j = 0; j < idx.size(1); ++j) {
      const int64_t e = idx[t][j].item<int64_t>();
      torch::Tensor gu = F::linear(x.narrow(0, t, 1), ex.gate_up[e]);
      const int64_t I = ex.down[e].size(1);
      torch::Tensor a = torch::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I);
      out.narrow(0, t, 1).add_(F::linear(a, ex.down[e]) * w[t][j].item<float>());
    }
  }
  return out;
}

std::vector<int64_t> Counts(const torch::Tensor& idx, int64_t E) {
  torch::Tensor c = torch::bincount(idx.reshape({-1}), {}, E);
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + E);
}

TEST(SmallBatchExperts, EqualsTorchOnDecodeAndPrefillShapes) {
  c10::InferenceMode guard;
  torch::manual_seed(7);
  // Shapes of the benchmark model and odd ones (H and I not multiples of a vector width),
  // with batches from one row to every expert at its row limit, and prefill chunks' where the
  // AVX-512 tiles take them.
  struct Shape {
    int64_t E, H, I, k, T;
  };
  std::vector<Shape> shapes = {Shape{16, 256, 256, 2, 1}, Shape{16, 256, 256, 2, 32},
                               Shape{16, 256, 256, 2, 64}, Shape{8, 37, 19, 3, 5},
                               Shape{4, 64, 96, 4, 32}};
  if (BestCpuIsa() == CpuIsa::kAvx512) {
    // A prefill chunk's rows: about 64 an expert for 512 tokens, and one expert given all 300
    // rows of a chunk (every token routed to it).
    shapes.push_back(Shape{16, 256, 256, 2, 512});
    shapes.push_back(Shape{2, 64, 48, 2, 300});
  }
  for (Shape s : shapes) {
    SCOPED_TRACE(::testing::Message()
                 << "E " << s.E << " H " << s.H << " I " << s.I << " k " << s.k << " T " << s.T);
    Experts ex = MakeExperts(s.E, s.H, s.I);
    torch::Tensor x = torch::randn({s.T, s.H});
    torch::Tensor idx = torch::stack(
        [&] {
          std::vector<torch::Tensor> rows;
          for (int64_t t = 0; t < s.T; ++t) {
            rows.push_back(torch::randperm(s.E).narrow(0, 0, s.k));
          }
          return rows;
        }(),
        0);
    torch::Tensor w = torch::softmax(torch::randn({s.T, s.k}), -1);
    std::vector<int64_t> counts = Counts(idx, s.E);
    ASSERT_TRUE(SmallBatchExpertsFit(x, ex.gate_up, ex.down, counts.data()));
    torch::Tensor got = SmallBatchExperts(x, idx, w, ex.gate_up, ex.down);
    torch::Tensor want = Reference(x, idx, w, ex);
    ASSERT_EQ(got.sizes(), want.sizes());
    const double diff = (got - want).abs().max().item<double>();
    const double scale = want.abs().max().item<double>();
    EXPECT_LE(diff, 1e-5 * std::max(1.0, scale)) << "max |diff| " << diff << " of " << scale;
  }
}

TEST(SmallBatchExperts, RefusesWhatItCannotTake) {
  torch::manual_seed(8);
  const int64_t E = 4, H = 32, I = 16;
  Experts ex = MakeExperts(E, H, I);
  torch::Tensor x = torch::randn({3, H});
  std::vector<int64_t> few = {1, 2, 3, 0};
  {
    c10::InferenceMode guard;
    EXPECT_TRUE(SmallBatchExpertsFit(x, ex.gate_up, ex.down, few.data()));
    // An expert over the row limit: BLAS does better there.
    std::vector<int64_t> many = {
        (BestCpuIsa() == CpuIsa::kAvx512 ? kTiledExpertRows : kSmallBatchExpertRows) + 1, 0, 0, 0};
    EXPECT_FALSE(SmallBatchExpertsFit(x, ex.gate_up, ex.down, many.data()));
    // Not fp32.
    EXPECT_FALSE(SmallBatchExpertsFit(x.to(torch::kBFloat16), ex.gate_up, ex.down, few.data()));
    // The checkpoint's own [out, in] layout (the trainer's, and deterministic mode's).
    Experts plain = ex;
    for (auto& t : plain.gate_up) t = t.contiguous();
    EXPECT_FALSE(SmallBatchExpertsFit(x, plain.gate_up, ex.down, few.data()));
    for (auto& t : plain.down) t = t.contiguous();
    EXPECT_FALSE(SmallBatchExpertsFit(x, ex.gate_up, plain.down, few.data()));
    // Shapes that disagree.
    Experts wide = MakeExperts(E, H + 1, I);
    EXPECT_FALSE(SmallBatchExpertsFit(x, wide.gate_up, wide.down, few.data()));
    EXPECT_FALSE(SmallBatchExpertsFit(x, ex.gate_up, {}, few.data()));
    // An expert index out of range is an error, not a read outside the weights.
    torch::Tensor idx = torch::tensor({{0, 4}, {1, 2}, {3, 1}}, torch::kInt64);
    torch::Tensor w = torch::full({3, 2}, 0.5f);
    EXPECT_THROW(SmallBatchExperts(x, idx, w, ex.gate_up, ex.down), c10::Error);
  }
  // Training: a gradient is wanted.
  torch::Tensor xg = x.clone().requires_grad_(true);
  EXPECT_FALSE(SmallBatchExpertsFit(xg, ex.gate_up, ex.down, few.data()));
}

// A router [E, H] in the serving layout (a transposed view of [H, E] memory).
torch::Tensor MakeRouter(int64_t E, int64_t H) { return torch::randn({E, H}).t().contiguous().t(); }

TEST(RouterTopK, EqualsTorchsSoftmaxAndTopK) {
  c10::InferenceMode guard;
  torch::manual_seed(9);
  struct Shape {
    int64_t T, H, E, k;
  };
  // The benchmark model's router, odd sizes, and a 128-expert top-8 one (Qwen3-30B-A3B's shape).
  for (Shape s : {Shape{1, 256, 16, 2}, Shape{64, 256, 16, 2}, Shape{37, 19, 5, 3},
                  Shape{512, 64, 128, 8}, Shape{3, 8, 4, 4}}) {
    for (bool normalize : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "T " << s.T << " H " << s.H << " E " << s.E << " k "
                                        << s.k << " normalize " << normalize);
      torch::Tensor x = torch::randn({s.T, s.H});
      torch::Tensor router = MakeRouter(s.E, s.H);
      ASSERT_TRUE(RouterTopKFits(x, router, s.k));
      torch::Tensor idx, w;
      std::vector<int64_t> counts;
      RouterTopK(x, router, s.k, normalize, &idx, &w, &counts);
      // The experts torch's float32 operators pick, and their weights in float64 and as those
      // operators compute them: ours are judged against float64, next to torch's own error.
      auto weights = [&](torch::Dtype dtype) {
        torch::Tensor probs = torch::softmax(F::linear(x.to(dtype), router.to(dtype)), -1);
        auto [pw, pi] = torch::topk(probs, s.k, -1);
        if (normalize) {
          pw = pw / pw.sum(-1, true);
        }
        return std::make_pair(pw.to(torch::kFloat64), pi);
      };
      auto [torch_w, want_idx] = weights(torch::kFloat32);
      torch::Tensor exact_w = weights(torch::kFloat64).first;
      EXPECT_TRUE(torch::equal(idx, want_idx));
      EXPECT_TRUE(torch::equal(idx, weights(torch::kFloat64).second));
      const double torch_err = (torch_w - exact_w).abs().max().item<double>();
      EXPECT_LE((w.to(torch::kFloat64) - exact_w).abs().max().item<double>(), 2 * torch_err + 1e-6)
          << "torch's float32 error " << torch_err;
      EXPECT_EQ(counts, Counts(want_idx, s.E));
    }
  }
}

TEST(RouterTopK, EqualExpertsGoInIndexOrderAndNaNsStillPickDistinctOnes) {
  c10::InferenceMode guard;
  torch::manual_seed(10);
  // Experts 1 and 3 have the same weights (the same probability for every row), above the rest.
  torch::Tensor r = torch::randn({4, 8}).mul(0.01);
  r[3] = r[1] = torch::ones({8});
  torch::Tensor router = r.t().contiguous().t();
  torch::Tensor x = torch::rand({5, 8}).add(0.5);  // positive rows: 1 and 3 lead
  torch::Tensor idx, w;
  std::vector<int64_t> counts;
  RouterTopK(x, router, 2, true, &idx, &w, &counts);
  for (int64_t t = 0; t < 5; ++t) {
    EXPECT_EQ(idx[t][0].item<int64_t>(), 1);
    EXPECT_EQ(idx[t][1].item<int64_t>(), 3);
    EXPECT_FLOAT_EQ(w[t][0].item<float>(), 0.5f);
  }
  EXPECT_EQ(counts, (std::vector<int64_t>{0, 5, 0, 5}));
  // A NaN row (a broken checkpoint): k distinct experts in range, not a read out of bounds.
  x[2] = std::numeric_limits<float>::quiet_NaN();
  RouterTopK(x, router, 3, true, &idx, &w, &counts);
  for (int64_t t = 0; t < 5; ++t) {
    std::vector<int64_t> row(idx[t].data_ptr<int64_t>(), idx[t].data_ptr<int64_t>() + 3);
    std::sort(row.begin(), row.end());
    EXPECT_TRUE(std::adjacent_find(row.begin(), row.end()) == row.end());
    EXPECT_GE(row.front(), 0);
    EXPECT_LT(row.back(), 4);
  }
}

TEST(RouterTopK, RefusesWhatItCannotTake) {
  torch::manual_seed(11);
  torch::Tensor x = torch::randn({3, 16});
  torch::Tensor router = MakeRouter(8, 16);
  {
    c10::InferenceMode guard;
    EXPECT_TRUE(RouterTopKFits(x, router, 2));
    EXPECT_FALSE(RouterTopKFits(x, router, 0));
    EXPECT_FALSE(RouterTopKFits(x, router, 9));                       // k > E
    EXPECT_FALSE(RouterTopKFits(x, router.contiguous(), 2));          // [out, in] memory
    EXPECT_FALSE(RouterTopKFits(x.to(torch::kBFloat16), router, 2));  // not fp32
    EXPECT_FALSE(RouterTopKFits(torch::randn({3, 15}), router, 2));   // H disagrees
    torch::Tensor idx, w;
    std::vector<int64_t> counts;
    EXPECT_THROW(RouterTopK(x, router, 9, true, &idx, &w, &counts), c10::Error);
  }
  EXPECT_FALSE(RouterTopKFits(x.clone().requires_grad_(true), router, 2));  // training
}

}  // namespace
}  // namespace bragg::engine::qwen3
