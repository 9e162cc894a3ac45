// OffloadAdamW against torch's AdamW: bitwise over 100 steps whatever the chunking, with weight
// decay, clipping, bfloat16 parameters, skipped parameters and a checkpoint in the middle; the
// workspace bound; hostile input. The Python side (torch 2.9.1 itself) is adamw_torch_test.py.

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "train/optim/offload_adamw.h"

namespace bragg::train {
namespace {

using NamedParams = std::vector<std::pair<std::string, torch::Tensor>>;

const std::vector<std::vector<int64_t>> kShapes = {{30, 100}, {777}, {1}};

NamedParams MakeParams(torch::ScalarType dtype = torch::kFloat, uint64_t seed = 1) {
  torch::manual_seed(seed);
  NamedParams out;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    out.emplace_back("p" + std::to_string(i),
                     torch::randn(kShapes[i]).to(dtype).set_requires_grad(true));
  }
  return out;
}

// The grads of step `step` (1-based): deterministic; a parameter with `skip(step, i)` gets none.
std::vector<torch::Tensor> MakeGrads(int step, torch::ScalarType dtype = torch::kFloat,
                                     double scale = 1.0, bool (*skip)(int, size_t) = nullptr) {
  torch::manual_seed(1000 + step);
  std::vector<torch::Tensor> out;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    torch::Tensor g = (torch::randn(kShapes[i]) * scale).to(dtype);
    out.push_back(skip && skip(step, i) ? torch::Tensor() : g);
  }
  return out;
}

void SetGrads(const NamedParams& params, const std::vector<torch::Tensor>& grads) {
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].second.mutable_grad() = grads[i].defined() ? grads[i].clone() : torch::Tensor();
  }
}

// torch 2.9.1's `_single_tensor_adam` (decoupled weight decay, FP32, whole parameters), written
// op for op with libtorch's ops: the reference the chunked optimizer must equal bitwise.
struct ReferenceAdamW {
  AdamWOptions o;
  std::vector<torch::Tensor> params, exp_avg, exp_avg_sq;
  std::vector<int64_t> steps;

  ReferenceAdamW(const NamedParams& init, const AdamWOptions& options) : o(options) {
    for (const auto& [name, p] : init) {
      params.push_back(p.detach().to(torch::kFloat).clone());
      exp_avg.push_back(torch::zeros_like(params.back()));
      exp_avg_sq.push_back(torch::zeros_like(params.back()));
      steps.push_back(0);
    }
  }
  void Step(std::vector<torch::Tensor> grads) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (!grads[i].defined()) {
        continue;
      }
      torch::Tensor grad = grads[i];
      torch::Tensor& param = params[i];
      const double step = static_cast<double>(++steps[i]);
      if (o.weight_decay != 0) {
        param.mul_(1 - o.lr * o.weight_decay);
      }
      exp_avg[i].lerp_(grad, 1 - o.beta1);
      exp_avg_sq[i].mul_(o.beta2).addcmul_(grad, grad, 1 - o.beta2);
      const double bias_correction1 = 1 - std::pow(o.beta1, step);
      const double bias_correction2 = 1 - std::pow(o.beta2, step);
      const double step_size = o.lr / bias_correction1;
      const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
      torch::Tensor denom = (exp_avg_sq[i].sqrt() / bias_correction2_sqrt).add_(o.eps);
      param.addcdiv_(exp_avg[i], denom, -step_size);
    }
  }
};

std::map<std::string, torch::Tensor> StateMap(const OffloadAdamW& opt) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : opt.StateTensors()) {
    out[name] = t.clone();
  }
  return out;
}

// Bitwise: the parameters, masters and moments of `opt` against the reference.
void ExpectBitwise(const NamedParams& params, const OffloadAdamW& opt, const ReferenceAdamW& ref) {
  auto state = StateMap(opt);
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params[i].first;
    EXPECT_TRUE(torch::equal(state.at(name + ".master"), ref.params[i])) << name;
    EXPECT_TRUE(torch::equal(state.at(name + ".exp_avg"), ref.exp_avg[i])) << name;
    EXPECT_TRUE(torch::equal(state.at(name + ".exp_avg_sq"), ref.exp_avg_sq[i])) << name;
    EXPECT_TRUE(torch::equal(params[i].second.detach(), ref.params[i])) << name;
    EXPECT_EQ(state.at(name + ".step").item<float>(), static_cast<float>(ref.steps[i])) << name;
  }
}

// Largest distance in units in the last place between two float tensors of the same shape.
int64_t MaxUlp(const torch::Tensor& a, const torch::Tensor& b) {
  auto key = [](const torch::Tensor& t) {
    torch::Tensor i = t.contiguous().view(torch::kInt).to(torch::kLong);
    // Map the sign-magnitude bit patterns onto a monotonic integer line.
    return torch::where(i < 0, -(i & 0x7fffffff), i);
  };
  return (key(a) - key(b)).abs().max().item<int64_t>();
}

struct Case {
  int64_t chunk;
  int steps;
  double weight_decay;
};

class ChunkedEqualsTorch : public ::testing::TestWithParam<Case> {};

TEST_P(ChunkedEqualsTorch, BitwiseOverSteps) {
  const Case c = GetParam();
  AdamWOptions o;
  o.chunk_elements = c.chunk;
  o.weight_decay = c.weight_decay;
  NamedParams params = MakeParams();
  ReferenceAdamW ref(params, o);
  auto opt = OffloadAdamW::Create(params, o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  for (int step = 1; step <= c.steps; ++step) {
    auto grads = MakeGrads(step);
    SetGrads(params, grads);
    auto stats = (*opt)->Step();
    ASSERT_TRUE(stats.ok()) << stats.status();
    ref.Step(grads);
  }
  EXPECT_EQ((*opt)->step(), c.steps);
  ExpectBitwise(params, **opt, ref);
}

INSTANTIATE_TEST_SUITE_P(Chunks, ChunkedEqualsTorch,
                         ::testing::Values(Case{1000, 100, 0.01}, Case{333, 100, 0.01},
                                           Case{1 << 22, 100, 0.01}, Case{1000, 100, 0.0},
                                           Case{3778, 100, 0.1}, Case{1, 3, 0.01}));

TEST(OffloadAdamW, ClippingEqualsClipGradNormThenAdamW) {
  AdamWOptions o;
  o.chunk_elements = 1000;
  o.max_grad_norm = 1.0;
  NamedParams params = MakeParams();
  ReferenceAdamW ref(params, o);
  std::vector<torch::Tensor> ref_leaves;
  for (auto& p : ref.params) {
    ref_leaves.push_back(p);
  }
  auto opt = OffloadAdamW::Create(params, o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  int clipped = 0;
  for (int step = 1; step <= 100; ++step) {
    // Some steps far above the norm (clipped), some below (scale 1/200: norm about 0.3).
    auto grads = MakeGrads(step, torch::kFloat, step % 3 == 0 ? 1.0 / 200 : 1.0);
    SetGrads(params, grads);
    auto stats = (*opt)->Step();
    ASSERT_TRUE(stats.ok()) << stats.status();
    for (size_t i = 0; i < ref_leaves.size(); ++i) {
      ref_leaves[i].mutable_grad() = grads[i].clone();
    }
    const double norm = torch::nn::utils::clip_grad_norm_(ref_leaves, o.max_grad_norm);
    EXPECT_EQ(stats->grad_norm, norm) << "step " << step;
    clipped += norm > o.max_grad_norm;
    std::vector<torch::Tensor> clipped_grads;
    for (auto& leaf : ref_leaves) {
      clipped_grads.push_back(leaf.grad());
    }
    ref.Step(clipped_grads);
  }
  EXPECT_GT(clipped, 30);
  EXPECT_LT(clipped, 100);
  ExpectBitwise(params, **opt, ref);
}

// A learning-rate schedule through set_lr(): torch reads group["lr"] at every step, so do we.
TEST(OffloadAdamW, SetLrFollowsASchedule) {
  AdamWOptions o;
  o.chunk_elements = 1000;
  NamedParams params = MakeParams();
  ReferenceAdamW ref(params, o);
  auto opt = OffloadAdamW::Create(params, o);
  ASSERT_TRUE(opt.ok());
  for (int step = 1; step <= 50; ++step) {
    const double lr = 1e-3 * std::cos(step / 50.0) + 1e-5 * step;  // warm-up-and-decay-like
    (*opt)->set_lr(lr);
    ref.o.lr = lr;
    auto grads = MakeGrads(step);
    SetGrads(params, grads);
    ASSERT_TRUE((*opt)->Step().ok());
    ref.Step(grads);
  }
  EXPECT_EQ((*opt)->lr(), ref.o.lr);
  ExpectBitwise(params, **opt, ref);
}

bool SkipP1OnEvenSteps(int step, size_t i) { return i == 1 && step % 2 == 0; }

TEST(OffloadAdamW, ParamWithoutGradIsSkippedAsTorchDoes) {
  AdamWOptions o;
  o.chunk_elements = 1000;  // p1 (777 elements) shares chunks with p0 and p2
  NamedParams params = MakeParams();
  ReferenceAdamW ref(params, o);
  auto opt = OffloadAdamW::Create(params, o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  for (int step = 1; step <= 20; ++step) {
    auto grads = MakeGrads(step, torch::kFloat, 1.0, SkipP1OnEvenSteps);
    SetGrads(params, grads);
    ASSERT_TRUE((*opt)->Step().ok());
    ref.Step(grads);
  }
  EXPECT_EQ(ref.steps[1], 10);
  ExpectBitwise(params, **opt, ref);
}

// bfloat16 parameters and grads: the FP32 master follows the FP32 reference started from the
// bf16 values and fed the bf16 grads (upcast, exact); the parameter is the master rounded to bf16.
TEST(OffloadAdamW, Bfloat16ParamsKeepAnFp32MasterEqualToTheFp32Reference) {
  AdamWOptions o;
  o.chunk_elements = 1000;
  NamedParams params = MakeParams(torch::kBFloat16);
  ReferenceAdamW ref(params, o);
  auto opt = OffloadAdamW::Create(params, o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  for (int step = 1; step <= 100; ++step) {
    auto grads = MakeGrads(step, torch::kBFloat16);
    SetGrads(params, grads);
    ASSERT_TRUE((*opt)->Step().ok());
    std::vector<torch::Tensor> fp32;
    for (auto& g : grads) {
      fp32.push_back(g.to(torch::kFloat));
    }
    ref.Step(fp32);
  }
  auto state = StateMap(**opt);
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params[i].first;
    EXPECT_TRUE(torch::equal(state.at(name + ".master"), ref.params[i])) << name;
    EXPECT_TRUE(torch::equal(params[i].second.detach(), ref.params[i].to(torch::kBFloat16)))
        << name;
    EXPECT_EQ(params[i].second.scalar_type(), torch::kBFloat16);
  }
}

TEST(OffloadAdamW, SaveAndRestoreContinuesBitwise) {
  AdamWOptions o;
  o.chunk_elements = 1000;
  o.max_grad_norm = 5.0;
  NamedParams params = MakeParams();
  auto whole = OffloadAdamW::Create(params, o);
  ASSERT_TRUE(whole.ok());
  std::map<std::string, torch::Tensor> saved;
  for (int step = 1; step <= 100; ++step) {
    SetGrads(params, MakeGrads(step, torch::kFloat, 1.0, SkipP1OnEvenSteps));
    ASSERT_TRUE((*whole)->Step().ok());
    if (step == 51) {
      saved = StateMap(**whole);
    }
  }
  // A fresh model (other weights) and optimizer, restored from step 51, with another chunking.
  NamedParams resumed = MakeParams(torch::kFloat, /*seed=*/7);
  o.chunk_elements = 333;
  auto opt = OffloadAdamW::Create(resumed, o);
  ASSERT_TRUE(opt.ok());
  ASSERT_TRUE((*opt)->LoadState(saved, 51).ok());
  EXPECT_EQ((*opt)->step(), 51);
  EXPECT_TRUE(torch::equal(resumed[0].second.detach(), saved.at("p0.master")));
  for (int step = 52; step <= 100; ++step) {
    SetGrads(resumed, MakeGrads(step, torch::kFloat, 1.0, SkipP1OnEvenSteps));
    ASSERT_TRUE((*opt)->Step().ok());
  }
  auto a = StateMap(**whole);
  auto b = StateMap(**opt);
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    EXPECT_TRUE(torch::equal(t, b.at(name))) << name;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::equal(params[i].second.detach(), resumed[i].second.detach()));
  }
}

// libtorch 1.13's own C++ AdamW computes exp_avg as mul_(beta1).add_(grad, 1 - beta1) rather than
// lerp_ (torch 2.x): not bitwise equal. The gap is measured and bounded here (README.md).
TEST(OffloadAdamW, Libtorch113AdamWDiffersByAFewUlp) {
  AdamWOptions o;
  o.chunk_elements = 1000;
  NamedParams params = MakeParams();
  std::vector<torch::Tensor> leaves;
  for (auto& [name, p] : params) {
    leaves.push_back(p.detach().clone().set_requires_grad(true));
  }
  torch::optim::AdamW torch_adamw(leaves, torch::optim::AdamWOptions(o.lr)
                                              .betas({o.beta1, o.beta2})
                                              .eps(o.eps)
                                              .weight_decay(o.weight_decay));
  auto opt = OffloadAdamW::Create(params, o);
  ASSERT_TRUE(opt.ok());
  for (int step = 1; step <= 100; ++step) {
    auto grads = MakeGrads(step);
    SetGrads(params, grads);
    ASSERT_TRUE((*opt)->Step().ok());
    for (size_t i = 0; i < leaves.size(); ++i) {
      leaves[i].mutable_grad() = grads[i].clone();
    }
    torch_adamw.step();
  }
  int64_t max_ulp = 0;
  int64_t differing = 0;
  for (size_t i = 0; i < leaves.size(); ++i) {
    max_ulp = std::max(max_ulp, MaxUlp(params[i].second.detach(), leaves[i].detach()));
    differing += (params[i].second.detach() != leaves[i].detach()).sum().item<int64_t>();
  }
  std::printf(
      "libtorch 1.13 torch::optim::AdamW vs OffloadAdamW after 100 steps: %lld of %lld "
      "params differ, max %lld ulp\n",
      static_cast<long long>(differing), static_cast<long long>(3778),
      static_cast<long long>(max_ulp));
  RecordProperty("libtorch113_max_ulp", static_cast<int>(max_ulp));
  EXPECT_LE(max_ulp, 64);
}

// Counts the bytes the CPU allocator hands out while installed: the optimizer must not allocate
// chunk- or parameter-sized tensors during a step (the workspace is made once, at Create).
class CountingAllocator : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) const override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    live_ += static_cast<int64_t>(n);
    int64_t live = live_.load();
    int64_t peak = peak_.load();
    while (live > peak && !peak_.compare_exchange_weak(peak, live)) {
    }
    auto* ctx = new Ctx{std::move(inner), static_cast<int64_t>(n), this};
    return c10::DataPtr(data, ctx, &Delete, device);
  }
  void Reset() {
    peak_ = live_.load();
    base_live_ = live_.load();
  }
  int64_t PeakAboveReset() const { return peak_.load() - base_live_; }

 private:
  struct Ctx {
    c10::DataPtr inner;
    int64_t n;
    const CountingAllocator* owner;
  };
  static void Delete(void* p) {
    auto* ctx = static_cast<Ctx*>(p);
    ctx->owner->live_ -= ctx->n;
    delete ctx;
  }
  c10::Allocator* base_;
  mutable std::atomic<int64_t> live_{0};
  mutable std::atomic<int64_t> peak_{0};
  int64_t base_live_ = 0;
};

TEST(OffloadAdamW, WorkspaceIsTwoChunksAndAStepAllocatesNoChunk) {
  NamedParams params = MakeParams();
  const int64_t total = 3778;
  for (int64_t chunk : {int64_t{1}, int64_t{1000}, int64_t{1} << 22}) {
    AdamWOptions o;
    o.chunk_elements = chunk;
    auto opt = OffloadAdamW::Create(params, o);
    ASSERT_TRUE(opt.ok());
    EXPECT_EQ((*opt)->workspace_bytes(), 2 * 4 * 4 * std::min(chunk, total)) << chunk;
    EXPECT_EQ((*opt)->state_bytes(), 12 * total);
  }
  c10::Allocator* base = c10::GetCPUAllocator();
  static CountingAllocator counting(base);  // outlives every tensor it allocated
  c10::SetCPUAllocator(&counting, /*priority=*/100);
  AdamWOptions o;
  o.chunk_elements = 1000;
  o.max_grad_norm = 1.0;
  auto opt = OffloadAdamW::Create(params, o);
  ASSERT_TRUE(opt.ok());
  int64_t peak = 0;
  for (int step = 1; step <= 3; ++step) {
    SetGrads(params, MakeGrads(step));
    counting.Reset();
    auto stats = (*opt)->Step();
    ASSERT_TRUE(stats.ok());
    peak = std::max(peak, counting.PeakAboveReset());
    EXPECT_EQ(stats->chunks, 4);
    EXPECT_LE(stats->peak_workspace_bytes, (*opt)->workspace_bytes() + 64);
    // state 3 * 4 bytes per element both ways, grads in, params out.
    EXPECT_EQ(stats->bytes_streamed, 2 * 12 * total + 2 * 4 * total);
  }
  c10::SetCPUAllocator(base, /*priority=*/100);
  std::printf(
      "bytes allocated during a step (peak above the start): %lld; one chunk of state "
      "is %lld\n",
      static_cast<long long>(peak), static_cast<long long>(4 * 1000));
  EXPECT_GT(peak, 0);         // the counter sees the clipping norms...
  EXPECT_LT(peak, 4 * 1000);  // ...and nothing the size of a chunk
}

TEST(OffloadAdamWHostile, BadParamsAreRefusedWithTheirName) {
  AdamWOptions o;
  auto err = [&](NamedParams p) { return OffloadAdamW::Create(std::move(p), o).status(); };
  EXPECT_EQ(err({}).code(), absl::StatusCode::kInvalidArgument);
  auto a = torch::zeros({4}).set_requires_grad(true);
  auto b = torch::zeros({4}).set_requires_grad(true);
  Status s = err({{"w", a}, {"w", b}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'w' is named twice"), std::string::npos) << s;
  s = err({{"w", a}, {"v", a}});
  EXPECT_NE(s.message().find("shares its memory"), std::string::npos) << s;
  s = err({{"d", torch::zeros({4}, torch::kDouble).set_requires_grad(true)}});
  EXPECT_NE(s.message().find("'d' has dtype Double"), std::string::npos) << s;
  s = err({{"t", torch::zeros({4, 3}).t().set_requires_grad(true)}});
  EXPECT_NE(s.message().find("'t' is not contiguous"), std::string::npos) << s;
  s = err({{"f", torch::zeros({4})}});
  EXPECT_NE(s.message().find("'f' does not require grad"), std::string::npos) << s;
  o.chunk_elements = 0;
  EXPECT_EQ(err({{"w", a}}).code(), absl::StatusCode::kInvalidArgument);
  o.chunk_elements = 16;
  o.beta2 = 1.0;
  EXPECT_EQ(err({{"w", a}}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(OffloadAdamWHostile, CudaDeviceWithoutCudaIsAFailedPrecondition) {
  if (torch::cuda::is_available()) {
    GTEST_SKIP() << "this libtorch has CUDA and a GPU: the refusal cannot be seen here";
  }
  AdamWOptions o;
  o.device = torch::Device(torch::kCUDA);
  Status s = OffloadAdamW::Create({{"w", torch::zeros({4}).set_requires_grad(true)}}, o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("use the cpu device"), std::string::npos) << s;
}

TEST(OffloadAdamWHostile, ZeroElementParamsAreCarriedAlong) {
  NamedParams params = {{"empty", torch::zeros({0}).set_requires_grad(true)},
                        {"w", torch::ones({5}).set_requires_grad(true)},
                        {"empty2", torch::zeros({3, 0}).set_requires_grad(true)}};
  AdamWOptions o;
  o.chunk_elements = 2;
  auto opt = OffloadAdamW::Create(params, o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  for (auto& [name, p] : params) {
    p.mutable_grad() = torch::ones_like(p);
  }
  ASSERT_TRUE((*opt)->Step().ok());
  EXPECT_TRUE((params[1].second.detach() < 1).all().item<bool>());
  EXPECT_EQ((*opt)->StateTensors().size(), 12u);
}

TEST(OffloadAdamWHostile, NanGradWithClippingIsAnErrorAndChangesNothing) {
  AdamWOptions o;
  o.chunk_elements = 1000;
  o.max_grad_norm = 1.0;
  NamedParams params = MakeParams();
  auto opt = OffloadAdamW::Create(params, o);
  ASSERT_TRUE(opt.ok());
  SetGrads(params, MakeGrads(1));
  ASSERT_TRUE((*opt)->Step().ok());
  auto before = StateMap(**opt);
  std::vector<torch::Tensor> weights;
  for (auto& [name, p] : params) {
    weights.push_back(p.detach().clone());
  }
  for (float bad : {NAN, INFINITY}) {
    auto grads = MakeGrads(2);
    grads[1][5] = bad;
    SetGrads(params, grads);
    auto stats = (*opt)->Step();
    ASSERT_FALSE(stats.ok());
    EXPECT_EQ(stats.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(stats.status().message().find("global grad norm"), std::string::npos)
        << stats.status();
    EXPECT_EQ((*opt)->step(), 1);
    for (const auto& [name, t] : StateMap(**opt)) {
      EXPECT_TRUE(torch::equal(t, before.at(name))) << name;
    }
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(torch::equal(params[i].second.detach(), weights[i]));
    }
  }
}

TEST(OffloadAdamWHostile, WrongGradIsRefused) {
  NamedParams params = MakeParams();
  auto opt = OffloadAdamW::Create(params, AdamWOptions{});
  ASSERT_TRUE(opt.ok());
  SetGrads(params, MakeGrads(1));
  params[1].second.mutable_grad() = torch::zeros({776});
  auto stats = (*opt)->Step();
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(stats.status().message().find("grad of 'p1' is [776]"), std::string::npos)
      << stats.status();
  EXPECT_EQ((*opt)->step(), 0);
}

TEST(OffloadAdamWHostile, LoadStateChecksNamesAndShapes) {
  NamedParams params = MakeParams();
  auto opt = OffloadAdamW::Create(params, AdamWOptions{});
  ASSERT_TRUE(opt.ok());
  const auto good = StateMap(**opt);
  auto check = [&](std::map<std::string, torch::Tensor> state, const std::string& needle,
                   int64_t step = 3) {
    Status s = (*opt)->LoadState(state, step);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << needle;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s;
  };
  auto state = good;
  state["p1.exp_avg_sq"] = torch::zeros({778});
  check(state, "'p1.exp_avg_sq' is [778] Float; expected [777]");
  state = good;
  state["p0.master"] = torch::zeros({100, 30});
  check(state, "'p0.master' is [100, 30]");
  state = good;
  state["p2.exp_avg"] = torch::zeros({1}, torch::kDouble);
  check(state, "'p2.exp_avg' is [1] Double");
  state = good;
  state.erase("p1.master");
  check(state, "'p1.master' is missing");
  state = good;
  state["p9.master"] = torch::zeros({1});
  check(state, "'p9.master' names no parameter");
  state = good;
  state["p0.step"] = torch::tensor(2.5f);
  check(state, "'p0.step' is 2.5");
  check(good, "step -1 < 0", -1);
  EXPECT_EQ((*opt)->step(), 0);
  EXPECT_TRUE((*opt)->LoadState(good, 3).ok());
  EXPECT_EQ((*opt)->step(), 3);
}

}  // namespace
}  // namespace bragg::train
