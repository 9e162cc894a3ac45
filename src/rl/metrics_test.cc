#include "rl/metrics.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "rl/config.h"

namespace bragg::rl {
namespace {

using json = nlohmann::json;

// Every sample line of the exposition, "name{labels}" -> value; fails on a line that is neither
// a comment nor "series value".
std::map<std::string, double> Samples(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') {
      continue;
    }
    size_t sp = line.rfind(' ');
    EXPECT_NE(sp, std::string::npos) << line;
    if (sp == std::string::npos) continue;
    out[line.substr(0, sp)] = std::stod(line.substr(sp + 1));
  }
  return out;
}

json Step(int step, double reward, json staleness, json dropped) {
  return {{"step", step},
          {"reward_mean", reward},
          {"success_rate", reward},
          {"samples", 32},
          {"groups", 4},
          {"over_stale", 0},
          {"dropped_stale", 1},
          {"dropped", dropped},
          {"dropped_groups", step},
          {"staleness", staleness},
          {"tool_failures", 2},
          {"sandbox_failures", 0},
          {"time_split", {{"generate_s", 1.5}, {"tools_s", 0.25}, {"train_s", 2.0}}},
          {"logprob_agreement_max", -1},
          {"cache_hit_rate", 0.9}};
}

TEST(RunMetrics, CountersSumGaugesKeepTheLastStep) {
  RunMetrics m([] { return LiveState{7, 30, 12, 9}; });
  m.ObserveStep(Step(1, 0.25, {{"0", 20}, {"1", 12}}, {{"verifier_failed", 1}}));
  m.ObserveStep(Step(2, 0.5, {{"1", 30}, {"2", 2}}, json::object()));
  auto s = Samples(m.Render());
  EXPECT_EQ(s["bragg_rl_step"], 2);
  EXPECT_EQ(s["bragg_rl_reward_mean"], 0.5);
  EXPECT_EQ(s["bragg_rl_cache_hit_ratio"], 0.9);
  EXPECT_EQ(s["bragg_rl_trajectories_trained_total"], 64);
  EXPECT_EQ(s["bragg_rl_groups_trained_total"], 8);
  EXPECT_EQ(s["bragg_rl_dropped_stale_total"], 2);
  EXPECT_EQ(s["bragg_rl_over_stale_total"], 0);
  EXPECT_EQ(s["bragg_rl_tool_failures_total"], 4);
  EXPECT_EQ(s["bragg_rl_groups_dropped_total"], 2);  // cumulative in the line: not summed
  EXPECT_EQ(s["bragg_rl_trained_staleness_total{versions=\"0\"}"], 20);
  EXPECT_EQ(s["bragg_rl_trained_staleness_total{versions=\"1\"}"], 42);
  EXPECT_EQ(s["bragg_rl_trained_staleness_total{versions=\"2\"}"], 2);
  EXPECT_EQ(s["bragg_rl_trajectories_dropped_total{reason=\"verifier_failed\"}"], 1);
  EXPECT_EQ(s["bragg_rl_phase_seconds_total{phase=\"generate\"}"], 3);
  EXPECT_EQ(s["bragg_rl_phase_seconds_total{phase=\"train\"}"], 4);
  // Live, read at scrape time.
  EXPECT_EQ(s["bragg_rl_version"], 7);
  EXPECT_EQ(s["bragg_rl_rollouts_in_flight"], 30);
  EXPECT_EQ(s["bragg_rl_generate_in_flight"], 12);
  EXPECT_EQ(s["bragg_rl_groups_admitted"], 9);
  // -1: no fresh trajectory that step; not a value to graph.
  EXPECT_EQ(s.count("bragg_rl_logprob_agreement_max"), 0u);
  EXPECT_EQ(s.count("bragg_rl_eval_success"), 0u);
  m.ObserveStep({{"step", 3}, {"logprob_agreement_max", 0.0}});
  m.ObserveEval(0.75);
  s = Samples(m.Render());
  EXPECT_EQ(s["bragg_rl_logprob_agreement_max"], 0);
  EXPECT_EQ(s["bragg_rl_eval_success"], 0.75);
  EXPECT_EQ(s["bragg_rl_reward_mean"], 0.5);  // a key missing from a line keeps its value
}

TEST(RunMetrics, EveryFamilyHasHelpAndTypeOnce) {
  RunMetrics m;
  m.ObserveStep(Step(1, 0.25, {{"0", 1}}, {{"a", 1}, {"b", 2}}));
  m.ObserveToolCall(3);
  std::string text = m.Render();
  std::map<std::string, int> types;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("# TYPE ", 0) == 0) {
      ++types[line.substr(7, line.find(' ', 7) - 7)];
    }
  }
  EXPECT_GE(types.size(), 19u);
  for (const auto& [name, n] : types) {
    EXPECT_EQ(n, 1) << name;
    EXPECT_NE(text.find("# HELP " + name + " "), std::string::npos) << name;
  }
}

TEST(RunMetrics, HostileReasonIsEscaped) {
  RunMetrics m;
  m.ObserveStep({{"dropped", {{"a\"b\\c\nd", 3}}}, {"staleness", {{"x", 1}, {"4", 2}}}});
  std::string text = m.Render();
  EXPECT_NE(text.find("bragg_rl_trajectories_dropped_total{reason=\"a\\\"b\\\\c\\nd\"} 3\n"),
            std::string::npos)
      << text;
  // A key that is not a number is skipped, not thrown on.
  auto s = Samples(text);
  EXPECT_EQ(s["bragg_rl_trained_staleness_total{versions=\"4\"}"], 2);
}

TEST(RunMetrics, ToolHistogramIsCumulative) {
  RunMetrics m;
  for (double ms : {0.5, 4.0, 4.0, 40.0, 3000.0, 1e7}) {
    m.ObserveToolCall(ms);
  }
  auto s = Samples(m.Render());
  EXPECT_EQ(s["bragg_rl_tool_call_seconds_bucket{le=\"0.001\"}"], 1);
  EXPECT_EQ(s["bragg_rl_tool_call_seconds_bucket{le=\"0.005\"}"], 3);
  EXPECT_EQ(s["bragg_rl_tool_call_seconds_bucket{le=\"0.05\"}"], 4);
  EXPECT_EQ(s["bragg_rl_tool_call_seconds_bucket{le=\"2.5\"}"], 4);
  EXPECT_EQ(s["bragg_rl_tool_call_seconds_bucket{le=\"10\"}"], 5);
  EXPECT_EQ(s["bragg_rl_tool_call_seconds_bucket{le=\"600\"}"], 5);  // 10,000 s: past the last
  EXPECT_EQ(s["bragg_rl_tool_call_seconds_bucket{le=\"+Inf\"}"], 6);
  EXPECT_EQ(s["bragg_rl_tool_call_seconds_count"], 6);
  EXPECT_NEAR(s["bragg_rl_tool_call_seconds_sum"], 10003.0485, 1e-6);
}

TEST(MetricsServer, ServesScrapesWhileStepsArrive) {
  std::atomic<int64_t> version{0};
  RunMetrics m([&] { return LiveState{version.load(), 0, 0, 0}; });
  auto server = MetricsServer::Start("127.0.0.1:0", &m);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string& url = (*server)->url();
  ASSERT_EQ(url.rfind("http://127.0.0.1:", 0), 0u) << url;
  int port = std::stoi(url.substr(17));
  ASSERT_GT(port, 0);

  std::thread writer([&] {
    for (int i = 1; i <= 200; ++i) {
      m.ObserveStep(Step(i, 0.5, {{"0", 32}}, json::object()));
      m.ObserveToolCall(i);
      version = i;
    }
  });
  httplib::Client c("127.0.0.1", port);
  double last_step = 0;
  for (int i = 0; i < 20; ++i) {
    auto r = c.Get("/metrics");
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    ASSERT_EQ(r->status, 200);
    EXPECT_EQ(r->get_header_value("Content-Type"), "text/plain; version=0.0.4");
    auto s = Samples(r->body);
    // Each scrape is one consistent view: a step's counters move together.
    EXPECT_EQ(s["bragg_rl_trajectories_trained_total"], 32 * s["bragg_rl_step"]);
    EXPECT_GE(s["bragg_rl_step"], last_step);  // monotonic across scrapes
    last_step = s["bragg_rl_step"];
  }
  writer.join();
  auto r = c.Get("/metrics");
  ASSERT_TRUE(r);
  auto s = Samples(r->body);
  EXPECT_EQ(s["bragg_rl_step"], 200);
  EXPECT_EQ(s["bragg_rl_version"], 200);
  EXPECT_EQ(s["bragg_rl_tool_call_seconds_count"], 200);
  EXPECT_EQ(c.Get("/nope")->status, 404);

  // A second server on the same port is refused, with the address in the message.
  auto again = MetricsServer::Start("127.0.0.1:" + std::to_string(port), &m);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable);
  server->reset();  // stops: the port answers no more
  httplib::Client gone("127.0.0.1", port);
  gone.set_connection_timeout(1);
  EXPECT_FALSE(gone.Get("/metrics"));
}

TEST(MetricsServer, BadListenIsRefused) {
  RunMetrics m;
  for (const char* bad : {"", "9400", "localhost", ":9400", "127.0.0.1:", "127.0.0.1:http",
                          "127.0.0.1:65536", "::1:9400", "127.0.0.1:-1"}) {
    auto s = MetricsServer::Start(bad, &m);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(ParseHostPort, Forms) {
  auto v4 = ParseHostPort("0.0.0.0:9400");
  ASSERT_TRUE(v4.ok());
  EXPECT_EQ(v4->first, "0.0.0.0");
  EXPECT_EQ(v4->second, 9400);
  auto v6 = ParseHostPort("[::1]:0");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->first, "::1");
  EXPECT_EQ(v6->second, 0);
  auto bad = ParseHostPort("::1:9400");
  EXPECT_NE(bad.status().message().find("brackets"), std::string::npos) << bad.status();
}

}  // namespace
}  // namespace bragg::rl
