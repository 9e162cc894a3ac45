#include "gateway/weights.h"

#include <gtest/gtest.h>

#include "gateway/fleet.h"

namespace bragg::gateway {
namespace {

// Weights changed outside the gateway: the fleet follows the version every worker in rotation
// agrees on, and only that (docs/gateway.md, "Weights changed outside the gateway").
class FollowWorkersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* url : {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}) {
      ASSERT_TRUE(fleet_.main().AddWorker(url, true).ok());
    }
    fleet_.set_version("v0");
  }

  void Follow() {
    std::unique_lock<std::mutex> lock = weights_.TryLockUpdates();
    ASSERT_TRUE(lock.owns_lock());
    weights_.FollowWorkers();
  }

  Fleet fleet_{RouterOptions{}};
  WeightUpdater weights_{&fleet_};
};

TEST_F(FollowWorkersTest, AllServingWorkersOnANewVersionMoveTheFleet) {
  Pool& pool = fleet_.main();
  pool.SetVersion(0, "v1");
  pool.SetVersion(1, "v1");
  Follow();  // worker 2 not read yet: its silence does not hold the others back
  EXPECT_EQ(fleet_.version(), "v1");
  EXPECT_EQ(weights_.updates_external(), 1u);
  pool.SetVersion(2, "v1");
  Follow();  // nothing new: not counted again
  EXPECT_EQ(weights_.updates_external(), 1u);
}

TEST_F(FollowWorkersTest, APushUnderWayIsWaitedFor) {
  Pool& pool = fleet_.main();
  pool.SetVersion(0, "v1");
  pool.SetVersion(1, "v0");
  pool.SetVersion(2, "v0");
  Follow();
  EXPECT_EQ(fleet_.version(), "v0");
  EXPECT_EQ(weights_.updates_external(), 0u);
  // No worker is taken out for being ahead of (or behind) the fleet.
  for (const WorkerSnapshot& w : pool.router().Snapshot()) {
    EXPECT_TRUE(w.healthy) << w.url;
  }
  EXPECT_FALSE(pool.quarantined(0));
}

TEST_F(FollowWorkersTest, QuarantinedAndUnhealthyWorkersDoNotVote) {
  Pool& pool = fleet_.main();
  pool.SetVersion(0, "v2");
  pool.SetVersion(1, "stale");
  pool.Quarantine(1, "left behind by a failed update", /*needs_continue=*/false);
  pool.SetVersion(2, "other");
  pool.router().SetHealthy(2, false);
  Follow();
  EXPECT_EQ(fleet_.version(), "v2");
}

TEST_F(FollowWorkersTest, NoVersionReadChangesNothing) {
  Follow();
  EXPECT_EQ(fleet_.version(), "v0");
  EXPECT_EQ(weights_.updates_external(), 0u);
}

}  // namespace
}  // namespace bragg::gateway
