// cgroup v2 against the real kernel: limits written and enforced (memory with an OOM kill,
// pids, cpuset, CPU quota), KillAll and Destroy of a cgroup with live processes, the parent
// removed at the end. Runs where /sys/fs/cgroup is a cgroup2 mount with the controllers
// available and BRAGG_CGROUP_V2_KERNEL_TEST=1 says this process may be moved (CgroupManager
// moves every process of its cgroup into a leaf "agent", as pboxd does): the cgroup v2 VM
// (tests/vm/guest-init, `make test-vm`) sets it. Elsewhere each test reports a skip.

#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/fs.h"
#include "common/process.h"
#include "fmt/format.h"
#include "pbox/cgroup/cgroup.h"
#include "pbox/cgroup/cgroup_internal.h"

namespace bragg::pbox {
namespace {

constexpr uint64_t kMemoryLimit = 64ull << 20;

std::string Trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) {
    s.pop_back();
  }
  return s;
}

std::string ReadControl(const std::string& path) {
  Result<std::string> text = ReadFileToString(path);
  return text.ok() ? Trim(*text) : "<" + std::string(text.status().message()) + ">";
}

class CgroupV2KernelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* opt_in = getenv("BRAGG_CGROUP_V2_KERNEL_TEST");
    if (opt_in == nullptr || std::string(opt_in) != "1") {
      GTEST_SKIP() << "needs a cgroup v2 kernel whose cgroup this test may reorganise: "
                      "BRAGG_CGROUP_V2_KERNEL_TEST=1 (set by make test-vm)";
    }
    if (geteuid() != 0 || !PathExists("/sys/fs/cgroup/cgroup.controllers")) {
      GTEST_SKIP() << "needs root and /sys/fs/cgroup as a cgroup2 mount";
    }
    CgroupManagerOptions options;
    options.parent_name = fmt::format("pbox-kernel-test-{}", getpid());
    Result<std::unique_ptr<CgroupManager>> manager = CgroupManager::Create(options);
    ASSERT_TRUE(manager.ok()) << manager.status();
    manager_ = std::move(*manager);
    ASSERT_EQ(manager_->version(), "v2");
  }

  void TearDown() override {
    if (manager_ != nullptr) {
      std::string parent = manager_->parent_path();
      EXPECT_TRUE(manager_->RemoveParent().ok());
      EXPECT_FALSE(PathExists(parent)) << parent << " left behind";
    }
  }

  // Forks a child that moves itself into `cg` (as pboxd's sandbox init does, through the
  // procs file) and then runs `body`, whose return value is the exit code.
  template <typename Body>
  pid_t ForkInto(Cgroup& cg, Body body) {
    std::string procs = cg.ProcsFiles().at(0);
    pid_t pid = fork();
    if (pid == 0) {
      if (!WriteControlFile(procs, "0").ok()) {
        _exit(100);
      }
      _exit(body());
    }
    return pid;
  }

  static int Wait(pid_t pid) {
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return status;
  }

  std::unique_ptr<CgroupManager> manager_;
};

TEST_F(CgroupV2KernelTest, LimitsAreWrittenWhereTheKernelReadsThem) {
  CgroupLimits limits;
  limits.memory_bytes = kMemoryLimit;
  limits.pids = 16;
  limits.cpus = "0";
  limits.cpu_quota = 0.5;
  Result<std::unique_ptr<Cgroup>> cg = manager_->CreateCgroup("limits", limits);
  ASSERT_TRUE(cg.ok()) << cg.status();
  std::string dir = manager_->parent_path() + "/limits";
  EXPECT_EQ(ReadControl(dir + "/memory.max"), std::to_string(kMemoryLimit));
  EXPECT_EQ(ReadControl(dir + "/pids.max"), "16");
  EXPECT_EQ(ReadControl(dir + "/cpuset.cpus.effective"), "0");
  EXPECT_EQ(ReadControl(dir + "/cpu.max"), "50000 100000");
  if (PathExists(dir + "/memory.swap.max")) {
    EXPECT_EQ(ReadControl(dir + "/memory.swap.max"), "0");
  }
  ASSERT_TRUE((*cg)->Destroy().ok());
  EXPECT_FALSE(PathExists(dir));
}

TEST_F(CgroupV2KernelTest, MemoryOverTheLimitIsOomKilledAndCounted) {
  CgroupLimits limits;
  limits.memory_bytes = kMemoryLimit;
  Result<std::unique_ptr<Cgroup>> cg = manager_->CreateCgroup("oom", limits);
  ASSERT_TRUE(cg.ok()) << cg.status();
  pid_t pid = ForkInto(**cg, [] {
    size_t size = 4 * kMemoryLimit;
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return 101;
    }
    memset(p, 1, size);  // every page touched: far over memory.max, with swap off
    return 0;
  });
  int status = Wait(pid);
  ASSERT_TRUE(WIFSIGNALED(status)) << "exit status " << status;
  EXPECT_EQ(WTERMSIG(status), SIGKILL);
  Result<uint64_t> kills = (*cg)->OomKills();
  ASSERT_TRUE(kills.ok()) << kills.status();
  EXPECT_GE(*kills, 1u);
  Result<CgroupStats> stats = (*cg)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_GE(stats->oom_kills, 1u);
  EXPECT_LE(stats->memory_peak, kMemoryLimit);
  ASSERT_TRUE((*cg)->Destroy().ok());
}

TEST_F(CgroupV2KernelTest, ForksStopAtThePidsLimit) {
  CgroupLimits limits;
  limits.pids = 8;
  Result<std::unique_ptr<Cgroup>> cg = manager_->CreateCgroup("pids", limits);
  ASSERT_TRUE(cg.ok()) << cg.status();
  pid_t pid = ForkInto(**cg, [] {
    // Children sleep until killed; count how many forks the kernel allows.
    int made = 0;
    for (int i = 0; i < 64; ++i) {
      pid_t c = fork();
      if (c == 0) {
        pause();
        _exit(0);
      }
      if (c < 0) {
        return errno == EAGAIN ? made : 102;
      }
      ++made;
    }
    return 103;  // the limit never held
  });
  int status = Wait(pid);
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status;
  // The forking process is one of the 8: 7 children at most.
  EXPECT_EQ(WEXITSTATUS(status), 7);
  // The children outlived their parent inside the cgroup: KillAll must take them all.
  Result<CgroupStats> stats = (*cg)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->processes, 7u);
  ASSERT_TRUE((*cg)->KillAll().ok());
  stats = (*cg)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->processes, 0u);
  ASSERT_TRUE((*cg)->Destroy().ok());
}

TEST_F(CgroupV2KernelTest, ProcessesSeeOnlyTheirCpuset) {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  if (cpus < 2) {
    GTEST_SKIP() << "needs 2 CPUs to tell a cpuset from the whole machine";
  }
  CgroupLimits limits;
  limits.cpus = "1";
  Result<std::unique_ptr<Cgroup>> cg = manager_->CreateCgroup("cpuset", limits);
  ASSERT_TRUE(cg.ok()) << cg.status();
  pid_t pid = ForkInto(**cg, [] {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) {
      return 104;
    }
    return CPU_COUNT(&set) == 1 && CPU_ISSET(1, &set) ? 0 : 105;
  });
  int status = Wait(pid);
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
  ASSERT_TRUE((*cg)->Destroy().ok());
}

TEST_F(CgroupV2KernelTest, DestroyKillsLiveProcessesAndReapAllFindsLeftovers) {
  Result<std::unique_ptr<Cgroup>> kept = manager_->CreateCgroup("left", {});
  ASSERT_TRUE(kept.ok()) << kept.status();
  std::vector<pid_t> sleepers;
  for (int i = 0; i < 3; ++i) {
    sleepers.push_back(ForkInto(**kept, [] {
      pause();
      return 0;
    }));
  }
  // What a killed agent leaves: a cgroup with live processes and no owner. ReapAll (pboxd
  // --reap, or the next start) must kill them and remove it.
  Result<std::vector<std::string>> reaped = manager_->ReapAll();
  ASSERT_TRUE(reaped.ok()) << reaped.status();
  EXPECT_EQ(*reaped, std::vector<std::string>{"left"});
  for (pid_t pid : sleepers) {
    int status = Wait(pid);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  }
  EXPECT_FALSE(PathExists(manager_->parent_path() + "/left"));
}

}  // namespace
}  // namespace bragg::pbox
