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

}  // namespace
}  // namespace bragg::pbox
