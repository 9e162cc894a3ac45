#include "train/kernels/linear_cross_entropy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "engine/model/linear.h"

namespace bragg::train {
namespace {

namespace F = torch::nn::functional;

struct Inputs {
  torch::Tensor hidden, weight, labels;
};

Inputs Random(int64_t T, int64_t H, int64_t V, torch::Dtype dtype, uint64_t seed) {
  torch::manual_seed(seed);
  // Logits of a few units, as a trained model's: a peaked but not degenerate softmax.
  torch::Tensor h = torch::randn({T, H}) * 2.0;
  torch::Tensor w = torch::randn({V, H}) / std::sqrt(static_cast<double>(H));
  return {h.to(dtype), w.to(dtype), torch::randint(0, V, {T}, torch::kInt64)};
}

// The naive path: full logits, log_softmax, entropy = -sum p log p.
LinearCrossEntropyOutput Naive(const torch::Tensor& h, const torch::Tensor& w,
                               const torch::Tensor& labels, double temperature) {
  torch::Tensor z = F::linear(h, w).to(torch::kFloat32) / static_cast<float>(temperature);
  torch::Tensor logp = torch::log_softmax(z, 1);
  return {logp.gather(1, labels.unsqueeze(1)).squeeze(1), -(logp.exp() * logp).sum(1)};
}

// grad_hidden, grad_weight of sum(a * logprobs + b * entropy), either a or b may be undefined.
template <typename Fn>
std::pair<torch::Tensor, torch::Tensor> Grads(const Inputs& in, const torch::Tensor& a,
                                              const torch::Tensor& b, Fn fn) {
  torch::Tensor h = in.hidden.detach().clone().requires_grad_(true);
  torch::Tensor w = in.weight.detach().clone().requires_grad_(true);
  LinearCrossEntropyOutput out = fn(h, w);
  torch::Tensor loss = torch::zeros({}, torch::kFloat32);
  if (a.defined()) {
    loss = loss + (a * out.logprobs).sum();
  }
  if (b.defined()) {
    loss = loss + (b * out.entropy).sum();
  }
  loss.backward();
  return {h.grad().to(torch::kFloat32), w.grad().to(torch::kFloat32)};
}

// max |x - y| / max(max |y|, floor)
double RelErr(const torch::Tensor& x, const torch::Tensor& y, double floor = 1e-30) {
  double scale = std::max(y.abs().max().item<double>(), floor);
  return (x.to(torch::kFloat64) - y.to(torch::kFloat64)).abs().max().item<double>() / scale;
}

// max over elements of |x - y| / max(|y|, 1)
double ElementRelErr(const torch::Tensor& x, const torch::Tensor& y) {
  torch::Tensor xd = x.to(torch::kFloat64), yd = y.to(torch::kFloat64);
  return ((xd - yd).abs() / yd.abs().clamp_min(1.0)).max().item<double>();
}

struct Case {
  int64_t T, H, V, token_chunk, vocab_chunk;
  double temperature;
};

class AgainstNaive : public testing::TestWithParam<Case> {};

TEST_P(AgainstNaive, Float32OutputsAndGradients) {
  const Case c = GetParam();
  Inputs in = Random(c.T, c.H, c.V, torch::kFloat32, 1234);
  LinearCrossEntropyOptions o{c.token_chunk, c.vocab_chunk, c.temperature, false};
  LinearCrossEntropyOutput ours = LinearCrossEntropy(in.hidden, in.weight, in.labels, o);
  LinearCrossEntropyOutput naive = Naive(in.hidden, in.weight, in.labels, c.temperature);
  ASSERT_EQ(ours.logprobs.sizes(), naive.logprobs.sizes());
  ASSERT_EQ(ours.logprobs.scalar_type(), torch::kFloat32);
  ASSERT_EQ(ours.entropy.scalar_type(), torch::kFloat32);
  EXPECT_LE(ElementRelErr(ours.logprobs, naive.logprobs), 1e-6);
  EXPECT_LE(ElementRelErr(ours.entropy, naive.entropy), 2e-6);

  torch::manual_seed(99);
  torch::Tensor a = torch::randn({c.T}), b = torch::randn({c.T});
  auto [gh, gw] = Grads(in, a, b, [&](const torch::Tensor& h, const torch::Tensor& w) {
    return LinearCrossEntropy(h, w, in.labels, o);
  });
  auto [nh, nw] = Grads(in, a, b, [&](const torch::Tensor& h, const torch::Tensor& w) {
    return Naive(h, w, in.labels, c.temperature);
  });
  EXPECT_LE(RelErr(gh, nh), 1e-5);
  EXPECT_LE(RelErr(gw, nw), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Chunks, AgainstNaive,
    testing::Values(Case{100, 32, 300, 1024, 0, 1.0},    // one chunk, whole vocabulary
                    Case{100, 32, 300, 16, 0, 0.7},      // T not a multiple of the chunk
                    Case{100, 32, 300, 16, 64, 0.7},     // vocab chunks, V not a multiple
                    Case{37, 48, 1000, 7, 999, 1.3},     // a last vocab chunk of one column
                    Case{33, 16, 257, 1, 1, 1.0},        // one row, one column at a time
                    Case{64, 64, 4096, 32, 512, 1.0}));  // a wider vocabulary

TEST(LinearCrossEntropy, Bfloat16AgainstNaive) {
  for (int64_t vocab_chunk : {0, 100}) {
    Inputs in = Random(70, 64, 500, torch::kBFloat16, 7);
    LinearCrossEntropyOptions o{32, vocab_chunk, 0.9, false};
    LinearCrossEntropyOutput ours = LinearCrossEntropy(in.hidden, in.weight, in.labels, o);
    LinearCrossEntropyOutput naive = Naive(in.hidden, in.weight, in.labels, 0.9);
    // The same bf16 logits (same GEMM rows) go into both: the rest is float32 on both sides.
    EXPECT_LE(ElementRelErr(ours.logprobs, naive.logprobs), 1e-5) << vocab_chunk;
    EXPECT_LE(ElementRelErr(ours.entropy, naive.entropy), 1e-5) << vocab_chunk;

    torch::manual_seed(5);
    torch::Tensor a = torch::randn({70}), b = torch::randn({70});
    auto [gh, gw] = Grads(in, a, b, [&](const torch::Tensor& h, const torch::Tensor& w) {
      return LinearCrossEntropy(h, w, in.labels, o);
    });
    EXPECT_EQ(gh.sizes(), in.hidden.sizes());
    // The naive gradient of bf16 leaves goes through bf16 GEMMs; ours accumulate in float32.
    // Both against a float64 reference on the same (bf16-valued) inputs.
    Inputs in64{in.hidden.to(torch::kFloat64), in.weight.to(torch::kFloat64), in.labels};
    auto [rh, rw] =
        Grads(in64, a.to(torch::kFloat64), b.to(torch::kFloat64),
              [&](const torch::Tensor& h, const torch::Tensor& w) {
                torch::Tensor logp = torch::log_softmax(F::linear(h, w) / 0.9, 1);
                return LinearCrossEntropyOutput{logp.gather(1, in.labels.unsqueeze(1)).squeeze(1),
                                                -(logp.exp() * logp).sum(1)};
              });
    EXPECT_LE(RelErr(gh, rh), 3e-2) << vocab_chunk;
    EXPECT_LE(RelErr(gw, rw), 3e-2) << vocab_chunk;
  }
}

TEST(LinearCrossEntropy, GradientsFromOneOutputOnly) {
  Inputs in = Random(50, 16, 200, torch::kFloat32, 3);
  LinearCrossEntropyOptions o{16, 64, 1.0, false};
  torch::manual_seed(4);
  torch::Tensor a = torch::randn({50});
  for (bool logprob_only : {true, false}) {
    torch::Tensor ga = logprob_only ? a : torch::Tensor();
    torch::Tensor gb = logprob_only ? torch::Tensor() : a;
    auto [gh, gw] = Grads(in, ga, gb, [&](const torch::Tensor& h, const torch::Tensor& w) {
      return LinearCrossEntropy(h, w, in.labels, o);
    });
    auto [nh, nw] = Grads(in, ga, gb, [&](const torch::Tensor& h, const torch::Tensor& w) {
      return Naive(h, w, in.labels, 1.0);
    });
    EXPECT_LE(RelErr(gh, nh), 1e-5) << logprob_only;
    EXPECT_LE(RelErr(gw, nw), 1e-5) << logprob_only;
  }
}

// Central finite differences of the op itself (float32, so a loose bound) on a tiny case: checks
// the backward formula independently of torch's autograd.
TEST(LinearCrossEntropy, FiniteDifferences) {
  Inputs in = Random(3, 4, 5, torch::kFloat32, 11);
  in.hidden = in.hidden * 0.5;
  torch::Tensor a = torch::tensor({0.3f, -1.1f, 0.7f}), b = torch::tensor({-0.4f, 0.9f, 0.2f});
  LinearCrossEntropyOptions o{2, 2, 0.8, false};
  auto loss = [&](const torch::Tensor& h, const torch::Tensor& w) {
    LinearCrossEntropyOutput out = LinearCrossEntropy(h, w, in.labels, o);
    return ((a * out.logprobs).sum() + (b * out.entropy).sum()).item<double>();
  };
  auto [gh, gw] = Grads(in, a, b, [&](const torch::Tensor& h, const torch::Tensor& w) {
    return LinearCrossEntropy(h, w, in.labels, o);
  });
  const float eps = 1e-2f;
  for (bool wrt_weight : {false, true}) {
    torch::Tensor x = wrt_weight ? in.weight : in.hidden;
    torch::Tensor g = wrt_weight ? gw : gh;
    for (int64_t i = 0; i < x.numel(); ++i) {
      torch::Tensor plus = x.clone(), minus = x.clone();
      plus.view(-1)[i] += eps;
      minus.view(-1)[i] -= eps;
      double fd = wrt_weight ? (loss(in.hidden, plus) - loss(in.hidden, minus)) / (2 * eps)
                             : (loss(plus, in.weight) - loss(minus, in.weight)) / (2 * eps);
      EXPECT_NEAR(g.view(-1)[i].item<double>(), fd, 2e-3)
          << (wrt_weight ? "weight " : "hidden ") << i;
    }
  }
}

// The engine's arithmetic, copied from src/engine/model/model.cc (the lm_head call) and
// src/engine/sampler.cc (LogProb): a token's hidden row alone through the deterministic Linear,
// then max and log-sum-exp in double in index order.
float EngineLogProb(const torch::Tensor& hs_row, const torch::Tensor& lm_head, float temperature,
                    int64_t token) {
  torch::Tensor logits =
      engine::Linear(hs_row, lm_head, {}, /*deterministic=*/true).to(torch::kFloat32).contiguous();
  const float* l = logits.data_ptr<float>();
  const int64_t n = logits.numel();
  double t = temperature > 0 ? temperature : 1.0;
  double m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    m = std::max(m, static_cast<double>(l[i]) / t);
  }
  double s = 0;
  for (int64_t i = 0; i < n; ++i) {
    s += std::exp(static_cast<double>(l[i]) / t - m);
  }
  double lse = m + std::log(s);
  return static_cast<float>(static_cast<double>(l[token]) / t - lse);
}

TEST(LinearCrossEntropy, DeterministicEqualsTheEngineBitwise) {
  for (torch::Dtype dtype : {torch::kFloat32, torch::kBFloat16}) {
    constexpr int64_t kRows = 65;
    // 65 rows: chunks of 32 and 64 leave a last chunk of one row (where BLAS alone may take
    // another kernel than for a full tile), chunk 1024 holds them all in one call.
    Inputs in = Random(kRows, 64, 1000, dtype, 21);
    for (float temperature : {1.0f, 0.7f}) {
      std::vector<float> engine(kRows);
      for (int64_t r = 0; r < kRows; ++r) {
        engine[r] = EngineLogProb(in.hidden.narrow(0, r, 1), in.weight, temperature,
                                  in.labels[r].item<int64_t>());
      }
      for (int64_t chunk : {32, 64, 1024}) {
        // The trainer's temperature is a double: 0.7 must mean the engine's 0.7f.
        LinearCrossEntropyOptions o{chunk, 0, temperature == 0.7f ? 0.7 : 1.0, true};
        LinearCrossEntropyOutput ours = LinearCrossEntropy(in.hidden, in.weight, in.labels, o);
        const float* lp = ours.logprobs.data_ptr<float>();
        int64_t differ = 0;
        for (int64_t r = 0; r < kRows; ++r) {
          differ += lp[r] != engine[r];  // bitwise: no tolerance
          if (lp[r] != engine[r] && differ <= 3) {
            ADD_FAILURE() << "row " << r << " chunk " << chunk << " T " << temperature << " dtype "
                          << dtype << ": " << lp[r] << " vs engine " << engine[r];
          }
        }
        EXPECT_EQ(differ, 0);
      }
    }
  }
}

TEST(LinearCrossEntropy, DeterministicDoesNotDependOnTheRowsAround) {
  Inputs in = Random(96, 32, 700, torch::kFloat32, 8);
  LinearCrossEntropyOptions o{32, 0, 1.0, true};
  LinearCrossEntropyOutput all = LinearCrossEntropy(in.hidden, in.weight, in.labels, o);
  // The same rows, reversed and then batched alone in a chunk of 64.
  torch::Tensor rev = torch::arange(95, -1, -1, torch::kInt64);
  LinearCrossEntropyOutput reversed =
      LinearCrossEntropy(in.hidden.index_select(0, rev), in.weight, in.labels.index_select(0, rev),
                         {64, 0, 1.0, true});
  EXPECT_TRUE(torch::equal(all.logprobs, reversed.logprobs.index_select(0, rev)));
  EXPECT_TRUE(torch::equal(all.entropy, reversed.entropy.index_select(0, rev)));
  // And the deterministic entropy is still the entropy.
  LinearCrossEntropyOutput naive = Naive(in.hidden, in.weight, in.labels, 1.0);
  EXPECT_LE(ElementRelErr(all.entropy, naive.entropy), 2e-6);
}

TEST(LinearCrossEntropy, DeterministicGradientsMatchNaive) {
  Inputs in = Random(40, 16, 300, torch::kFloat32, 9);
  torch::manual_seed(10);
  torch::Tensor a = torch::randn({40}), b = torch::randn({40});
  auto [gh, gw] = Grads(in, a, b, [&](const torch::Tensor& h, const torch::Tensor& w) {
    return LinearCrossEntropy(h, w, in.labels, {32, 0, 0.7, true});
  });
  auto [nh, nw] = Grads(in, a, b, [&](const torch::Tensor& h, const torch::Tensor& w) {
    return Naive(h, w, in.labels, 0.7);
  });
  EXPECT_LE(RelErr(gh, nh), 1e-5);
  EXPECT_LE(RelErr(gw, nw), 1e-5);
}

TEST(LinearCrossEntropy, EmptyBatch) {
  Inputs in = Random(0, 8, 10, torch::kFloat32, 1);
  torch::Tensor w = in.weight.clone().requires_grad_(true);
  LinearCrossEntropyOutput out = LinearCrossEntropy(in.hidden, w, in.labels, {});
  EXPECT_EQ(out.logprobs.sizes(), torch::IntArrayRef({0}));
  EXPECT_EQ(out.entropy.sizes(), torch::IntArrayRef({0}));
  EXPECT_EQ(out.logprobs.scalar_type(), torch::kFloat32);
  (out.logprobs.sum() + out.entropy.sum()).backward();
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().abs().sum().item<float>(), 0.0f);
}

// The error of TryLinearCrossEntropy and of LinearCrossEntropy's exception for bad input.
std::string ErrorOf(const torch::Tensor& h, const torch::Tensor& w, const torch::Tensor& labels,
                    const LinearCrossEntropyOptions& o = {}) {
  Result<LinearCrossEntropyOutput> r = TryLinearCrossEntropy(h, w, labels, o);
  EXPECT_FALSE(r.ok());
  if (r.ok()) {
    return "";
  }
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THROW(LinearCrossEntropy(h, w, labels, o), c10::Error);
  try {
    LinearCrossEntropy(h, w, labels, o);
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), testing::HasSubstr(std::string(r.status().message())));
  }
  return std::string(r.status().message());
}

TEST(LinearCrossEntropy, HostileInputsNameWhatIsWrong) {
  using testing::HasSubstr;
  Inputs in = Random(20, 8, 256, torch::kFloat32, 2);
  torch::Tensor labels = in.labels.clone();
  labels[17] = 300;
  EXPECT_THAT(ErrorOf(in.hidden, in.weight, labels),
              HasSubstr("labels[17] = 300 is outside the vocabulary (V = 256)"));
  labels = in.labels.clone();
  labels[3] = -1;
  labels[9] = -5;
  EXPECT_THAT(ErrorOf(in.hidden, in.weight, labels),
              HasSubstr("labels[3] = -1 is outside the vocabulary (V = 256)"));
  labels = in.labels.clone();
  labels[0] = 256;
  EXPECT_THAT(ErrorOf(in.hidden, in.weight, labels), HasSubstr("labels[0] = 256"));

  EXPECT_THAT(ErrorOf(in.hidden, torch::randn({256, 9}), in.labels), HasSubstr("disagree on H"));
  EXPECT_THAT(ErrorOf(in.hidden.view({20, 2, 4}), in.weight, in.labels),
              HasSubstr("hidden must be [T, H], got [20, 2, 4]"));
  EXPECT_THAT(ErrorOf(in.hidden, in.weight.view({-1}), in.labels),
              HasSubstr("weight must be [V, H]"));
  EXPECT_THAT(ErrorOf(in.hidden, in.weight, in.labels.narrow(0, 0, 19)),
              HasSubstr("labels must be [T] = [20]"));
  EXPECT_THAT(ErrorOf(in.hidden, in.weight, in.labels.to(torch::kInt32)),
              HasSubstr("labels must be int64"));
  EXPECT_THAT(ErrorOf(in.hidden, in.weight.to(torch::kBFloat16), in.labels),
              HasSubstr("give both the same dtype"));
  EXPECT_THAT(ErrorOf(in.hidden.to(torch::kFloat64), in.weight.to(torch::kFloat64), in.labels),
              HasSubstr("float32 or bfloat16"));
  EXPECT_THAT(ErrorOf(in.hidden, in.weight.narrow(0, 0, 0), torch::zeros({20}, torch::kInt64)),
              HasSubstr("V = 0"));
  EXPECT_THAT(ErrorOf(in.hidden, in.weight, in.labels, {0, 0, 1.0, false}),
              HasSubstr("token_chunk must be positive"));
  EXPECT_THAT(ErrorOf(in.hidden, in.weight, in.labels, {32, -1, 1.0, false}),
              HasSubstr("vocab_chunk"));
  EXPECT_THAT(ErrorOf(in.hidden, in.weight, in.labels, {32, 0, 0.0, false}),
              HasSubstr("temperature must be a positive float"));
  EXPECT_THAT(ErrorOf(in.hidden, in.weight, in.labels, {32, 0, NAN, false}),
              HasSubstr("temperature"));
  EXPECT_THAT(ErrorOf(in.hidden, in.weight, in.labels, {33, 0, 1.0, true}),
              HasSubstr("multiple of 4"));
  EXPECT_THAT(ErrorOf(in.hidden, in.weight, in.labels, {32, 64, 1.0, true}),
              HasSubstr("set vocab_chunk = 0"));
  EXPECT_THAT(ErrorOf(torch::Tensor(), in.weight, in.labels), HasSubstr("defined"));
}

TEST(LinearCrossEntropy, NonContiguousInputs) {
  Inputs in = Random(30, 16, 100, torch::kFloat32, 12);
  torch::Tensor ht = in.hidden.t().contiguous().t();  // same values, column-major strides
  ASSERT_FALSE(ht.is_contiguous());
  LinearCrossEntropyOutput a = LinearCrossEntropy(ht, in.weight, in.labels, {8, 32, 1.0, false});
  LinearCrossEntropyOutput b =
      LinearCrossEntropy(in.hidden, in.weight, in.labels, {8, 32, 1.0, false});
  EXPECT_TRUE(torch::equal(a.logprobs, b.logprobs));
}

}  // namespace
}  // namespace bragg::train
