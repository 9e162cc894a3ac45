#include "pbox/runtime/gvisor_runtime.h"

#include <errno.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "common/fs.h"
#include "nlohmann/json.hpp"
#include "pbox/cgroup/testing/null_cgroup.h"
#include "pbox/runtime/seccomp_filter.h"

namespace bragg::pbox {
namespace {

using nlohmann::json;

json Config(uint32_t pids, const std::vector<std::string>& denied = {}, uint64_t nofile = 0) {
  Image image{.name = "host", .lower_dirs = {"/x/lower"}};
  LaunchSpec spec;
  spec.id = "sb-1";
  spec.image = &image;
  spec.pids = pids;
  GvisorSandboxPolicy policy{
      .denied_syscalls = denied, .nofile_soft = nofile, .nofile_hard = nofile * 4};
  return json::parse(GvisorBundleConfig(spec, "/opt/pbox-init", "/b/rootfs", policy));
}

TEST(GvisorBundleConfigTest, ProcessLimitBecomesRlimitNproc) {
  json c = Config(64);
  ASSERT_EQ(c["process"]["rlimits"].size(), 1u) << c.dump();
  const json& r = c["process"]["rlimits"][0];
  EXPECT_EQ(r["type"], "RLIMIT_NPROC");
  // soft = hard: a command cannot raise it.
  EXPECT_EQ(r["soft"], 64);
  EXPECT_EQ(r["hard"], 64);
  EXPECT_TRUE(Config(0)["process"]["rlimits"].empty());
}

TEST(GvisorBundleConfigTest, OpenFilesLimitIsTheAgentsOriginal) {
  json c = Config(0, {}, 256);
  ASSERT_EQ(c["process"]["rlimits"].size(), 1u) << c.dump();
  EXPECT_EQ(c["process"]["rlimits"][0]["type"], "RLIMIT_NOFILE");
  EXPECT_EQ(c["process"]["rlimits"][0]["soft"], 256);
  EXPECT_EQ(c["process"]["rlimits"][0]["hard"], 1024);
}

TEST(GvisorBundleConfigTest, NoCapabilitiesAndNoNewPrivileges) {
  json c = Config(64);
  for (const char* set : {"bounding", "effective", "inheritable", "permitted", "ambient"}) {
    EXPECT_TRUE(c["process"]["capabilities"][set].empty()) << set;
  }
  EXPECT_EQ(c["process"]["noNewPrivileges"], true);
  EXPECT_EQ(c["process"]["args"], json({"/dev/pbox-init", "--stream"}));
}

TEST(GvisorBundleConfigTest, SeccompDenyListWithCloneFlagsAndClone3) {
  EXPECT_FALSE(Config(64)["linux"].contains("seccomp"));
  json c = Config(64, {"mount", "unshare", "clone(CLONE_NEW*)", "clone3"});
  const json& s = c["linux"]["seccomp"];
  EXPECT_EQ(s["defaultAction"], "SCMP_ACT_ALLOW");
  const json& rules = s["syscalls"];
  ASSERT_EQ(rules.size(), 1u + 7u + 1u) << s.dump();
  EXPECT_EQ(rules[0]["names"], json({"mount", "unshare"}));
  EXPECT_EQ(rules[0]["errnoRet"], EPERM);
  uint64_t flags = 0;
  for (size_t i = 1; i <= 7; ++i) {
    EXPECT_EQ(rules[i]["names"], json({"clone"}));
    const json& arg = rules[i]["args"][0];
    EXPECT_EQ(arg["op"], "SCMP_CMP_MASKED_EQ");
    EXPECT_EQ(arg["index"], 0);
    EXPECT_EQ(arg["value"], arg["valueTwo"]);
    flags |= arg["value"].get<uint64_t>();
  }
  EXPECT_EQ(flags, static_cast<uint64_t>(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER |
                                         CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWCGROUP));
  EXPECT_EQ(rules[8]["names"], json({"clone3"}));
  EXPECT_EQ(rules[8]["errnoRet"], ENOSYS);
}

TEST(GvisorBundleConfigTest, IsolatedCommandsGetTheNativeProgramThroughPboxInit) {
  Image image{.name = "host", .lower_dirs = {"/x/lower"}};
  LaunchSpec spec;
  spec.id = "sb-1";
  spec.image = &image;
  spec.pids = 64;
  GvisorSandboxPolicy policy{.denied_syscalls = {"mount", "unshare"},
                             .init_seccomp_program = std::string(16, 'p')};
  json c = json::parse(GvisorBundleConfig(spec, "/opt/pbox-init", "/b/rootfs", policy));
  // The program comes on pbox-init's stdin, not as a file in the sandbox.
  EXPECT_EQ(c["process"]["args"], json({"/dev/pbox-init", "--stream", "--isolate"}));
  // pbox-init loads the program after its unshare: no OCI filter would let that through.
  EXPECT_FALSE(c["linux"].contains("seccomp")) << c["linux"].dump();
  const json& caps = c["process"]["capabilities"];
  for (const char* set : {"bounding", "effective", "permitted"}) {
    EXPECT_EQ(caps[set], json({"CAP_SYS_ADMIN", "CAP_SETPCAP"})) << set;
  }
  EXPECT_TRUE(caps["inheritable"].empty());
  EXPECT_TRUE(caps["ambient"].empty());
  EXPECT_EQ(c["process"]["noNewPrivileges"], true);
  // Nothing of pbox's in the sandbox but pbox-init's binary.
  for (const json& m : c["mounts"]) {
    const std::string dest = m["destination"];
    EXPECT_TRUE(dest.rfind("/dev/pbox", 0) != 0 || dest == "/dev/pbox-init") << dest;
  }
  // The holder of the commands' PID namespace counts as one more process.
  EXPECT_EQ(c["process"]["rlimits"][0]["hard"], 65);
  EXPECT_EQ(c["process"]["rlimits"][0]["soft"], 65);
}

TEST(GvisorBundleConfigTest, TheNativeDenyListCarriesOver) {
  auto seccomp = SeccompProgram::BuildDefault();
  ASSERT_TRUE(seccomp.ok()) << seccomp.status();
  json names = Config(64, seccomp->denied())["linux"]["seccomp"]["syscalls"][0]["names"];
  for (const char* must : {"mount", "unshare", "setns", "bpf", "io_uring_setup", "chroot",
                           "pivot_root", "init_module", "keyctl", "userfaultfd"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), must), names.end()) << must;
  }
  for (const json& n : names) {
    EXPECT_EQ(n.get<std::string>().find('('), std::string::npos) << n;
  }
}

TEST(GvisorRuntimeTest, HostPidsBoundLeavesRoomForGvisorsOwnTasks) {
  char tmpl[] = "/tmp/pbox-gvisor-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  // runsc is only looked up here: any executable will do.
  auto rt = GvisorRuntime::Create(
      {.state_dir = dir, .init_path = "/bin/true", .runsc = "/bin/true", .platform = "ptrace"});
  ASSERT_TRUE(rt.ok()) << rt.status();
  EXPECT_EQ((*rt)->HostPidsLimit(0), 0u);
  EXPECT_EQ((*rt)->HostPidsLimit(64), 64u * 8 + 512);
  EXPECT_EQ((*rt)->HostPidsLimit(4000000000u), 4194304u);  // the kernel's PID_MAX_LIMIT
  EXPECT_FALSE(
      GvisorRuntime::Create(
          {.state_dir = dir, .init_path = "/bin/true", .runsc = "/bin/true", .platform = "bogus"})
          .ok());
  EXPECT_TRUE(RemoveTree(dir).ok());
}

// A cgroup whose procs files cannot be written: the runsc launcher cannot join it.
class UnjoinableCgroup : public testing::NullCgroup {
 public:
  UnjoinableCgroup() : NullCgroup("unjoinable") {}
  std::vector<std::string> ProcsFiles() const override { return {"/nonexistent/pbox/tasks"}; }
};

bool MountedUnder(const std::string& dir) {
  auto text = ReadFileToString("/proc/self/mountinfo");
  EXPECT_TRUE(text.ok()) << text.status();
  return text.ok() && text->find(" " + dir + "/") != std::string::npos;
}

TEST(GvisorRuntimeTest, ALauncherThatCannotJoinTheCgroupFailsAndLeavesNothing) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "mounts the bundle: needs root";
  }
  char tmpl[] = "/tmp/pbox-gvisor-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  ASSERT_TRUE(MakeDirs(dir + "/lower/usr", 0755).ok());
  // The launcher fails before its exec: any executable will do for runsc.
  auto rt = GvisorRuntime::Create(
      {.state_dir = dir + "/state", .init_path = "/bin/true", .runsc = "/bin/true"});
  ASSERT_TRUE(rt.ok()) << rt.status();
  Image image{.name = "test", .lower_dirs = {dir + "/lower"}};
  UnjoinableCgroup cgroup;
  LaunchSpec spec;
  spec.id = "sb-unjoinable";
  spec.image = &image;
  spec.disk_bytes = 1 << 20;
  spec.cgroup = &cgroup;
  auto sb = (*rt)->Start(spec);
  ASSERT_FALSE(sb.ok());
  EXPECT_NE(std::string(sb.status().message()).find("joining the sandbox's cgroup"),
            std::string::npos)
      << sb.status();
  EXPECT_FALSE(MountedUnder(dir)) << "the bundle's mounts outlived the failed start";
  EXPECT_NE(::access((dir + "/state/gvisor/sb-unjoinable").c_str(), F_OK), 0);
  rt->reset();
  EXPECT_TRUE(RemoveTree(dir).ok());
}

// Whether some mapping of [addr, addr + len) in this process is backed by huge pages.
bool HugePagesBack(const void* addr, size_t len) {
  auto smaps = ReadFileToString("/proc/self/smaps");
  EXPECT_TRUE(smaps.ok()) << smaps.status();
  if (!smaps.ok()) {
    return false;
  }
  const uintptr_t lo = reinterpret_cast<uintptr_t>(addr), hi = lo + len;
  bool inside = false;
  std::istringstream lines(*smaps);
  std::string line;
  while (std::getline(lines, line)) {
    uintptr_t a = 0, b = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &a, &b) == 2 && line.find(':') > line.find('-')) {
      inside = a < hi && lo < b;
    } else if (inside &&
               (line.rfind("ShmemPmdMapped:", 0) == 0 || line.rfind("FilePmdMapped:", 0) == 0)) {
      if (std::strtoull(line.c_str() + line.find(':') + 1, nullptr, 10) > 0) {
        return true;
      }
    }
  }
  return false;
}

TEST(GvisorRuntimeTest, RunscStartsFromACopyOnHugePagesThatNothingMounts) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "mounts a tmpfs: needs root";
  }
  char tmpl[] = "/tmp/pbox-gvisor-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  // A "runsc" of 5 MiB and a few bytes (more than two huge pages), each byte telling where it
  // is, so that a short or shifted copy shows.
  std::string body(5 * (1 << 20) + 12345, '\0');
  for (size_t i = 0; i < body.size(); ++i) {
    body[i] = static_cast<char>((i * 2654435761u) >> 13);
  }
  const std::string runsc = dir + "/runsc-original";
  ASSERT_TRUE(WriteStringToFile(runsc, body).ok());
  ASSERT_EQ(::chmod(runsc.c_str(), 0755), 0);
  const GvisorRuntimeOptions options{
      .state_dir = dir + "/state", .init_path = "/bin/true", .runsc = runsc};
  auto rt = GvisorRuntime::Create(options);
  ASSERT_TRUE(rt.ok()) << rt.status();
  EXPECT_EQ((*rt)->runsc_path(), runsc);
  EXPECT_FALSE(MountedUnder(dir)) << "the copy's tmpfs is still mounted";
  EXPECT_NE(::access((dir + "/state/gvisor/bin").c_str(), F_OK), 0) << "its mount point stayed";
  const int fd = (*rt)->runsc_copy_fd();
  if (fd < 0) {
    // Only a kernel without huge pages for tmpfs (or with them denied) may refuse the copy.
    auto policy = ReadFileToString("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
    if (policy.ok() && policy->find("[deny]") != std::string::npos) {
      rt->reset();
      EXPECT_TRUE(RemoveTree(dir).ok());
      GTEST_SKIP() << "huge pages for tmpfs are denied here";
    }
    const std::string probe = dir + "/probe";
    ASSERT_TRUE(MakeDirs(probe, 0700).ok());
    const bool huge = ::mount("probe", probe.c_str(), "tmpfs", 0, "huge=always") == 0;
    if (huge) {
      ::umount2(probe.c_str(), MNT_DETACH);
    }
    ASSERT_FALSE(huge) << "this kernel mounts tmpfs with huge=always, yet runsc was not copied";
    rt->reset();
    EXPECT_TRUE(RemoveTree(dir).ok());
    GTEST_SKIP() << "no tmpfs with huge=always on this kernel";
  }
  struct statfs fs {};
  ASSERT_EQ(::fstatfs(fd, &fs), 0);
  EXPECT_EQ(fs.f_type, TMPFS_MAGIC);
  struct stat st {};
  ASSERT_EQ(::fstat(fd, &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0555u) << "runsc executes itself again as nobody";
  EXPECT_EQ(static_cast<size_t>(st.st_size), body.size());
  EXPECT_EQ(::fcntl(fd, F_GETFL) & O_ACCMODE, O_RDONLY);
  EXPECT_NE(::fcntl(fd, F_GETFD) & FD_CLOEXEC, 0) << "commands would inherit it";
  std::string copy(body.size(), '\0');
  ASSERT_EQ(::pread(fd, copy.data(), copy.size(), 0), static_cast<ssize_t>(copy.size()));
  EXPECT_TRUE(copy == body) << "the copy differs";
  // Its pages are huge: a mapping of it (as exec makes) is backed by PMD-sized pages.
  constexpr size_t kLen = 4 << 20;
  void* map = ::mmap(nullptr, kLen, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(map, MAP_FAILED);
  volatile char sum = 0;
  for (size_t i = 0; i < kLen; i += 4096) {
    sum = sum + static_cast<const char*>(map)[i];
  }
  EXPECT_TRUE(HugePagesBack(map, kLen)) << "the copy is not on huge pages";
  ::munmap(map, kLen);
  rt->reset();

  // Off: runsc runs where it is.
  auto off = GvisorRuntime::Create({.state_dir = dir + "/state",
                                    .init_path = "/bin/true",
                                    .runsc = runsc,
                                    .runsc_huge_pages = false});
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ((*off)->runsc_copy_fd(), -1);
  off->reset();

  // A runsc that cannot be copied (a directory passes the executable check): runsc runs
  // where it is, and the failed copy leaves no mount and no mount point.
  ASSERT_TRUE(MakeDirs(dir + "/runsc-dir", 0755).ok());
  auto dir_runsc = GvisorRuntime::Create(
      {.state_dir = dir + "/state", .init_path = "/bin/true", .runsc = dir + "/runsc-dir"});
  ASSERT_TRUE(dir_runsc.ok()) << dir_runsc.status();
  EXPECT_EQ((*dir_runsc)->runsc_copy_fd(), -1);
  EXPECT_FALSE(MountedUnder(dir));
  EXPECT_NE(::access((dir + "/state/gvisor/bin").c_str(), F_OK), 0);
  dir_runsc->reset();
  EXPECT_TRUE(RemoveTree(dir).ok());
}

TEST(GvisorHelperPathTest, NormalizesAndRefusesWhatMustNotBeTouchedFromInside) {
  EXPECT_EQ(GvisorHelperPath("/tmp/fill"), "/tmp/fill");
  EXPECT_EQ(GvisorHelperPath("tmp//./fill/"), "/tmp/fill");
  EXPECT_EQ(GvisorHelperPath("/procfs/x"), "/procfs/x");
  EXPECT_EQ(GvisorHelperPath("/tmp/proc"), "/tmp/proc");
  for (const char* refused : {"", "/", "//", "/.", "./", "/tmp/../etc", "..", "/a/b/..", "/proc",
                              "/proc/1/fd", "dev/null", "/./dev/shm/x"}) {
    EXPECT_EQ(GvisorHelperPath(refused), std::nullopt) << refused;
  }
  EXPECT_EQ(GvisorHelperPath(std::string("/tmp/a\0b", 9)), std::nullopt);
  EXPECT_EQ(GvisorHelperPath("/" + std::string(5000, 'a')), std::nullopt);
}

}  // namespace
}  // namespace bragg::pbox
