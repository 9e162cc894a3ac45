// The engine end to end on random tiny models written by testing/tiny_model.h: prefix-cache
// exactness, batch invariance in deterministic mode, seeds, in-place weight updates with
// requests in flight, a bad weights directory, aborts, a KV cache too small for the load, and
// routed experts (whole and as deltas).

#include "engine/engine.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "common/fs.h"
#include "engine/testing/tiny_model.h"

namespace bragg::engine {
namespace {

using std::chrono::seconds;

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = TempDir::Create("/tmp", "bragg-engine-test-");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = std::move(*dir);
    ASSERT_TRUE(testing::WriteTinyModel(Model("v1"), spec_).ok());
  }

  std::string Model(const std::string& name) { return dir_.path() + "/" + name; }

  std::unique_ptr<Engine> Start(EngineOptions o = {}) {
    if (o.model_dir.empty()) o.model_dir = Model("v1");
    if (o.threads == 0) o.threads = 1;
    auto e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(*e) : nullptr;
  }

  static GenerateOutput Run(Engine& e, GenerateRequest r) {
    auto s = e.Submit(std::move(r));
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return {};
    GenerateOutput out;
    for (int i = 0; i < 6000 && !out.finished(); ++i) {
      out = (*s)->Wait(out.output_ids.size(), std::chrono::milliseconds(100));
    }
    EXPECT_TRUE(out.finished());
    return out;
  }

  static std::vector<int32_t> Prompt(int n, int seed, int vocab = 256) {
    std::mt19937 rng(seed);
    std::vector<int32_t> v(n);
    for (auto& t : v) t = static_cast<int32_t>(rng() % vocab);
    return v;
  }

  static GenerateRequest Greedy(std::vector<int32_t> ids, int n) {
    GenerateRequest r;
    r.input_ids = std::move(ids);
    r.sampling.temperature = 0;
    r.sampling.max_new_tokens = n;
    r.return_logprob = true;
    return r;
  }

  TempDir dir_;  // removed with everything in it when the test ends
  testing::TinyModelSpec spec_;
};

TEST_F(EngineTest, GreedyFromThePrefixCacheEqualsAColdPrefill) {
  auto e = Start();
  std::vector<int32_t> turn1 = Prompt(70, 1);
  GenerateOutput a = Run(*e, Greedy(turn1, 20));
  EXPECT_EQ(a.cached_tokens, 0);
  EXPECT_EQ(a.finish, FinishReason::kLength);
  // Turn 2 = turn 1 + its answer + new tokens: everything but the new part is cached.
  std::vector<int32_t> turn2 = turn1;
  turn2.insert(turn2.end(), a.output_ids.begin(), a.output_ids.end());
  auto extra = Prompt(9, 2);
  turn2.insert(turn2.end(), extra.begin(), extra.end());
  GenerateOutput warm = Run(*e, Greedy(turn2, 24));
  EXPECT_GE(warm.cached_tokens, 80);  // 5 full blocks of 16 of the 90 earlier tokens
  EXPECT_EQ(warm.prompt_tokens, 99);

  auto cold_engine = Start();
  GenerateOutput cold = Run(*cold_engine, Greedy(turn2, 24));
  EXPECT_EQ(cold.cached_tokens, 0);
  EXPECT_EQ(warm.output_ids, cold.output_ids);
  ASSERT_EQ(warm.output_logprobs.size(), cold.output_logprobs.size());
  for (size_t i = 0; i < warm.output_logprobs.size(); ++i) {
    EXPECT_NEAR(warm.output_logprobs[i], cold.output_logprobs[i], 1e-5) << i;
  }
  // The cache salt keeps prefixes apart.
  GenerateRequest salted = Greedy(turn2, 4);
  salted.extra_key = "other";
  EXPECT_EQ(Run(*e, salted).cached_tokens, 0);
}

TEST_F(EngineTest, DeterministicModeIsBatchInvariantBitForBit) {
  EngineOptions o;
  o.deterministic = true;
  o.threads = 2;
  auto e = Start(o);
  std::vector<int32_t> p = Prompt(40, 7);
  GenerateOutput alone = Run(*e, Greedy(p, 16));
  ASSERT_TRUE(e->FlushCache().ok());
  // The same request among 63 others of other lengths, admitted together.
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 64; ++i) {
    auto r = Greedy(i == 31 ? p : Prompt(10 + i, 100 + i), 16);
    auto s = e->Submit(r);
    ASSERT_TRUE(s.ok());
    streams.push_back(*s);
  }
  GenerateOutput together;
  for (int i = 0; i < 6000 && !together.finished(); ++i) {
    together = streams[31]->Wait(together.output_ids.size(), std::chrono::milliseconds(100));
  }
  EXPECT_EQ(alone.output_ids, together.output_ids);
  ASSERT_EQ(alone.output_logprobs.size(), together.output_logprobs.size());
  for (size_t i = 0; i < alone.output_logprobs.size(); ++i) {
    EXPECT_EQ(alone.output_logprobs[i], together.output_logprobs[i]) << "token " << i;
  }
  for (auto& s : streams) {
    GenerateOutput o2;
    while (!o2.finished()) o2 = s->Wait(o2.output_ids.size(), seconds(60));
  }
}

TEST_F(EngineTest, DeterministicModeServesACachedPrefixBitForBitAsAColdPrefill) {
  EngineOptions o;
  o.deterministic = true;
  o.threads = 2;
  auto warm_engine = Start(o);
  std::vector<int32_t> turn1 = Prompt(45, 21);
  GenerateOutput a = Run(*warm_engine, Greedy(turn1, 10));
  std::vector<int32_t> turn2 = turn1;
  turn2.insert(turn2.end(), a.output_ids.begin(), a.output_ids.end());
  auto extra = Prompt(7, 22);
  turn2.insert(turn2.end(), extra.begin(), extra.end());
  GenerateOutput warm = Run(*warm_engine, Greedy(turn2, 12));
  EXPECT_GE(warm.cached_tokens, 54);  // every earlier token but the last answer token's
  auto cold_engine = Start(o);
  GenerateOutput cold = Run(*cold_engine, Greedy(turn2, 12));
  EXPECT_EQ(cold.cached_tokens, 0);
  EXPECT_EQ(warm.output_ids, cold.output_ids);
  EXPECT_EQ(warm.output_logprobs, cold.output_logprobs);  // bitwise
}

TEST_F(EngineTest, SameSeedSameTokensAndSeedsDiffer) {
  auto e = Start();
  GenerateRequest r;
  r.input_ids = Prompt(12, 3);
  r.sampling.max_new_tokens = 32;
  r.sampling.sampling_seed = 5;
  GenerateOutput a = Run(*e, r);
  GenerateOutput b = Run(*e, r);
  EXPECT_EQ(a.output_ids, b.output_ids);
  r.sampling.sampling_seed = 6;
  GenerateOutput c = Run(*e, r);
  EXPECT_NE(a.output_ids, c.output_ids);
}

TEST_F(EngineTest, WeightUpdateWithRequestsInFlightKeepsEveryRequestAndRecordsBothVersions) {
  ASSERT_TRUE(testing::WriteTinyModel(Model("v2"), spec_, 0.5f).ok());
  EngineOptions o;
  o.weight_version = "v1";
  auto e = Start(o);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 32; ++i) {
    auto r = Greedy(Prompt(20, 200 + i), 60);
    auto s = e->Submit(r);
    ASSERT_TRUE(s.ok());
    streams.push_back(*s);
  }
  // Once the first tokens are out, update in place.
  GenerateOutput first = streams[0]->Wait(3, seconds(60));
  ASSERT_GE(first.output_ids.size(), 3u);
  ASSERT_TRUE(e->UpdateWeightsFromDisk(Model("v2"), "v2", /*flush_cache=*/false).ok());
  int both = 0;
  for (auto& s : streams) {
    GenerateOutput out;
    while (!out.finished()) out = s->Wait(out.output_ids.size(), seconds(60));
    EXPECT_EQ(out.finish, FinishReason::kLength);
    EXPECT_EQ(out.output_ids.size(), 60u);
    EXPECT_EQ(out.weight_version, "v2");
    ASSERT_FALSE(out.weight_versions.empty());
    EXPECT_EQ(out.weight_versions.front().start, 0);
    EXPECT_EQ(out.weight_versions.back().end, 60);
    EXPECT_EQ(out.weight_versions.back().version, "v2");
    both += out.weight_versions.size() == 2 && out.weight_versions[0].version == "v1";
  }
  EXPECT_GT(both, 0);
  EXPECT_EQ(e->stats().weight_updates_total, 1);
}

// The update writes through whatever layout the engine keeps its weights in (transposed outside
// deterministic mode): afterwards it answers bit for bit as an engine loaded with the new
// weights does. Dense and MoE, both modes.
TEST_F(EngineTest, AnUpdatedEngineAnswersAsOneLoadedWithTheNewWeights) {
  for (bool moe : {true, false}) {
    testing::TinyModelSpec spec = spec_;
    spec.moe = moe;
    std::string v1 = Model(moe ? "moe-v1" : "dense-v1"), v2 = Model(moe ? "moe-v2" : "dense-v2");
    ASSERT_TRUE(testing::WriteTinyModel(v1, spec).ok());
    spec.seed = 7;  // other weights, not only scaled ones
    ASSERT_TRUE(testing::WriteTinyModel(v2, spec).ok());
    for (bool deterministic : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "moe " << moe << ", deterministic " << deterministic);
      EngineOptions o;
      o.deterministic = deterministic;
      o.model_dir = v1;
      auto updated = Start(o);
      o.model_dir = v2;
      auto fresh = Start(o);
      ASSERT_TRUE(updated && fresh);
      std::vector<int32_t> p = Prompt(40, 11);
      GenerateOutput old_weights = Run(*updated, Greedy(p, 16));
      ASSERT_TRUE(updated->UpdateWeightsFromDisk(v2, "v2", /*flush_cache=*/true).ok());
      GenerateOutput want = Run(*fresh, Greedy(p, 16));
      GenerateOutput got = Run(*updated, Greedy(p, 16));
      EXPECT_EQ(got.output_ids, want.output_ids);
      EXPECT_EQ(got.output_logprobs, want.output_logprobs);
      EXPECT_NE(old_weights.output_logprobs, want.output_logprobs);  // the update changed them
    }
  }
}

// OpenBLAS's OpenMP build is the one torch calls where the build found it (bragg_torch_blas).
TEST(EngineCpuRuntime, NamesTheBlasTheBuildChose) {
  std::string runtime = Engine::CpuRuntime();
  EXPECT_NE(runtime.find("thread(s); BLAS: "), std::string::npos) << runtime;
  // And which instance of its own kernels runs (cpu_isa.h): a CPU of CI's has AVX2 at least.
  EXPECT_TRUE(runtime.find("the engine's kernels: avx2") != std::string::npos ||
              runtime.find("the engine's kernels: avx512") != std::string::npos)
      << runtime;
#ifdef BRAGG_TORCH_BLAS_DIR
  EXPECT_NE(runtime.find(BRAGG_TORCH_BLAS_DIR), std::string::npos) << runtime;
  EXPECT_NE(runtime.find("OpenMP: on torch's threads"), std::string::npos) << runtime;
#endif
}

TEST_F(EngineTest, ABadWeightsDirectoryIsRefusedAndTheRunningWeightsStay) {
  auto e = Start();
  std::vector<int32_t> p = Prompt(30, 9);
  GenerateOutput before = Run(*e, Greedy(p, 12));

  // Missing directory; another shape; another dtype; a truncated file.
  EXPECT_EQ(e->UpdateWeightsFromDisk(Model("nope"), "x", true).code(), absl::StatusCode::kNotFound);
  testing::TinyModelSpec wide = spec_;
  wide.hidden = 96;
  ASSERT_TRUE(testing::WriteTinyModel(Model("wide"), wide).ok());
  Status s = e->UpdateWeightsFromDisk(Model("wide"), "x", true);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("hidden_size"), std::string::npos) << s;
  testing::TinyModelSpec half = spec_;
  half.bf16 = true;
  ASSERT_TRUE(testing::WriteTinyModel(Model("bf16"), half).ok());
  s = e->UpdateWeightsFromDisk(Model("bf16"), "x", true);
  EXPECT_NE(std::string(s.message()).find("BF16"), std::string::npos) << s;
  ASSERT_TRUE(testing::WriteTinyModel(Model("cut"), spec_, 3.0f).ok());
  std::filesystem::resize_file(Model("cut") + "/model.safetensors",
                               std::filesystem::file_size(Model("cut") + "/model.safetensors") / 2);
  s = e->UpdateWeightsFromDisk(Model("cut"), "x", true);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;

  EXPECT_EQ(e->stats().weight_version, "0");
  ASSERT_TRUE(e->FlushCache().ok());
  GenerateOutput after = Run(*e, Greedy(p, 12));
  EXPECT_EQ(before.output_ids, after.output_ids);
  EXPECT_EQ(before.output_logprobs, after.output_logprobs);
}

TEST_F(EngineTest, AbortAndCancelFreeTheirBlocks) {
  auto e = Start();
  GenerateRequest r = Greedy(Prompt(50, 4), 1000);
  r.rid = "long";
  auto s = e->Submit(r);
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE(e->Submit(r).ok());  // duplicate rid
  (*s)->Wait(2, seconds(60));
  EXPECT_EQ(e->Abort("nobody").code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(e->Abort("long").ok());
  GenerateOutput out;
  while (!out.finished()) out = (*s)->Wait(out.output_ids.size(), seconds(60));
  EXPECT_EQ(out.finish, FinishReason::kAbort);

  auto s2 = e->Submit(Greedy(Prompt(50, 5), 1000));
  ASSERT_TRUE(s2.ok());
  (*s2)->Wait(2, seconds(60));
  (*s2)->Cancel();
  out = {};
  while (!out.finished()) out = (*s2)->Wait(out.output_ids.size(), seconds(60));
  EXPECT_EQ(out.finish, FinishReason::kAbort);
  EngineStats st = e->stats();
  EXPECT_EQ(st.kv_tokens_used, 0);
  EXPECT_EQ(st.running + st.queued, 0);
}

// A stop check (the server's stop strings) ends a request at the token it names: the output is
// the same tokens as the unstopped run's up to there, the finish is stop with the string, and the
// request leaves the engine (no KV blocks held beyond the prefix cache's).
TEST_F(EngineTest, AStopCheckEndsTheRequestAtItsToken) {
  auto e = Start();
  GenerateOutput whole = Run(*e, Greedy(Prompt(20, 6), 12));
  ASSERT_EQ(whole.output_ids.size(), 12u);
  GenerateRequest r = Greedy(Prompt(20, 6), 12);
  std::atomic<int> calls{0};
  std::vector<int32_t> want(whole.output_ids.begin(), whole.output_ids.begin() + 5);
  r.stop_check = [&](std::span<const int32_t> ids) -> std::optional<std::string> {
    ++calls;
    if (std::vector<int32_t>(ids.begin(), ids.end()) == want) {
      return "five";
    }
    return std::nullopt;
  };
  GenerateOutput out = Run(*e, r);
  EXPECT_EQ(out.output_ids, want);
  EXPECT_EQ(out.output_logprobs.size(), 5u);
  EXPECT_EQ(out.finish, FinishReason::kStop);
  EXPECT_EQ(out.matched_stop_string, "five");
  EXPECT_FALSE(out.matched_stop.has_value());
  EXPECT_EQ(calls.load(), 5);
  EngineStats st = e->stats();
  EXPECT_EQ(st.running + st.queued, 0);
  EXPECT_EQ(st.aborted_total, 0);
}

TEST_F(EngineTest, ASmallCacheQueuesAndRetractsButAnswersEveryRequestAsABigOneDoes) {
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 12; ++i) {
    reqs.push_back(Greedy(Prompt(30 + i, 300 + i), 40));
    if (i % 3 == 0) {
      reqs.back().logprob_start_len = 0;  // input log-probs survive a retraction whole
    }
  }
  auto big = Start();
  std::vector<GenerateOutput> want;
  for (auto& r : reqs) want.push_back(Run(*big, r));
  EngineOptions o;
  o.kv_cache_tokens = 160;  // two or three requests at a time
  auto small = Start(o);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (auto& r : reqs) streams.push_back(*small->Submit(r));
  for (size_t i = 0; i < reqs.size(); ++i) {
    GenerateOutput out;
    while (!out.finished()) out = streams[i]->Wait(out.output_ids.size(), seconds(60));
    EXPECT_EQ(out.output_ids, want[i].output_ids) << i;
    ASSERT_EQ(out.input_logprobs.size(), want[i].input_logprobs.size()) << i;
    for (size_t k = 1; k < out.input_logprobs.size(); ++k) {
      EXPECT_NEAR(out.input_logprobs[k], want[i].input_logprobs[k], 1e-5) << i << " " << k;
    }
    EXPECT_LE(small->stats().kv_tokens_used, 160);
  }
  EXPECT_GT(small->stats().retracted_total, 0) << "the cache never filled: nothing was retracted";
  // A request larger than the whole cache is refused up front.
  EXPECT_EQ(small->Submit(Greedy(Prompt(150, 1), 40)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(EngineTest, RoutedExpertsWholeEqualTheDeltasAndTheCachedPositions) {
  auto e = Start();
  std::vector<int32_t> p = Prompt(40, 11);
  GenerateRequest r1 = Greedy(p, 10);
  r1.return_routed_experts = true;
  GenerateOutput a = Run(*e, r1);
  const size_t per = 2 * 2;  // layers x top_k
  ASSERT_EQ(a.routed_experts.size(), (40 + 10 - 1) * per);
  for (int32_t x : a.routed_experts) ASSERT_TRUE(x >= 0 && x < 8);
  // Turn 2 asks only for its new positions; the whole of turn 2 from a cold engine agrees.
  std::vector<int32_t> t2 = p;
  t2.insert(t2.end(), a.output_ids.begin(), a.output_ids.end());
  GenerateRequest r2 = Greedy(t2, 10);
  r2.return_routed_experts = true;
  r2.routed_experts_start_len = 49;
  GenerateOutput b = Run(*e, r2);
  EXPECT_GT(b.cached_tokens, 0);
  ASSERT_EQ(b.routed_experts.size(), (59 - 49) * per);
  auto cold = Start();
  GenerateRequest whole = r2;
  whole.routed_experts_start_len = 0;
  GenerateOutput c = Run(*cold, whole);
  ASSERT_EQ(c.routed_experts.size(), 59 * per);
  std::vector<int32_t> assembled(a.routed_experts.begin(), a.routed_experts.end());
  assembled.insert(assembled.end(), b.routed_experts.begin(), b.routed_experts.end());
  EXPECT_EQ(assembled, c.routed_experts);
  // The same request from the warm engine (cached positions' experts come from the cache).
  GenerateOutput d = Run(*e, whole);
  EXPECT_EQ(d.routed_experts, c.routed_experts);
}

TEST_F(EngineTest, InputLogprobsScoreThePromptWithMaxNewTokensZero) {
  auto e = Start();
  std::vector<int32_t> p = Prompt(33, 12);
  GenerateRequest r = Greedy(p, 0);
  r.logprob_start_len = 0;
  GenerateOutput a = Run(*e, r);
  ASSERT_EQ(a.input_logprobs.size(), 33u);
  EXPECT_TRUE(std::isnan(a.input_logprobs[0]));
  for (size_t i = 1; i < 33; ++i) EXPECT_LT(a.input_logprobs[i], 0) << i;
  EXPECT_TRUE(a.output_ids.empty());
  // A second scoring from the cache-warm engine gives the same numbers (cache capped below start).
  GenerateOutput b = Run(*e, r);
  ASSERT_EQ(b.input_logprobs.size(), 33u);
  for (size_t i = 1; i < 33; ++i) EXPECT_NEAR(a.input_logprobs[i], b.input_logprobs[i], 1e-5);
  GenerateRequest bad = Greedy(p, 0);
  bad.return_logprob = false;
  EXPECT_FALSE(e->Submit(bad).ok()) << "max_new_tokens 0 without return_logprob";
}

TEST_F(EngineTest, RefusesBadRequestsNamingTheProblem) {
  auto e = Start();
  auto code = [&](GenerateRequest r) { return e->Submit(std::move(r)).status(); };
  GenerateRequest r = Greedy({1, 2, 3}, 4);
  r.input_ids[1] = 256;
  EXPECT_NE(std::string(code(r).message()).find("vocabulary"), std::string::npos);
  r = Greedy({}, 4);
  EXPECT_FALSE(code(r).ok());
  r = Greedy(Prompt(4096, 1), 4);
  EXPECT_NE(std::string(code(r).message()).find("context"), std::string::npos);
  r = Greedy({1}, 5000);
  EXPECT_NE(std::string(code(r).message()).find("context"), std::string::npos);
  r = Greedy({1}, 4);
  r.sampling.temperature = -1;
  EXPECT_FALSE(code(r).ok());
  r.sampling.temperature = 1;
  r.sampling.top_p = 0;
  EXPECT_FALSE(code(r).ok());
}

}  // namespace
}  // namespace bragg::engine
