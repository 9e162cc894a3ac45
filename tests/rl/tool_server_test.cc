// rl's pieces that touch the outside: the vocabulary, and the tool server in a real pboxd's
// sandboxes (hangs, crashes, OOMs, garbage, slow partial replies, many at once).

#include "rl/tool_server.h"

#include <gtest/gtest.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <thread>

#include "agent_fixture.h"
#include "rl/vocab.h"

namespace bragg::rl {
namespace {

using namespace std::chrono_literals;
using pbox::testing::SharedAgentTest;

// ---- Vocab -----------------------------------------------------------------------------------

TEST(Vocab, GreedyLongestMatchAndRoundTrip) {
  auto v = Vocab::FromTokens({"<eos>", "<", "e", "o", "s", ">", "\n", "?", "ab", "a", "b"});
  ASSERT_TRUE(v.ok()) << v.status();
  auto ids = v->Encode("<eos>ab<e>a\n");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, (std::vector<int32_t>{0, 8, 1, 2, 5, 9, 6}));
  EXPECT_EQ(v->Decode(*ids), "<eos>ab<e>a\n");
  EXPECT_EQ(v->Id("<eos>"), 0);
  EXPECT_FALSE(v->Id("zz").has_value());
}

TEST(Vocab, RefusesWhatItCannotEncodeAndLossyReplaces) {
  auto v = Vocab::FromTokens({"a", "?", "\n"});
  ASSERT_TRUE(v.ok());
  auto bad = v->Encode("aXa");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("offset 1"), std::string::npos);
  // Unknown bytes, a multi-byte character (é) and a stray continuation byte: one "?" each.
  EXPECT_EQ(v->EncodeLossy("aX\xC3\xA9\x80\n"), (std::vector<int32_t>{0, 1, 1, 1, 2}));
  // Ids outside the vocabulary decode as U+FFFD, never read past the table.
  EXPECT_EQ(v->Decode(std::vector<int32_t>{0, -1, 7}), "a\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(Vocab, RefusesBadTables) {
  EXPECT_FALSE(Vocab::FromTokens({}).ok());
  EXPECT_FALSE(Vocab::FromTokens({"a", ""}).ok());
  EXPECT_FALSE(Vocab::FromTokens({"a", "b", "a"}).ok());
  EXPECT_FALSE(Vocab::Load("/nonexistent/vocab.json").ok());
}

// ---- ToolServer ------------------------------------------------------------------------------

// A tool server whose behaviour is chosen by the turn's text.
constexpr char kServer[] = R"PY(
import json, sys, time
for line in sys.stdin:
    req = json.loads(line)
    if "verify" in req:
        how = req["verify"]["prompt"]
        if how == "hang":
            time.sleep(3600)
        if how == "crash":
            sys.exit(4)
        if how == "garbage":
            print("not json", flush=True)
        elif how == "error":
            print(json.dumps({"error": "no reward for you"}), flush=True)
        elif how == "no number":
            print(json.dumps({"reward": "high"}), flush=True)
        else:
            print(json.dumps({"reward": len(req["verify"]["turns"]) + 0.5}), flush=True)
        continue
    text = req["text"]
    if text == "hang\n":
        time.sleep(3600)
    if text == "crash\n":
        sys.exit(3)
    if text == "oom\n":
        x = bytearray(1 << 30)
        x[::4096] = b"x" * len(x[::4096])
    if text == "garbage\n":
        print("this is not json", flush=True)
        continue
    if text == "slow\n":
        sys.stdout.write('{"observation": "sl')
        sys.stdout.flush()
        time.sleep(0.3)
        sys.stdout.write('ow\\n", "tool": "t"}\n')
        sys.stdout.flush()
        continue
    if text == "answer\n":
        print(json.dumps({"done": True}), flush=True)
        continue
    print(json.dumps({"observation": "got " + text, "tool": "echo"}), flush=True)
)PY";

class ToolServerTest : public SharedAgentTest<ToolServerTest> {
 public:
  // Keepalive pings every second: a client that does not answer them loses its connection, and
  // with it its session, within seconds.
  static std::vector<std::string> AgentFlags() { return {"--keepalive-ms", "1000"}; }

 protected:
  std::string NewSandbox(uint64_t memory = 256ull << 20) {
    pbox::client::v1::SandboxSpec spec;
    spec.set_memory_bytes(memory);
    auto sb = client_->Create(spec);
    EXPECT_TRUE(sb.ok()) << sb.status();
    if (!sb.ok()) return "";
    auto w = client_->WriteFile(sb->id(), "/task/server.py", kServer);
    EXPECT_TRUE(w.ok()) << w.status();
    sandboxes_.push_back(sb->id());
    return sb->id();
  }
  void TearDown() override {
    for (const std::string& id : sandboxes_) {
      (void)client_->Destroy(id);
    }
  }
  std::unique_ptr<ToolServer> Start(const std::string& sb) {
    auto s = ToolServer::Start(client_.get(), sb, {"python3", "-u", "/task/server.py"});
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }
  std::vector<std::string> sandboxes_;
};

TEST_F(ToolServerTest, AnswersEachTurnAndSaysDone) {
  auto s = Start(NewSandbox());
  ASSERT_NE(s, nullptr);
  for (int i = 0; i < 20; ++i) {
    ToolReply r = s->Call("lattice Al\n", 10s);
    ASSERT_EQ(r.failure, "");
    EXPECT_EQ(r.observation, "got lattice Al\n");
    EXPECT_EQ(r.tool, "echo");
    EXPECT_FALSE(r.done);
    EXPECT_GT(r.ms, 0);
    EXPECT_GT(r.bytes, r.observation.size());
  }
  ToolReply done = s->Call("answer\n", 10s);
  EXPECT_TRUE(done.done);
  EXPECT_EQ(done.failure, "");
  // Non-ASCII and control characters travel as JSON, not as raw lines.
  ToolReply odd = s->Call("a\"b\\c\x01\xC3\xA9\n", 10s);
  EXPECT_EQ(odd.failure, "");
  EXPECT_EQ(odd.observation, "got a\"b\\c\x01\xC3\xA9\n");
}

TEST_F(ToolServerTest, ASlowReplyInPiecesIsOneReply) {
  auto s = Start(NewSandbox());
  ASSERT_NE(s, nullptr);
  ToolReply r = s->Call("slow\n", 10s);
  EXPECT_EQ(r.failure, "");
  EXPECT_EQ(r.observation, "slow\n");
  EXPECT_GE(r.ms, 250);
}

TEST_F(ToolServerTest, AHangIsATimeoutAndRestartRecovers) {
  auto s = Start(NewSandbox());
  ASSERT_NE(s, nullptr);
  auto t0 = std::chrono::steady_clock::now();
  ToolReply r = s->Call("hang\n", 300ms);
  EXPECT_EQ(r.failure, "timeout");
  EXPECT_TRUE(r.error);
  EXPECT_EQ(r.observation, "error: tool timed out\n");
  ASSERT_TRUE(s->Restart().ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_EQ(s->Call("x\n", 10s).observation, "got x\n");
}

TEST_F(ToolServerTest, ACrashIsReportedWithItsExit) {
  auto s = Start(NewSandbox());
  ASSERT_NE(s, nullptr);
  ToolReply r = s->Call("crash\n", 10s);
  EXPECT_EQ(r.failure, "exited: exit 3");
  EXPECT_EQ(r.observation, "error: tool crashed\n");
  EXPECT_FALSE(s->alive());
  // Calls on a dead server fail fast, not at the timeout.
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_NE(s->Call("x\n", 10s).failure, "");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  ASSERT_TRUE(s->Restart().ok());
  EXPECT_EQ(s->Call("x\n", 10s).observation, "got x\n");
}

TEST_F(ToolServerTest, AnOomIsAnErrorObservation) {
  auto s = Start(NewSandbox(64ull << 20));
  ASSERT_NE(s, nullptr);
  ToolReply r = s->Call("oom\n", 20s);
  EXPECT_TRUE(r.error);
  EXPECT_TRUE(r.failure == "oom" || r.failure.rfind("exited:", 0) == 0) << r.failure;
  ASSERT_TRUE(s->Restart().ok());
  EXPECT_EQ(s->Call("x\n", 10s).observation, "got x\n");
}

TEST_F(ToolServerTest, GarbageIsABadReplyAndTheServerGoesOn) {
  auto s = Start(NewSandbox());
  ASSERT_NE(s, nullptr);
  ToolReply r = s->Call("garbage\n", 10s);
  EXPECT_EQ(r.failure.rfind("bad reply", 0), 0u) << r.failure;
  EXPECT_EQ(s->Call("x\n", 10s).observation, "got x\n");
}

TEST_F(ToolServerTest, AMissingProgramFailsItsFirstCall) {
  std::string sb = NewSandbox();
  auto s = ToolServer::Start(client_.get(), sb, {"/task/no-such-server"});
  ASSERT_TRUE(s.ok());  // the exec is asynchronous: its failure shows on the first call
  ToolReply r = (*s)->Call("x\n", 10s);
  EXPECT_NE(r.failure, "");
  EXPECT_TRUE(r.error);
}

TEST_F(ToolServerTest, DestroyingAHungServerIsBounded) {
  auto s = Start(NewSandbox());
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->Call("hang\n", 200ms).failure, "timeout");
  auto t0 = std::chrono::steady_clock::now();
  s.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
}

// bragg-rl holds its session for the whole run and may make no call for minutes (a warm start):
// the session and its sandboxes must outlive the agent's keepalive pings meanwhile.
TEST_F(ToolServerTest, AnIdleSessionOutlivesKeepalivePings) {
  auto session = client_->OpenSession("idle");
  ASSERT_TRUE(session.ok()) << session.status();
  pbox::client::v1::SandboxSpec spec;
  auto sb = client_->Create(spec, (*session)->id());
  ASSERT_TRUE(sb.ok()) << sb.status();
  std::this_thread::sleep_for(6s);
  EXPECT_TRUE(client_->Get(sb->id()).ok()) << "the idle session's sandbox is gone";
  EXPECT_TRUE((*session)->Close().ok());
  EXPECT_EQ(client_->Get(sb->id()).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ToolServerTest, ManyServersAtOnce) {
  constexpr int kN = 8;
  std::vector<std::string> ids;
  for (int i = 0; i < kN; ++i) ids.push_back(NewSandbox());
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  for (int i = 0; i < kN; ++i) {
    threads.emplace_back([&, i] {
      auto s = ToolServer::Start(client_.get(), ids[static_cast<size_t>(i)],
                                 {"python3", "-u", "/task/server.py"});
      if (!s.ok()) return;
      for (int k = 0; k < 10; ++k) {
        std::string text = "t" + std::to_string(i) + "-" + std::to_string(k) + "\n";
        if ((*s)->Call(text, 20s).observation == "got " + text) ++good;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(good.load(), kN * 10);
}

// ---- ToolServer::Verify (task.verifier_in_tool_server) -----------------------------------------

std::string Rollout(const std::string& how, int turns = 2) {
  nlohmann::json r = {{"prompt", how}, {"turns", nlohmann::json::array()}};
  for (int i = 0; i < turns; ++i) r["turns"].push_back("t\n");
  return r.dump();
}

TEST_F(ToolServerTest, VerifyScoresBetweenTurnsAndEveryFailureIsNamed) {
  auto s = Start(NewSandbox());
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->Call("a\n", 10s).observation, "got a\n");
  VerifierOutput v = s->Verify(Rollout("score", 3), 10s);
  EXPECT_EQ(v.failure, "");
  EXPECT_EQ(v.output, "3.5");
  // The server goes on after a verify, and after each failure it can answer in step.
  EXPECT_EQ(s->Call("b\n", 10s).observation, "got b\n");
  v = s->Verify(Rollout("error"), 10s);
  EXPECT_EQ(v.failure, "the tool server's verify failed: no reward for you");
  v = s->Verify(Rollout("no number"), 10s);
  EXPECT_EQ(v.failure, "");
  EXPECT_EQ(v.output, R"({"reward": "high"})");  // the caller drops it as verifier_no_number
  v = s->Verify(Rollout("garbage"), 10s);
  EXPECT_EQ(v.failure.rfind("the tool server's verify: bad reply: not a JSON object", 0), 0u)
      << v.failure;
  EXPECT_EQ(s->Verify(Rollout("score", 0), 10s).output, "0.5");
  // Only a JSON object is sent as a rollout: nothing else reaches the server.
  EXPECT_EQ(s->Verify("[1, 2]", 10s).failure, "the rollout to verify is not a JSON object");
  EXPECT_EQ(s->Verify("{not json", 10s).failure, "the rollout to verify is not a JSON object");
  EXPECT_EQ(s->Call("c\n", 10s).observation, "got c\n");
}

TEST_F(ToolServerTest, VerifyOnAServerThatDiedStartsItAgain) {
  auto s = Start(NewSandbox());
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->Call("crash\n", 10s).failure, "exited: exit 3");  // the last turn crashed it
  VerifierOutput v = s->Verify(Rollout("score"), 10s);
  EXPECT_EQ(v.failure, "");
  EXPECT_EQ(v.output, "2.5");
  // A verify that crashes the server is a failure with its exit, not a hang.
  auto t0 = std::chrono::steady_clock::now();
  v = s->Verify(Rollout("crash"), 10s);
  EXPECT_EQ(v.failure.rfind("the tool server's verify: exited: exit 4", 0), 0u) << v.failure;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_FALSE(s->alive());
  EXPECT_EQ(s->Verify(Rollout("score", 1), 10s).output, "1.5");
}

TEST_F(ToolServerTest, AVerifyThatHangsTimesOut) {
  auto s = Start(NewSandbox());
  ASSERT_NE(s, nullptr);
  auto t0 = std::chrono::steady_clock::now();
  VerifierOutput v = s->Verify(Rollout("hang"), 300ms);
  EXPECT_EQ(v.failure.rfind("the tool server's verify: timeout", 0), 0u) << v.failure;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  // The server is still hung: destroying it stays bounded.
  t0 = std::chrono::steady_clock::now();
  s.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
}

}  // namespace
}  // namespace bragg::rl
