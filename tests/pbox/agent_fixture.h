#pragma once

// Starts a real pboxd in a temp dir for a test and stops it afterwards.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/fs.h"
#include "common/process.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "pbox/client/client.h"

namespace bragg::pbox::testing {

struct AgentOptions {
  std::vector<std::string> extra_flags;
  bool tcp = false;  // also listen on tcp://127.0.0.1:0 with a token
};

// True when the suite runs its sandboxes on gVisor (PBOX_TEST_RUNTIME=gvisor).
bool OnGvisor();
// Why the agent's integration tests cannot run here, "" when they can: pboxd needs root, and
// PBOX_TEST_RUNTIME=gvisor needs runsc installed.
std::string AgentTestSkipReason();

// One pboxd process. Destruction SIGTERMs it and waits; if it did not exit cleanly (SIGKILLed
// by the test, or crashed) and was not restarted, destruction runs `pboxd --reap` on its state
// dir so that none of its sandboxes, mounts or cgroups outlive the test.
class TestAgent {
 public:
  // Starts pboxd and waits (up to 20 s) for its ready file.
  static Result<std::unique_ptr<TestAgent>> Start(const AgentOptions& options = {});
  ~TestAgent();

  const std::string& unix_endpoint() const { return unix_endpoint_; }
  const std::string& tcp_endpoint() const { return tcp_endpoint_; }
  const std::string& token() const { return token_; }
  const std::string& state_dir() const { return state_dir_; }
  const std::string& cgroup_parent() const { return cgroup_parent_; }
  const std::string& dir() const { return dir_.path(); }
  pid_t pid() const { return process_.pid(); }
  int metrics_port() const { return metrics_port_; }
  std::vector<std::string> flags() const { return flags_; }

  // A client of the unix socket.
  std::unique_ptr<client::Client> NewClient() const;
  // Sends `sig` and waits for exit.
  Result<ExitInfo> Stop(int sig);
  // Starts the agent again with the same flags (after Stop).
  Status Restart();
  // Runs `pboxd --reap` on this agent's state dir (with its --cgroup and --cgroup-parent
  // flags) and returns what it printed; an error with its stderr if it exits non-zero.
  Result<std::string> Reap();

 private:
  TestAgent() = default;
  Status Launch();

  TempDir dir_;
  std::string state_dir_, cgroup_parent_, unix_endpoint_, tcp_endpoint_, token_, ready_file_;
  std::vector<std::string> flags_;
  ChildProcess process_;
  std::optional<ExitInfo> last_exit_;  // of the latest run, once it was waited for
  int metrics_port_ = 0;
};

// A suite whose tests share one pboxd: started with `Suite::AgentFlags()` (and a TCP listener)
// before the suite's first test, stopped after its last. Every test skips where
// AgentTestSkipReason() says so and gets its own unix-socket client. A suite that adds to
// SetUp() calls this one first and returns if IsSkipped().
template <typename Suite>
class SharedAgentTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!AgentTestSkipReason().empty()) {
      return;
    }
    auto a = TestAgent::Start({.extra_flags = Suite::AgentFlags(), .tcp = true});
    ASSERT_TRUE(a.ok()) << a.status();
    agent_ = std::move(*a);
  }
  static void TearDownTestSuite() { agent_.reset(); }
  void SetUp() override {
    if (std::string why = AgentTestSkipReason(); !why.empty()) {
      GTEST_SKIP() << why;
    }
    ASSERT_NE(agent_, nullptr);
    client_ = agent_->NewClient();
    ASSERT_NE(client_, nullptr);
  }

  static inline std::unique_ptr<TestAgent> agent_;
  std::unique_ptr<client::Client> client_;
};

}  // namespace bragg::pbox::testing
