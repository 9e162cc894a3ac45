// engine::Linear in deterministic mode: each tile's bits are those of torch's own linear on that
// tile (the engine's and the trainer's log-probs rest on it), a row's result does not depend on
// its batch, and the gradients are torch's.

#include "engine/model/linear.h"

#include <gtest/gtest.h>

#include <vector>

namespace bragg::engine {
namespace {

namespace F = torch::nn::functional;

// The tiles one call at a time through torch's linear, the last zero-padded, then joined.
torch::Tensor PerTileLinear(const torch::Tensor& x, const torch::Tensor& w,
                            const torch::Tensor& b) {
  const int64_t rows = x.size(0);
  const int64_t tiles = (rows + kDeterministicTile - 1) / kDeterministicTile;
  torch::Tensor padded =
      torch::cat({x, torch::zeros({tiles * kDeterministicTile - rows, x.size(1)}, x.options())});
  std::vector<torch::Tensor> outs;
  for (int64_t t = 0; t < tiles; ++t) {
    outs.push_back(F::linear(padded.narrow(0, t * kDeterministicTile, kDeterministicTile), w, b));
  }
  return torch::cat(outs).narrow(0, 0, rows);
}

TEST(DeterministicLinear, EachTileIsTorchsLinearBitForBit) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(3);
  for (int64_t rows : {1, 3, 4, 5, 8, 13, 33, 130}) {
    for (bool bias : {false, true}) {
      // Row-major weights (the trainer's) and [in, out] memory (TransposeLinearWeights');
      // contiguous rows and rows that are a column slice of a wider tensor.
      for (bool transposed : {false, true}) {
        for (bool strided : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "rows " << rows << " bias " << bias << " transposed "
                                            << transposed << " strided " << strided);
          const int64_t in = 72, out = 40;
          torch::Tensor w = transposed ? torch::randn({in, out}).t() : torch::randn({out, in});
          torch::Tensor b = bias ? torch::randn({out}) : torch::Tensor();
          torch::Tensor x =
              strided ? torch::randn({rows, in + 9}).narrow(1, 5, in) : torch::randn({rows, in});
          torch::Tensor got = Linear(x, w, b, /*deterministic=*/true);
          ASSERT_EQ(got.sizes(), (std::vector<int64_t>{rows, out}));
          EXPECT_TRUE(got.is_contiguous());
          EXPECT_TRUE(torch::equal(got, PerTileLinear(x, w, b)));
        }
      }
    }
  }
}

TEST(DeterministicLinear, ARowsResultDoesNotDependOnItsBatch) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(5);
  torch::Tensor w = torch::randn({96, 64}), b = torch::randn({96});
  torch::Tensor batch = torch::randn({37, 64});
  torch::Tensor whole = Linear(batch, w, b, true);
  for (int64_t r = 0; r < batch.size(0); ++r) {
    SCOPED_TRACE(r);
    EXPECT_TRUE(torch::equal(Linear(batch.narrow(0, r, 1), w, b, true), whole.narrow(0, r, 1)));
    // The same row at another position, among other rows.
    torch::Tensor moved = torch::cat({torch::randn({r % 7 + 1, 64}), batch.narrow(0, r, 1)});
    EXPECT_TRUE(torch::equal(Linear(moved, w, b, true).narrow(0, moved.size(0) - 1, 1),
                             whole.narrow(0, r, 1)));
  }
  EXPECT_EQ(Linear(batch.narrow(0, 0, 0), w, b, true).sizes(), (std::vector<int64_t>{0, 96}));
}

TEST(DeterministicLinear, GradientsAreTorchsAndOnlyForWhatNeedsThem) {
  torch::manual_seed(7);
  const int64_t rows = 23, in = 48, out = 30;
  torch::Tensor x0 = torch::randn({rows, in}), w0 = torch::randn({out, in}),
                b0 = torch::randn({out});
  torch::Tensor g = torch::randn({rows, out});
  // With and without a bias: autograd's custom functions take no undefined tensor, so the two
  // are two signatures.
  auto grads = [&](bool deterministic, bool bias, bool gx, bool gw, bool gb) {
    torch::Tensor x = x0.clone().requires_grad_(gx), w = w0.clone().requires_grad_(gw);
    torch::Tensor b = bias ? b0.clone().requires_grad_(gb) : torch::Tensor();
    torch::Tensor y = Linear(x, w, b, deterministic);
    EXPECT_TRUE(y.requires_grad());
    (y * g).sum().backward();
    return std::vector<torch::Tensor>{x.grad(), w.grad(), bias ? b.grad() : torch::Tensor()};
  };
  for (bool bias : {false, true}) {
    for (int mask = 1; mask < 8; ++mask) {
      const bool gx = mask & 1, gw = mask & 2, gb = mask & 4;
      if (!bias && !gx && !gw) {
        continue;  // nothing to differentiate
      }
      SCOPED_TRACE(::testing::Message() << "bias " << bias << " mask " << mask);
      auto got = grads(true, bias, gx, gw, gb), want = grads(false, bias, gx, gw, gb);
      for (int i = 0; i < 3; ++i) {
        ASSERT_EQ(got[i].defined(), want[i].defined()) << i;
        if (want[i].defined()) {
          EXPECT_TRUE(torch::allclose(got[i], want[i], 1e-5, 1e-5)) << i;
        }
      }
    }
  }
  // Without a graph (the engine, a reference forward inside a step) nothing is recorded.
  torch::NoGradGuard no_grad;
  EXPECT_FALSE(Linear(x0, w0.clone().requires_grad_(true), b0, true).requires_grad());
}

}  // namespace
}  // namespace bragg::engine
