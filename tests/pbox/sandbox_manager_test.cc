// SandboxManager: what a create or clone does when its session ends, or its caller goes away,
// while the sandbox is being made (between admission and publication). The runtime is the
// fuzzers' FakeRuntime (no processes) behind a hook that runs inside Start, so each race is hit
// at exactly that point.

#include "pbox/sandbox_manager.h"

#include <unistd.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/fs.h"
#include "fake_runtime.h"
#include "gtest/gtest.h"
#include "pbox/cgroup/cpuset.h"
#include "pbox/image/image_store.h"
#include "spdlog/spdlog.h"

namespace bragg::pbox {
namespace {

// FakeRuntime, with `on_start` run at the start of each Start (while the manager is making a
// sandbox and holds none of its locks).
class HookedRuntime : public Runtime {
 public:
  std::string name() const override { return "native"; }
  Result<std::unique_ptr<RuntimeSandbox>> Start(const LaunchSpec& spec) override {
    if (on_start) {
      on_start();
    }
    return fake_.Start(spec);
  }
  std::function<void()> on_start;

 private:
  fuzz::FakeRuntime fake_;
};

class SandboxManagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);
    auto dir = TempDir::Create("/tmp", "pbox-manager-test-");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = std::move(*dir);
    auto images = ImageStore::Create(dir_.path() + "/images", {});
    ASSERT_TRUE(images.ok()) << images.status();
    images_ = std::move(*images);
    ASSERT_TRUE(MakeDirs(dir_.path() + "/frozen", 0700).ok());
    SandboxDefaults defaults;
    defaults.memory_bytes = 64 << 20;
    defaults.disk_bytes = 16 << 20;
    manager_ = std::make_unique<SandboxManager>(std::map<std::string, Runtime*>{{"native", &rt_}},
                                                "native", images_.get(), &cgroups_, &cpus_,
                                                defaults, /*max_sandboxes=*/8);
    manager_->set_layers_dir(dir_.path() + "/frozen");
  }

  void TearDown() override {
    manager_.reset();
    EXPECT_EQ(fuzz::FakeRuntime::live(), 0) << "runtime sandboxes leaked";
    EXPECT_EQ(fuzz::FakeCgroupManager::live(), 0) << "cgroups leaked";
  }

  std::string OpenSession() {
    auto id = manager_->OpenSession("test");
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : "";
  }

  // What an attempt left behind: sandboxes listed, started in the runtime, cgroups, and
  // sandboxes admitted (a full agent has room for max_sandboxes creates again).
  void ExpectOnly(size_t sandboxes) {
    EXPECT_EQ(manager_->List().size(), sandboxes);
    EXPECT_EQ(manager_->live(), sandboxes);
    EXPECT_EQ(fuzz::FakeRuntime::live(), static_cast<int>(sandboxes));
    EXPECT_EQ(fuzz::FakeCgroupManager::live(), static_cast<int>(sandboxes));
  }

  TempDir dir_;
  std::unique_ptr<ImageStore> images_;
  fuzz::FakeCgroupManager cgroups_;
  HookedRuntime rt_;
  CpuAllocator cpus_{CpuSet({0, 1})};
  std::unique_ptr<SandboxManager> manager_;
};

// Where the sandboxes' cgroups have no cpuset controller (a user's systemd delegates cpu, memory
// and pids), a sandbox runs on the agent's CPUs and its `cpus` is enforced as that many CPUs'
// worth of time; a session's CPU set is refused. With cpuset, CPUs are placed and no quota is
// added.
TEST_F(SandboxManagerTest, WithoutCpusetCpusBecomeCpuTime) {
  SandboxSettings two;
  two.cpus = 2;
  auto sb = manager_->Create(OpenSession(), two);
  ASSERT_TRUE(sb.ok()) << sb.status();
  EXPECT_EQ(cgroups_.last_limits().cpus, "0-1");
  EXPECT_EQ(cgroups_.last_limits().cpu_quota, 0);
  ASSERT_TRUE(manager_->Destroy((*sb)->id()).ok());

  fuzz::FakeCgroupManager no_cpuset({"cpu", "memory", "pids"});
  CpuAllocator cpus{CpuSet({0, 1})};
  {
    SandboxManager m({{"native", &rt_}}, "native", images_.get(), &no_cpuset, &cpus,
                     SandboxDefaults{}, 8);
    m.set_layers_dir(dir_.path() + "/frozen");
    auto session = m.OpenSession("test");
    ASSERT_TRUE(session.ok()) << session.status();
    auto a = m.Create(*session, two);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(no_cpuset.last_limits().cpus, "");
    EXPECT_EQ(no_cpuset.last_limits().cpu_quota, 2.0);
    EXPECT_EQ(cpus.Load(), (std::vector<uint32_t>{0, 0})) << "no CPU was placed";
    SandboxSettings quota;
    quota.cpu_quota = 0.25;
    auto b = m.Create(*session, quota);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(no_cpuset.last_limits().cpu_quota, 0.25);
    auto held = m.OpenSession("job", "7", CpuSet({1}));
    EXPECT_EQ(held.status().code(), absl::StatusCode::kFailedPrecondition) << held.status();
    EXPECT_NE(held.status().message().find("no cpuset"), std::string::npos) << held.status();
  }
  // Without the cpu controller either, nothing bounds its CPU: no quota is asked for.
  fuzz::FakeCgroupManager bare({"memory", "pids"});
  {
    SandboxManager m({{"native", &rt_}}, "native", images_.get(), &bare, &cpus, SandboxDefaults{},
                     8);
    m.set_layers_dir(dir_.path() + "/frozen");
    auto a = m.Create(*m.OpenSession("test"), two);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(bare.last_limits().cpu_quota, 0);
  }
}

TEST_F(SandboxManagerTest, SessionEndingMidCreateTakesTheNewSandbox) {
  std::string session = OpenSession();
  rt_.on_start = [&] { manager_->CloseSession(session); };
  auto sb = manager_->Create(session, {});
  EXPECT_EQ(sb.status().code(), absl::StatusCode::kFailedPrecondition) << sb.status();
  ExpectOnly(0);
  // The session stays ended: nothing more joins it.
  rt_.on_start = nullptr;
  EXPECT_EQ(manager_->Create(session, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  ExpectOnly(0);
}

TEST_F(SandboxManagerTest, CallerGoneMidCreateLeavesNothing) {
  // A detached sandbox nobody learned the id of would hold a slot until its idle TTL; a
  // session's one would join a session whose client is dead (until the agent reads the broken
  // stream). Either way the caller went away while the runtime started it.
  for (const std::string& session : {std::string(), OpenSession()}) {
    SCOPED_TRACE(session.empty() ? "detached" : "in a session");
    std::atomic<bool> gone{false};
    rt_.on_start = [&] { gone = true; };
    auto sb = manager_->Create(session, {}, [&] { return gone.load(); });
    EXPECT_EQ(sb.status().code(), absl::StatusCode::kCancelled) << sb.status();
    ExpectOnly(0);
  }
  // A caller still there gets its sandbox, and every slot is free again.
  rt_.on_start = nullptr;
  std::vector<std::string> made;
  for (uint32_t i = 0; i < manager_->max_sandboxes(); ++i) {
    auto sb = manager_->Create("", {}, [] { return false; });
    ASSERT_TRUE(sb.ok()) << sb.status();
    made.push_back((*sb)->id());
  }
  ExpectOnly(manager_->max_sandboxes());
  for (const std::string& id : made) {
    EXPECT_TRUE(manager_->Destroy(id).ok());
  }
  ExpectOnly(0);
}

TEST_F(SandboxManagerTest, SessionEndingMidCloneTakesSourceAndClones) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "cloning copies the writable layer with its owners: needs root";
  }
  std::string session = OpenSession();
  auto source = manager_->Create(session, {});
  ASSERT_TRUE(source.ok()) << source.status();
  const std::string source_id = (*source)->id();
  source->reset();             // the runtime's count goes down when the last holder lets go
  std::atomic<int> starts{0};  // the clones start on several threads
  rt_.on_start = [&] {
    if (++starts == 2) {
      manager_->CloseSession(session);
    }
  };
  auto clones = manager_->Clone("", source_id, 3, {});
  EXPECT_EQ(clones.status().code(), absl::StatusCode::kFailedPrecondition) << clones.status();
  ExpectOnly(0);
}

TEST_F(SandboxManagerTest, CallerGoneMidCloneLeavesOnlyTheSource) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "cloning copies the writable layer with its owners: needs root";
  }
  std::string session = OpenSession();
  auto source = manager_->Create(session, {});
  ASSERT_TRUE(source.ok()) << source.status();
  const std::string source_id = (*source)->id();
  source->reset();                // the runtime's count goes down when the last holder lets go
  std::atomic<bool> gone{false};  // the clones start on several threads
  rt_.on_start = [&] { gone = true; };
  auto clones = manager_->Clone("", source_id, 3, {}, [&] { return gone.load(); });
  EXPECT_EQ(clones.status().code(), absl::StatusCode::kCancelled) << clones.status();
  ExpectOnly(1);
  rt_.on_start = nullptr;
  clones = manager_->Clone("", source_id, 3, {}, [] { return false; });
  ASSERT_TRUE(clones.ok()) << clones.status();
  clones->clear();
  ExpectOnly(4);
  manager_->CloseSession(session);
  ExpectOnly(0);
}

}  // namespace
}  // namespace bragg::pbox
