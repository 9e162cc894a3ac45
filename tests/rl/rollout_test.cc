// RunRollout, the agent loop, against an in-process bragg-sim-worker with scripted tools and
// verifiers: the trajectory is exactly the ids the worker saw and produced (checked by asking
// the worker again, turn by turn), and every way a turn, a tool or a verifier can fail ends as
// the documented result.

#include "rl/rollout.h"

#include <gtest/gtest.h>

#include <deque>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gateway/client.h"
#include "gateway/sim/sim_worker.h"
#include "rl/config.h"
#include "rl/tool_server.h"
#include "rl/vocab.h"

namespace bragg::rl {
namespace {

using json = nlohmann::json;

// Replies in order; records what the loop sent and how often it restarted the server.
class ScriptedTools : public ToolChannel {
 public:
  explicit ScriptedTools(std::deque<ToolReply> replies) : replies_(std::move(replies)) {}
  ToolReply Call(std::string_view text, std::chrono::milliseconds) override {
    seen.emplace_back(text);
    if (replies_.empty()) {
      ToolReply done;
      done.done = true;
      return done;
    }
    ToolReply r = replies_.front();
    replies_.pop_front();
    return r;
  }
  Status Restart() override {
    ++restarts;
    return absl::OkStatus();
  }
  std::vector<std::string> seen;
  int restarts = 0;

 private:
  std::deque<ToolReply> replies_;
};

ToolReply Observation(std::string text) {
  ToolReply r;
  r.observation = std::move(text);
  r.tool = "t";
  return r;
}

class RolloutTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::vector<std::string> tokens = {"<eos>", "\n", " ", ".", ":"};
    for (char c = 'a'; c <= 'z'; ++c) tokens.emplace_back(1, c);
    for (char c = '0'; c <= '9'; ++c) tokens.emplace_back(1, c);
    auto v = Vocab::FromTokens(tokens);
    ASSERT_TRUE(v.ok()) << v.status();
    vocab_ = std::move(*v);
    gateway::SimWorkerOptions o;
    o.vocab = static_cast<int>(vocab_.size());
    o.seed = 7;
    worker_ = std::make_unique<gateway::SimWorker>(o);
    ASSERT_TRUE(worker_->Start().ok());
    task_.max_turns = 3;
    task_.max_new_tokens = 5;
    task_.max_tokens = 200;
    client_ = MakeClient(true);
  }

  std::unique_ptr<gateway::RolloutClient> MakeClient(bool logprobs) {
    gateway::ClientOptions co;
    co.return_logprob = logprobs;
    co.return_routed_experts = true;
    auto c = gateway::RolloutClient::Create(worker_->url(), co);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  RolloutEnv Env(ToolChannel* tools, Verifier verify) {
    return RolloutEnv{&vocab_,
                      &task_,
                      {*vocab_.Id("\n")},
                      client_.get(),
                      tools,
                      std::move(verify),
                      [this](int d) { in_flight_ += d; }};
  }

  static Verifier Prints(std::string out, json* input = nullptr) {
    return [out, input](const std::string& in) -> Result<VerifierOutput> {
      if (input != nullptr) *input = json::parse(in);
      return VerifierOutput{"", out};
    };
  }

  Vocab vocab_ = *Vocab::FromTokens({"a"});
  TaskConfig task_;
  std::unique_ptr<gateway::SimWorker> worker_;
  std::unique_ptr<gateway::RolloutClient> client_;
  int in_flight_ = 0;
};

TEST_F(RolloutTest, TrajectoryIsExactlyWhatTheWorkerSawAndProduced) {
  ToolReply failed = Observation("error: the tool timed out");
  failed.error = true;
  failed.failure = "timeout";
  ScriptedTools tools({Observation("fcc 4.05"), failed});
  json verifier_input;
  auto r = RunRollout(Env(&tools, Prints(" 0.75\n", &verifier_input)), "r1", "g1",
                      Prompt{"al cu", R"({"element": "al"})", ""}, SamplingConfig{}, 11);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->dropped, "") << r->detail;
  EXPECT_DOUBLE_EQ(r->reward, 0.75);
  EXPECT_DOUBLE_EQ(r->trajectory.reward, 0.75);
  EXPECT_TRUE(r->done);  // the script ran out: the server said done on the third call
  EXPECT_EQ(r->turn_count, 3);
  EXPECT_EQ(r->generated_tokens, 15);
  EXPECT_EQ(r->generate_retries, 0);
  EXPECT_EQ(in_flight_, 0);
  // The hung tool was restarted once; the model saw the error.
  EXPECT_EQ(tools.restarts, 1);
  ASSERT_EQ(tools.seen.size(), 3u);
  ASSERT_EQ(r->tool_calls.size(), 3u);
  EXPECT_EQ(r->tool_calls[1].failure, "timeout");
  EXPECT_TRUE(r->tool_calls[1].error);

  const train::Trajectory& t = r->trajectory;
  EXPECT_EQ(t.id, "r1");
  EXPECT_EQ(t.group, "g1");
  ASSERT_EQ(t.loss_mask.size(), t.tokens.size());
  ASSERT_EQ(t.logprobs.size(), t.tokens.size());
  ASSERT_EQ(t.versions.size(), t.tokens.size());
  std::vector<int32_t> prompt = *vocab_.Encode("al cu");
  std::vector<int32_t> obs1 = vocab_.EncodeLossy("fcc 4.05");
  std::vector<int32_t> obs2 = vocab_.EncodeLossy("error: the tool timed out");
  // prompt, turn, observation, turn, observation, turn: no trailing observation.
  ASSERT_EQ(t.tokens.size(), prompt.size() + 5 + obs1.size() + 5 + obs2.size() + 5);
  EXPECT_TRUE(std::equal(prompt.begin(), prompt.end(), t.tokens.begin()));

  // Ask the worker again for each turn with the trajectory's prefix: the same ids and
  // log-probs must come back, at the same places.
  auto replay = MakeClient(true);
  json sp = {{"max_new_tokens", 5}};
  size_t at = prompt.size();
  const std::vector<size_t> obs_len = {obs1.size(), obs2.size(), 0};
  for (int turn = 0; turn < 3; ++turn) {
    std::vector<int32_t> prefix(t.tokens.begin(), t.tokens.begin() + static_cast<long>(at));
    auto out = replay->Generate("replay-" + std::to_string(turn), prefix, sp);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->output_ids.size(), 5u);
    const json& lps = out->meta_info["output_token_logprobs"];
    for (size_t i = 0; i < 5; ++i) {
      EXPECT_EQ(t.tokens[at + i], out->output_ids[i]) << "turn " << turn << " token " << i;
      EXPECT_EQ(t.loss_mask[at + i], 1);
      EXPECT_FLOAT_EQ(t.logprobs[at + i], lps[i][0].get<float>());
      EXPECT_EQ(t.versions[at + i], 0);
    }
    EXPECT_EQ(vocab_.Decode(out->output_ids), r->turns[static_cast<size_t>(turn)]);
    EXPECT_EQ(tools.seen[static_cast<size_t>(turn)], r->turns[static_cast<size_t>(turn)]);
    at += 5;
    for (size_t i = 0; i < obs_len[static_cast<size_t>(turn)]; ++i, ++at) {
      EXPECT_EQ(t.loss_mask[at], 0);
      EXPECT_EQ(t.logprobs[at], 0.0f);
      EXPECT_EQ(t.versions[at], -1);
    }
  }
  for (size_t i = 0; i < prompt.size(); ++i) {
    EXPECT_EQ(t.loss_mask[i], 0);
    EXPECT_EQ(t.versions[i], -1);
  }
  // Routed experts for every token but the last, as delta router replay assembled them.
  EXPECT_FALSE(t.routed_experts.empty());

  // The verifier saw the rollout as the protocol says.
  EXPECT_EQ(verifier_input["prompt"], "al cu");
  EXPECT_EQ(verifier_input["meta"]["element"], "al");
  EXPECT_EQ(verifier_input["turns"].size(), 3u);
  EXPECT_EQ(verifier_input["observations"], json::array({"fcc 4.05", "error: the tool timed out"}));
  EXPECT_EQ(verifier_input["done"], true);
}

TEST_F(RolloutTest, EveryVerifierFailureIsADroppedResultWithItsReason) {
  struct Case {
    Verifier verify;
    std::string dropped;
  };
  std::vector<Case> cases = {
      {Prints("0.5"), ""},
      {Prints("nan"), "verifier_no_number"},
      {Prints("inf"), "verifier_no_number"},
      {Prints("1.0 extra"), "verifier_no_number"},
      {Prints(""), "verifier_no_number"},
      {Prints("\x80\xff not utf-8"), "verifier_no_number"},
      {[](const std::string&) -> Result<VerifierOutput> {
         return VerifierOutput{"exit 1 signal 0: Traceback", "1.0"};
       },
       "verifier_failed"},
      {[](const std::string&) -> Result<VerifierOutput> {
         return absl::UnavailableError("sandbox gone");
       },
       "sandbox_failed"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    ScriptedTools tools({});
    auto r = RunRollout(Env(&tools, cases[i].verify), "v" + std::to_string(i), "g", Prompt{"al cu"},
                        SamplingConfig{}, i);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->dropped, cases[i].dropped) << "case " << i << ": " << r->detail;
    EXPECT_EQ(r->turn_count, 1);
  }
  // The message names what scored: a verifier process, or the tool server's verify line.
  ScriptedTools tools({});
  auto r = RunRollout(Env(&tools, Prints("high")), "w", "g", Prompt{"al cu"}, SamplingConfig{}, 9);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->detail, "the verifier printed \"high\"");
  task_.verifier_in_tool_server = true;
  ScriptedTools tools2({});
  r = RunRollout(Env(&tools2, Prints(R"({"reward": "high"})")), "x", "g", Prompt{"al cu"},
                 SamplingConfig{}, 10);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->dropped, "verifier_no_number");
  EXPECT_EQ(r->detail, R"(the tool server's verify answered "{\"reward\": \"high\"}")");
}

TEST_F(RolloutTest, ObservationsAreCutToTheTokenBudgetAndTheTrajectoryEndsOnAModelTurn) {
  task_.max_tokens = 20;  // prompt 5 + turn 5 + at most 10 observation tokens
  ScriptedTools tools({Observation(std::string(100, 'x'))});
  auto r = RunRollout(Env(&tools, Prints("1")), "b", "g", Prompt{"al cu"}, SamplingConfig{}, 1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->dropped, "") << r->detail;
  // The observation filled the budget, so no second turn; the unseen observation is not kept.
  EXPECT_EQ(r->turn_count, 1);
  EXPECT_FALSE(r->done);
  EXPECT_EQ(r->trajectory.tokens.size(), 10u);
  EXPECT_EQ(r->trajectory.loss_mask.back(), 1);
}

TEST_F(RolloutTest, APromptTheVocabularyCannotEncodeIsAnError) {
  ScriptedTools tools({});
  auto r = RunRollout(Env(&tools, Prints("1")), "p", "g", Prompt{"AL CU"}, SamplingConfig{}, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(tools.seen.empty());
}

TEST_F(RolloutTest, AWorkerThatKeepsFailingIsRetriedThenDropped) {
  httplib::Client c(worker_->url());
  auto set = c.Post("/sim/config", R"({"error_rate": 1.0})", "application/json");
  ASSERT_TRUE(set && set->status == 200);
  ScriptedTools tools({});
  auto r = RunRollout(Env(&tools, Prints("1")), "e", "g", Prompt{"al cu"}, SamplingConfig{}, 1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->dropped, "generate_failed");
  EXPECT_NE(r->detail.find("injected failure"), std::string::npos) << r->detail;
  EXPECT_EQ(r->generate_retries, 3);
  EXPECT_EQ(in_flight_, 0);
  EXPECT_TRUE(tools.seen.empty());
}

TEST_F(RolloutTest, AnswersWithoutLogProbsAreNotTrainedOn) {
  client_ = MakeClient(false);
  ScriptedTools tools({});
  auto r = RunRollout(Env(&tools, Prints("1")), "l", "g", Prompt{"al cu"}, SamplingConfig{}, 1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->dropped, "bad_logprobs");
}

}  // namespace
}  // namespace bragg::rl
