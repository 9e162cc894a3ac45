// The endpoints file, endpoint lists and $PBOX_ENDPOINTS, held to the rules of the Python
// client (python/pbox/cluster.py), and ClusterClient's checks that need no agent.

#include "pbox/client/endpoints.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "common/fs.h"
#include "pbox/client/cluster_client.h"

namespace bragg::pbox::client {
namespace {

using ::testing::HasSubstr;

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = ::getenv(name);
    had_ = old != nullptr;
    old_ = had_ ? old : "";
    if (value == nullptr) {
      ::unsetenv(name);
    } else {
      ::setenv(name, value, 1);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      ::setenv(name_, old_.c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  bool had_;
  std::string old_;
};

class EndpointsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto d = TempDir::Create("/tmp", "pbox-endpoints-test-");
    ASSERT_TRUE(d.ok()) << d.status();
    dir_ = std::move(*d);
  }
  std::string Write(const std::string& name, const std::string& text) {
    std::string path = dir_.path() + "/" + name;
    EXPECT_TRUE(WriteStringToFile(path, text).ok());
    return path;
  }
  TempDir dir_;
};

void ExpectInvalid(const Status& s, const std::string& part) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(part));
}

TEST(CanonicalEndpointTest, AcceptsThePythonClientsForms) {
  EXPECT_EQ(*CanonicalEndpoint("tcp://10.0.0.1:40123"), "tcp://10.0.0.1:40123");
  EXPECT_EQ(*CanonicalEndpoint("tcp://[::1]:80"), "tcp://[::1]:80");
  EXPECT_EQ(*CanonicalEndpoint("tcp://host:80/"), "tcp://host:80/");
  EXPECT_EQ(*CanonicalEndpoint("unix:///run/pbox/pbox.sock"), "unix:///run/pbox/pbox.sock");
  EXPECT_EQ(*CanonicalEndpoint("/run/pbox/pbox.sock"), "unix:///run/pbox/pbox.sock");
  for (const char* bad : {"", "tcp://host", "tcp://host:", "tcp://host:8x", "unix://rel/path",
                          "unix://", "http://host:80", "host:80", "relative/path"}) {
    EXPECT_EQ(CanonicalEndpoint(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(CountCpuListTest, CountsDistinctCpus) {
  EXPECT_EQ(*CountCpuList("56-63"), 8u);
  EXPECT_EQ(*CountCpuList("0-3,8,10-11"), 7u);
  EXPECT_EQ(*CountCpuList(" 0-3 , 2-5 \n"), 6u);  // overlap counted once
  EXPECT_EQ(*CountCpuList("5,5,5"), 1u);
  EXPECT_EQ(*CountCpuList("0000007"), 1u);
  EXPECT_EQ(*CountCpuList("0-65535"), 65536u);
  for (const char* bad : {"", " ", "a", "-1", "3-1", "1-", "1,,2", "1-2-3", "65536", "0-65536",
                          "99999999999999999999", "1 2", "0x1"}) {
    EXPECT_EQ(CountCpuList(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(ParseEndpointListTest, NamesNodesByEndpoint) {
  auto eps = ParseEndpointList(" tcp://a:1 ,,/run/b.sock, ");
  ASSERT_TRUE(eps.ok()) << eps.status();
  ASSERT_EQ(eps->size(), 2u);
  EXPECT_EQ((*eps)[0].node, "tcp://a:1");
  EXPECT_EQ((*eps)[0].endpoint, "tcp://a:1");
  EXPECT_EQ((*eps)[1].node, "unix:///run/b.sock");
  EXPECT_TRUE((*eps)[0].token_file.empty());
  ExpectInvalid(ParseEndpointList(" , ").status(), "empty endpoint list");
  ExpectInvalid(ParseEndpointList("").status(), "empty endpoint list");
  ExpectInvalid(ParseEndpointList("tcp://a:1,/x,unix:///x").status(), "duplicate");
  ExpectInvalid(ParseEndpointList("tcp://a:1,tcp://b").status(), "tcp://HOST:PORT");
}

TEST(ParseEndpointsJsonTest, ReadsTheLaunchersFile) {
  // As deploy/slurm/pbox-slurm writes it.
  const char* doc = R"({"job_id": "123", "token_file": "/shared/token",
    "nodes": [{"node": "n1", "host": "10.0.0.1", "port": 40123,
               "endpoint": "tcp://10.0.0.1:40123", "cpuset": "56-63", "trainer_cpus": "0-55",
               "job_cpus": "0-63", "token_file": "/shared/token", "pid": 42,
               "unix_endpoint": "unix:///tmp/x/pbox.sock", "scratch": "/tmp/x", "step_id": "0"},
              {"node": "n2", "host": "10.0.0.2", "port": 40124, "cpuset": "0-3,8",
               "token_file": "/other/token"},
              {"host": "fe80::1", "port": 7},
              {"endpoint": "/run/p.sock"}]})";
  auto eps = ParseEndpointsJson(doc, "f");
  ASSERT_TRUE(eps.ok()) << eps.status();
  ASSERT_EQ(eps->size(), 4u);
  const auto& e = *eps;
  EXPECT_EQ(e[0].node, "n1");
  EXPECT_EQ(e[0].endpoint, "tcp://10.0.0.1:40123");
  EXPECT_EQ(e[0].cpuset, "56-63");
  EXPECT_EQ(e[0].trainer_cpus, "0-55");
  EXPECT_EQ(e[0].token_file, "/shared/token");
  EXPECT_EQ(e[1].endpoint, "tcp://10.0.0.2:40124");  // from host and port
  EXPECT_EQ(e[1].token_file, "/other/token");        // per node beats top level
  EXPECT_EQ(e[2].node, "fe80::1");                   // no "node": the host
  EXPECT_EQ(e[2].endpoint, "tcp://[fe80::1]:7");
  EXPECT_EQ(e[2].token_file, "/shared/token");  // inherited
  EXPECT_EQ(e[3].node, "/run/p.sock");          // neither: the endpoint as written
  EXPECT_EQ(e[3].endpoint, "unix:///run/p.sock");
}

TEST(ParseEndpointsJsonTest, AcceptsABareListAndFalsyFields) {
  auto eps = ParseEndpointsJson(
      R"([{"node": "", "host": "h", "endpoint": "", "port": 9, "token_file": ""},
          {"node": 7, "endpoint": "tcp://x:1", "cpuset": ""}])",
      "f");
  ASSERT_TRUE(eps.ok()) << eps.status();
  EXPECT_EQ((*eps)[0].node, "h");
  EXPECT_EQ((*eps)[0].endpoint, "tcp://h:9");
  EXPECT_EQ((*eps)[1].node, "7");  // Python's str(7)
}

TEST(ParseEndpointsJsonTest, RejectsMalformedAndHostileFiles) {
  struct Case {
    std::string text, message;
  };
  std::vector<Case> cases = {
      {"", "not JSON"},
      {"{\"nodes\": [", "not JSON"},
      {"{\"nodes\": [{\"endpoint\": \"tcp://a:1\"}]} trailing", "not JSON"},
      {"\xff\xfe", "not JSON"},
      {"null", "non-empty 'nodes' list"},
      {"[]", "non-empty 'nodes' list"},
      {"{}", "non-empty 'nodes' list"},
      {R"({"nodes": []})", "non-empty 'nodes' list"},
      {R"({"nodes": {"endpoint": "tcp://a:1"}})", "non-empty 'nodes' list"},
      {R"("tcp://a:1")", "non-empty 'nodes' list"},
      {R"({"nodes": [5]})", "nodes[0] is not an object"},
      {R"({"nodes": [{"endpoint": "tcp://a:1"}, null]})", "nodes[1] is not an object"},
      {R"({"nodes": [{"node": "n"}]})", "needs 'endpoint' or 'host' and 'port'"},
      {R"({"nodes": [{"host": "h"}]})", "needs 'endpoint'"},
      {R"({"nodes": [{"host": "h", "port": 0}]})", "needs 'endpoint'"},
      {R"({"nodes": [{"host": "h", "port": 65536}]})", "needs 'endpoint'"},
      {R"({"nodes": [{"host": "h", "port": -1}]})", "needs 'endpoint'"},
      {R"({"nodes": [{"host": "h", "port": "80"}]})", "needs 'endpoint'"},
      {R"({"nodes": [{"host": "h", "port": true}]})", "needs 'endpoint'"},
      {R"({"nodes": [{"host": "h", "port": 80.0}]})", "needs 'endpoint'"},
      {R"({"nodes": [{"host": "h", "port": 18446744073709551615}]})", "needs 'endpoint'"},
      {R"({"nodes": [{"host": "", "port": 80}]})", "needs 'endpoint'"},
      {R"({"nodes": [{"host": ["h"], "port": 80}]})", "needs 'endpoint'"},
      {R"({"nodes": [{"endpoint": 5}]})", "nodes[0].endpoint must be a string"},
      {R"({"nodes": [{"endpoint": "http://a:1"}]})", "expected unix:///path"},
      {R"({"nodes": [{"endpoint": "tcp://a"}]})", "tcp://HOST:PORT"},
      {R"({"nodes": [{"endpoint": "unix://relative"}]})", "absolute"},
      {R"({"nodes": [{"endpoint": "tcp://a:1", "node": true}]})", "node must be a string"},
      {R"({"nodes": [{"endpoint": "tcp://a:1", "node": {"x": 1}}]})", "node must be a string"},
      {R"({"nodes": [{"endpoint": "tcp://a:1", "cpuset": 5}]})", "cpuset must be a string"},
      {R"({"nodes": [{"endpoint": "tcp://a:1", "cpuset": "3-1"}]})", "cpuset: bad CPU list"},
      {R"({"nodes": [{"endpoint": "tcp://a:1", "cpuset": "0-99999"}]})", "bad CPU list"},
      {R"({"nodes": [{"endpoint": "tcp://a:1", "trainer_cpus": null}]})", "must be a string"},
      {R"({"nodes": [{"endpoint": "tcp://a:1", "token_file": 7}]})", "token_file must be"},
      {R"({"token_file": null, "nodes": [{"endpoint": "tcp://a:1"}]})", "token_file must be"},
      {R"({"token_file": ["x"], "nodes": [{"endpoint": "tcp://a:1"}]})", "token_file must be"},
      {R"({"nodes": [{"endpoint": "tcp://a:1"}, {"endpoint": "tcp://a:1"}]})", "duplicate"},
      {R"({"nodes": [{"node": "n", "endpoint": "tcp://a:1"},
                     {"node": "n", "endpoint": "tcp://b:1"}]})",
       "duplicate node name \"n\""},
      {std::string(200000, '['), "not JSON"},
      {std::string(100000, '[') + std::string(100000, ']'), "nodes[0] is not an object"},
  };
  for (const auto& c : cases) {
    auto eps = ParseEndpointsJson(c.text, "endpoints file F");
    ASSERT_FALSE(eps.ok()) << c.text.substr(0, 200);
    ExpectInvalid(eps.status(), c.message);
    EXPECT_THAT(std::string(eps.status().message()), HasSubstr("endpoints file F"));
  }
}

TEST_F(EndpointsTest, LoadsFilesAndRefusesUnreadableOnes) {
  std::string good = Write("endpoints.json", R"({"nodes": [{"endpoint": "tcp://a:1"}]})");
  auto eps = LoadEndpointsFile(good);
  ASSERT_TRUE(eps.ok()) << eps.status();
  EXPECT_EQ((*eps)[0].node, "tcp://a:1");

  ExpectInvalid(LoadEndpointsFile(dir_.path() + "/missing.json").status(), "missing.json");
  ExpectInvalid(LoadEndpointsFile(dir_.path()).status(), "endpoints file");  // a directory
  ExpectInvalid(LoadEndpointsFile("/dev/zero").status(), "larger than");     // endless
  std::string big = Write("big.json", "[" + std::string((16 << 20) + 1, ' ') + "]");
  ExpectInvalid(LoadEndpointsFile(big).status(), "larger than");
  if (::geteuid() != 0) {  // root reads anything
    std::string secret = Write("secret.json", "[]");
    ::chmod(secret.c_str(), 0);
    ExpectInvalid(LoadEndpointsFile(secret).status(), "secret.json");
  }
}

TEST_F(EndpointsTest, PboxEndpointsIsAFileOrAList) {
  {
    ScopedEnv env(kEndpointsEnv, nullptr);
    ExpectInvalid(LoadEndpoints().status(), "PBOX_ENDPOINTS");
  }
  {
    ScopedEnv env(kEndpointsEnv, "");
    ExpectInvalid(LoadEndpoints().status(), "PBOX_ENDPOINTS");
  }
  {
    ScopedEnv env(kEndpointsEnv, "tcp://a:1,tcp://b:2");
    auto eps = LoadEndpoints();
    ASSERT_TRUE(eps.ok()) << eps.status();
    EXPECT_EQ(eps->size(), 2u);
  }
  std::string file = Write("e.json", R"({"nodes": [{"node": "x", "endpoint": "tcp://a:1"}]})");
  {
    ScopedEnv env(kEndpointsEnv, file.c_str());
    auto eps = LoadEndpoints();
    ASSERT_TRUE(eps.ok()) << eps.status();
    EXPECT_EQ((*eps)[0].node, "x");
    // An explicit spec wins over the variable.
    auto list = LoadEndpoints("unix:///a.sock");
    ASSERT_TRUE(list.ok());
    EXPECT_EQ((*list)[0].node, "unix:///a.sock");
  }
  {
    // Without "://" it is a file path, even if it looks like a socket path (as in Python).
    ScopedEnv env(kEndpointsEnv, "/run/pbox/pbox.sock");
    ExpectInvalid(LoadEndpoints().status(), "endpoints file /run/pbox/pbox.sock");
  }
}

TEST_F(EndpointsTest, TokenFiles) {
  EXPECT_EQ(*ReadTokenFile(Write("t1", "  s3cret-token_x \n\n")), "s3cret-token_x");
  EXPECT_EQ(*ReadTokenFile(Write("t2", "")), "");
  ExpectInvalid(ReadTokenFile(Write("t3", "a\nb")).status(), "HTTP header");
  ExpectInvalid(ReadTokenFile(Write("t4", std::string("a\0b", 3))).status(), "0x00");
  ExpectInvalid(ReadTokenFile(Write("t5", "caf\xc3\xa9")).status(), "HTTP header");
  ExpectInvalid(ReadTokenFile("/dev/zero").status(), "larger than");
  ExpectInvalid(ReadTokenFile(dir_.path() + "/none").status(), "token file");
}

TEST_F(EndpointsTest, ClusterClientChecksItsInputsBeforeDialing) {
  ClusterOptions both{.endpoints = "tcp://a:1", .endpoints_file = "/x"};
  ExpectInvalid(ClusterClient::Connect(both).status(), "not several");

  std::string missing_token = Write(
      "e.json", R"({"token_file": "/nonexistent/token", "nodes": [{"endpoint": "tcp://a:1"}]})");
  ExpectInvalid(ClusterClient::Connect({.endpoints_file = missing_token}).status(),
                "token file /nonexistent/token");
  // An explicit token makes the token files moot (as in Python).
  auto with_token = ClusterClient::Connect({.endpoints_file = missing_token, .token = "t"});
  EXPECT_TRUE(with_token.ok()) << with_token.status();

  ExpectInvalid(ClusterClient::Connect({.nodes = {{.node = "a", .endpoint = "tcp://a:1"},
                                                  {.node = "a", .endpoint = "tcp://b:1"}}})
                    .status(),
                "duplicate node name");
  ExpectInvalid(ClusterClient::Connect({.nodes = {{.node = "a", .endpoint = "nope"}}}).status(),
                "nope");

  auto unnamed = ClusterClient::Connect({.nodes = {{.endpoint = "/run/x.sock", .cpuset = "0-3"}}});
  ASSERT_TRUE(unnamed.ok()) << unnamed.status();
  EXPECT_EQ((*unnamed)->nodes()[0], "unix:///run/x.sock");
  EXPECT_EQ((*unnamed)->Loads()[0].weight, 4u);
  ExpectInvalid(
      ClusterClient::Connect({.nodes = {{.endpoint = "tcp://a:1", .cpuset = "x"}}}).status(),
      "bad CPU list");

  auto cluster = ClusterClient::Connect({.endpoints = "tcp://a:1,tcp://b:2/"});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  EXPECT_EQ((*cluster)->nodes(), (std::vector<std::string>{"tcp://a:1", "tcp://b:2/"}));
  ExpectInvalid((*cluster)->client("c").status(), "unknown node \"c\"; nodes: tcp://a:1");
  ExpectInvalid((*cluster)->Create({}, "c").status(), "unknown node");
}

TEST_F(EndpointsTest, NoAgentAnswers) {
  // Sockets that do not exist: every call fails UNAVAILABLE at once.
  std::string a = "unix://" + dir_.path() + "/a.sock", b = "unix://" + dir_.path() + "/b.sock";
  auto cluster = ClusterClient::Connect({.endpoints = a + "," + b, .health_timeout_ms = 2000});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto sb = (*cluster)->Create({});
  EXPECT_EQ(sb.status().code(), absl::StatusCode::kUnavailable) << sb.status();
  EXPECT_THAT(std::string(sb.status().message()), HasSubstr(a));
  EXPECT_THAT(std::string(sb.status().message()), HasSubstr(b));
  for (const auto& load : (*cluster)->Loads()) {
    EXPECT_TRUE(load.down) << load.node;
  }
  auto named = (*cluster)->Create({}, b);
  EXPECT_EQ(named.status().code(), absl::StatusCode::kUnavailable) << named.status();
  EXPECT_THAT(std::string(named.status().message()), HasSubstr("node " + b));
  auto session = (*cluster)->OpenSession("t");
  EXPECT_EQ(session.status().code(), absl::StatusCode::kUnavailable) << session.status();
  auto found = (*cluster)->Find("sb-000000000000");
  EXPECT_EQ(found.status().code(), absl::StatusCode::kUnavailable) << found.status();
  auto waited = (*cluster)->WaitHealthy(std::chrono::milliseconds(200));
  EXPECT_EQ(waited.code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace bragg::pbox::client
