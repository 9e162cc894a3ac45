// ClusterClient against three real pboxd agents on loopback TCP with tokens: placement by load
// and by name, the endpoints file and $PBOX_ENDPOINTS, one session spanning every node, and an
// agent SIGKILLed mid-session.

#include "pbox/client/cluster_client.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <thread>

#include "agent_fixture.h"
#include "common/fs.h"
#include "common/unique_fd.h"
#include "fmt/format.h"

namespace bragg::pbox::testing {
namespace {

using client::ClusterClient;
using client::ClusterOptions;
using client::ClusterSandbox;
using ::testing::HasSubstr;
namespace v1 = bragg::pbox::v1;

constexpr int kAgents = 3;
const char* const kNames[kAgents] = {"node-a", "node-b", "node-c"};

v1::SandboxSpec SmallSpec() {
  v1::SandboxSpec spec;
  spec.set_memory_bytes(64 << 20);
  spec.set_idle_ttl_seconds(300);  // detached ones go even if a test fails half-way
  return spec;
}

class ClusterClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (geteuid() != 0) {
      return;
    }
    for (int i = 0; i < kAgents; ++i) {
      auto a = TestAgent::Start({.extra_flags = {"--max-sandboxes", "32"}, .tcp = true});
      ASSERT_TRUE(a.ok()) << a.status();
      agents_[i] = a->release();
    }
  }
  static void TearDownTestSuite() {
    for (auto*& a : agents_) {
      delete a;
      a = nullptr;
    }
  }

  void SetUp() override {
    if (geteuid() != 0) {
      GTEST_SKIP() << "pboxd needs root (namespaces, mounts, cgroups)";
    }
    for (int i = 0; i < kAgents; ++i) {
      ASSERT_NE(agents_[i], nullptr);
      ASSERT_FALSE(agents_[i]->tcp_endpoint().empty());
    }
    auto d = TempDir::Create("/tmp", "pbox-cluster-test-");
    ASSERT_TRUE(d.ok()) << d.status();
    dir_ = std::move(*d);
  }

  void TearDown() override {
    // Every test leaves every agent empty.
    for (int i = 0; i < kAgents; ++i) {
      if (agents_[i] == nullptr) {
        continue;
      }
      auto c = agents_[i]->NewClient();
      auto list = c->List();
      if (!list.ok()) {
        continue;
      }
      for (const auto& sb : *list) {
        (void)c->Destroy(sb.id());
      }
    }
  }

  // The endpoints file as deploy/slurm/pbox-slurm writes it: node names, TCP endpoints,
  // cpusets and each node's token file. `cpusets[i]` empty: no cpuset for that node.
  std::string WriteEndpointsFile(const std::vector<int>& which,
                                 const std::vector<std::string>& cpusets = {}) {
    nlohmann::json nodes = nlohmann::json::array();
    for (size_t k = 0; k < which.size(); ++k) {
      TestAgent* a = agents_[which[k]];
      std::string ep = a->tcp_endpoint();
      size_t colon = ep.rfind(':');
      nlohmann::json n = {{"node", kNames[which[k]]},
                          {"host", ep.substr(6, colon - 6)},
                          {"port", std::stoi(ep.substr(colon + 1))},
                          {"endpoint", ep},
                          {"token_file", a->dir() + "/token"}};
      if (k < cpusets.size() && !cpusets[k].empty()) {
        n["cpuset"] = cpusets[k];
      }
      nodes.push_back(n);
    }
    std::string path = dir_.path() + "/endpoints.json";
    EXPECT_TRUE(
        WriteStringToFile(path, nlohmann::json{{"job_id", "7"}, {"nodes", nodes}}.dump()).ok());
    return path;
  }

  // Health deadlines long enough for a loaded machine: a slow agent must not look down here.
  std::unique_ptr<ClusterClient> Connect(ClusterOptions options) {
    options.health_timeout_ms = 30000;
    auto c = ClusterClient::Connect(options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // What the agent itself holds (ground truth, over its unix socket).
  static std::vector<v1::Sandbox> Held(int i, const std::string& session_id = "") {
    auto list = agents_[i]->NewClient()->List(session_id);
    EXPECT_TRUE(list.ok()) << list.status();
    return list.ok() ? *list : std::vector<v1::Sandbox>{};
  }

  static TestAgent* agents_[kAgents];
  TempDir dir_;
};

TestAgent* ClusterClientTest::agents_[kAgents] = {};

TEST_F(ClusterClientTest, SpreadsByLoadPerSandboxCpu) {
  // node-a counts 1 sandbox CPU, node-b 2: the fewest sandboxes per CPU is b twice as often.
  auto cluster =
      Connect({.endpoints_file = WriteEndpointsFile({0, 1}, {"7", "6-7"}), .refresh_ms = 60000});
  ASSERT_NE(cluster, nullptr);
  std::vector<ClusterSandbox> made;
  for (int k = 0; k < 6; ++k) {
    auto sb = cluster->Create(SmallSpec());
    ASSERT_TRUE(sb.ok()) << sb.status();
    made.push_back(*sb);
  }
  std::map<std::string, int> by_node;
  for (const auto& sb : made) {
    by_node[sb.node()]++;
  }
  EXPECT_EQ(by_node["node-a"], 2);
  EXPECT_EQ(by_node["node-b"], 4);
  EXPECT_EQ(Held(0).size(), 2u);
  EXPECT_EQ(Held(1).size(), 4u);
  EXPECT_TRUE(Held(2).empty());

  // Each handle talks to its own node: a file written through it is read back there and is
  // not on the other node.
  for (const auto& sb : made) {
    ASSERT_TRUE(sb.WriteFile("/tmp/who", sb.node()).ok());
    auto back = sb.ReadFile("/tmp/who");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, sb.node());
    auto r = sb.Run({.argv = {"cat", "/tmp/who"}});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->stdout(), sb.node());
    std::string other = sb.node() == "node-a" ? "node-b" : "node-a";
    auto wrong = (*cluster->client(other))->Get(sb.id());
    EXPECT_EQ(wrong.status().code(), absl::StatusCode::kNotFound);
    auto found = cluster->Find(sb.id());
    ASSERT_TRUE(found.ok()) << found.status();
    EXPECT_EQ(found->node(), sb.node());
  }
  for (const auto& sb : made) {
    EXPECT_TRUE(sb.Destroy().ok());
  }
  EXPECT_TRUE(Held(0).empty());
  EXPECT_TRUE(Held(1).empty());
  EXPECT_EQ(cluster->Find(made[0].id()).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ClusterClientTest, CountsSandboxesOthersMade) {
  // Two sandboxes made on node-a outside this client: the agents' Health counts them, so the
  // next two go to b and c, and only then a again.
  auto direct = agents_[0]->NewClient();
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(direct->Create(SmallSpec()).ok());
  }
  auto cluster = Connect({.endpoints_file = WriteEndpointsFile({0, 1, 2}), .refresh_ms = 0});
  ASSERT_NE(cluster, nullptr);
  std::vector<std::string> order;
  for (int k = 0; k < 5; ++k) {
    auto sb = cluster->Create(SmallSpec());
    ASSERT_TRUE(sb.ok()) << sb.status();
    order.push_back(sb->node());
  }
  // Loads (a, b, c) go 2,0,0 -> b; 2,1,0 -> c; 2,1,1 -> b; 2,2,1 -> c; 2,2,2 -> a.
  EXPECT_EQ(order, (std::vector<std::string>{"node-b", "node-c", "node-b", "node-c", "node-a"}));
  auto loads = cluster->Loads();
  ASSERT_EQ(loads.size(), 3u);
  EXPECT_EQ(loads[0].live + loads[0].added, 3);
  EXPECT_EQ(loads[0].inflight, 0);
  EXPECT_FALSE(loads[0].down);
}

TEST_F(ClusterClientTest, ConcurrentCreatesSpread) {
  auto cluster = Connect({.endpoints_file = WriteEndpointsFile({0, 1, 2}), .refresh_ms = 60000});
  ASSERT_NE(cluster, nullptr);
  // Health once, so that the creates below race only on their own reservations.
  for (const auto& [node, h] : cluster->Health()) {
    ASSERT_TRUE(h.ok()) << h.status();
  }
  std::vector<std::thread> threads;
  std::vector<Result<ClusterSandbox>> res(6, absl::UnknownError("not run"));
  for (int k = 0; k < 6; ++k) {
    threads.emplace_back([&, k] { res[k] = cluster->Create(SmallSpec()); });
  }
  for (auto& t : threads) {
    t.join();
  }
  for (const auto& r : res) {
    ASSERT_TRUE(r.ok()) << r.status();
  }
  for (int i = 0; i < kAgents; ++i) {
    EXPECT_EQ(Held(i).size(), 2u) << kNames[i];
  }

  // Many threads through one session with Health refreshed on every create: each handle's
  // node holds its sandbox, and the session counts them all.
  auto busy = Connect({.endpoints_file = WriteEndpointsFile({0, 1, 2}), .refresh_ms = 0});
  ASSERT_NE(busy, nullptr);
  auto session = busy->OpenSession("busy");
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<std::vector<Result<ClusterSandbox>>> made(12);
  threads.clear();
  for (int t = 0; t < 12; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < 2; ++k) {
        made[t].push_back((*session)->Create(SmallSpec()));
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  for (const auto& per_thread : made) {
    for (const auto& sb : per_thread) {
      ASSERT_TRUE(sb.ok()) << sb.status();
      auto got = (*busy->client(sb->node()))->Get(sb->id());
      EXPECT_TRUE(got.ok()) << sb->node() << " " << got.status();
    }
  }
  auto listed = (*session)->List();
  ASSERT_TRUE(listed.ok()) << listed.status();
  size_t total = 0;
  for (const auto& [node, list] : *listed) {
    total += list.size();
    EXPECT_GE(list.size(), 2u) << node;  // spread, though refresh races may skew it
  }
  EXPECT_EQ(total, 24u);
  EXPECT_TRUE((*session)->Close().ok());
}

TEST_F(ClusterClientTest, NamedNodeIsNeverSubstituted) {
  auto cluster = Connect({.endpoints_file = WriteEndpointsFile({0, 1, 2}), .refresh_ms = 0});
  ASSERT_NE(cluster, nullptr);
  auto session = cluster->OpenSession("named");
  ASSERT_TRUE(session.ok()) << session.status();
  for (int k = 0; k < 3; ++k) {
    auto sb = (*session)->Create(SmallSpec(), "node-c");
    ASSERT_TRUE(sb.ok()) << sb.status();
    EXPECT_EQ(sb->node(), "node-c");
  }
  EXPECT_EQ(Held(2, (*session)->ids().at("node-c")).size(), 3u);
  EXPECT_TRUE(Held(0).empty());
  EXPECT_TRUE(Held(1).empty());
  // Least-loaded placement now avoids c.
  auto sb = (*session)->Create(SmallSpec());
  ASSERT_TRUE(sb.ok()) << sb.status();
  EXPECT_EQ(sb->node(), "node-a");

  auto unknown = (*session)->Create(SmallSpec(), "node-z");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("node-a, node-b, node-c"));
  // A request the agent refuses is not retried elsewhere.
  v1::SandboxSpec huge = SmallSpec();
  huge.set_cpus(4096);
  auto refused = (*session)->Create(huge);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("node node-"));
}

TEST_F(ClusterClientTest, EnvironmentAndTokens) {
  std::string file = WriteEndpointsFile({0, 1});
  {
    // $PBOX_ENDPOINTS names the file; tokens come from its token_file entries.
    ::setenv("PBOX_ENDPOINTS", file.c_str(), 1);
    ::unsetenv("PBOX_TOKEN");
    ::unsetenv("PBOX_TOKEN_FILE");
    auto cluster = Connect({});
    ::unsetenv("PBOX_ENDPOINTS");
    ASSERT_NE(cluster, nullptr);
    EXPECT_EQ(cluster->nodes(), (std::vector<std::string>{"node-a", "node-b"}));
    EXPECT_TRUE(cluster->WaitHealthy(std::chrono::seconds(20)).ok());
  }
  std::string list = agents_[1]->tcp_endpoint() + "," + agents_[2]->tcp_endpoint();
  {
    // A list in $PBOX_ENDPOINTS and the token from $PBOX_TOKEN.
    ::setenv("PBOX_ENDPOINTS", list.c_str(), 1);
    ::setenv("PBOX_TOKEN", agents_[1]->token().c_str(), 1);
    auto cluster = Connect({});
    ::unsetenv("PBOX_ENDPOINTS");
    ::unsetenv("PBOX_TOKEN");
    ASSERT_NE(cluster, nullptr);
    EXPECT_EQ(cluster->nodes()[0], agents_[1]->tcp_endpoint());
    auto sb = cluster->Create(SmallSpec());
    ASSERT_TRUE(sb.ok()) << sb.status();
    EXPECT_EQ(sb->node(), agents_[1]->tcp_endpoint());
    EXPECT_TRUE(sb->Destroy().ok());
  }
  {
    // No token at all: UNAUTHENTICATED is a misconfiguration, returned rather than skipped.
    auto cluster = Connect({.endpoints = list});
    ASSERT_NE(cluster, nullptr);
    auto sb = cluster->Create(SmallSpec());
    EXPECT_EQ(sb.status().code(), absl::StatusCode::kUnauthenticated) << sb.status();
    EXPECT_THAT(std::string(sb.status().message()), HasSubstr("node tcp://"));
  }
  {
    // A wrong token in one node's token file.
    std::string bad = dir_.path() + "/bad-token";
    ASSERT_TRUE(WriteStringToFile(bad, "not-the-token\n").ok());
    nlohmann::json doc = nlohmann::json::parse(*ReadFileToString(file));
    doc["nodes"][1]["token_file"] = bad;
    ASSERT_TRUE(WriteStringToFile(file, doc.dump()).ok());
    auto cluster = Connect({.endpoints_file = file});
    ASSERT_NE(cluster, nullptr);
    auto sb = cluster->Create(SmallSpec(), "node-b");
    EXPECT_EQ(sb.status().code(), absl::StatusCode::kUnauthenticated) << sb.status();
    auto a = cluster->Create(SmallSpec(), "node-a");
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_TRUE(a->Destroy().ok());
  }
}

TEST_F(ClusterClientTest, SessionEndLeavesNothingOnAnyNode) {
  auto cluster = Connect({.endpoints_file = WriteEndpointsFile({0, 1, 2}), .refresh_ms = 0});
  ASSERT_NE(cluster, nullptr);
  std::map<std::string, std::string> ids;
  {
    auto session = cluster->OpenSession("span", "job-42");
    ASSERT_TRUE(session.ok()) << session.status();
    ids = (*session)->ids();
    ASSERT_EQ(ids.size(), 3u);
    for (int k = 0; k < 6; ++k) {
      auto sb = (*session)->Create(SmallSpec());
      ASSERT_TRUE(sb.ok()) << sb.status();
    }
    // One detached sandbox survives the session.
    auto detached = cluster->Create(SmallSpec(), "node-b");
    ASSERT_TRUE(detached.ok());
    auto listed = (*session)->List();
    ASSERT_TRUE(listed.ok()) << listed.status();
    for (int i = 0; i < kAgents; ++i) {
      EXPECT_EQ((*listed)[kNames[i]].size(), 2u) << kNames[i];
      EXPECT_EQ(Held(i, ids[kNames[i]]).size(), 2u) << kNames[i];
    }
    EXPECT_TRUE((*session)->Close().ok());
    for (int i = 0; i < kAgents; ++i) {
      EXPECT_TRUE(Held(i, ids[kNames[i]]).empty()) << kNames[i];
    }
    EXPECT_EQ(Held(1).size(), 1u);
    EXPECT_TRUE(detached->Destroy().ok());
    auto after = (*session)->Create(SmallSpec());
    EXPECT_EQ(after.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE((*session)->Close().ok());  // twice is fine
  }
  {
    // Dropping the object ends it too.
    auto session = cluster->OpenSession("dropped");
    ASSERT_TRUE(session.ok());
    for (int k = 0; k < 3; ++k) {
      ASSERT_TRUE((*session)->Create(SmallSpec()).ok());
    }
  }
  for (int i = 0; i < kAgents; ++i) {
    EXPECT_TRUE(Held(i).empty()) << kNames[i];
  }
}

TEST_F(ClusterClientTest, SilentNodeIsSkipped) {
  // A TCP listener that never speaks HTTP/2: its Health times out and placement goes on.
  UniqueFd sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(sock.valid());
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::bind(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(sock.get(), 16), 0);
  ASSERT_EQ(::getsockname(sock.get(), reinterpret_cast<sockaddr*>(&addr), &len), 0);
  std::string silent = fmt::format("tcp://127.0.0.1:{}", ntohs(addr.sin_port));
  // Not Connect(): the deadlines are short on purpose, yet long enough for node a under load.
  auto connected = ClusterClient::Connect({.nodes = {{.node = "silent", .endpoint = silent},
                                                     {.node = "a",
                                                      .endpoint = agents_[0]->tcp_endpoint(),
                                                      .token_file = agents_[0]->dir() + "/token"}},
                                           .health_timeout_ms = 3000,
                                           .session_open_timeout_ms = 3000,
                                           .refresh_ms = 60000});
  ASSERT_TRUE(connected.ok()) << connected.status();
  auto& cluster = *connected;
  auto sb = cluster->Create(SmallSpec());
  ASSERT_TRUE(sb.ok()) << sb.status();
  EXPECT_EQ(sb->node(), "a");
  auto loads = cluster->Loads();
  EXPECT_TRUE(loads[0].down);
  EXPECT_FALSE(loads[1].down);
  // Named, it answers at once from what placement learned.
  auto named = cluster->Create(SmallSpec(), "silent");
  EXPECT_EQ(named.status().code(), absl::StatusCode::kUnavailable) << named.status();
  EXPECT_THAT(std::string(named.status().message()), HasSubstr("node silent"));
  // A session cannot span it: the open times out and names it.
  auto session = cluster->OpenSession("s");
  EXPECT_EQ(session.status().code(), absl::StatusCode::kDeadlineExceeded) << session.status();
  EXPECT_THAT(std::string(session.status().message()), HasSubstr("node silent"));
  EXPECT_TRUE(sb->Destroy().ok());
}

struct Shell {
  int rc;
  std::string out;  // stdout and stderr
};

Shell RunShell(const std::string& cmd) {
  Shell r{-1, ""};
  FILE* f = ::popen((cmd + " 2>&1").c_str(), "r");
  if (f == nullptr) {
    return r;
  }
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) {
    r.out.append(buf, n);
  }
  int status = ::pclose(f);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

TEST_F(ClusterClientTest, CliAcrossNodes) {
  std::string file = WriteEndpointsFile({0, 1});
  std::string pbox =
      fmt::format("env -u PBOX_ENDPOINT -u PBOX_TOKEN -u PBOX_TOKEN_FILE {}", PBOX_CLI_PATH);
  std::string with_file = fmt::format("{} --endpoints {}", pbox, file);
  std::vector<std::string> ids;
  for (const char* extra : {"", "", "--node node-b"}) {
    auto r = RunShell(fmt::format("{} create --memory 64M --ttl 300 {}", with_file, extra));
    ASSERT_EQ(r.rc, 0) << r.out;
    ids.push_back(r.out.substr(0, r.out.find('\n')));
  }
  EXPECT_EQ(Held(0).size(), 1u);  // least loaded: a, then b; then b by name
  EXPECT_EQ(Held(1).size(), 2u);
  ASSERT_EQ(Held(0)[0].id(), ids[0]);

  // $PBOX_ENDPOINTS works as --endpoints; exec finds the node holding the id.
  auto r = RunShell(
      fmt::format("PBOX_ENDPOINTS={} {} exec {} -- sh -c 'echo hi; exit 3'", file, pbox, ids[1]));
  EXPECT_EQ(r.rc, 3) << r.out;
  EXPECT_EQ(r.out, "hi\n");
  r = RunShell(fmt::format("echo payload | {} cp - {}:/tmp/p && {} cp {}:/tmp/p -", with_file,
                           ids[2], with_file, ids[2]));
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out, "payload\n");
  r = RunShell(with_file + " ps");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("NODE"));
  EXPECT_THAT(r.out, HasSubstr("node-a"));
  EXPECT_THAT(r.out, HasSubstr("node-b"));
  r = RunShell(with_file + " ps -q");
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 3) << r.out;
  r = RunShell(with_file + " info");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("node:           node-b (tcp://"));

  r = RunShell(fmt::format("{} rm {} {} {}", with_file, ids[0], ids[1], ids[2]));
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(Held(0).empty());
  EXPECT_TRUE(Held(1).empty());

  // Wrong usage and hostile input.
  r = RunShell(fmt::format("{} exec {} -- true", with_file, ids[0]));
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_THAT(r.out, HasSubstr("is on no node of the cluster"));
  r = RunShell(with_file + " create --node node-z");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_THAT(r.out, HasSubstr("unknown node"));
  r = RunShell(with_file + " --endpoint unix:///x.sock ps");
  EXPECT_EQ(r.rc, 2) << r.out;
  r = RunShell(with_file + " image ls");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_THAT(r.out, HasSubstr("one agent"));
  r = RunShell(pbox + " --endpoint unix:///x.sock create --node node-a");
  EXPECT_EQ(r.rc, 2) << r.out;
  r = RunShell(pbox + " --endpoints " + dir_.path() + "/none.json ps");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_THAT(r.out, HasSubstr("none.json"));
  ASSERT_TRUE(WriteStringToFile(dir_.path() + "/junk.json", "{\"nodes\": [{\"port\": 1}]").ok());
  r = RunShell(pbox + " --endpoints " + dir_.path() + "/junk.json ps");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_THAT(r.out, HasSubstr("not JSON"));
}

// Last: it kills node-c (and starts it again afterwards).
TEST_F(ClusterClientTest, AgentKilledMidSession) {
  auto cluster = Connect({.endpoints_file = WriteEndpointsFile({0, 1, 2}), .refresh_ms = 200});
  ASSERT_NE(cluster, nullptr);
  auto session = cluster->OpenSession("survivor");
  ASSERT_TRUE(session.ok()) << session.status();
  for (int k = 0; k < 3; ++k) {
    ASSERT_TRUE((*session)->Create(SmallSpec()).ok());
  }
  // A second cluster over the unix sockets, whose paths survive the restart below.
  std::string unix_list;
  for (int i = 0; i < kAgents; ++i) {
    unix_list += (i ? "," : "") + agents_[i]->unix_endpoint();
  }
  auto unix_cluster = Connect({.endpoints = unix_list, .refresh_ms = 0});
  ASSERT_NE(unix_cluster, nullptr);
  auto unix_session = unix_cluster->OpenSession("outlives-c");
  ASSERT_TRUE(unix_session.ok()) << unix_session.status();

  auto killed = agents_[2]->Stop(SIGKILL);
  ASSERT_TRUE(killed.ok()) << killed.status();

  // Creates go to a and b; the session there still works.
  std::vector<ClusterSandbox> after;
  for (int k = 0; k < 4; ++k) {
    auto sb = (*session)->Create(SmallSpec());
    ASSERT_TRUE(sb.ok()) << sb.status();
    EXPECT_NE(sb->node(), "node-c");
    after.push_back(*sb);
  }
  EXPECT_EQ(Held(0, (*session)->ids().at("node-a")).size(), 3u);
  EXPECT_EQ(Held(1, (*session)->ids().at("node-b")).size(), 3u);
  auto r = after[0].Run({.argv = {"echo", "alive"}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->stdout(), "alive\n");
  auto loads = cluster->Loads();
  EXPECT_TRUE(loads[2].down);
  EXPECT_FALSE(loads[2].down_reason.empty());

  // Naming the dead node: UNAVAILABLE, never another node.
  auto named = (*session)->Create(SmallSpec(), "node-c");
  EXPECT_EQ(named.status().code(), absl::StatusCode::kUnavailable) << named.status();
  EXPECT_THAT(std::string(named.status().message()), HasSubstr("node-c"));

  // Ending the session reports the dead node and still empties the live ones.
  Status closed = (*session)->Close();
  EXPECT_EQ(closed.code(), absl::StatusCode::kUnavailable) << closed;
  EXPECT_THAT(std::string(closed.message()), HasSubstr("node-c"));
  EXPECT_TRUE(Held(0).empty());
  EXPECT_TRUE(Held(1).empty());

  // A new session cannot span a dead node (all or nothing), and says which.
  auto again = cluster->OpenSession("again");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("node node-c"));
  EXPECT_TRUE(Held(0).empty());
  EXPECT_TRUE(Held(1).empty());

  // The agent comes back on its state dir and reaps what the killed one left.
  ASSERT_TRUE(agents_[2]->Restart().ok());
  EXPECT_TRUE(Held(2).empty());

  // node-c answers Health again but no longer knows the session opened before: placement
  // passes it over (FAILED_PRECONDITION), and naming it says so.
  for (int k = 0; k < 3; ++k) {
    auto sb = (*unix_session)->Create(SmallSpec());
    ASSERT_TRUE(sb.ok()) << sb.status();
    EXPECT_NE(sb->node(), agents_[2]->unix_endpoint());
  }
  auto stale = (*unix_session)->Create(SmallSpec(), agents_[2]->unix_endpoint());
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
  EXPECT_TRUE(Held(2).empty());
  EXPECT_EQ(Held(0).size() + Held(1).size(), 3u);
  // Its part of the session died with the old agent: Close names it, and only it.
  Status unix_closed = (*unix_session)->Close();
  EXPECT_FALSE(unix_closed.ok());
  EXPECT_THAT(std::string(unix_closed.message()), HasSubstr(agents_[2]->unix_endpoint()));
  EXPECT_THAT(std::string(unix_closed.message()),
              ::testing::Not(HasSubstr(agents_[0]->unix_endpoint())));
  EXPECT_TRUE(Held(0).empty());
  EXPECT_TRUE(Held(1).empty());
}

}  // namespace
}  // namespace bragg::pbox::testing
