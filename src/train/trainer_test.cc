// The trainer against the engine it trains for, on random tiny models (engine/testing):
// log-prob parity bit for bit in deterministic mode (dense and MoE, traces packed with others),
// router replay equal to the engine's recorded routing, packing invariance, learning (SFT and
// GRPO move the policy the right way), checkpoints (the engine loads them; resume is bit-exact)
// and hostile batches.

#include "train/trainer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <random>
#include <thread>

#include "common/fs.h"
#include "engine/engine.h"
#include "engine/model/checkpoint.h"
#include "engine/testing/tiny_model.h"
#include "train/safetensors_writer.h"

namespace bragg::train {
namespace {

using engine::GenerateOutput;
using engine::GenerateRequest;

class TrainerTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    auto dir = TempDir::Create("/tmp", "bragg-train-test-");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = std::move(*dir);
    spec_.moe = GetParam();
    spec_.vocab = 64;
    spec_.std = 0.3f;
    ASSERT_TRUE(engine::testing::WriteTinyModel(Path("v0"), spec_).ok());
  }

  std::string Path(const std::string& name) const { return dir_.path() + "/" + name; }

  TrainOptions Options(bool deterministic = true) const {
    TrainOptions o;
    o.model_dir = Path("v0");
    o.deterministic = deterministic;
    o.threads = 2;
    o.lr = 1e-2;
    o.max_tokens = 256;
    o.lce_token_chunk = 64;
    return o;
  }

  std::unique_ptr<Trainer> MakeTrainer(const TrainOptions& o) {
    auto t = Trainer::Create(o);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? std::move(*t) : nullptr;
  }

  // Two data-parallel ranks, one thread each, joined through a file rendezvous named `name`:
  // each rank's options are Options() with the rank's fields and one torch thread, then
  // `configure(options, rank)`; `body(Trainer::Create's result, rank)` runs on the rank's thread.
  void RunRanks(const std::string& name, const std::function<void(TrainOptions&, int)>& configure,
                const std::function<void(Result<std::unique_ptr<Trainer>>, int)>& body) {
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        TrainOptions o = Options();
        o.threads = 1;
        o.world_size = 2;
        o.rank = r;
        o.rendezvous = "file:" + Path(name);
        configure(o, r);
        body(Trainer::Create(o), r);
      });
    }
    for (auto& t : threads) t.join();
  }

  std::unique_ptr<engine::Engine> MakeEngine(const std::string& model, bool deterministic = true) {
    engine::EngineOptions o;
    o.model_dir = model;
    o.threads = 2;
    o.deterministic = deterministic;
    auto e = engine::Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(*e) : nullptr;
  }

  static std::vector<int32_t> Random(int n, int seed, int vocab) {
    std::mt19937 rng(seed);
    std::vector<int32_t> v(n);
    for (auto& t : v) t = static_cast<int32_t>(rng() % vocab);
    return v;
  }

  // Samples `n` rollouts of prompts of various lengths at temperature 1 with log-probs and
  // routed experts, submitted together (so the engine batches them), as trajectories.
  std::vector<Trajectory> Rollouts(engine::Engine& e, int n, int new_tokens, int seed0 = 0) {
    std::vector<std::shared_ptr<engine::RequestStream>> streams;
    std::vector<std::vector<int32_t>> prompts;
    for (int i = 0; i < n; ++i) {
      GenerateRequest r;
      r.input_ids = Random(3 + 5 * i % 23, seed0 + i, static_cast<int>(spec_.vocab));
      r.sampling.temperature = 1.0f;
      r.sampling.max_new_tokens = new_tokens + i % 5;
      r.sampling.sampling_seed = 1000 + seed0 + i;
      r.sampling.ignore_eos = true;
      r.return_logprob = true;
      r.return_routed_experts = spec_.moe;
      prompts.push_back(r.input_ids);
      auto s = e.Submit(std::move(r));
      EXPECT_TRUE(s.ok()) << s.status();
      streams.push_back(*s);
    }
    std::vector<Trajectory> out;
    for (int i = 0; i < n; ++i) {
      GenerateOutput g;
      for (int k = 0; k < 6000 && !g.finished(); ++k) {
        g = streams[i]->Wait(g.output_ids.size(), std::chrono::milliseconds(100));
      }
      EXPECT_TRUE(g.finished());
      Trajectory t;
      t.id = "r" + std::to_string(seed0 + i);
      t.group = "g" + std::to_string(i / 4);
      t.tokens = prompts[i];
      t.loss_mask.assign(prompts[i].size(), 0);
      t.logprobs.assign(prompts[i].size(), 0.0f);
      t.versions.assign(prompts[i].size(), -1);
      for (size_t j = 0; j < g.output_ids.size(); ++j) {
        t.tokens.push_back(g.output_ids[j]);
        t.loss_mask.push_back(1);
        t.logprobs.push_back(g.output_logprobs.at(j));
        t.versions.push_back(0);
      }
      t.routed_experts = g.routed_experts;
      t.reward = static_cast<double>(i % 4);
      out.push_back(std::move(t));
    }
    return out;
  }

  TempDir dir_;
  engine::testing::TinyModelSpec spec_;
};

// The seed's "zero train-rollout log-prob difference": the trainer's log-probs of the engine's
// sampled tokens are the engine's output_token_logprobs, bit for bit, for traces packed several
// to a micro-batch.
TEST_P(TrainerTest, LogProbsEqualTheEnginesBitForBitInDeterministicMode) {
  auto e = MakeEngine(Path("v0"));
  std::vector<Trajectory> batch = Rollouts(*e, 12, 20);
  auto t = MakeTrainer(Options());
  auto lp = t->LogProbs(batch);
  ASSERT_TRUE(lp.ok()) << lp.status();
  int64_t compared = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    for (size_t j = 0; j < batch[i].tokens.size(); ++j) {
      if (!batch[i].loss_mask[j]) continue;
      ASSERT_EQ((*lp)[i][j], batch[i].logprobs[j]) << batch[i].id << " token " << j;
      ++compared;
    }
  }
  EXPECT_GT(compared, 12 * 20);
}

// Router replay: the experts the trainer routes each position to are the engine's recorded
// ones (the same tensor), and replaying them changes nothing.
TEST_P(TrainerTest, RoutingEqualsTheEnginesRecordedRouting) {
  auto e = MakeEngine(Path("v0"));
  std::vector<Trajectory> batch = Rollouts(*e, 6, 12);
  auto t = MakeTrainer(Options());
  if (!spec_.moe) {
    // A dense model routes nothing, and says so with empty routing.
    auto routed = t->RoutedExperts(batch);
    ASSERT_TRUE(routed.ok()) << routed.status();
    for (const auto& r : *routed) EXPECT_TRUE(r.empty());
    return;
  }
  std::vector<Trajectory> unrouted = batch;
  for (auto& u : unrouted) u.routed_experts.clear();
  auto routed = t->RoutedExperts(unrouted);
  ASSERT_TRUE(routed.ok()) << routed.status();
  for (size_t i = 0; i < batch.size(); ++i) {
    ASSERT_FALSE(batch[i].routed_experts.empty());
    EXPECT_EQ((*routed)[i], batch[i].routed_experts) << batch[i].id;
  }
  auto with = t->LogProbs(batch);
  auto without = t->LogProbs(unrouted);
  ASSERT_TRUE(with.ok() && without.ok());
  EXPECT_EQ(*with, *without);
  // Replaying other experts does change the log-probs: the replay is really used.
  std::vector<Trajectory> other = batch;
  for (auto& o : other) {
    for (auto& x : o.routed_experts) x = (x + 1) % spec_.experts;
  }
  auto moved = t->LogProbs(other);
  ASSERT_TRUE(moved.ok());
  EXPECT_NE(*moved, *with);
}

// A trace's log-probs packed beside others equal its log-probs alone.
TEST_P(TrainerTest, PackingDoesNotChangeATracesLogProbs) {
  for (bool det : {true, false}) {
    auto e = MakeEngine(Path("v0"), det);
    std::vector<Trajectory> batch = Rollouts(*e, 8, 16);
    for (auto& b : batch) b.routed_experts.clear();
    auto t = MakeTrainer(Options(det));
    auto packed = t->LogProbs(batch);
    ASSERT_TRUE(packed.ok()) << packed.status();
    // A padded batch (every trace padded to its micro-batch's longest) computes the same.
    TrainOptions po = Options(det);
    po.padded = true;
    auto padded = MakeTrainer(po)->LogProbs(batch);
    ASSERT_TRUE(padded.ok()) << padded.status();
    if (det) {
      EXPECT_EQ(*padded, *packed);
    }
    // The unfused cross-entropy (whole logits) agrees to FP32 rounding.
    TrainOptions uo = Options(det);
    uo.fused_cross_entropy = false;
    auto unfused = MakeTrainer(uo)->LogProbs(batch);
    ASSERT_TRUE(unfused.ok()) << unfused.status();
    for (size_t i = 0; i < batch.size(); ++i) {
      for (size_t j = 0; j < batch[i].tokens.size(); ++j) {
        EXPECT_NEAR((*unfused)[i][j], (*packed)[i][j],
                    1e-5 * std::max(1.0f, std::abs((*packed)[i][j])));
        if (!det) {
          EXPECT_NEAR((*padded)[i][j], (*packed)[i][j],
                      1e-5 * std::max(1.0f, std::abs((*packed)[i][j])));
        }
      }
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      auto alone = t->LogProbs(std::span<const Trajectory>(&batch[i], 1));
      ASSERT_TRUE(alone.ok());
      for (size_t j = 0; j < batch[i].tokens.size(); ++j) {
        if (det) {
          ASSERT_EQ((*alone)[0][j], (*packed)[i][j]) << i << " " << j;
        } else {
          // Other GEMM shapes round differently: relative FP32 noise, not a layout error.
          ASSERT_NEAR((*alone)[0][j], (*packed)[i][j],
                      std::max(1e-5, 1e-5 * std::abs((*alone)[0][j])))
              << i << " " << j;
        }
      }
    }
  }
}

TEST_P(TrainerTest, SupervisedStepsRaiseTheLogProbOfTheTargets) {
  auto e = MakeEngine(Path("v0"));
  std::vector<Trajectory> batch = Rollouts(*e, 8, 16);
  TrainOptions o = Options();
  o.objective = Objective::kSft;
  auto t = MakeTrainer(o);
  double first = 0, last = 0;
  for (int s = 0; s < 15; ++s) {
    auto m = t->Step(batch);
    ASSERT_TRUE(m.ok()) << m.status();
    if (s == 0) first = m->loss;
    last = m->loss;
    EXPECT_TRUE(std::isfinite(m->grad_norm));
  }
  EXPECT_LT(last, 0.7 * first) << "first " << first << " last " << last;
  EXPECT_EQ(t->step(), 15);
}

// GRPO: rewarded trajectories become likelier, punished ones less likely; importance weights
// are 1 on fresh tokens (behaviour = policy) and the metrics say so.
TEST_P(TrainerTest, GrpoMovesThePolicyTowardsRewardedTrajectories) {
  auto e = MakeEngine(Path("v0"));
  std::vector<Trajectory> batch = Rollouts(*e, 8, 16);
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i].group = "g";
    batch[i].reward = i % 2 == 0 ? 1.0 : 0.0;
  }
  auto t = MakeTrainer(Options());
  auto before = t->LogProbs(batch);
  ASSERT_TRUE(before.ok());
  auto m = t->Step(batch);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->logprob_diff_max, 0.0);  // deterministic: the engine's log-probs exactly
  EXPECT_DOUBLE_EQ(m->is_weight_mean, 1.0);
  EXPECT_EQ(m->clip_fraction, 0.0);
  EXPECT_EQ(m->version, 1);
  EXPECT_EQ(m->min_version, 0);
  for (int s = 0; s < 4; ++s) ASSERT_TRUE(t->Step(batch).ok());
  auto after = t->LogProbs(batch);
  ASSERT_TRUE(after.ok());
  for (size_t i = 0; i < batch.size(); ++i) {
    double delta = 0;
    for (size_t j = 0; j < batch[i].tokens.size(); ++j) {
      if (batch[i].loss_mask[j]) delta += (*after)[i][j] - (*before)[i][j];
    }
    if (batch[i].reward > 0) {
      EXPECT_GT(delta, 0) << batch[i].id;
    } else {
      EXPECT_LT(delta, 0) << batch[i].id;
    }
  }
}

// Recomputing activations in backward (each layer's MLP half, or whole layers) recomputes the
// same values: the gradients are the same bits.
TEST_P(TrainerTest, RecomputationChangesNoGradient) {
  auto e = MakeEngine(Path("v0"));
  std::vector<Trajectory> batch = Rollouts(*e, 6, 12);
  std::string reference;
  for (Recompute r : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
    for (bool det : {true, false}) {
      TrainOptions o = Options(det);
      o.recompute = r;
      auto t = MakeTrainer(o);
      std::string path = Path("grads-" + std::to_string(static_cast<int>(r)) + (det ? "d" : "n"));
      ASSERT_TRUE(t->SaveGradients(batch, path).ok());
      auto bytes = ReadFileToString(path);
      ASSERT_TRUE(bytes.ok());
      if (!det) continue;  // other kernels: compared with themselves only through training
      if (reference.empty()) {
        reference = *bytes;
      } else {
        EXPECT_TRUE(*bytes == reference) << "recompute " << static_cast<int>(r);
      }
    }
  }
  // And training with it runs and moves the weights the same way.
  TrainOptions o = Options();
  o.recompute = Recompute::kFull;
  auto full = MakeTrainer(o);
  auto plain = MakeTrainer(Options());
  ASSERT_TRUE(full->Step(batch).ok());
  ASSERT_TRUE(plain->Step(batch).ok());
  EXPECT_EQ(*full->LogProbs(batch), *plain->LogProbs(batch));
  // With a KL reference (whose forward runs inside the step, without a graph).
  o.reference_dir = Path("v0");
  o.kl_coef = 0.1;
  auto with_kl = MakeTrainer(o);
  TrainOptions p = Options();
  p.reference_dir = Path("v0");
  p.kl_coef = 0.1;
  auto plain_kl = MakeTrainer(p);
  for (int s = 0; s < 2; ++s) {
    auto a = with_kl->Step(batch);
    auto b = plain_kl->Step(batch);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->loss, b->loss);
    EXPECT_EQ(a->kl, b->kl);
  }
  EXPECT_GT(with_kl->Step(batch)->kl, 0.0);
}

// Several optimizer steps per batch: the ratio against the proximal policy departs from 1, and
// clipping engages.
TEST_P(TrainerTest, MinibatchesClipAgainstTheProximalPolicy) {
  auto e = MakeEngine(Path("v0"));
  std::vector<Trajectory> batch = Rollouts(*e, 8, 16);
  for (size_t i = 0; i < batch.size(); ++i) batch[i].reward = i % 2;
  TrainOptions o = Options();
  o.minibatches = 4;
  o.lr = 5e-2;
  o.clip_low = o.clip_high = 0.01;
  auto t = MakeTrainer(o);
  auto m = t->Step(batch);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(t->step(), 4);
  EXPECT_EQ(t->version(), 1);
  EXPECT_GT(m->clip_fraction, 0.0);
}

// Off-policy tokens: behaviour log-probs from another policy are weighted by the truncated
// importance ratio.
TEST_P(TrainerTest, StaleTokensAreWeightedByTheTruncatedImportanceRatio) {
  auto e = MakeEngine(Path("v0"));
  std::vector<Trajectory> batch = Rollouts(*e, 4, 16);
  for (auto& b : batch) {
    for (size_t j = 0; j < b.tokens.size(); ++j) {
      if (b.loss_mask[j]) b.logprobs[j] -= 2.0f;  // the behaviour policy found them unlikely
    }
  }
  TrainOptions o = Options();
  o.tis_cap = 3.0;
  auto t = MakeTrainer(o);
  auto m = t->Step(batch);
  ASSERT_TRUE(m.ok()) << m.status();
  // exp(2) = 7.4 > 3: every token's weight is truncated to the cap.
  EXPECT_DOUBLE_EQ(m->is_truncated_fraction, 1.0);
  EXPECT_NEAR(m->is_weight_mean, 3.0, 1e-6);
  EXPECT_NEAR(m->logprob_diff_max, 2.0, 1e-5);
}

// The trained weights go to the engine (a weight update from the trainer's directory) and the
// parity holds on the new weights: the synchronous RL loop in miniature.
TEST_P(TrainerTest, TheEngineRunsTheTrainedWeightsWithTheTrainersLogProbs) {
  auto e = MakeEngine(Path("v0"));
  auto t = MakeTrainer(Options());
  for (int round = 1; round <= 2; ++round) {
    std::vector<Trajectory> batch = Rollouts(*e, 8, 12, 100 * round);
    for (size_t i = 0; i < batch.size(); ++i) batch[i].reward = (i * 7 + round) % 3;
    auto m = t->Step(batch);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_TRUE(t->SaveModel(Path("live")).ok());
    ASSERT_TRUE(
        e->UpdateWeightsFromDisk(Path("live"), std::to_string(round), /*flush_cache=*/true).ok());
    std::vector<Trajectory> fresh = Rollouts(*e, 6, 12, 100 * round + 50);
    auto lp = t->LogProbs(fresh);
    ASSERT_TRUE(lp.ok());
    for (size_t i = 0; i < fresh.size(); ++i) {
      for (size_t j = 0; j < fresh[i].tokens.size(); ++j) {
        if (fresh[i].loss_mask[j]) {
          ASSERT_EQ((*lp)[i][j], fresh[i].logprobs[j]) << round;
        }
      }
    }
  }
}

// Resume is bit-exact: 2 steps, checkpoint, 2 more == resume from the checkpoint, 2 more.
TEST_P(TrainerTest, ResumeFromACheckpointContinuesBitForBit) {
  auto e = MakeEngine(Path("v0"));
  std::vector<Trajectory> a = Rollouts(*e, 6, 12, 1), b = Rollouts(*e, 6, 12, 50);
  TrainOptions o = Options();
  o.weight_decay = 0.01;
  auto t = MakeTrainer(o);
  ASSERT_TRUE(t->Step(a).ok());
  ASSERT_TRUE(t->Step(b).ok());
  ASSERT_TRUE(t->SaveCheckpoint(Path("ckpt")).ok());
  ASSERT_TRUE(t->Step(a).ok());
  ASSERT_TRUE(t->Step(b).ok());
  ASSERT_TRUE(t->SaveModel(Path("uninterrupted")).ok());

  auto r = Trainer::Resume(Path("ckpt"), o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->step(), 2);
  EXPECT_EQ((*r)->version(), 2);
  ASSERT_TRUE((*r)->Step(a).ok());
  ASSERT_TRUE((*r)->Step(b).ok());
  ASSERT_TRUE((*r)->SaveModel(Path("resumed")).ok());
  auto x = engine::Checkpoint::Open(Path("uninterrupted"));
  auto y = engine::Checkpoint::Open(Path("resumed"));
  ASSERT_TRUE(x.ok() && y.ok());
  ASSERT_EQ(x->tensors().size(), y->tensors().size());
  for (const auto& [name, v] : x->tensors()) {
    const auto& w = y->tensors().at(name);
    ASSERT_EQ(v.bytes, w.bytes);
    EXPECT_EQ(std::memcmp(v.data, w.data, v.bytes), 0) << name;
  }
  // A checkpoint that is not one.
  EXPECT_FALSE(Trainer::Resume(Path("nowhere"), o).ok());
  ASSERT_TRUE(WriteStringToFile(Path("ckpt/latest"), "../../etc\n").ok());
  EXPECT_FALSE(Trainer::Resume(Path("ckpt"), o).ok());
}

// Data parallelism (gloo): two ranks, each running its half of the plan, end every step with
// the same weights, and those are the one-rank trainer's up to the order of the gradient sum.
TEST_P(TrainerTest, DataParallelRanksHoldTheSameWeightsAsOneRank) {
  auto e = MakeEngine(Path("v0"));
  std::vector<Trajectory> batch = Rollouts(*e, 10, 12);
  auto single = MakeTrainer(Options());
  for (int s = 0; s < 2; ++s) ASSERT_TRUE(single->Step(batch).ok());
  std::vector<std::unique_ptr<Trainer>> ranks(2);
  std::vector<StepMetrics> last(2);
  RunRanks(
      "rendezvous", [](TrainOptions&, int) {},
      [&](Result<std::unique_ptr<Trainer>> t, int r) {
        ASSERT_TRUE(t.ok()) << t.status();
        ranks[r] = std::move(*t);
        for (int s = 0; s < 2; ++s) {
          auto m = ranks[r]->Step(batch);
          ASSERT_TRUE(m.ok()) << m.status();
          last[r] = *m;
        }
      });
  ASSERT_TRUE(ranks[0] && ranks[1]);
  // Both ranks report the whole batch's metrics.
  EXPECT_EQ(last[0].loss, last[1].loss);
  EXPECT_GE(last[0].rank_seconds_max, last[0].rank_seconds_mean);
  auto a = ranks[0]->LogProbs(batch), b = ranks[1]->LogProbs(batch), c = single->LogProbs(batch);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(*a, *b);
  for (size_t i = 0; i < batch.size(); ++i) {
    for (size_t j = 0; j < batch[i].tokens.size(); ++j) {
      EXPECT_NEAR((*a)[i][j], (*c)[i][j], 1e-4 * std::max(1.0f, std::abs((*c)[i][j])));
    }
  }
  // Only rank 0 writes.
  ASSERT_TRUE(ranks[1]->SaveModel(Path("dp1")).ok());
  EXPECT_FALSE(std::filesystem::exists(Path("dp1")));
  ASSERT_TRUE(ranks[0]->SaveModel(Path("dp0")).ok());
  EXPECT_TRUE(std::filesystem::exists(Path("dp0") + "/model.safetensors"));
}

// The data-parallel balance: on a heavy-tailed batch whose two long trajectories arrive at even
// positions, round-robin deals both to rank 0 while the cost-aware plan gives each rank one;
// the ranks' tokens say so. Either way the ranks train the same weights (the balance decides
// who computes which gradient, not their sum).
TEST_P(TrainerTest, CostAwareDpBalanceEvensTheRanksWhereRoundRobinDoesNot) {
  std::vector<Trajectory> batch;
  for (int i = 0; i < 12; ++i) {
    const int n = i == 0 || i == 2 ? 120 : 8;
    Trajectory t;
    t.id = "t" + std::to_string(i);
    t.group = "g" + std::to_string(i / 4);
    t.tokens = Random(n, 50 + i, static_cast<int>(spec_.vocab));
    t.loss_mask.assign(n, 1);
    t.loss_mask[0] = 0;
    t.logprobs.assign(n, -1.0f);
    t.reward = static_cast<double>(i % 3);
    batch.push_back(std::move(t));
  }
  // Packed: 2 x 119 + 10 x 7 = 308 tokens (a trajectory's last token predicts nothing), 154 a
  // rank, one micro-batch of at most 256 each. Round-robin: trajectory i to rank i mod 2 while
  // it fits, so 119 + 119 + 2 x 7 on rank 0 until the next short one overflows it (252 tokens),
  // 56 on rank 1. Cost-aware: one long and five short on each (154).
  auto step = [&](DpBalance balance, const std::string& name) {
    std::vector<StepMetrics> metrics(2);
    std::vector<std::vector<std::vector<float>>> logprobs(2);
    RunRanks(
        name,
        [&](TrainOptions& o, int) {
          o.objective = Objective::kSft;
          o.dp_balance = balance;
        },
        [&](Result<std::unique_ptr<Trainer>> t, int r) {
          ASSERT_TRUE(t.ok()) << t.status();
          auto m = (*t)->Step(batch);
          ASSERT_TRUE(m.ok()) << m.status();
          metrics[r] = *m;
          auto lp = (*t)->LogProbs(batch);
          ASSERT_TRUE(lp.ok()) << lp.status();
          logprobs[r] = *lp;
        });
    // Every rank reports the same balance.
    EXPECT_EQ(metrics[0].rank_tokens_max, metrics[1].rank_tokens_max);
    EXPECT_EQ(metrics[0].rank_tokens_mean, metrics[1].rank_tokens_mean);
    EXPECT_EQ(metrics[0].micro_batches, 2);
    EXPECT_GE(metrics[0].rank_seconds_max, metrics[0].rank_seconds_mean);
    return std::make_pair(metrics[0], logprobs[0]);
  };
  auto [cost, cost_lp] = step(DpBalance::kCost, "rendezvous-cost");
  auto [rr, rr_lp] = step(DpBalance::kRoundRobin, "rendezvous-round-robin");
  EXPECT_EQ(cost.rank_tokens_mean, 154);
  EXPECT_EQ(rr.rank_tokens_mean, 154);
  EXPECT_EQ(cost.rank_tokens_max, 154);
  EXPECT_EQ(rr.rank_tokens_max, 252);
  EXPECT_LT(cost.rank_tokens_max / cost.rank_tokens_mean, rr.rank_tokens_max / rr.rank_tokens_mean);
  EXPECT_EQ(cost.loss_tokens, rr.loss_tokens);
  EXPECT_NEAR(cost.loss, rr.loss, 1e-6 * std::abs(rr.loss));
  ASSERT_EQ(cost_lp.size(), rr_lp.size());
  // The same gradient summed in another order, then Adam's first step: lr times the gradient's
  // sign, so a component near zero whose rounding flips it moves by 2 lr (lr is 1e-2 here).
  // Measured: 1.4e-5 (dense) and 1.2e-4 (MoE) at worst.
  for (size_t i = 0; i < batch.size(); ++i) {
    for (size_t j = 0; j < batch[i].tokens.size(); ++j) {
      EXPECT_NEAR(cost_lp[i][j], rr_lp[i][j], 5e-4 * std::max(1.0f, std::abs(rr_lp[i][j])));
    }
  }
}

// Ranks given different options, or different batches, would plan different shares of a step
// (training some trajectories twice and others never) or wait forever in a collective: every
// rank refuses, at start for options and at the step for batches, and nothing is trained.
TEST_P(TrainerTest, DataParallelRanksRefuseDifferentOptionsAndBatches) {
  auto e = MakeEngine(Path("v0"));
  std::vector<Trajectory> batch = Rollouts(*e, 6, 8);
  auto both = [&](const std::string& name, const std::function<void(TrainOptions&, int)>& configure,
                  const std::function<Status(Trainer&, int)>& run) {
    std::vector<Status> got(2);
    RunRanks(name, configure, [&](Result<std::unique_ptr<Trainer>> t, int r) {
      got[r] = t.ok() ? run(**t, r) : t.status();
    });
    return got;
  };
  auto no_step = [](Trainer&, int) { return absl::OkStatus(); };
  for (auto configure : std::vector<std::function<void(TrainOptions&, int)>>{
           [](TrainOptions&o, int r) { o.max_tokens = r ? 512 : 1024; },
           [](TrainOptions&o, int r) { o.dp_balance = r ? DpBalance::kRoundRobin : o.dp_balance; },
           [](TrainOptions&o, int r) { o.lr = r ? 2 * o.lr : o.lr; }}) {
    std::vector<Status> got = both("rdv-options", configure, no_step);
    for (const Status& s : got) {
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
      EXPECT_NE(std::string(s.message()).find("different options"), std::string::npos) << s;
    }
  }
  // Same options, different batches: refused at the step, on both ranks; the weights stay.
  auto before = MakeTrainer(Options())->LogProbs(batch);
  ASSERT_TRUE(before.ok());
  std::vector<std::vector<std::vector<float>>> after(2);
  std::vector<Status> got = both(
      "rdv-batches", [](TrainOptions&, int) {},
      [&](Trainer& t, int r) {
        std::vector<Trajectory> mine = batch;
        if (r == 1) std::swap(mine[0], mine[1]);  // the same trajectories in another order
        Status s = t.Step(mine).status();
        auto lp = t.LogProbs(batch);
        if (lp.ok()) after[r] = *lp;
        return s;
      });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got[r].code(), absl::StatusCode::kFailedPrecondition) << got[r];
    EXPECT_NE(std::string(got[r].message()).find("different batches"), std::string::npos);
    EXPECT_EQ(after[r], *before) << "rank " << r << " trained";
  }
}

TEST_P(TrainerTest, BadBatchesAreRefusedNamingTheTrajectoryAndNothingIsTrained) {
  auto e = MakeEngine(Path("v0"));
  std::vector<Trajectory> good = Rollouts(*e, 4, 8);
  auto t = MakeTrainer(Options());
  auto before = t->LogProbs(good);
  ASSERT_TRUE(before.ok());
  auto expect_refused = [&](std::vector<Trajectory> batch, const std::string& needle) {
    auto m = t->Step(batch);
    ASSERT_FALSE(m.ok()) << needle;
    EXPECT_NE(std::string(m.status().message()).find(needle), std::string::npos) << m.status();
  };
  expect_refused({}, "empty batch");
  {
    auto b = good;
    b[2].logprobs.pop_back();
    expect_refused(b, "trajectory " + b[2].id + ": logprobs has");
  }
  {
    auto b = good;
    b[1].reward = std::nan("");
    expect_refused(b, "trajectory " + b[1].id + ": reward is nan");
  }
  {
    auto b = good;
    b[0].tokens[3] = 9999;
    expect_refused(b, "outside the vocabulary");
  }
  {
    auto b = good;
    b[3].loss_mask.assign(b[3].loss_mask.size(), 0);
    expect_refused(b, "no token carries loss");
  }
  {
    auto b = good;
    b[3].id = b[0].id;
    expect_refused(b, "appears twice");
  }
  {
    auto b = good;
    b[1].loss_mask[0] = 1;
    expect_refused(b, "loss_mask[0] is 1");
  }
  if (spec_.moe) {
    auto b = good;
    b[0].routed_experts.pop_back();
    expect_refused(b, "routed_experts has");
    b = good;
    b[1].routed_experts.clear();
    expect_refused(b, "some trajectories carry routed_experts");
  }
  EXPECT_EQ(t->step(), 0);
  auto after = t->LogProbs(good);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(*before, *after);
  // A reference of another shape.
  engine::testing::TinyModelSpec other = spec_;
  other.hidden = 32;
  ASSERT_TRUE(engine::testing::WriteTinyModel(Path("other"), other).ok());
  TrainOptions o = Options();
  o.reference_dir = Path("other");
  o.kl_coef = 0.1;
  EXPECT_FALSE(Trainer::Create(o).ok());
  o.reference_dir.clear();
  EXPECT_EQ(Trainer::Create(o).status().code(), absl::StatusCode::kFailedPrecondition);
}

INSTANTIATE_TEST_SUITE_P(DenseAndMoe, TrainerTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Moe" : "Dense"; });

TEST(DpBalanceTest, ParsesItsTwoNamesAndRefusesOthersNamingTheChoices) {
  EXPECT_EQ(TrainOptions().dp_balance, DpBalance::kCost);
  EXPECT_EQ(*ParseDpBalance("cost"), DpBalance::kCost);
  EXPECT_EQ(*ParseDpBalance("round-robin"), DpBalance::kRoundRobin);
  for (const char* bad : {"", "lpt", "Cost", "round_robin", "round-robin ", "roundrobin"}) {
    auto b = ParseDpBalance(bad);
    ASSERT_FALSE(b.ok()) << bad;
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(b.status().message()).find("cost or round-robin"), std::string::npos)
        << b.status();
  }
}

TEST(TrajectoryTest, ParsesAndRefusesHostileLines) {
  auto ok = ParseTrajectory(
      R"({"id":"a","group":"g","tokens":[1,2,3],"loss_mask":[0,1,1],"logprobs":[0,-1,-2],"reward":1})",
      "f:1");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->tokens.size(), 3u);
  auto round = ParseTrajectory(TrajectoryToJson(*ok), "f:2");
  ASSERT_TRUE(round.ok());
  EXPECT_EQ(round->tokens, ok->tokens);
  EXPECT_EQ(round->logprobs, ok->logprobs);
  for (const char* bad : {
           "not json",
           "[1,2]",
           R"({"tokens":[1,2],"loss_mask":[0,1],"logprobs":[0,-1]})",  // no reward
           R"({"tokens":[1,2],"loss_mask":[0,2],"logprobs":[0,-1],"reward":0})",
           R"({"tokens":"12","loss_mask":[0,1],"logprobs":[0,-1],"reward":0})",
           R"({"tokens":[1,2],"loss_mask":[0,1],"logprobs":[0,"x"],"reward":0})",
           R"({"tokens":[1,2],"loss_mask":[0,1],"logprobs":[0,-1],"reward":0,"rewrad":1})",
       }) {
    EXPECT_FALSE(ParseTrajectory(bad, "f:3").ok()) << bad;
  }
}

TEST(TrajectoryTest, GroupAdvantagesAreNormalisedWithinEachGroup) {
  std::vector<Trajectory> b(5);
  b[0].group = b[1].group = b[2].group = "x";
  b[3].group = "y";
  b[0].reward = 1, b[1].reward = 0, b[2].reward = 0, b[3].reward = 5, b[4].reward = 2;
  b[4].advantage = 0.5;
  auto a = GroupAdvantages(b, true);
  double std = std::sqrt(((1 - 1.0 / 3) * (1 - 1.0 / 3) + 2 * (1.0 / 9)) / 2);
  EXPECT_NEAR(a[0], (2.0 / 3) / (std + 1e-6), 1e-9);
  EXPECT_NEAR(a[1], (-1.0 / 3) / (std + 1e-6), 1e-9);
  EXPECT_EQ(a[3], 0.0);  // alone in its group: no signal
  EXPECT_EQ(a[4], 0.5);  // given
  auto d = GroupAdvantages(b, false);
  EXPECT_NEAR(d[0], 2.0 / 3, 1e-12);
}

TEST(SafetensorsWriterTest, WritesWhatTheEngineReadsAndPublishesAtomically) {
  auto dir = TempDir::Create("/tmp", "bragg-st-");
  ASSERT_TRUE(dir.ok());
  std::vector<float> a = {1, 2, 3, 4, 5, 6};
  std::vector<uint16_t> b = {7, 8};
  std::vector<TensorBytes> ts = {
      {"a",
       engine::TensorDType::kF32,
       {2, 3},
       {reinterpret_cast<const uint8_t*>(a.data()), a.size() * 4}},
      {"b", engine::TensorDType::kBF16, {2}, {reinterpret_cast<const uint8_t*>(b.data()), 4}},
  };
  std::string staging = dir->path() + "/s";
  ASSERT_TRUE(MakeDirs(staging).ok());
  ASSERT_TRUE(WriteSafetensors(staging + "/m.safetensors", ts).ok());
  auto bytes = ReadFileToString(staging + "/m.safetensors");
  ASSERT_TRUE(bytes.ok());
  auto views =
      engine::ParseSafetensors(reinterpret_cast<const uint8_t*>(bytes->data()), bytes->size(), "m");
  ASSERT_TRUE(views.ok()) << views.status();
  ASSERT_EQ(views->size(), 2u);
  EXPECT_EQ(std::memcmp((*views)[0].data, a.data(), 24), 0);
  // Size mismatch and duplicates are refused.
  ts[1].shape = {3};
  EXPECT_FALSE(WriteSafetensors(staging + "/x.safetensors", ts).ok());
  ts[1] = ts[0];
  EXPECT_FALSE(WriteSafetensors(staging + "/x.safetensors", ts).ok());
  // Publishing over an existing directory swaps it whole.
  std::string final_dir = dir->path() + "/final";
  ASSERT_TRUE(MakeDirs(final_dir).ok());
  ASSERT_TRUE(WriteStringToFile(final_dir + "/old", "x").ok());
  ASSERT_TRUE(PublishDirectory(staging, final_dir).ok());
  EXPECT_TRUE(std::filesystem::exists(final_dir + "/m.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(final_dir + "/old"));
  EXPECT_FALSE(std::filesystem::exists(staging));
}

}  // namespace
}  // namespace bragg::train
