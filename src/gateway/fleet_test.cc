#include "gateway/fleet.h"

#include <gtest/gtest.h>

namespace bragg::gateway {
namespace {

TEST(PoolTest, AddWorkerCanonicalUrlOneRecordPerUrl) {
  Pool pool("main", RouterOptions{});
  ASSERT_TRUE(pool.AddWorker("127.0.0.1:9001", true).ok());
  ASSERT_TRUE(pool.AddWorker("http://127.0.0.1:9002", false).ok());
  // The same worker again, spelled the other way: no second record.
  ASSERT_TRUE(pool.AddWorker("http://127.0.0.1:9001", false).ok());
  EXPECT_EQ(pool.size(), 2u);
  EXPECT_EQ(pool.router().num_workers(), 2u);
  EXPECT_EQ(pool.url(0), "http://127.0.0.1:9001");
  EXPECT_EQ(pool.url(1), "http://127.0.0.1:9002");
  EXPECT_EQ(pool.Client(1)->target().port, 9002);
  std::vector<WorkerSnapshot> snap = pool.router().Snapshot();
  EXPECT_TRUE(snap[0].healthy);  // health unchanged by the second add
  EXPECT_FALSE(snap[1].healthy);
  EXPECT_EQ(pool.Versions(), (std::vector<std::string>{"", ""}));
}

TEST(PoolTest, OneRecordHoldsTheRoutingAndTheFleetPart) {
  Pool pool("main", RouterOptions{});
  ASSERT_TRUE(pool.AddWorker("127.0.0.1:9001", true).ok());
  Worker* w = pool.router().record(0);
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(pool.router().record(1), nullptr);
  EXPECT_EQ(w->url, "http://127.0.0.1:9001");
  EXPECT_EQ(w->client.get(), pool.Client(0));
  pool.SetVersion(0, "v7");
  EXPECT_EQ(w->version, "v7");
  pool.router().SetHealthy(0, false);
  EXPECT_FALSE(w->healthy);
}

TEST(PoolTest, BadUrlsAreRefused) {
  Pool pool("main", RouterOptions{});
  for (const char* url : {"", "no-port", "http://h:notaport", "ftp://h:1"}) {
    Status st = pool.AddWorker(url, true).status();
    EXPECT_FALSE(st.ok()) << url;
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << url;
  }
  EXPECT_EQ(pool.size(), 0u);
  EXPECT_EQ(pool.router().num_workers(), 0u);
}

TEST(PoolTest, HealthChecksCountConsecutiveFailures) {
  Pool pool("main", RouterOptions{});
  ASSERT_TRUE(pool.AddWorker("127.0.0.1:9001", true).ok());
  EXPECT_EQ(pool.RecordHealthCheck(0, false), 1);
  EXPECT_EQ(pool.RecordHealthCheck(0, false), 2);
  EXPECT_EQ(pool.RecordHealthCheck(0, true), 0);
  EXPECT_EQ(pool.RecordHealthCheck(0, false), 1);
}

TEST(PoolTest, QuarantineTakesOutUntilAdmitted) {
  Pool pool("decode", RouterOptions{});
  ASSERT_TRUE(pool.AddWorker("127.0.0.1:9001", true).ok());
  EXPECT_FALSE(pool.quarantined(0));
  pool.Quarantine(0, "test", /*needs_continue=*/true);
  EXPECT_TRUE(pool.quarantined(0));
  EXPECT_TRUE(pool.needs_continue(0));
  EXPECT_FALSE(pool.router().Snapshot()[0].healthy);
  // A later quarantine that does not need a continue keeps the earlier need.
  pool.Quarantine(0, "again", /*needs_continue=*/false);
  EXPECT_TRUE(pool.needs_continue(0));
  pool.SetNeedsContinue(0, false);
  pool.Admitted(0, "v2");
  EXPECT_FALSE(pool.quarantined(0));
  EXPECT_EQ(pool.Versions(), (std::vector<std::string>{"v2"}));
}

TEST(FleetTest, PoolsAndHealthyTargets) {
  RouterOptions options;
  options.policy = Policy::kRoundRobin;
  Fleet fleet(options);
  EXPECT_EQ(fleet.main().name(), "main");
  EXPECT_EQ(fleet.prefill().name(), "prefill");
  EXPECT_EQ(fleet.decode().name(), "decode");
  ASSERT_TRUE(fleet.main().AddWorker("127.0.0.1:1", true).ok());
  ASSERT_TRUE(fleet.main().AddWorker("127.0.0.1:2", false).ok());
  ASSERT_TRUE(fleet.decode().AddWorker("127.0.0.1:3", true).ok());
  std::vector<Target> targets = fleet.HealthyTargets();
  ASSERT_EQ(targets.size(), 2u);
  EXPECT_EQ(targets[0].pool, &fleet.main());
  EXPECT_EQ(targets[0].worker, 0);
  EXPECT_EQ(targets[0].url, "http://127.0.0.1:1");
  EXPECT_EQ(targets[1].pool, &fleet.decode());
  EXPECT_EQ(targets[1].url, "http://127.0.0.1:3");
}

TEST(FleetTest, FirstVersionReadBecomesTheFleets) {
  Fleet fleet(RouterOptions{});
  EXPECT_EQ(fleet.version(), "");
  EXPECT_EQ(fleet.VersionOr("v1"), "v1");
  EXPECT_EQ(fleet.VersionOr("v2"), "v1");
  fleet.set_version("v3");
  EXPECT_EQ(fleet.version(), "v3");
}

}  // namespace
}  // namespace bragg::gateway
