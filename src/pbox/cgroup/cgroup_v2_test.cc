// cgroup v2 against a fake cgroupfs: a temp dir tree plus a CgroupFs that does what the kernel
// does on mkdir/rmdir/write (creates control files, moves pids, kills on cgroup.kill).

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "common/fs.h"
#include "common/process.h"
#include "fmt/format.h"
#include "pbox/cgroup/cgroup.h"
#include "pbox/cgroup/cgroup_internal.h"

namespace bragg::pbox {
namespace {

namespace stdfs = std::filesystem;

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void Put(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::trunc);
  out << data;
}

bool Alive(pid_t pid) {
  std::string stat = Slurp(fmt::format("/proc/{}/stat", pid));
  size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) {
    return false;
  }
  char state = stat[paren + 2];
  return state != 'Z' && state != 'X';
}

struct FakeOptions {
  bool kill_file = true;         // cgroup.kill (5.14+)
  bool swap_file = true;         // memory.swap.max
  bool peak_file = true;         // memory.peak (5.19+)
  bool freeze_completes = true;  // cgroup.events reports the freeze (false: a task never stops)
};

class FakeCgroupFs : public CgroupFs {
 public:
  FakeCgroupFs(std::string root, FakeOptions options) : root_(std::move(root)), options_(options) {}

  Status MakeDir(const std::string& path) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (::mkdir(path.c_str(), 0755) != 0) {
      return ErrnoError("mkdir", path);
    }
    mkdirs_.push_back(path);
    std::vector<std::pair<std::string, std::string>> files = {
        {"cgroup.procs", ""},
        {"cgroup.controllers", "cpuset cpu memory pids\n"},
        {"cgroup.subtree_control", ""},
        {"cgroup.events", "populated 0\nfrozen 0\n"},
        {"cgroup.freeze", "0\n"},
        {"memory.max", "max\n"},
        {"memory.current", "0\n"},
        {"memory.events", "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n"},
        {"pids.max", "max\n"},
        {"cpuset.cpus", "\n"},
        {"cpuset.mems", "\n"},
        {"cpu.max", "max 100000\n"},
        {"cpu.stat", "usage_usec 0\nuser_usec 0\nsystem_usec 0\n"},
    };
    if (options_.kill_file) {
      files.emplace_back("cgroup.kill", "");
    }
    if (options_.swap_file) {
      files.emplace_back("memory.swap.max", "max\n");
    }
    if (options_.peak_file) {
      files.emplace_back("memory.peak", "0\n");
    }
    for (const auto& [name, data] : files) {
      Put(path + "/" + name, data);
    }
    return absl::OkStatus();
  }

  Status RemoveDir(const std::string& path) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stdfs::exists(path)) {
      return ErrnoError("rmdir", path, ENOENT);
    }
    for (const auto& e : stdfs::directory_iterator(path)) {
      if (e.is_directory()) {
        return ErrnoError("rmdir", path, EBUSY);
      }
    }
    if (!LivePids(path + "/cgroup.procs").empty()) {
      return ErrnoError("rmdir", path, EBUSY);
    }
    stdfs::remove_all(path);
    rmdirs_.push_back(path);
    return absl::OkStatus();
  }

  Result<std::string> Read(const std::string& path) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (EndsWith(path, "/cgroup.procs") && stdfs::exists(path) &&
        Slurp(path).find_first_not_of("0123456789\n") == std::string::npos) {
      std::string out;
      for (pid_t pid : LivePids(path)) {
        out += std::to_string(pid) + "\n";
      }
      return out;
    }
    return ReadFileToString(path);
  }

  Status Write(const std::string& path, std::string_view data) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stdfs::is_regular_file(path)) {
      return ErrnoError("open", path, ENOENT);  // cgroupfs never creates files on write
    }
    writes_.emplace_back(path, std::string(data));
    std::string dir = path.substr(0, path.rfind('/'));
    if (EndsWith(path, "/cgroup.procs")) {
      pid_t pid = std::stoi(std::string(data));
      if (!Alive(pid)) {
        return ErrnoError("write", path, ESRCH);
      }
      for (const auto& e : stdfs::recursive_directory_iterator(root_)) {
        if (e.path().filename() == "cgroup.procs") {
          std::string kept;
          for (pid_t p : LivePids(e.path())) {
            if (p != pid) {
              kept += std::to_string(p) + "\n";
            }
          }
          Put(e.path(), kept);
        }
      }
      std::ofstream(path, std::ios::app) << pid << "\n";
      return absl::OkStatus();
    }
    if (EndsWith(path, "/cgroup.kill") && data == "1") {
      for (const auto& e : stdfs::recursive_directory_iterator(dir)) {
        if (e.path().filename() == "cgroup.procs") {
          for (pid_t p : LivePids(e.path())) {
            ::kill(p, SIGKILL);
          }
        }
      }
      return absl::OkStatus();
    }
    if (EndsWith(path, "/cgroup.freeze") && (options_.freeze_completes || data != "1")) {
      Put(dir + "/cgroup.events", fmt::format("populated 1\nfrozen {}\n", data == "1" ? 1 : 0));
    }
    Put(path, std::string(data));
    return absl::OkStatus();
  }

  std::vector<std::string> WritesTo(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> out;
    for (const auto& [p, d] : writes_) {
      if (p == path) {
        out.push_back(d);
      }
    }
    return out;
  }
  size_t write_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return writes_.size();
  }
  std::vector<std::string> mkdirs() {
    std::lock_guard<std::mutex> lock(mu_);
    return mkdirs_;
  }

 private:
  static bool EndsWith(const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() &&
           s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  }
  // Like the kernel, cgroup.procs does not list exited tasks.
  static std::vector<pid_t> LivePids(const std::string& procs) {
    std::vector<pid_t> out;
    std::istringstream in(Slurp(procs));
    long pid;
    while (in >> pid) {
      if (Alive(static_cast<pid_t>(pid))) {
        out.push_back(static_cast<pid_t>(pid));
      }
    }
    return out;
  }

  std::string root_;
  FakeOptions options_;
  std::mutex mu_;
  std::vector<std::pair<std::string, std::string>> writes_;
  std::vector<std::string> mkdirs_;
  std::vector<std::string> rmdirs_;
};

class CgroupV2Test : public ::testing::Test {
 protected:
  void SetUp() override {
    auto tmp = TempDir::Create("/tmp", "pbox-cgv2-");
    ASSERT_TRUE(tmp.ok()) << tmp.status();
    tmp_ = std::move(*tmp);
    root_ = tmp_.path();
    own_ = root_ + "/job.slice/pboxd.service";
    stdfs::create_directories(own_);
    Put(root_ + "/cgroup.controllers", "cpuset cpu io memory hugetlb pids rdma misc\n");
    Put(root_ + "/cgroup.procs", "");
    Put(own_ + "/cgroup.controllers", "cpuset cpu io memory pids\n");
    Put(own_ + "/cgroup.subtree_control", "");
    Put(own_ + "/cgroup.procs", fmt::format("{}\n", getpid()));
    options_.root = root_;
    options_.self_cgroup = "0::/job.slice/pboxd.service\n";
  }

  std::shared_ptr<FakeCgroupFs> MakeFs(FakeOptions o = {}) {
    fs_ = std::make_shared<FakeCgroupFs>(root_, o);
    return fs_;
  }

  std::unique_ptr<CgroupManager> MakeManager(FakeOptions o = {}) {
    auto m = CreateCgroupManager(options_, MakeFs(o));
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? std::move(*m) : nullptr;
  }

  TempDir tmp_;
  std::string root_;
  std::string own_;
  CgroupManagerOptions options_;
  std::shared_ptr<FakeCgroupFs> fs_;
};

std::string Msg(const Status& s) { return std::string(s.message()); }

TEST_F(CgroupV2Test, CreateMovesAgentToLeafAndEnablesControllers) {
  auto helper = Spawn({"sleep", "100"});
  ASSERT_TRUE(helper.ok());
  Put(own_ + "/cgroup.procs", fmt::format("{}\n{}\n", getpid(), helper->pid()));
  auto m = MakeManager();
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->version(), "v2");
  EXPECT_EQ(m->parent_path(), own_ + "/pbox");
  EXPECT_EQ(Slurp(own_ + "/cgroup.procs"), "");
  EXPECT_EQ(Slurp(own_ + "/agent/cgroup.procs"), fmt::format("{}\n{}\n", getpid(), helper->pid()));
  EXPECT_EQ(Slurp(own_ + "/cgroup.subtree_control"), "+cpu +cpuset +memory +pids");
  EXPECT_EQ(Slurp(own_ + "/pbox/cgroup.subtree_control"), "+cpu +cpuset +memory +pids");
  // The leaf is created before subtree_control is written (the kernel refuses otherwise).
  EXPECT_EQ(fs_->mkdirs().front(), own_ + "/agent");

  // A second agent start finds the leaf and the parent in place.
  auto again = CreateCgroupManager(options_, fs_);
  ASSERT_TRUE(again.ok()) << again.status();
}

// An agent restarted from the shell an earlier agent moved into its leaf uses the delegated
// cgroup above the leaf, as the earlier one did, instead of nesting one level deeper.
TEST_F(CgroupV2Test, AgentRestartedFromTheLeafUsesTheDelegatedCgroup) {
  Put(own_ + "/cgroup.procs", fmt::format("{}\n", getpid()));
  auto first = MakeManager();
  ASSERT_NE(first, nullptr);
  ASSERT_EQ(Slurp(own_ + "/agent/cgroup.procs"), fmt::format("{}\n", getpid()));
  options_.self_cgroup = "0::/job.slice/pboxd.service/agent\n";
  auto second = MakeManager();
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(second->parent_path(), own_ + "/pbox");
  EXPECT_FALSE(stdfs::exists(own_ + "/agent/agent"));
  EXPECT_EQ(Slurp(own_ + "/agent/cgroup.procs"), fmt::format("{}\n", getpid()));

  // A leaf called "agent" whose parent holds processes is no earlier agent's: used as it is.
  auto other = Spawn({"sleep", "100"});
  ASSERT_TRUE(other.ok());
  Put(own_ + "/cgroup.procs", fmt::format("{}\n", other->pid()));
  auto nested = MakeManager();
  ASSERT_NE(nested, nullptr);
  EXPECT_EQ(nested->parent_path(), own_ + "/agent/pbox");
  EXPECT_TRUE(stdfs::exists(own_ + "/agent/agent"));
}

TEST_F(CgroupV2Test, EnablesOnlyAvailableControllers) {
  Put(own_ + "/cgroup.controllers", "io memory pids\n");
  auto m = MakeManager();
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(Slurp(own_ + "/cgroup.subtree_control"), "+memory +pids");
  // Asking for what is not there fails clearly instead of silently not limiting.
  CgroupLimits limits;
  limits.cpus = "0";
  auto cg = m->CreateCgroup("sb", limits);
  EXPECT_EQ(cg.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(Msg(cg.status()).find("cpuset controller"), std::string::npos) << cg.status();
  limits = {};
  limits.cpu_quota = 1;
  cg = m->CreateCgroup("sb", limits);
  EXPECT_NE(Msg(cg.status()).find("cpu controller"), std::string::npos) << cg.status();
}

TEST_F(CgroupV2Test, MissingRequiredControllerIsActionable) {
  Put(own_ + "/cgroup.controllers", "cpu cpuset pids\n");
  auto m = CreateCgroupManager(options_, MakeFs());
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(
      Msg(m.status()).find("memory controller not available in " + own_ + "/cgroup.controllers"),
      std::string::npos)
      << m.status();
  EXPECT_NE(Msg(m.status()).find("delegate"), std::string::npos);
  // Nothing was touched.
  EXPECT_EQ(fs_->write_count(), 0u);
  EXPECT_FALSE(stdfs::exists(own_ + "/agent"));
  // "memoryx" is not "memory".
  Put(own_ + "/cgroup.controllers", "memoryx pids\n");
  EXPECT_FALSE(CreateCgroupManager(options_, MakeFs()).ok());
}

TEST_F(CgroupV2Test, SandboxCpusGoToParent) {
  options_.cpus = "3,1-2\n";
  auto m = MakeManager();
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(Slurp(own_ + "/pbox/cpuset.cpus"), "1-3");
  options_.cpus = "2-1";
  auto bad = CreateCgroupManager(options_, MakeFs());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  Put(own_ + "/cgroup.controllers", "memory pids\n");
  options_.cpus = "1";
  bad = CreateCgroupManager(options_, MakeFs());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(CgroupV2Test, RootCgroupIsNotEmptied) {
  options_.self_cgroup = "0::/\n";
  Put(root_ + "/cgroup.procs", fmt::format("{}\n", getpid()));
  Put(root_ + "/cgroup.subtree_control", "");
  auto m = MakeManager();
  ASSERT_NE(m, nullptr);
  EXPECT_FALSE(stdfs::exists(root_ + "/agent"));
  EXPECT_EQ(Slurp(root_ + "/cgroup.procs"), fmt::format("{}\n", getpid()));
  EXPECT_EQ(m->parent_path(), root_ + "/pbox");
}

TEST_F(CgroupV2Test, BadSelfCgroup) {
  for (const char* self : {"garbage", "0::relative/path\n", "1:memory:/x\n", "0::/../../etc\n",
                           "0::/does/not/exist\n", ""}) {
    options_.self_cgroup = self;
    if (options_.self_cgroup.empty()) {
      continue;  // empty means "read /proc/self/cgroup"
    }
    auto m = CreateCgroupManager(options_, MakeFs());
    EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition) << self;
  }
}

TEST_F(CgroupV2Test, LimitsLandInTheRightFiles) {
  auto m = MakeManager();
  ASSERT_NE(m, nullptr);
  CgroupLimits limits;
  limits.memory_bytes = 64ull << 20;
  limits.pids = 16;
  limits.cpus = "3,2";
  limits.cpu_quota = 1.5;
  auto cg = m->CreateCgroup("sb-1", limits);
  ASSERT_TRUE(cg.ok()) << cg.status();
  std::string dir = own_ + "/pbox/sb-1";
  EXPECT_EQ((*cg)->name(), "sb-1");
  EXPECT_EQ(Slurp(dir + "/memory.max"), "67108864");
  EXPECT_EQ(Slurp(dir + "/memory.swap.max"), "0");
  EXPECT_EQ(Slurp(dir + "/pids.max"), "16");
  EXPECT_EQ(Slurp(dir + "/cpuset.cpus"), "2-3");
  EXPECT_EQ(Slurp(dir + "/cpu.max"), "150000 100000");

  // dir_fd is an O_DIRECTORY fd of exactly that directory.
  int fd = (*cg)->dir_fd();
  ASSERT_GE(fd, 0);
  struct stat a, b;
  ASSERT_EQ(fstat(fd, &a), 0);
  ASSERT_EQ(stat(dir.c_str(), &b), 0);
  EXPECT_TRUE(S_ISDIR(a.st_mode));
  EXPECT_EQ(a.st_ino, b.st_ino);
  EXPECT_TRUE(fcntl(fd, F_GETFD) & FD_CLOEXEC);

  // Tiny quotas are raised to the kernel's 1 ms minimum instead of failing with EINVAL.
  limits = {};
  limits.cpu_quota = 0.001;
  auto tiny = m->CreateCgroup("sb-2", limits);
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  EXPECT_EQ(Slurp(own_ + "/pbox/sb-2/cpu.max"), "1000 100000");
}

TEST_F(CgroupV2Test, UnlimitedLeavesDefaultsAndNeverCreatesFiles) {
  auto m = MakeManager({.kill_file = true, .swap_file = false, .peak_file = false});
  ASSERT_NE(m, nullptr);
  auto cg = m->CreateCgroup("sb", CgroupLimits{});
  ASSERT_TRUE(cg.ok()) << cg.status();
  std::string dir = own_ + "/pbox/sb";
  EXPECT_EQ(Slurp(dir + "/memory.max"), "max\n");
  EXPECT_EQ(Slurp(dir + "/pids.max"), "max\n");
  EXPECT_EQ(Slurp(dir + "/cpu.max"), "max 100000\n");
  EXPECT_FALSE(stdfs::exists(dir + "/memory.swap.max"));
  EXPECT_TRUE(fs_->WritesTo(dir + "/memory.max").empty());
  auto stats = (*cg)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->memory_peak, 0u);
}

TEST_F(CgroupV2Test, HostileNamesAndLimits) {
  auto m = MakeManager();
  ASSERT_NE(m, nullptr);
  for (const std::string& name :
       {std::string(""), std::string("."), std::string(".."), std::string("../escape"),
        std::string("a/b"), std::string("x\n"), std::string(".hidden"), std::string(200, 'a'),
        std::string("sp ace"), std::string("nul\0x", 5)}) {
    auto cg = m->CreateCgroup(name, {});
    EXPECT_EQ(cg.status().code(), absl::StatusCode::kInvalidArgument) << name;
  }
  EXPECT_FALSE(stdfs::exists(own_ + "/escape"));
  for (const char* cpus : {"3-1", "a", "-1", ",", "1,,2"}) {
    CgroupLimits limits;
    limits.cpus = cpus;
    auto cg = m->CreateCgroup("sb", limits);
    EXPECT_EQ(cg.status().code(), absl::StatusCode::kInvalidArgument) << cpus;
  }
  for (double q : {-1.0, std::nan(""), HUGE_VAL}) {
    CgroupLimits limits;
    limits.cpu_quota = q;
    EXPECT_EQ(m->CreateCgroup("sb", limits).status().code(), absl::StatusCode::kInvalidArgument);
  }
  // Rejected requests left nothing behind.
  EXPECT_FALSE(stdfs::exists(own_ + "/pbox/sb"));
  auto first = m->CreateCgroup("dup", {});
  ASSERT_TRUE(first.ok());
  auto second = m->CreateCgroup("dup", {});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(Msg(second.status()).find("ReapAll"), std::string::npos);
  // A name that is an existing control file cannot be created either.
  EXPECT_EQ(m->CreateCgroup("cgroup.procs", {}).status().code(), absl::StatusCode::kAlreadyExists);
}

TEST_F(CgroupV2Test, FailedLimitRollsBack) {
  auto m = MakeManager();
  ASSERT_NE(m, nullptr);
  // A fake kernel without pids.max in new cgroups: the write fails and the cgroup is removed.
  struct NoPids : FakeCgroupFs {
    using FakeCgroupFs::FakeCgroupFs;
    Status MakeDir(const std::string& path) override {
      BRAGG_RETURN_IF_ERROR(FakeCgroupFs::MakeDir(path));
      stdfs::remove(path + "/pids.max");
      return absl::OkStatus();
    }
  };
  options_.self_cgroup = "0::/job.slice/pboxd.service\n";
  auto m2 = CreateCgroupManager(options_, std::make_shared<NoPids>(root_, FakeOptions{}));
  ASSERT_TRUE(m2.ok()) << m2.status();
  CgroupLimits limits;
  limits.pids = 5;
  auto cg = (*m2)->CreateCgroup("sb", limits);
  ASSERT_FALSE(cg.ok());
  EXPECT_NE(Msg(cg.status()).find("pids.max"), std::string::npos) << cg.status();
  EXPECT_FALSE(stdfs::exists(own_ + "/pbox/sb"));
}

TEST_F(CgroupV2Test, StatsParsing) {
  auto m = MakeManager();
  ASSERT_NE(m, nullptr);
  auto cg = m->CreateCgroup("sb", {});
  ASSERT_TRUE(cg.ok());
  std::string dir = own_ + "/pbox/sb";
  auto child = Spawn({"sleep", "100"});
  ASSERT_TRUE(child.ok());
  ASSERT_TRUE((*cg)->AddProcess(child->pid()).ok());
  Put(dir + "/memory.current", "1234\n");
  Put(dir + "/memory.peak", "5678\n");
  Put(dir + "/memory.events", "low 0\nhigh 0\nmax 7\noom 4\noom_kill 3\noom_group_kill 0\n");
  Put(dir + "/cpu.stat", "usage_usec 42\nuser_usec 40\nsystem_usec 2\n");
  auto stats = (*cg)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->memory_current, 1234u);
  EXPECT_EQ(stats->memory_peak, 5678u);
  EXPECT_EQ(stats->oom_kills, 3u);
  EXPECT_EQ(stats->cpu_usage_ns, 42000u);
  EXPECT_EQ(stats->processes, 1u);

  struct Case {
    const char* file;
    const char* data;
    absl::StatusCode code;
  } cases[] = {
      {"memory.current", "abc\n", absl::StatusCode::kInvalidArgument},
      {"memory.current", "", absl::StatusCode::kInvalidArgument},
      {"memory.current", "99999999999999999999999\n", absl::StatusCode::kInvalidArgument},
      {"memory.peak", "-1\n", absl::StatusCode::kInvalidArgument},
      {"memory.events", "low 0\noom 1\n", absl::StatusCode::kNotFound},
      {"memory.events", "oom_kill\n", absl::StatusCode::kNotFound},
      {"memory.events", "oom_kill x\n", absl::StatusCode::kInvalidArgument},
      {"cpu.stat", "usage_usec -5\n", absl::StatusCode::kInvalidArgument},
      {"cgroup.procs", "12x\n", absl::StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    std::string path = dir + "/" + c.file;
    std::string saved = Slurp(path);
    Put(path, c.data);
    auto bad = (*cg)->Stats();
    EXPECT_EQ(bad.status().code(), c.code) << c.file << " '" << c.data << "': " << bad.status();
    EXPECT_NE(Msg(bad.status()).find(c.file), std::string::npos) << bad.status();
    Put(path, saved);
  }
  ASSERT_TRUE(stdfs::remove(dir + "/memory.current"));
  EXPECT_EQ((*cg)->Stats().status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CgroupV2Test, KillAllWithCgroupKill) {
  auto m = MakeManager();
  ASSERT_NE(m, nullptr);
  auto cg = m->CreateCgroup("sb", {});
  ASSERT_TRUE(cg.ok());
  auto child = Spawn({"sleep", "100"});
  ASSERT_TRUE(child.ok());
  ASSERT_TRUE((*cg)->AddProcess(child->pid()).ok());
  ASSERT_TRUE((*cg)->KillAll().ok());
  auto info = child->Wait(std::chrono::seconds(5));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->signal, SIGKILL);
  std::string dir = own_ + "/pbox/sb";
  EXPECT_EQ(fs_->WritesTo(dir + "/cgroup.kill"), std::vector<std::string>{"1"});
  EXPECT_TRUE(fs_->WritesTo(dir + "/cgroup.freeze").empty());
  // Adding a pid that does not exist fails and names it.
  Status s = (*cg)->AddProcess(child->pid());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(Msg(s).find(std::to_string(child->pid())), std::string::npos);
}

TEST_F(CgroupV2Test, KillAllWithoutCgroupKillFreezes) {
  auto m = MakeManager({.kill_file = false});
  ASSERT_NE(m, nullptr);
  auto cg = m->CreateCgroup("sb", {});
  ASSERT_TRUE(cg.ok());
  auto a = Spawn({"sleep", "100"});
  auto b = Spawn({"sleep", "100"});
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*cg)->AddProcess(a->pid()).ok());
  ASSERT_TRUE((*cg)->AddProcess(b->pid()).ok());
  EXPECT_EQ((*cg)->Stats()->processes, 2u);
  ASSERT_TRUE((*cg)->KillAll().ok());
  EXPECT_EQ(a->Wait(std::chrono::seconds(5))->signal, SIGKILL);
  EXPECT_EQ(b->Wait(std::chrono::seconds(5))->signal, SIGKILL);
  std::string dir = own_ + "/pbox/sb";
  EXPECT_EQ(fs_->WritesTo(dir + "/cgroup.freeze"), (std::vector<std::string>{"1", "0"}));
  EXPECT_EQ((*cg)->Stats()->processes, 0u);
}

TEST_F(CgroupV2Test, FreezeWritesCgroupFreezeAndWaitsForEvents) {
  auto m = MakeManager();
  ASSERT_NE(m, nullptr);
  auto cg = m->CreateCgroup("sb", {});
  ASSERT_TRUE(cg.ok());
  std::string dir = own_ + "/pbox/sb";
  ASSERT_TRUE((*cg)->Freeze(true).ok());
  EXPECT_EQ(Slurp(dir + "/cgroup.events"), "populated 1\nfrozen 1\n");
  ASSERT_TRUE((*cg)->Freeze(false).ok());
  EXPECT_EQ(Slurp(dir + "/cgroup.events"), "populated 1\nfrozen 0\n");
  EXPECT_EQ(fs_->WritesTo(dir + "/cgroup.freeze"), (std::vector<std::string>{"1", "0"}));
  ASSERT_TRUE((*cg)->Destroy().ok());
  EXPECT_EQ((*cg)->Freeze(true).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fs_->WritesTo(dir + "/cgroup.freeze").size(), 2u);
}

TEST_F(CgroupV2Test, FreezeThatNeverCompletesTimesOutAndThaws) {
  auto m = MakeManager({.freeze_completes = false});
  ASSERT_NE(m, nullptr);
  auto cg = m->CreateCgroup("sb", {});
  ASSERT_TRUE(cg.ok());
  Status s = (*cg)->Freeze(true);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(fs_->WritesTo(own_ + "/pbox/sb/cgroup.freeze"), (std::vector<std::string>{"1", "0"}));
}

TEST_F(CgroupV2Test, DestroyIsIdempotentAndDestructorCleansUp) {
  auto m = MakeManager();
  ASSERT_NE(m, nullptr);
  auto cg = m->CreateCgroup("sb", {});
  ASSERT_TRUE(cg.ok());
  std::string dir = own_ + "/pbox/sb";
  auto child = Spawn({"sleep", "100"});
  ASSERT_TRUE(child.ok());
  ASSERT_TRUE((*cg)->AddProcess(child->pid()).ok());
  // A sandbox may nest its own cgroups: they go too.
  ASSERT_TRUE(fs_->MakeDir(dir + "/inner").ok());
  ASSERT_TRUE(stdfs::exists(dir));
  ASSERT_TRUE((*cg)->Destroy().ok());
  EXPECT_FALSE(stdfs::exists(dir));
  EXPECT_EQ((*cg)->dir_fd(), -1);
  EXPECT_TRUE((*cg)->Destroy().ok());
  EXPECT_TRUE((*cg)->KillAll().ok());
  EXPECT_EQ((*cg)->AddProcess(getpid()).code(), absl::StatusCode::kFailedPrecondition);

  {
    auto scoped = m->CreateCgroup("scoped", {});
    ASSERT_TRUE(scoped.ok());
    EXPECT_TRUE(stdfs::exists(own_ + "/pbox/scoped"));
  }
  EXPECT_FALSE(stdfs::exists(own_ + "/pbox/scoped"));
}

TEST_F(CgroupV2Test, ReapAllRemovesLeftoversOfAPreviousAgent) {
  std::vector<ChildProcess> children;
  {
    auto old = MakeManager();
    ASSERT_NE(old, nullptr);
    for (const char* name : {"old-a", "old-b"}) {
      auto cg = old->CreateCgroup(name, {});
      ASSERT_TRUE(cg.ok());
      auto child = Spawn({"sleep", "100"});
      ASSERT_TRUE(child.ok());
      ASSERT_TRUE((*cg)->AddProcess(child->pid()).ok());
      children.push_back(std::move(*child));
      (void)cg->release();  // the old agent was SIGKILLed: nothing ran its destructors
    }
    ASSERT_TRUE(fs_->MakeDir(own_ + "/pbox/old-a/nested").ok());
    auto nested = Spawn({"sleep", "100"});
    ASSERT_TRUE(nested.ok());
    ASSERT_TRUE(
        fs_->Write(own_ + "/pbox/old-a/nested/cgroup.procs", std::to_string(nested->pid())).ok());
    children.push_back(std::move(*nested));
  }
  auto m = MakeManager();
  ASSERT_NE(m, nullptr);
  auto reaped = m->ReapAll();
  ASSERT_TRUE(reaped.ok()) << reaped.status();
  EXPECT_EQ(*reaped, (std::vector<std::string>{"old-a", "old-b"}));
  for (ChildProcess& c : children) {
    auto info = c.Wait(std::chrono::seconds(5));
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->signal, SIGKILL);
  }
  EXPECT_FALSE(stdfs::exists(own_ + "/pbox/old-a"));
  EXPECT_FALSE(stdfs::exists(own_ + "/pbox/old-b"));
  EXPECT_TRUE(stdfs::exists(own_ + "/pbox"));
  auto again = m->ReapAll();
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->empty());
}

// `pboxd --reap`: a locate-only manager creates, enables and moves nothing, reaps what a
// killed agent left, and removes the parent; one whose parent is gone finds nothing.
TEST_F(CgroupV2Test, LocateOnlyReapsWithoutSideEffects) {
  std::vector<ChildProcess> children;
  {
    auto old = MakeManager();
    ASSERT_NE(old, nullptr);
    auto cg = old->CreateCgroup("old-a", {});
    ASSERT_TRUE(cg.ok());
    auto child = Spawn({"sleep", "100"});
    ASSERT_TRUE(child.ok());
    ASSERT_TRUE((*cg)->AddProcess(child->pid()).ok());
    children.push_back(std::move(*child));
    (void)cg->release();
  }
  // The reaper runs where the agent's parent shell ended up: the agent's leaf.
  Put(own_ + "/agent/cgroup.procs", fmt::format("{}\n", getpid()));
  options_.self_cgroup = "0::/job.slice/pboxd.service/agent\n";
  options_.create_parent = false;
  const std::string subtree = Slurp(own_ + "/cgroup.subtree_control");
  auto fs = MakeFs();
  auto m = CreateCgroupManager(options_, fs);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->parent_path(), own_ + "/pbox");
  EXPECT_TRUE(fs->mkdirs().empty());
  EXPECT_EQ(fs->write_count(), 0u);
  EXPECT_FALSE(stdfs::exists(own_ + "/agent/agent"));
  EXPECT_EQ(Slurp(own_ + "/cgroup.subtree_control"), subtree);
  ASSERT_TRUE((*m)->RemoveParent().ok());
  auto info = children[0].Wait(std::chrono::seconds(5));
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->signal, SIGKILL);
  EXPECT_FALSE(stdfs::exists(own_ + "/pbox"));
  EXPECT_TRUE(stdfs::exists(own_ + "/agent"));

  // Nothing left: the parent is missing, and that is fine (idempotent).
  auto again = CreateCgroupManager(options_, MakeFs());
  ASSERT_TRUE(again.ok()) << again.status();
  auto reaped = (*again)->ReapAll();
  ASSERT_TRUE(reaped.ok()) << reaped.status();
  EXPECT_TRUE(reaped->empty());
  EXPECT_TRUE((*again)->RemoveParent().ok());
  EXPECT_TRUE(fs_->mkdirs().empty());
}

TEST_F(CgroupV2Test, DetectsVersionFromLayout) {
  // v2: cgroup.controllers at the root.
  auto v2 = CreateCgroupManager(options_, MakeFs());
  ASSERT_TRUE(v2.ok()) << v2.status();
  EXPECT_EQ((*v2)->version(), "v2");
  EXPECT_EQ(*DetectCgroupVersion(root_), "v2");

  // v1: per-controller directories.
  auto v1tmp = TempDir::Create("/tmp", "pbox-cgv1-");
  ASSERT_TRUE(v1tmp.ok());
  std::string r = v1tmp->path();
  for (const char* c : {"memory", "pids", "cpuset"}) {
    stdfs::create_directories(r + "/" + c);
    Put(r + "/" + c + "/cgroup.procs", "");
  }
  Put(r + "/cpuset/cpuset.cpus", "0-1\n");
  Put(r + "/cpuset/cpuset.mems", "0\n");
  CgroupManagerOptions o;
  o.root = r;
  o.self_cgroup = "4:memory:/\n3:cpuset:/\n8:pids:/\n1:name=systemd:/\n0::/\n";
  EXPECT_EQ(*DetectCgroupVersion(r), "v1");
  auto v1 = CreateCgroupManager(o, std::make_shared<FakeCgroupFs>(r, FakeOptions{}));
  ASSERT_TRUE(v1.ok()) << v1.status();
  EXPECT_EQ((*v1)->version(), "v1");
  EXPECT_EQ((*v1)->parent_path(), r + "/memory/pbox");
  EXPECT_EQ(Slurp(r + "/cpuset/pbox/cpuset.cpus"), "0-1");
  EXPECT_EQ(Slurp(r + "/cpuset/pbox/cpuset.mems"), "0");
  EXPECT_TRUE(stdfs::exists(r + "/pids/pbox"));

  // v1 without a required hierarchy.
  stdfs::remove_all(r + "/pids");
  auto nopids = CreateCgroupManager(o, std::make_shared<FakeCgroupFs>(r, FakeOptions{}));
  EXPECT_EQ(nopids.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(Msg(nopids.status()).find("pids controller not available"), std::string::npos)
      << nopids.status();

  // Neither.
  auto empty = TempDir::Create("/tmp", "pbox-cgnone-");
  ASSERT_TRUE(empty.ok());
  o.root = empty->path();
  auto none = CreateCgroupManager(o, std::make_shared<FakeCgroupFs>(o.root, FakeOptions{}));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(Msg(none.status()).find("no cgroup filesystem"), std::string::npos);

  // Forced modes and bad options.
  options_.mode = "v3";
  EXPECT_EQ(CreateCgroupManager(options_, MakeFs()).status().code(),
            absl::StatusCode::kInvalidArgument);
  options_.mode = "v2";
  options_.parent_name = "../up";
  EXPECT_EQ(CreateCgroupManager(options_, MakeFs()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CgroupV2RealTest, ControllerlessHostCgroup2IsRejectedWithoutSideEffects) {
  // On a hybrid host the cgroup2 mount usually has no controllers; the real Create must say so
  // (and must not move anything). Skips where the agent could really use v2.
  const std::string root = "/sys/fs/cgroup/unified";
  auto controllers = ReadFileToString(root + "/cgroup.controllers");
  if (!controllers.ok()) {
    GTEST_SKIP() << "no cgroup2 mount at " << root;
  }
  if (controllers->find("memory") != std::string::npos) {
    GTEST_SKIP() << root << " has the memory controller; not a controller-less mount";
  }
  CgroupManagerOptions o;
  o.root = root;
  o.mode = "auto";
  o.parent_name = fmt::format("pbox-test-{}", getpid());
  auto m = CgroupManager::Create(o);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition) << m.status();
  EXPECT_NE(Msg(m.status()).find("memory controller not available"), std::string::npos)
      << m.status();
}

}  // namespace
}  // namespace bragg::pbox
