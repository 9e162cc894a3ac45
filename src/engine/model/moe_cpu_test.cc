// SmallBatchExperts against the experts computed with torch's own operators, on the weight
// layout the engine serves from, and the calls it must refuse.

#include "engine/model/moe_cpu.h"

#include <gtest/gtest.h>

#include <vector>

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
  if (__builtin_cpu_supports("avx512f")) {
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
        (__builtin_cpu_supports("avx512f") ? kTiledExpertRows : kSmallBatchExpertRows) + 1, 0, 0,
        0};
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

}  // namespace
}  // namespace bragg::engine::qwen3
