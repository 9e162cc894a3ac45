// cgroup v1 on the real machine (label "root"): limits, OOM kills, fork bombs, KillAll,
// Destroy and ReapAll against the kernel.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "common/fs.h"
#include "common/process.h"
#include "fmt/format.h"
#include "pbox/cgroup/cgroup.h"
#include "pbox/cgroup/cgroup_internal.h"
#include "pbox/cgroup/cpuset.h"

namespace bragg::pbox {
namespace {

std::string Read(const std::string& path) {
  auto s = ReadFileToString(path);
  return s.ok() ? *s : std::string("<missing>");
}

std::string Trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) {
    s.pop_back();
  }
  return s;
}

// A child that waits for a line on stdin before running `script`, so that the test can move it
// into the cgroup first.
struct Gated {
  ChildProcess child;
  UniqueFd gate;
  void Open() { ASSERT_TRUE(WriteAll(gate.get(), "go\n").ok()); }
};

Result<Gated> SpawnGated(const std::string& script, const std::string& shell = "/bin/sh") {
  BRAGG_ASSIGN_OR_RETURN(Pipe pipe, MakePipe());
  SpawnOptions opts;
  opts.stdin_fd = pipe.read.get();
  BRAGG_ASSIGN_OR_RETURN(ChildProcess child, Spawn({shell, "-c", "read x; " + script}, opts));
  return Gated{std::move(child), std::move(pipe.write)};
}

class CgroupV1Test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) {
      GTEST_SKIP() << "needs root to create cgroups";
    }
    if (!PathExists(kRoot + "/memory/cgroup.procs")) {
      GTEST_SKIP() << "no cgroup v1 memory hierarchy at " << kRoot << "/memory";
    }
    auto version = DetectCgroupVersion(kRoot);
    if (!version.ok() || *version != "v1") {
      GTEST_SKIP() << kRoot << " is not a cgroup v1 layout";
    }
    static std::atomic<int> counter{0};
    options_.root = kRoot;
    options_.mode = "auto";
    options_.parent_name = fmt::format("pbox-test-{}-{}", getpid(), counter++);
    // Parent directories in every hierarchy, from /proc/self/cgroup.
    auto self = ReadFileToString("/proc/self/cgroup");
    ASSERT_TRUE(self.ok());
    for (const char* c : {"memory", "pids", "cpuset", "cpu", "cpuacct", "freezer"}) {
      size_t pos = self->find(std::string(":") + c + ":");
      if (pos == std::string::npos || !PathExists(kRoot + "/" + c)) {
        continue;
      }
      size_t start = pos + std::strlen(c) + 2;
      std::string own = self->substr(start, self->find('\n', start) - start);
      parents_[c] = kRoot + "/" + c + (own == "/" ? "" : own) + "/" + options_.parent_name;
    }
    auto m = CgroupManager::Create(options_);
    ASSERT_TRUE(m.ok()) << m.status();
    manager_ = std::move(*m);
  }

  void TearDown() override {
    if (manager_ != nullptr) {
      auto reaped = manager_->ReapAll();
      EXPECT_TRUE(reaped.ok()) << reaped.status();
    }
    CgroupFs fs;
    for (const auto& [c, dir] : parents_) {
      EXPECT_TRUE(RemoveCgroupTree(fs, dir).ok()) << dir;
    }
  }

  std::string Dir(const std::string& controller, const std::string& name) {
    return parents_.at(controller) + "/" + name;
  }

  const std::string kRoot = "/sys/fs/cgroup";
  CgroupManagerOptions options_;
  std::map<std::string, std::string> parents_;
  std::unique_ptr<CgroupManager> manager_;
};

TEST_F(CgroupV1Test, ParentInEveryHierarchy) {
  EXPECT_EQ(manager_->version(), "v1");
  EXPECT_EQ(manager_->parent_path(), parents_.at("memory"));
  for (const auto& [c, dir] : parents_) {
    EXPECT_TRUE(PathExists(dir)) << c << ": " << dir;
  }
  // The parent's cpuset was filled in from the agent's (a v1 cpuset starts empty).
  EXPECT_NE(Trim(Read(parents_.at("cpuset") + "/cpuset.cpus")), "");
  EXPECT_NE(Trim(Read(parents_.at("cpuset") + "/cpuset.mems")), "");
}

TEST_F(CgroupV1Test, LimitsLandInTheFilesAndProcessJoins) {
  auto pool = CpuSet::Parse(Read(parents_.at("cpuset") + "/cpuset.cpus"));
  ASSERT_TRUE(pool.ok() && !pool->empty());
  std::string cpu = std::to_string(pool->cpus().back());
  CgroupLimits limits;
  limits.memory_bytes = 64ull << 20;
  limits.pids = 16;
  limits.cpus = cpu;
  limits.cpu_quota = 0.5;
  auto cg = manager_->CreateCgroup("sb", limits);
  ASSERT_TRUE(cg.ok()) << cg.status();
  EXPECT_EQ((*cg)->dir_fd(), -1);
  EXPECT_EQ(Trim(Read(Dir("memory", "sb") + "/memory.limit_in_bytes")), "67108864");
  if (PathExists(Dir("memory", "sb") + "/memory.memsw.limit_in_bytes")) {
    EXPECT_EQ(Trim(Read(Dir("memory", "sb") + "/memory.memsw.limit_in_bytes")), "67108864");
  }
  EXPECT_EQ(Trim(Read(Dir("pids", "sb") + "/pids.max")), "16");
  EXPECT_EQ(Trim(Read(Dir("cpuset", "sb") + "/cpuset.cpus")), cpu);
  EXPECT_EQ(Trim(Read(Dir("cpuset", "sb") + "/cpuset.mems")),
            Trim(Read(parents_.at("cpuset") + "/cpuset.mems")));
  if (parents_.count("cpu")) {
    EXPECT_EQ(Trim(Read(Dir("cpu", "sb") + "/cpu.cfs_period_us")), "100000");
    EXPECT_EQ(Trim(Read(Dir("cpu", "sb") + "/cpu.cfs_quota_us")), "50000");
  }

  auto busy = SpawnGated("i=0; while [ $i -lt 30000 ]; do i=$((i+1)); done; exec sleep 100");
  ASSERT_TRUE(busy.ok()) << busy.status();
  ASSERT_TRUE((*cg)->AddProcess(busy->child.pid()).ok());
  busy->Open();
  std::string proc_cgroup = Read(fmt::format("/proc/{}/cgroup", busy->child.pid()));
  for (const auto& [c, dir] : parents_) {
    std::string rel = Dir(c, "sb").substr(kRoot.size() + 1 + c.size());
    EXPECT_NE(proc_cgroup.find(":" + rel + "\n"), std::string::npos) << c << " " << proc_cgroup;
  }
  // The kernel applied the cpuset to the task itself.
  std::string status = Read(fmt::format("/proc/{}/status", busy->child.pid()));
  size_t at = status.find("Cpus_allowed_list:");
  ASSERT_NE(at, std::string::npos);
  auto allowed = CpuSet::Parse(status.substr(at + 18, status.find('\n', at) - at - 18));
  ASSERT_TRUE(allowed.ok()) << allowed.status();
  EXPECT_EQ(allowed->ToString(), cpu);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto stats = (*cg)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->processes, 1u);
  EXPECT_GT(stats->memory_peak, 0u);
  EXPECT_LE(stats->memory_current, 64ull << 20);
  if (parents_.count("cpuacct")) {
    EXPECT_GT(stats->cpu_usage_ns, 0u);
  }
  EXPECT_EQ(stats->oom_kills, 0u);
  ASSERT_TRUE((*cg)->KillAll().ok());
  auto info = busy->child.Wait(std::chrono::seconds(5));
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->signal, SIGKILL);
  EXPECT_EQ((*cg)->Stats()->processes, 0u);
}

TEST_F(CgroupV1Test, ANewProcessMovesItselfInThroughProcsFiles) {
  auto cg = manager_->CreateCgroup("self", {});
  ASSERT_TRUE(cg.ok()) << cg.status();
  std::vector<std::string> files = (*cg)->ProcsFiles();
  ASSERT_EQ(files.size(), parents_.size());
  // cpuset first; `tasks`, which a single-threaded process moving itself writes without the
  // threadgroup lock's RCU grace period.
  EXPECT_EQ(files[0], Dir("cpuset", "self") + "/tasks");
  for (const std::string& f : files) {
    EXPECT_TRUE(f.size() > 6 && f.compare(f.size() - 6, 6, "/tasks") == 0) << f;
  }
  int gate[2];
  ASSERT_EQ(::pipe(gate), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    for (const std::string& f : files) {
      int fd = ::open(f.c_str(), O_WRONLY | O_CLOEXEC);
      if (fd < 0 || ::write(fd, "0", 1) != 1) {
        _exit(1);
      }
      ::close(fd);
    }
    char c;
    ::close(gate[1]);
    (void)::read(gate[0], &c, 1);  // until the parent looked
    _exit(0);
  }
  ::close(gate[0]);
  auto child = ChildProcess::Adopt(pid);
  ASSERT_TRUE(child.ok());
  // The whole process (one thread) lands in every hierarchy, as with cgroup.procs.
  bool in_all = false;
  for (int i = 0; i < 200 && !in_all; ++i) {
    std::string proc_cgroup = Read(fmt::format("/proc/{}/cgroup", pid));
    in_all = true;
    for (const auto& [c, dir] : parents_) {
      std::string rel = Dir(c, "self").substr(kRoot.size() + 1 + c.size());
      in_all = in_all && proc_cgroup.find(":" + rel + "\n") != std::string::npos;
    }
    if (!in_all) {
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
  }
  EXPECT_TRUE(in_all) << Read(fmt::format("/proc/{}/cgroup", pid));
  EXPECT_EQ((*cg)->Stats()->processes, 1u);
  ::close(gate[1]);
  auto info = child->Wait(std::chrono::seconds(10));
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->exit_code, 0);
}

TEST_F(CgroupV1Test, MemoryHogIsOomKilled) {
  CgroupLimits limits;
  limits.memory_bytes = 64ull << 20;
  limits.pids = 16;
  auto cg = manager_->CreateCgroup("hog", limits);
  ASSERT_TRUE(cg.ok()) << cg.status();
  if (!PathExists("/usr/bin/python3")) {
    GTEST_SKIP() << "needs /usr/bin/python3 for the memory hog";
  }
  // bytearray zero-fills (touches) 512 MiB, eight times the limit.
  auto hog = SpawnGated("exec /usr/bin/python3 -c 'x = bytearray(512 << 20)'");
  ASSERT_TRUE(hog.ok()) << hog.status();
  ASSERT_TRUE((*cg)->AddProcess(hog->child.pid()).ok());
  hog->Open();
  auto info = hog->child.Wait(std::chrono::seconds(60));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->signal, SIGKILL) << DescribeExit(*info);
  auto stats = (*cg)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_GE(stats->oom_kills, 1u);
  EXPECT_GT(stats->memory_peak, 32ull << 20);
  EXPECT_LE(stats->memory_peak, 64ull << 20);
  // The agent (this process) is alive and the sibling limit holds for the next one.
  auto small = Spawn({"/bin/true"});
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->Wait()->exit_code, 0);
}

TEST_F(CgroupV1Test, ForkBombStaysUnderPidsMaxAndKillAllEmptiesIt) {
  CgroupLimits limits;
  limits.memory_bytes = 256ull << 20;
  limits.pids = 16;
  auto cg = manager_->CreateCgroup("bomb", limits);
  ASSERT_TRUE(cg.ok()) << cg.status();
  auto bomb = SpawnGated("while :; do sleep 30 & done 2>/dev/null");
  ASSERT_TRUE(bomb.ok()) << bomb.status();
  ASSERT_TRUE((*cg)->AddProcess(bomb->child.pid()).ok());
  bomb->Open();
  // Poll until the bomb runs into the limit (a loaded machine may take seconds to fork): the
  // count never passes the limit on the way, and it does grow, so the limit is what holds it.
  CgroupFs fs;
  const std::string pids_dir = Dir("pids", "bomb");
  uint64_t most = 0;
  bool refused = false;
  for (auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
       !refused && std::chrono::steady_clock::now() < deadline;) {
    auto current = ParseCgroupU64("pids.current", Read(pids_dir + "/pids.current"));
    ASSERT_TRUE(current.ok());
    EXPECT_LE(*current, 16u);
    most = std::max(most, *current);
    auto events = ReadKeyedU64(fs, pids_dir + "/pids.events", "max");
    // Kernels without pids.events: reaching the limit is the sign.
    refused = events.ok() ? *events > 0 : most >= 16;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(refused) << "the bomb never reached pids.max";
  EXPECT_GE(most, 4u);  // it really forked
  auto stats = (*cg)->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_LE(stats->processes, 16u);
  EXPECT_GE(stats->processes, 2u);
  ASSERT_TRUE((*cg)->KillAll().ok());
  EXPECT_EQ((*cg)->Stats()->processes, 0u);
  // dash gives up with "Cannot fork" once pids.max is hit, or dies by the SIGKILL.
  auto info = bomb->child.Wait(std::chrono::seconds(5));
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->signal == SIGKILL || info->exit_code != 0) << DescribeExit(*info);
}

TEST_F(CgroupV1Test, KillAllCatchesAProcessThatKeepsForking) {
  CgroupLimits limits;
  limits.pids = 200;
  auto cg = manager_->CreateCgroup("forker", limits);
  ASSERT_TRUE(cg.ok()) << cg.status();
  // Each generation forks the next and exits: there is never a stable pid list to kill. Eight
  // such chains (~24 processes), far under pids.max. bash, not dash: a fork refused for a moment
  // (a host busy with other tests) is retried by bash, where dash exits and the chains die out.
  auto forker = SpawnGated(
      "f() { ( f & ) ; sleep 0.01; }; for i in 1 2 3 4 5 6 7 8; do f; done; "
      "while :; do sleep 0.05; done",
      "/bin/bash");
  ASSERT_TRUE(forker.ok()) << forker.status();
  ASSERT_TRUE((*cg)->AddProcess(forker->child.pid()).ok());
  forker->Open();
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  ASSERT_GE((*cg)->Stats()->processes, 2u);
  Status s = (*cg)->KillAll();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ((*cg)->Stats()->processes, 0u);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ((*cg)->Stats()->processes, 0u);  // nothing escaped and came back
  EXPECT_EQ(forker->child.Wait(std::chrono::seconds(5))->signal, SIGKILL);
}

TEST_F(CgroupV1Test, FreezeStopsEveryProcessUntilThawed) {
  if (parents_.count("freezer") == 0) {
    GTEST_SKIP() << "no v1 freezer hierarchy";
  }
  auto tmp = TempDir::Create("/tmp", "pbox-freeze-");
  ASSERT_TRUE(tmp.ok());
  std::string counter = tmp->path() + "/n";
  auto cg = manager_->CreateCgroup("frozen", CgroupLimits{});
  ASSERT_TRUE(cg.ok()) << cg.status();
  // A writer and a forked child of it: the freezer stops both.
  auto writer = SpawnGated(
      fmt::format("(while :; do echo x >> {0}; done) & while :; do echo y >> {0}; done", counter));
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_TRUE((*cg)->AddProcess(writer->child.pid()).ok());
  writer->Open();
  auto size = [&] { return Read(counter).size(); };
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (size() < 100 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_GE(size(), 100u);
  Status s = (*cg)->Freeze(true);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(Trim(Read(Dir("freezer", "frozen") + "/freezer.state")), "FROZEN");
  size_t frozen_size = size();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(size(), frozen_size) << "a frozen process wrote";
  ASSERT_TRUE((*cg)->Freeze(false).ok());
  EXPECT_EQ(Trim(Read(Dir("freezer", "frozen") + "/freezer.state")), "THAWED");
  deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (size() == frozen_size && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GT(size(), frozen_size) << "the thawed processes did not resume";
  // A frozen cgroup is still destroyed (KillAll thaws it), and a destroyed one cannot freeze.
  ASSERT_TRUE((*cg)->Freeze(true).ok());
  ASSERT_TRUE((*cg)->Destroy().ok());
  EXPECT_EQ(writer->child.Wait(std::chrono::seconds(5))->signal, SIGKILL);
  EXPECT_EQ((*cg)->Freeze(true).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(CgroupV1Test, DestroyRemovesEveryHierarchy) {
  auto cg = manager_->CreateCgroup("gone", CgroupLimits{});
  ASSERT_TRUE(cg.ok()) << cg.status();
  for (const auto& [c, dir] : parents_) {
    EXPECT_TRUE(PathExists(Dir(c, "gone"))) << c;
  }
  auto child = Spawn({"sleep", "100"});
  ASSERT_TRUE(child.ok());
  ASSERT_TRUE((*cg)->AddProcess(child->pid()).ok());
  ASSERT_TRUE((*cg)->Destroy().ok());
  for (const auto& [c, dir] : parents_) {
    EXPECT_FALSE(PathExists(Dir(c, "gone"))) << c;
  }
  EXPECT_EQ(child->Wait(std::chrono::seconds(5))->signal, SIGKILL);
  EXPECT_TRUE((*cg)->Destroy().ok());
  EXPECT_FALSE((*cg)->AddProcess(getpid()).ok());
  {
    auto scoped = manager_->CreateCgroup("scoped", CgroupLimits{});
    ASSERT_TRUE(scoped.ok());
  }
  for (const auto& [c, dir] : parents_) {
    EXPECT_FALSE(PathExists(Dir(c, "scoped"))) << c;
  }
}

TEST_F(CgroupV1Test, BadRequestsLeaveNothingBehind) {
  auto first = manager_->CreateCgroup("dup", CgroupLimits{});
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(manager_->CreateCgroup("dup", CgroupLimits{}).status().code(),
            absl::StatusCode::kAlreadyExists);
  CgroupLimits limits;
  limits.cpus = "4000";  // not in the parent's cpuset
  auto bad = manager_->CreateCgroup("badcpu", limits);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("cpuset.cpus"), std::string::npos)
      << bad.status();
  for (const char* name : {"..", "a/b", "", ".x"}) {
    EXPECT_EQ(manager_->CreateCgroup(name, CgroupLimits{}).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  for (const auto& [c, dir] : parents_) {
    EXPECT_FALSE(PathExists(Dir(c, "badcpu"))) << c;
  }
  // A sandbox cannot be made to join a pid that does not exist.
  EXPECT_FALSE((*first)->AddProcess(0x3ffffff0).ok());
}

TEST_F(CgroupV1Test, ReapAllRemovesLeftoversOfAPreviousAgent) {
  std::vector<ChildProcess> children;
  {
    auto old = CgroupManager::Create(options_);
    ASSERT_TRUE(old.ok()) << old.status();
    for (const char* name : {"left-1", "left-2"}) {
      CgroupLimits limits;
      limits.pids = 8;
      auto cg = (*old)->CreateCgroup(name, limits);
      ASSERT_TRUE(cg.ok()) << cg.status();
      auto child = Spawn({"sleep", "100"});
      ASSERT_TRUE(child.ok());
      ASSERT_TRUE((*cg)->AddProcess(child->pid()).ok());
      children.push_back(std::move(*child));
      (void)cg->release();  // the old agent died without destroying anything
    }
  }
  auto fresh = CgroupManager::Create(options_);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  auto reaped = (*fresh)->ReapAll();
  ASSERT_TRUE(reaped.ok()) << reaped.status();
  EXPECT_EQ(*reaped, (std::vector<std::string>{"left-1", "left-2"}));
  for (ChildProcess& c : children) {
    auto info = c.Wait(std::chrono::seconds(5));
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->signal, SIGKILL);
  }
  for (const auto& [c, dir] : parents_) {
    EXPECT_FALSE(PathExists(Dir(c, "left-1"))) << c;
    EXPECT_FALSE(PathExists(Dir(c, "left-2"))) << c;
    EXPECT_TRUE(PathExists(dir)) << c;
  }
}

// `pboxd --reap`: a locate-only manager finds the parent in every hierarchy, kills and removes
// the leftovers, removes the parents, and afterwards creates nothing and finds nothing.
TEST_F(CgroupV1Test, LocateOnlyRemovesTheParentsAndRecreatesNothing) {
  auto cg = manager_->CreateCgroup("left", {});
  ASSERT_TRUE(cg.ok()) << cg.status();
  auto child = Spawn({"sleep", "100"});
  ASSERT_TRUE(child.ok());
  ASSERT_TRUE((*cg)->AddProcess(child->pid()).ok());
  (void)cg->release();
  CgroupManagerOptions locate = options_;
  locate.create_parent = false;
  auto reaper = CgroupManager::Create(locate);
  ASSERT_TRUE(reaper.ok()) << reaper.status();
  std::vector<std::string> paths = (*reaper)->parent_paths();
  EXPECT_EQ(paths.size(), parents_.size());
  for (const auto& [c, dir] : parents_) {
    EXPECT_NE(std::find(paths.begin(), paths.end(), dir), paths.end()) << c;
  }
  ASSERT_TRUE((*reaper)->RemoveParent().ok());
  auto info = child->Wait(std::chrono::seconds(5));
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->signal, SIGKILL);
  for (const auto& [c, dir] : parents_) {
    EXPECT_FALSE(PathExists(dir)) << c;
  }
  auto again = CgroupManager::Create(locate);
  ASSERT_TRUE(again.ok()) << again.status();
  auto reaped = (*again)->ReapAll();
  ASSERT_TRUE(reaped.ok()) << reaped.status();
  EXPECT_TRUE(reaped->empty());
  EXPECT_TRUE((*again)->RemoveParent().ok());
  for (const auto& [c, dir] : parents_) {
    EXPECT_FALSE(PathExists(dir)) << c << ": a locate-only manager created it";
  }
  manager_.reset();
}

TEST_F(CgroupV1Test, StatsOfAFreshCgroup) {
  auto cg = manager_->CreateCgroup("fresh", CgroupLimits{});
  ASSERT_TRUE(cg.ok());
  auto stats = (*cg)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->processes, 0u);
  EXPECT_EQ(stats->oom_kills, 0u);
  // Unlimited memory stays at the kernel default.
  EXPECT_GT(
      ParseCgroupU64("limit", Read(Dir("memory", "fresh") + "/memory.limit_in_bytes")).value_or(0),
      1ull << 40);
  EXPECT_EQ(Trim(Read(Dir("pids", "fresh") + "/pids.max")), "max");
}

}  // namespace
}  // namespace bragg::pbox
