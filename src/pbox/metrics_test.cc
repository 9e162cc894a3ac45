#include "pbox/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "common/unique_fd.h"

namespace bragg::pbox {
namespace {

using ::testing::HasSubstr;

TEST(MetricsRenderTest, SmallRegistryExactText) {
  Registry r;
  Counter* started =
      r.AddCounter("pbox_sandboxes_started_total", "Sandboxes started.", {{"runtime", "native"}});
  Counter* started_gvisor =
      r.AddCounter("pbox_sandboxes_started_total", "Sandboxes started.", {{"runtime", "gvisor"}});
  Gauge* mem = r.AddGauge("pbox_memory_bytes", "Memory in use.");
  r.AddCallbackGauge("pbox_live_sandboxes", "Live sandboxes.", [] { return 3.0; });
  Histogram* lat = r.AddHistogram("pbox_exec_seconds", "Exec latency.", {0.1, 1, 10},
                                  {{"op", "exec"}, {"image", "host"}});
  started->Inc();
  started->Inc(4);
  started_gvisor->Inc(2);
  mem->Set(1.5e9);
  mem->Add(0.25);
  lat->Observe(0.05);
  lat->Observe(0.1);
  lat->Observe(2);
  lat->Observe(100);

  EXPECT_EQ(r.Render(),
            "# HELP pbox_sandboxes_started_total Sandboxes started.\n"
            "# TYPE pbox_sandboxes_started_total counter\n"
            "pbox_sandboxes_started_total{runtime=\"native\"} 5\n"
            "pbox_sandboxes_started_total{runtime=\"gvisor\"} 2\n"
            "# HELP pbox_memory_bytes Memory in use.\n"
            "# TYPE pbox_memory_bytes gauge\n"
            "pbox_memory_bytes 1500000000.25\n"
            "# HELP pbox_live_sandboxes Live sandboxes.\n"
            "# TYPE pbox_live_sandboxes gauge\n"
            "pbox_live_sandboxes 3\n"
            "# HELP pbox_exec_seconds Exec latency.\n"
            "# TYPE pbox_exec_seconds histogram\n"
            "pbox_exec_seconds_bucket{image=\"host\",op=\"exec\",le=\"0.1\"} 2\n"
            "pbox_exec_seconds_bucket{image=\"host\",op=\"exec\",le=\"1\"} 2\n"
            "pbox_exec_seconds_bucket{image=\"host\",op=\"exec\",le=\"10\"} 3\n"
            "pbox_exec_seconds_bucket{image=\"host\",op=\"exec\",le=\"+Inf\"} 4\n"
            "pbox_exec_seconds_sum{image=\"host\",op=\"exec\"} 102.15\n"
            "pbox_exec_seconds_count{image=\"host\",op=\"exec\"} 4\n");
}

TEST(MetricsRenderTest, EmptyRegistryRendersNothing) {
  Registry r;
  EXPECT_EQ(r.Render(), "");
}

TEST(MetricsRenderTest, EscapesLabelValuesAndHelp) {
  Registry r;
  r.AddCounter("x_total", "Help with \\ backslash\nand \"quotes\".",
               {{"path", "C:\\dir\\\"a\"\nb"}});
  EXPECT_EQ(r.Render(),
            "# HELP x_total Help with \\\\ backslash\\nand \"quotes\".\n"
            "# TYPE x_total counter\n"
            "x_total{path=\"C:\\\\dir\\\\\\\"a\\\"\\nb\"} 0\n");
}

TEST(MetricsRenderTest, SpecialGaugeValues) {
  Registry r;
  r.AddGauge("g", "g", {{"k", "inf"}})->Set(std::numeric_limits<double>::infinity());
  r.AddGauge("g", "g", {{"k", "ninf"}})->Set(-std::numeric_limits<double>::infinity());
  r.AddGauge("g", "g", {{"k", "nan"}})->Set(std::nan(""));
  r.AddGauge("g", "g", {{"k", "small"}})->Set(-0.00001);
  const std::string text = r.Render();
  EXPECT_THAT(text, HasSubstr("g{k=\"inf\"} +Inf\n"));
  EXPECT_THAT(text, HasSubstr("g{k=\"ninf\"} -Inf\n"));
  EXPECT_THAT(text, HasSubstr("g{k=\"nan\"} NaN\n"));
  EXPECT_THAT(text, HasSubstr("g{k=\"small\"} -1e-05\n"));
}

TEST(MetricsRegistryTest, SameSeriesReturnsSameMetricAndLabelOrderDoesNotMatter) {
  Registry r;
  Counter* a = r.AddCounter("c_total", "c", {{"a", "1"}, {"b", "2"}});
  Counter* b = r.AddCounter("c_total", "c", {{"b", "2"}, {"a", "1"}});
  Counter* other = r.AddCounter("c_total", "c", {{"a", "1"}, {"b", "3"}});
  EXPECT_EQ(a, b);
  EXPECT_NE(a, other);
  Gauge* g1 = r.AddGauge("g", "g");
  EXPECT_EQ(g1, r.AddGauge("g", "g"));
  Histogram* h1 = r.AddHistogram("h", "h", {1, 2});
  EXPECT_EQ(h1, r.AddHistogram("h", "h", {1, 2}));
  // One family: one HELP line for three series registrations.
  const std::string text = r.Render();
  EXPECT_EQ(text.find("# HELP c_total"), text.rfind("# HELP c_total"));
}

TEST(MetricsRegistryDeathTest, ProgrammerErrorsAbort) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        Registry r;
        r.AddCounter("dup", "help");
        r.AddGauge("dup", "help");
      },
      "registered as counter and as gauge");
  EXPECT_DEATH(
      {
        Registry r;
        r.AddCounter("dup", "help one");
        r.AddCounter("dup", "help two");
      },
      "two help texts");
  EXPECT_DEATH(
      {
        Registry r;
        r.AddCounter("9starts_with_digit", "h");
      },
      "invalid metric name");
  EXPECT_DEATH(
      {
        Registry r;
        r.AddCounter("has-dash", "h");
      },
      "invalid metric name");
  EXPECT_DEATH(
      {
        Registry r;
        r.AddCounter("", "h");
      },
      "invalid metric name");
  EXPECT_DEATH(
      {
        Registry r;
        r.AddCounter("ok", "h", {{"bad-label", "v"}});
      },
      "invalid label name");
  EXPECT_DEATH(
      {
        Registry r;
        r.AddCounter("ok", "h", {{"__reserved", "v"}});
      },
      "invalid label name");
  EXPECT_DEATH(
      {
        Registry r;
        r.AddCounter("ok", "h", {{"a", "1"}, {"a", "2"}});
      },
      "duplicate label");
  EXPECT_DEATH(
      {
        Registry r;
        r.AddHistogram("h", "h", {1, 2}, {{"le", "1"}});
      },
      "reserved");
  EXPECT_DEATH(
      {
        Registry r;
        r.AddHistogram("h", "h", {2, 1});
      },
      "strictly increasing");
  EXPECT_DEATH(
      {
        Registry r;
        r.AddHistogram("h", "h", {1, std::nan("")});
      },
      "not finite");
  EXPECT_DEATH(
      {
        Registry r;
        r.AddHistogram("h", "h", {1, 2}, {{"a", "1"}});
        r.AddHistogram("h", "h", {1, 3}, {{"a", "2"}});
      },
      "different buckets");
  EXPECT_DEATH(
      {
        Registry r;
        r.AddCallbackGauge("g", "h", [] { return 1.0; });
        r.AddCallbackGauge("g", "h", [] { return 2.0; });
      },
      "already exists");
  EXPECT_DEATH(
      {
        Registry r;
        r.AddCallbackGauge("g", "h", [] { return 1.0; });
        r.AddGauge("g", "h");
      },
      "callback gauge");
}

TEST(MetricsRegistryTest, ValidNamesAccepted) {
  Registry r;
  r.AddCounter("a:b_c:d9", "h", {{"_x9", "v"}});
  r.AddCounter("_leading_underscore", "h");
  EXPECT_THAT(r.Render(), HasSubstr("a:b_c:d9{_x9=\"v\"} 0\n"));
}

TEST(MetricsRegistryTest, CallbackGaugeEvaluatedAtEachRender) {
  Registry r;
  std::atomic<int> live{0};
  r.AddCallbackGauge("live", "Live sandboxes.", [&live] { return live.load(); }, {{"node", "n1"}});
  r.AddGauge("live", "Live sandboxes.", {{"node", "n2"}})->Set(7);
  EXPECT_THAT(r.Render(), HasSubstr("live{node=\"n1\"} 0\n"));
  live = 12;
  const std::string text = r.Render();
  EXPECT_THAT(text, HasSubstr("live{node=\"n1\"} 12\n"));
  EXPECT_THAT(text, HasSubstr("live{node=\"n2\"} 7\n"));
}

TEST(HistogramTest, BoundaryValuesLandInTheirOwnBucket) {
  Histogram h({1, 2, 5});
  for (double v : {-3.0, 0.0, 1.0}) {
    h.Observe(v);  // <= 1
  }
  h.Observe(std::nextafter(1.0, 2.0));  // just above 1 -> le=2
  h.Observe(2.0);                       // exactly 2 -> le=2
  h.Observe(5.0);                       // exactly 5 -> le=5
  h.Observe(5.000001);                  // +Inf
  h.Observe(std::numeric_limits<double>::infinity());
  EXPECT_EQ(h.CumulativeCounts(), (std::vector<uint64_t>{3, 5, 6, 8}));
  EXPECT_EQ(h.count(), 8u);
}

TEST(HistogramTest, NaNGoesToInfBucketAndPoisonsSum) {
  Histogram h({1});
  h.Observe(0.5);
  h.Observe(std::nan(""));
  EXPECT_EQ(h.CumulativeCounts(), (std::vector<uint64_t>{1, 2}));
  EXPECT_TRUE(std::isnan(h.sum()));
}

TEST(HistogramTest, TrailingInfBoundIsDroppedAndEmptyBucketsWork) {
  Histogram h({1, std::numeric_limits<double>::infinity()});
  EXPECT_EQ(h.upper_bounds(), (std::vector<double>{1}));
  Histogram none({});
  none.Observe(3);
  none.Observe(4);
  EXPECT_EQ(none.CumulativeCounts(), (std::vector<uint64_t>{2}));
  EXPECT_DOUBLE_EQ(none.sum(), 7);
  Registry r;
  r.AddHistogram("only_inf", "h", {})->Observe(1);
  EXPECT_EQ(r.Render(),
            "# HELP only_inf h\n# TYPE only_inf histogram\n"
            "only_inf_bucket{le=\"+Inf\"} 1\nonly_inf_sum 1\nonly_inf_count 1\n");
}

TEST(HistogramTest, LatencyBucketsAreSane) {
  const std::vector<double> b = LatencyBucketsSeconds();
  ASSERT_GE(b.size(), 10u);
  EXPECT_DOUBLE_EQ(b.front(), 50e-6);
  EXPECT_DOUBLE_EQ(b.back(), 60);
  for (size_t i = 1; i < b.size(); ++i) {
    EXPECT_LT(b[i - 1], b[i]);
    EXPECT_LE(b[i] / b[i - 1], 3.01) << i;
  }
  Histogram h(b);  // Must not abort.
  h.Observe(0.003);
  EXPECT_EQ(h.count(), 1u);
}

TEST(MetricsConcurrencyTest, ExactTotalsFromEightThreads) {
  Registry r;
  Counter* c = r.AddCounter("c_total", "c");
  Gauge* g = r.AddGauge("g", "g");
  Histogram* h = r.AddHistogram("h", "h", {0.5, 1.5});
  constexpr int kThreads = 8;
  constexpr int kIters = 100000;
  std::vector<std::thread> threads;
  std::atomic<bool> stop_render{false};
  // A concurrent scraper: rendering while writers run must not crash or tear.
  std::thread scraper([&] {
    while (!stop_render.load()) {
      const std::string text = r.Render();
      ASSERT_THAT(text, HasSubstr("# TYPE h histogram"));
    }
  });
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kIters; ++i) {
        c->Inc();
        g->Add(1.0);
        h->Observe(t % 2 == 0 ? 1.0 : 2.0);
        // Registration from many threads must return the same series.
        if (i % 10000 == 0) {
          ASSERT_EQ(r.AddCounter("c_total", "c"), c);
        }
      }
    });
  }
  for (auto& th : threads) {
    th.join();
  }
  stop_render = true;
  scraper.join();
  EXPECT_EQ(c->value(), uint64_t{kThreads} * kIters);
  EXPECT_EQ(g->value(), double{kThreads} * kIters);
  EXPECT_EQ(h->count(), uint64_t{kThreads} * kIters);
  EXPECT_EQ(h->CumulativeCounts(),
            (std::vector<uint64_t>{0, kThreads / 2 * kIters, uint64_t{kThreads} * kIters}));
  EXPECT_EQ(h->sum(), 1.0 * (kThreads / 2) * kIters + 2.0 * (kThreads / 2) * kIters);
  EXPECT_THAT(r.Render(), HasSubstr("c_total 800000\n"));
}

TEST(MetricsServerTest, ServesMetricsHealthzAnd404) {
  Registry r;
  r.AddCounter("pbox_requests_total", "Requests.")->Inc(3);
  auto server = MetricsServer::Start(&r, "127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);

  httplib::Client client("127.0.0.1", port);
  auto res = client.Get("/metrics");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/plain; version=0.0.4");
  EXPECT_EQ(res->body, r.Render());
  EXPECT_THAT(res->body, HasSubstr("pbox_requests_total 3\n"));

  // Values are live, not a snapshot from Start().
  r.AddCounter("pbox_requests_total", "Requests.")->Inc();
  res = client.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_THAT(res->body, HasSubstr("pbox_requests_total 4\n"));

  res = client.Get("/healthz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->body, "ok");

  for (const char* path : {"/", "/metricsx", "/metrics/extra", "/../metrics", "/nope"}) {
    res = client.Get(path);
    ASSERT_TRUE(res) << path;
    EXPECT_EQ(res->status, 404) << path;
  }
  res = client.Post("/metrics", "x", "text/plain");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
}

TEST(MetricsServerTest, GarbageRequestDoesNotKillServer) {
  Registry r;
  auto server = MetricsServer::Start(&r, "127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status();
  {
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    ASSERT_TRUE(fd);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>((*server)->port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    const std::string junk = "\x01\x02 NOT HTTP \r\n\r\n";
    ASSERT_EQ(::send(fd.get(), junk.data(), junk.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(junk.size()));
    char buf[512];
    // Whatever comes back (a 400 or a close), it must not be a 200.
    const ssize_t n = ::recv(fd.get(), buf, sizeof(buf), 0);
    if (n > 0) {
      EXPECT_EQ(std::string(buf, static_cast<size_t>(n)).find("200 OK"), std::string::npos);
    }
  }
  httplib::Client client("127.0.0.1", (*server)->port());
  auto res = client.Get("/healthz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->body, "ok");
}

TEST(MetricsServerTest, BindConflictIsAClearError) {
  Registry r;
  auto first = MetricsServer::Start(&r, "127.0.0.1:0");
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string addr = "127.0.0.1:" + std::to_string((*first)->port());
  auto second = MetricsServer::Start(&r, addr);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(std::string(second.status().message()),
            "cannot listen on " + addr + ": Address already in use");
  // The first server is unaffected.
  httplib::Client client("127.0.0.1", (*first)->port());
  auto res = client.Get("/healthz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
}

TEST(MetricsServerTest, PortIsFreedOnDestruction) {
  Registry r;
  int port = 0;
  {
    auto server = MetricsServer::Start(&r, "127.0.0.1:0");
    ASSERT_TRUE(server.ok()) << server.status();
    port = (*server)->port();
  }
  auto again = MetricsServer::Start(&r, "127.0.0.1:" + std::to_string(port));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->port(), port);
}

TEST(MetricsServerTest, StartThenImmediateDestroyDoesNotHang) {
  Registry r;
  for (int i = 0; i < 20; ++i) {
    auto server = MetricsServer::Start(&r, "127.0.0.1:0");
    ASSERT_TRUE(server.ok()) << server.status();
  }
}

TEST(MetricsServerTest, IPv6Loopback) {
  Registry r;
  auto server = MetricsServer::Start(&r, "[::1]:0");
  if (!server.ok()) {
    GTEST_SKIP() << "no IPv6 loopback: " << server.status();
  }
  httplib::Client client("::1", (*server)->port());
  auto res = client.Get("/healthz");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->body, "ok");
}

TEST(MetricsServerTest, MalformedListenAddresses) {
  Registry r;
  for (const char* listen :
       {"", "127.0.0.1", "127.0.0.1:", ":9100", "127.0.0.1:abc", "127.0.0.1:65536", "127.0.0.1:-1",
        "127.0.0.1:999999999999", "::1:9100", "127.0.0.1: 80"}) {
    auto server = MetricsServer::Start(&r, listen);
    ASSERT_FALSE(server.ok()) << listen;
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << listen;
    EXPECT_THAT(std::string(server.status().message()), HasSubstr("invalid listen address"))
        << listen;
  }
}

TEST(MetricsServerTest, UnassignedAddressFails) {
  Registry r;
  // TEST-NET-1 is never assigned to a local interface.
  auto server = MetricsServer::Start(&r, "192.0.2.1:0");
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(std::string(server.status().message()),
              HasSubstr("cannot listen on 192.0.2.1:0: Cannot assign requested address"));
}

}  // namespace
}  // namespace bragg::pbox
