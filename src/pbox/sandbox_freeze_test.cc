// Sandbox::Freeze/Thaw: a count of holders over the cgroup's freezer, so that concurrent clones
// of one source each copy it stopped. Against a cgroup that records what it is told.

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "pbox/cgroup/testing/null_cgroup.h"
#include "pbox/sandbox.h"

namespace bragg::pbox {
namespace {

class RecordingCgroup : public testing::NullCgroup {
 public:
  RecordingCgroup() : NullCgroup("recording") {}
  Status Freeze(bool frozen) override {
    std::lock_guard<std::mutex> lock(mu);
    if (frozen && fail_next_freeze) {
      fail_next_freeze = false;
      return absl::DeadlineExceededError("tasks never stopped");
    }
    (frozen ? freezes : thaws) += 1;
    is_frozen = frozen;
    return absl::OkStatus();
  }

  std::mutex mu;
  int freezes = 0, thaws = 0;
  bool is_frozen = false;
  bool fail_next_freeze = false;
};

struct Fixture {
  Fixture() {
    auto owned = std::make_unique<RecordingCgroup>();
    cgroup = owned.get();
    sandbox = std::make_shared<Sandbox>("sb-test", "", SandboxSettings{}, CpuSet(),
                                        std::move(owned), nullptr);
  }
  RecordingCgroup* cgroup = nullptr;
  std::shared_ptr<Sandbox> sandbox;
};

TEST(SandboxFreezeTest, ResumesOnlyWhenTheLastHolderThaws) {
  Fixture f;
  ASSERT_TRUE(f.sandbox->Freeze().ok());
  ASSERT_TRUE(f.sandbox->Freeze().ok());
  EXPECT_EQ(f.cgroup->freezes, 1);  // the second holder finds it stopped
  ASSERT_TRUE(f.sandbox->Thaw().ok());
  EXPECT_TRUE(f.cgroup->is_frozen) << "one clone's thaw resumed it under the other's copy";
  EXPECT_EQ(f.cgroup->thaws, 0);
  ASSERT_TRUE(f.sandbox->Thaw().ok());
  EXPECT_FALSE(f.cgroup->is_frozen);
  EXPECT_EQ(f.cgroup->thaws, 1);
  // Nothing held: a thaw more is refused, not passed on.
  EXPECT_EQ(f.sandbox->Thaw().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(f.cgroup->thaws, 1);
}

TEST(SandboxFreezeTest, AFailedFreezeHoldsNothing) {
  Fixture f;
  f.cgroup->fail_next_freeze = true;
  EXPECT_EQ(f.sandbox->Freeze().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(f.sandbox->Thaw().code(), absl::StatusCode::kFailedPrecondition);
  // The next holder freezes it for real.
  ASSERT_TRUE(f.sandbox->Freeze().ok());
  EXPECT_TRUE(f.cgroup->is_frozen);
  ASSERT_TRUE(f.sandbox->Thaw().ok());
  EXPECT_FALSE(f.cgroup->is_frozen);
}

// Many clones at once: while any holds it, it is frozen, and it ends thawed.
TEST(SandboxFreezeTest, ConcurrentHoldersNeverSeeItRunning) {
  Fixture f;
  std::atomic<int> saw_running{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 500; ++i) {
        ASSERT_TRUE(f.sandbox->Freeze().ok());
        {
          std::lock_guard<std::mutex> lock(f.cgroup->mu);
          saw_running += f.cgroup->is_frozen ? 0 : 1;
        }
        ASSERT_TRUE(f.sandbox->Thaw().ok());
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  EXPECT_EQ(saw_running.load(), 0);
  EXPECT_FALSE(f.cgroup->is_frozen);
  EXPECT_EQ(f.cgroup->freezes, f.cgroup->thaws);
}

// FillUnset, the rule both Create and Clone apply: zero and empty fields are unset.
TEST(SandboxSettingsTest, FillUnsetTakesOnlyUnsetFieldsFromBase) {
  SandboxSettings base;
  base.image = "base-image";
  base.runtime = "native";
  base.cpus = 4;
  base.cpu_quota = 1.5;
  base.memory_bytes = 1 << 30;
  base.pids = 512;
  base.disk_bytes = 2 << 20;
  base.workdir = "/base";
  base.idle_ttl_seconds = 60;
  base.env = {{"FROM", "base"}};
  base.labels = {{"from", "base"}};

  SandboxSettings unset;
  unset.image = "";
  unset.cpus = 0;
  unset.workdir = "";
  SandboxSettings filled = FillUnset(unset, base);
  EXPECT_EQ(filled.image, "base-image");
  EXPECT_EQ(filled.runtime, "native");
  EXPECT_EQ(filled.cpus, 4u);
  EXPECT_EQ(filled.cpu_quota, 1.5);
  EXPECT_EQ(filled.memory_bytes, uint64_t{1} << 30);
  EXPECT_EQ(filled.pids, 512u);
  EXPECT_EQ(filled.disk_bytes, uint64_t{2} << 20);
  EXPECT_EQ(filled.workdir, "/base");
  EXPECT_EQ(filled.idle_ttl_seconds, 60u);
  EXPECT_TRUE(filled.env.empty());
  EXPECT_TRUE(filled.labels.empty());

  SandboxSettings set;
  set.image = "mine";
  set.runtime = "gvisor";
  set.cpus = 2;
  set.cpu_quota = 0.5;
  set.memory_bytes = 7;
  set.pids = 8;
  set.disk_bytes = 9;
  set.workdir = "/mine";
  set.idle_ttl_seconds = 10;
  SandboxSettings kept = FillUnset(set, base);
  EXPECT_EQ(kept.image, "mine");
  EXPECT_EQ(kept.runtime, "gvisor");
  EXPECT_EQ(kept.cpus, 2u);
  EXPECT_EQ(kept.cpu_quota, 0.5);
  EXPECT_EQ(kept.memory_bytes, 7u);
  EXPECT_EQ(kept.pids, 8u);
  EXPECT_EQ(kept.disk_bytes, 9u);
  EXPECT_EQ(kept.workdir, "/mine");
  EXPECT_EQ(kept.idle_ttl_seconds, 10u);
}

}  // namespace
}  // namespace bragg::pbox
