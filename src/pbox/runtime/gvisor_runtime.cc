#include "pbox/runtime/gvisor_runtime.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <sstream>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "common/fs.h"
#include "common/process.h"
#include "fmt/format.h"
#include "nlohmann/json.hpp"
#include "pbox/init/init_protocol.h"
#include "pbox/runtime/read_only_tree.h"
#include "pbox/runtime/seccomp_filter.h"
#include "spdlog/spdlog.h"

namespace bragg::pbox {
namespace {

// Where pbox-init appears inside the sandbox (a read-only bind of the agent's binary; /dev is
// the sentry's own tmpfs, so nothing shows up in the sandbox's root filesystem).
constexpr char kInitInSandbox[] = "/dev/pbox-init";
constexpr auto kReadyTimeout = std::chrono::seconds(60);

Result<std::string> FindInPath(const std::string& name) {
  Result<std::string> found = FindExecutable(name);
  if (!found.ok()) {
    return absl::FailedPreconditionError(
        fmt::format("{}: the gVisor runtime needs runsc (Debian package runsc) or --runsc",
                    std::string(found.status().message())));
  }
  return found;
}

// Mount points at or below `dir`, deepest first.
std::vector<std::string> MountsUnder(const std::string& dir) {
  std::vector<std::string> out;
  auto info = ReadFileToString("/proc/self/mountinfo");
  if (!info.ok()) {
    return out;
  }
  std::istringstream lines(*info);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    std::string id, parent, devno, root, mount_point;
    fields >> id >> parent >> devno >> root >> mount_point;
    // mountinfo escapes spaces and the like as \ooo; our paths have none.
    if (mount_point == dir || mount_point.rfind(dir + "/", 0) == 0) {
      out.push_back(mount_point);
    }
  }
  std::sort(out.begin(), out.end(),
            [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
  return out;
}

std::string LogTail(const std::string& path) {
  auto text = ReadFileToString(path);
  if (!text.ok() || text->empty()) {
    return "no output from runsc";
  }
  std::string t = *text;
  if (t.size() > 2000) {
    t = "..." + t.substr(t.size() - 2000);
  }
  while (!t.empty() && (t.back() == '\n' || t.back() == ' ')) {
    t.pop_back();
  }
  return t;
}

// Longest wait for one of pbox-init's helpers inside a sandbox (init_helpers.h).
constexpr auto kHelperTimeout = std::chrono::seconds(30);

std::string DescribeHelperExit(const ProcessExit& exit) {
  if (!exit.error.empty()) {
    return exit.error;
  }
  return exit.signal != 0 ? fmt::format("killed by signal {}", exit.signal)
                          : fmt::format("exit code {}", exit.exit_code);
}

class GvisorSandbox : public RuntimeSandbox {
 public:
  GvisorSandbox(std::string bundle, Cgroup* cgroup, UniqueFd writable_layer)
      : bundle_(std::move(bundle)), cgroup_(cgroup), writable_layer_(std::move(writable_layer)) {}

  ~GvisorSandbox() override { (void)Stop(); }

  InitClient* init() override { return init_.get(); }
  const SandboxFs& fs() const override { return *fs_; }
  pid_t init_pid() const override { return runsc_pid_; }

  Result<UniqueFd> OpenWritableLayer() override {
    std::lock_guard<std::mutex> lock(layer_mu_);
    return ReopenLayer(writable_layer_);
  }

  Status FlushWrites(std::chrono::milliseconds timeout) override {
    // sync(2) inside gVisor: the sentry writes back what it caches of the files (pages of
    // files it maps without a host fd; with --file-access=shared plain writes go through).
    BRAGG_ASSIGN_OR_RETURN(ProcessExit exit, RunHelper({"--sync"}, timeout));
    if (exit.signal != 0 || exit.exit_code != 0) {
      return absl::InternalError(
          fmt::format("sync inside the sandbox failed: {}", DescribeHelperExit(exit)));
    }
    return absl::OkStatus();
  }

  Status Remove(const std::string& path, bool recursive) override {
    // The sentry keeps what it looked up (dentries holding the gofer's open files); a removal
    // behind its back on the host leaves those open, and the file's blocks taken, until it
    // happens to revalidate them and the gofer's batched closes go out. Removed through the
    // sentry first, the files are closed at once. Best effort, with the sandbox's own rights;
    // the agent's removal on the host then does the rest and decides the outcome.
    std::optional<std::string> inside = GvisorHelperPath(path);
    bool gone_inside = false;
    if (inside.has_value()) {
      auto exit = RunHelper({recursive ? "--remove-tree" : "--remove", *inside}, kHelperTimeout);
      if (!exit.ok()) {
        // Unavailable: the sandbox's processes are gone (OOM, stopped); its files stay.
        spdlog::log(absl::IsUnavailable(exit.status()) ? spdlog::level::debug : spdlog::level::warn,
                    "removing {} inside gVisor sandbox {}: {}", *inside, bundle_,
                    std::string(exit.status().message()));
      } else {
        gone_inside = exit->signal == 0 && exit->exit_code == 0;
      }
    }
    Status removed = fs_->Remove(path, recursive);
    if (gone_inside && absl::IsNotFound(removed)) {
      return absl::OkStatus();
    }
    return removed;
  }

  Status Stop() override {
    if (stopped_) {
      return absl::OkStatus();
    }
    stopped_ = true;
    {
      // The fd pins the writable layer's tmpfs (and its memory): let it go with the sandbox.
      // A clone still copying holds its own fd from OpenWritableLayer and finishes.
      std::lock_guard<std::mutex> lock(layer_mu_);
      writable_layer_.Reset();
    }
    // runsc, the sentry, the gofer and (inside the sentry) every sandboxed process.
    Status status = cgroup_->KillAll();
    if (runsc_.running()) {
      (void)runsc_.Signal(SIGKILL);
      auto exit = runsc_.Wait(std::chrono::milliseconds(10000));
      if (!exit.ok()) {
        status.Update(Annotate(exit.status(), "waiting for runsc"));
      }
    }
    // init_ stays: commands still holding it get Unavailable from the dead stream. The
    // bundle's mounts went with runsc, the last process in their mount namespace (fs_ may
    // still hold the detached root). Here the bundle is plain directories and files.
    if (Status s = RemoveTree(bundle_); !s.ok()) {
      status.Update(s);
    }
    return status;
  }

  std::string bundle_;
  Cgroup* cgroup_;
  ChildProcess runsc_;
  pid_t runsc_pid_ = -1;
  std::unique_ptr<InitClient> init_;
  std::optional<SandboxFs> fs_;
  bool stopped_ = false;

  std::mutex layer_mu_;
  UniqueFd writable_layer_;  // the overlay's upper directory on the host; guarded by layer_mu_

 private:
  // Runs pbox-init's one-shot helper (init_helpers.h) with `args` in the sandbox and waits
  // at most `timeout` for it (then kills it: DeadlineExceeded).
  Result<ProcessExit> RunHelper(std::vector<std::string> args, std::chrono::milliseconds timeout) {
    SpawnRequest request;
    request.argv = {kInitInSandbox};
    request.argv.insert(request.argv.end(), args.begin(), args.end());
    request.cwd = "/";
    BRAGG_ASSIGN_OR_RETURN(std::shared_ptr<ProcessHandle> helper, init_->Spawn(request));
    auto exit = helper->Wait(timeout);
    if (!exit.ok() && absl::IsDeadlineExceeded(exit.status())) {
      (void)init_->Kill(helper->id(), SIGKILL, /*whole_tree=*/false);
    }
    return exit;
  }
};

// What the runsc launcher child needs, all made before it starts (it shares our memory).
struct LaunchPlan {
  std::vector<char*> argv;         // runsc's, null-terminated
  std::vector<const char*> procs;  // the sandbox's cgroups' procs (v1: tasks) files
  int fds[3] = {-1, -1, -1};       // its stdin (to pbox-init), stdout (from it), stderr (log)
  int report = -1;                 // close-on-exec pipe for a LaunchReport
  int exec_fd = -1;                // runsc to execveat (the copy on huge pages), or -1: argv[0]
};
struct LaunchReport {
  const char* step;  // a string literal: the child shares our memory
  int err;
};

constexpr char kLaunchEnvPath[] =
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

[[noreturn]] void LaunchFailed(int report, const char* step) {
  LaunchReport r{step, errno};
  (void)!::write(report, &r, sizeof(r));
  _exit(127);
}

// The child: its fds into place (0-2, the report pipe on 3; every other fd goes, the agent's
// state dir lock among them: if the agent is SIGKILLed now, this child lives on, and the next
// agent must not find the lock held), into the sandbox's cgroups (v1: through `tasks`, which
// skips the RCU grace period a first write to cgroup.procs waits for), out of the agent's
// process group, then runsc. System calls only, no allocation: it runs on our memory while
// our thread waits for its exec.
[[noreturn]] void LaunchMain(const LaunchPlan& plan) {
  // Above the final slots first (any of them may sit on 0-4), then into place.
  int moved[5] = {-1, -1, -1, -1, -1};
  const int from[5] = {plan.fds[0], plan.fds[1], plan.fds[2], plan.report, plan.exec_fd};
  for (int i = 0; i < 5; ++i) {
    if (from[i] < 0) {
      continue;  // no exec_fd
    }
    moved[i] = ::fcntl(from[i], F_DUPFD_CLOEXEC, 10);
    if (moved[i] < 0) {
      LaunchFailed(plan.report, "fcntl(F_DUPFD_CLOEXEC)");
    }
  }
  if (::dup3(moved[3], 3, O_CLOEXEC) != 3) {
    LaunchFailed(plan.report, "dup3");
  }
  constexpr int kReport = 3;  // close-on-exec: the exec closes it, which tells the agent
  if (::dup2(moved[0], 0) != 0 || ::dup2(moved[1], 1) != 1 || ::dup2(moved[2], 2) != 2) {
    LaunchFailed(kReport, "dup2");
  }
  // runsc's copy on 4, close-on-exec (an ELF binary needs no fd once exec'd).
  constexpr int kExec = 4;
  if (moved[4] >= 0 && ::dup3(moved[4], kExec, O_CLOEXEC) != kExec) {
    LaunchFailed(kReport, "dup3");
  }
  ::syscall(SYS_close_range, moved[4] >= 0 ? kExec + 1 : kExec, ~0U, 0);
  for (const char* p : plan.procs) {
    UniqueFd fd(::open(p, O_WRONLY | O_CLOEXEC));
    if (!fd.valid() || ::write(fd.get(), "0", 1) != 1) {
      LaunchFailed(kReport, "joining the sandbox's cgroup");
    }
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::setsid();  // out of the agent's process group (terminal signals)
  const char* envp[] = {kLaunchEnvPath, nullptr};
  if (moved[4] >= 0) {
    ::syscall(SYS_execveat, kExec, "", plan.argv.data(), envp, AT_EMPTY_PATH);
    LaunchFailed(kReport, "execveat(runsc's copy on huge pages)");
  }
  ::execve(plan.argv[0], plan.argv.data(), const_cast<char**>(envp));
  LaunchFailed(kReport, "execve(runsc)");
}

// Starts LaunchMain in a child that shares our memory and returns once it has exec'd runsc
// or died (CLONE_VFORK); whether it exec'd is on plan.report.
Result<ChildProcess> SpawnLauncher(LaunchPlan& plan) {
  return SpawnSharingMemory([](void* arg) -> int { LaunchMain(*static_cast<LaunchPlan*>(arg)); },
                            &plan, 0, 64 << 10, "the runsc launcher");
}

// A copy of the executable `path` on a tmpfs of huge pages (huge=always: every 2 MiB of the
// file that can be is one page), mounted at `dir` only while it is written, then detached and
// `dir` removed: the returned fd (read-only, close-on-exec) keeps the copy and its tmpfs.
// EINVAL from kernels without transparent huge pages for shmem.
Result<UniqueFd> CopyToHugePages(const std::string& path, const std::string& dir) {
  // "deny" (an emergency switch) makes tmpfs ignore huge=: a copy would buy nothing.
  if (auto policy = ReadFileToString("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
      policy.ok() && policy->find("[deny]") != std::string::npos) {
    return absl::FailedPreconditionError("huge pages for tmpfs are denied (shmem_enabled)");
  }
  BRAGG_ASSIGN_OR_RETURN(UniqueFd src, OpenFile(path, O_RDONLY | O_CLOEXEC, 0));
  struct stat st {};
  if (::fstat(src.get(), &st) != 0) {
    return ErrnoError("fstat", path);
  }
  if (!S_ISREG(st.st_mode) || st.st_size <= 0) {
    return absl::FailedPreconditionError(path + " is not a regular file");
  }
  constexpr uint64_t kHuge = 2ull << 20;  // room for whole huge pages, and one more
  const uint64_t size = (static_cast<uint64_t>(st.st_size) + 2 * kHuge - 1) / kHuge * kHuge;
  BRAGG_RETURN_IF_ERROR(MakeDirs(dir, 0700));
  absl::Cleanup remove_dir = [&dir] { ::rmdir(dir.c_str()); };
  BRAGG_ASSIGN_OR_RETURN(ScopedMount mount,
                         ScopedMount::Mount("pbox-runsc", dir, "tmpfs", MS_NOSUID | MS_NODEV,
                                            fmt::format("size={},mode=0700,huge=always", size)));
  const std::string copy = dir + "/runsc";
  {
    BRAGG_ASSIGN_OR_RETURN(
        UniqueFd dst, OpenFile(copy, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0555));
    uint64_t done = 0;
    while (done < static_cast<uint64_t>(st.st_size)) {
      ssize_t n = ::sendfile(dst.get(), src.get(), nullptr,
                             static_cast<size_t>(static_cast<uint64_t>(st.st_size) - done));
      if (n < 0 && errno == EINTR) {
        continue;
      }
      if (n < 0) {
        return ErrnoError("sendfile", path + " to " + copy);
      }
      if (n == 0) {
        return absl::DataLossError(path + " ended before its size while being copied");
      }
      done += static_cast<uint64_t>(n);
    }
  }
  // 0555 as installed: runsc executes itself again as the sandbox, as nobody in a user
  // namespace. Read-only: execveat needs no more, and nothing can change the copy through it.
  BRAGG_ASSIGN_OR_RETURN(UniqueFd out, OpenFile(copy, O_RDONLY | O_NOFOLLOW | O_CLOEXEC, 0));
  BRAGG_RETURN_IF_ERROR(mount.Unmount());  // detached: the open copy keeps the tmpfs alive
  return out;
}

}  // namespace

std::optional<std::string> GvisorHelperPath(const std::string& path) {
  if (path.find('\0') != std::string::npos || path.size() >= 4096) {
    return std::nullopt;
  }
  std::string out;
  std::string first;
  size_t i = 0;
  while (i < path.size()) {
    size_t j = path.find('/', i);
    if (j == std::string::npos) {
      j = path.size();
    }
    std::string part = path.substr(i, j - i);
    i = j + 1;
    if (part.empty() || part == ".") {
      continue;
    }
    if (part == "..") {
      return std::nullopt;
    }
    if (first.empty()) {
      first = part;
    }
    out += "/" + part;
  }
  if (out.empty() || first == "proc" || first == "dev") {
    return std::nullopt;
  }
  return out;
}

std::string GvisorBundleConfig(const LaunchSpec& spec, const std::string& init_path,
                               const std::string& rootfs, const GvisorSandboxPolicy& policy) {
  using nlohmann::json;
  json mounts = json::array();
  mounts.push_back({{"destination", "/proc"}, {"type", "proc"}, {"source", "proc"}});
  mounts.push_back({{"destination", "/dev"},
                    {"type", "tmpfs"},
                    {"source", "tmpfs"},
                    {"options", {"nosuid", "strictatime", "mode=755", "size=65536k"}}});
  mounts.push_back(
      {{"destination", "/dev/shm"},
       {"type", "tmpfs"},
       {"source", "shm"},
       {"options",
        {"nosuid", "noexec", "nodev", "mode=1777", fmt::format("size={}", spec.shm_bytes)}}});
  // runsc mounts its own tmpfs on /tmp unless the spec mounts something there: bind the
  // rootfs's /tmp onto itself so that /tmp is the sandbox's disk like everywhere else (the
  // agent's file API sees it, and it counts against the writable layer's size).
  mounts.push_back({{"destination", "/tmp"},
                    {"type", "bind"},
                    {"source", rootfs + "/tmp"},
                    {"options", {"rbind", "rw", "nosuid", "nodev"}}});
  // The image's binds (the "host" image's /usr) are mounted on the host inside the rootfs
  // (GvisorRuntime::Start), where the gofer serves them like the rest of the tree.
  mounts.push_back({{"destination", kInitInSandbox},
                    {"type", "bind"},
                    {"source", init_path},
                    {"options", {"bind", "ro"}}});
  const bool isolate = !policy.init_seccomp_program.empty();
  json no_caps = json::array();
  // Only what pbox-init needs to set up the commands' PID namespace; it drops them before it
  // serves, and commands never have any.
  json init_caps = isolate ? json::array({"CAP_SYS_ADMIN", "CAP_SETPCAP"}) : no_caps;
  json init_args = {kInitInSandbox, "--stream"};
  if (isolate) {
    init_args.push_back("--isolate");  // the program follows on its stdin (Start)
  }
  json rlimits = json::array();
  if (spec.pids > 0) {
    // The sandbox's processes are tasks of the sentry, which the pids cgroup does not see
    // (it counts only the sentry's and the gofer's host threads). gVisor's own kernel enforces
    // RLIMIT_NPROC, per uid across the sandbox, for tasks without CAP_SYS_RESOURCE and
    // CAP_SYS_ADMIN (all of ours): soft = hard, so no command can raise it. pbox-init counts
    // as one, like in the pids cgroup of the native runtime; the holder of the commands' PID
    // namespace is one more.
    const uint64_t nproc = spec.pids + (isolate ? 1 : 0);
    rlimits.push_back({{"type", "RLIMIT_NPROC"}, {"hard", nproc}, {"soft", nproc}});
  }
  if (policy.nofile_soft != 0 || policy.nofile_hard != 0) {
    rlimits.push_back(
        {{"type", "RLIMIT_NOFILE"}, {"hard", policy.nofile_hard}, {"soft", policy.nofile_soft}});
  }
  json config = {{"ociVersion", "1.0.0"},
                 {"process",
                  {{"terminal", false},
                   {"rlimits", rlimits},
                   {"user", {{"uid", 0}, {"gid", 0}}},
                   {"args", init_args},
                   {"env", {"PATH=/usr/local/bin:/usr/bin:/bin"}},
                   {"cwd", "/"},
                   // No capabilities and no_new_privs, as on the native runtime (beyond
                   // pbox-init's own while it sets up, see init_caps).
                   {"capabilities",
                    {{"bounding", init_caps},
                     {"effective", init_caps},
                     {"inheritable", no_caps},
                     {"permitted", init_caps},
                     {"ambient", no_caps}}},
                   {"noNewPrivileges", true}}},
                 {"root", {{"path", "rootfs"}, {"readonly", false}}},
                 {"hostname", spec.hostname.empty() ? "pbox" : spec.hostname},
                 {"mounts", mounts},
                 {"linux",
                  {{"namespaces",
                    {{{"type", "pid"}},
                     {{"type", "network"}},
                     {{"type", "ipc"}},
                     {{"type", "uts"}},
                     {{"type", "mount"}}}}}}};
  if (!policy.denied_syscalls.empty() && !isolate) {
    // The native runtime's deny list, enforced by gVisor's kernel on the sandbox's tasks (it
    // never reaches the host's): EPERM for each name; clone with any namespace flag, one
    // rule per flag as in seccomp_filter.cc; clone3 ENOSYS so that libc falls back to clone.
    json names = json::array();
    for (const std::string& name : policy.denied_syscalls) {
      if (name.find('(') == std::string::npos && name != "clone3") {
        names.push_back(name);
      }
    }
    json rules = json::array();
    rules.push_back({{"names", names}, {"action", "SCMP_ACT_ERRNO"}, {"errnoRet", EPERM}});
    for (uint64_t flag : {CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID,
                          CLONE_NEWNET, CLONE_NEWCGROUP}) {
      rules.push_back(
          {{"names", {"clone"}},
           {"action", "SCMP_ACT_ERRNO"},
           {"errnoRet", EPERM},
           {"args",
            {{{"index", 0}, {"value", flag}, {"valueTwo", flag}, {"op", "SCMP_CMP_MASKED_EQ"}}}}});
    }
    rules.push_back({{"names", {"clone3"}}, {"action", "SCMP_ACT_ERRNO"}, {"errnoRet", ENOSYS}});
    config["linux"]["seccomp"] = {{"defaultAction", "SCMP_ACT_ALLOW"},
                                  {"architectures", {"SCMP_ARCH_X86_64"}},
                                  {"syscalls", rules}};
  }
  return config.dump(1) + "\n";
}

Status GvisorRuntime::RemoveStale(const std::string& dir) {
  std::vector<std::string> mounts = MountsUnder(dir);
  for (const std::string& m : mounts) {
    if (::umount2(m.c_str(), MNT_DETACH) != 0 && errno != EINVAL && errno != ENOENT) {
      return ErrnoError("umount2", m);
    }
  }
  if (!mounts.empty()) {
    spdlog::warn("removed {} mounts of gVisor sandboxes left by a previous agent", mounts.size());
  }
  return RemoveTree(dir);
}

GvisorRuntime::~GvisorRuntime() {
  if (dir_.empty()) {
    return;
  }
  Status removed = RemoveStale(dir_);
  if (!removed.ok()) {
    spdlog::warn("removing {}: {}", dir_, std::string(removed.message()));
  }
}

Result<std::unique_ptr<GvisorRuntime>> GvisorRuntime::Create(const GvisorRuntimeOptions& options) {
  if (options.platform != "ptrace" && options.platform != "systrap" && options.platform != "kvm") {
    return absl::InvalidArgumentError(
        fmt::format("--gvisor-platform {}: expected ptrace, systrap or kvm", options.platform));
  }
  BRAGG_ASSIGN_OR_RETURN(std::string runsc, FindInPath(options.runsc));
  if (::access(options.init_path.c_str(), R_OK) != 0) {
    return Annotate(ErrnoError("access", options.init_path),
                    "pbox-init not found: pass --init-path or install it beside pboxd");
  }
  std::unique_ptr<GvisorRuntime> rt(new GvisorRuntime(options, runsc));
  rt->dir_ = options.state_dir + "/gvisor";
  BRAGG_ASSIGN_OR_RETURN(SeccompProgram seccomp, SeccompProgram::BuildDefault());
  rt->policy_.denied_syscalls = seccomp.denied();
  rt->policy_.nofile_soft = options.nofile_soft;
  rt->policy_.nofile_hard = options.nofile_hard;
  BRAGG_RETURN_IF_ERROR(RemoveStale(rt->dir_));
  BRAGG_RETURN_IF_ERROR(MakeDirs(rt->dir_, 0700));
  // The same program as the native runtime's, loaded by pbox-init in every sandbox. Also
  // written to <state_dir>/gvisor/seccomp.bpf, for a person (or bench/peers/runsc_peer.py) to
  // see what sandboxes load; sandboxes get it on their channel.
  rt->policy_.init_seccomp_program =
      std::string(reinterpret_cast<const char*>(seccomp.prog()->filter),
                  seccomp.prog()->len * sizeof(struct sock_filter));
  BRAGG_RETURN_IF_ERROR(
      WriteStringToFile(rt->dir_ + "/seccomp.bpf", rt->policy_.init_seccomp_program));
  if (options.runsc_huge_pages) {
    Result<UniqueFd> copy = CopyToHugePages(runsc, rt->dir_ + "/bin");
    if (copy.ok()) {
      rt->runsc_copy_ = std::move(*copy);
      spdlog::info("gVisor sandboxes start {} from a copy on huge pages", runsc);
    } else {
      spdlog::info("gVisor sandboxes start {} where it is (no copy on huge pages: {})", runsc,
                   std::string(copy.status().message()));
    }
  }
  return rt;
}

namespace {

using Clock = std::chrono::steady_clock;

// What StageBundle needs of the runtime.
struct StageInputs {
  const GvisorRuntimeOptions& options;
  const std::string& runsc_path;
  int runsc_copy;  // runsc on huge pages, or -1
  const GvisorSandboxPolicy& policy;
};

// A sandbox whose runsc has exec'd, and pbox-init's two pipes.
struct Staged {
  std::unique_ptr<GvisorSandbox> sandbox;
  UniqueFd to_init;
  UniqueFd from_init;
  std::string log_path;
  Clock::time_point t_begin, t_mounted, t_config, t_forked;
};

// Makes the bundle's mounts and starts runsc, on the calling thread, which is in the bundle's own
// mount namespace (GvisorRuntime::Start).
Result<Staged> StageBundle(const LaunchSpec& spec, const std::string& bundle,
                           const StageInputs& in) {
  Staged out;
  out.t_begin = Clock::now();
  const std::string layer_dir = bundle + "/layer";
  const std::string rootfs = bundle + "/rootfs";
  const std::string log_path = bundle + "/runsc.log";

  // The bundle first: the sandbox's writable layer, its overlay root and the image's binds,
  // then config.json.
  BRAGG_RETURN_IF_ERROR(MakeDirs(layer_dir, 0700));
  BRAGG_RETURN_IF_ERROR(MakeDirs(rootfs, 0755));
  BRAGG_ASSIGN_OR_RETURN(ScopedMount layer,
                         ScopedMount::Mount("pbox", layer_dir, "tmpfs", MS_NOSUID | MS_NODEV,
                                            fmt::format("size={},mode=0755", spec.disk_bytes)));
  BRAGG_RETURN_IF_ERROR(MakeDirs(layer_dir + "/upper", 0755));
  BRAGG_RETURN_IF_ERROR(MakeDirs(layer_dir + "/work", 0755));
  BRAGG_ASSIGN_OR_RETURN(UniqueFd upper_fd,
                         OpenFile(layer_dir + "/upper", O_RDONLY | O_DIRECTORY | O_NOFOLLOW, 0));
  std::string lower;
  // A clone's frozen layers (top first) above the image's.
  for (const std::string& dir : spec.frozen_lower_dirs) {
    lower += (lower.empty() ? "" : ":") + dir;
  }
  for (const std::string& dir : spec.image->lower_dirs) {
    lower += (lower.empty() ? "" : ":") + dir;
  }
  BRAGG_ASSIGN_OR_RETURN(
      ScopedMount root,
      ScopedMount::Mount("overlay", rootfs, "overlay", MS_NOSUID | MS_NODEV,
                         fmt::format("lowerdir={},upperdir={}/upper,workdir={}/work", lower,
                                     layer_dir, layer_dir)));
  if (::mkdir((rootfs + "/tmp").c_str(), 01777) != 0 && errno != EEXIST) {
    return ErrnoError("mkdir", rootfs + "/tmp");
  }
  // Inside the rootfs: the image's read-only binds (as on the native runtime),
  // and an empty read-only tmpfs where gVisor mounts its own /proc, so that the agent's file
  // API neither reads nor writes beneath it. (/dev cannot be masked the same way: runsc
  // needs to create mount points there.)
  std::vector<ScopedMount> inner;
  for (const BindMount& b : spec.image->binds) {
    const std::string target = rootfs + b.target;
    BRAGG_RETURN_IF_ERROR(MakeDirs(target, 0755));
    BRAGG_ASSIGN_OR_RETURN(ScopedMount m,
                           ScopedMount::Mount(b.source, target, "", MS_BIND | MS_REC));
    inner.push_back(std::move(m));
    if (int err = SetTreeReadOnly(target.c_str()); err == ENOSYS) {
      // An older kernel: a plain bind, without the mounts beneath the source, which a
      // remount would leave writable.
      inner.pop_back();
      BRAGG_ASSIGN_OR_RETURN(ScopedMount plain, ScopedMount::Mount(b.source, target, "", MS_BIND));
      inner.push_back(std::move(plain));
      if (::mount(nullptr, target.c_str(), nullptr,
                  MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, nullptr) != 0) {
        return ErrnoError("mount", "read-only remount of " + target);
      }
    } else if (err != 0) {
      return ErrnoError("mount_setattr", "read-only " + target, err);
    }
  }
  {
    const std::string target = rootfs + "/proc";
    BRAGG_RETURN_IF_ERROR(MakeDirs(target, 0755));
    BRAGG_ASSIGN_OR_RETURN(ScopedMount m,
                           ScopedMount::Mount("pbox-mask", target, "tmpfs",
                                              MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                                              "size=4k,nr_inodes=1,mode=0555"));
    inner.push_back(std::move(m));
  }
  // The agent's file API reaches the root through this descriptor, from any thread. Opened
  // before runsc starts: nothing after its launch may fail on this thread, where a failure
  // would stop the sandbox with the bundle's mounts still in view.
  BRAGG_ASSIGN_OR_RETURN(SandboxFs fs, SandboxFs::Open(rootfs));
  out.t_mounted = Clock::now();
  BRAGG_RETURN_IF_ERROR(WriteStringToFile(
      bundle + "/config.json", GvisorBundleConfig(spec, in.options.init_path, rootfs, in.policy)));
  out.t_config = Clock::now();

  // Then runsc, from a child that shares the agent's memory until it execs (like vfork): it
  // joins the sandbox's cgroups (runsc, the sentry and the gofer it starts all count against
  // the sandbox's limits; runsc runs with --ignore-cgroups and leaves them there) and execs
  // runsc. A fork of the agent instead copies its page tables, 1 ms for a fresh agent and
  // 5-6 ms once it has served a hundred sandboxes (RSS 166 MB), and makes every page it
  // writes meanwhile a copy-on-write fault. Everything the child uses is made here first: it
  // makes system calls only.
  std::vector<std::string> args = {in.runsc_path,
                                   "--root=" + bundle + "/runsc-root",
                                   "--platform=" + in.options.platform,
                                   "--network=none",
                                   "--file-access=shared",
                                   "--ignore-cgroups",
                                   "--oci-seccomp",
                                   "run",
                                   "--bundle=" + bundle,
                                   spec.id};
  LaunchPlan plan;
  for (std::string& a : args) {
    plan.argv.push_back(a.data());
  }
  plan.argv.push_back(nullptr);
  const std::vector<std::string> procs = spec.cgroup->ProcsFiles();
  for (const std::string& p : procs) {
    plan.procs.push_back(p.c_str());
  }
  BRAGG_ASSIGN_OR_RETURN(Pipe to_init, MakePipe());
  if (!in.policy.init_seccomp_program.empty()) {
    // pbox-init's first read: the program preamble, ahead of every frame. At most 32 KiB, so
    // the empty pipe takes it whole without blocking.
    BRAGG_RETURN_IF_ERROR(WriteAll(to_init.write.get(),
                                   init_protocol::ProgramPreamble(in.policy.init_seccomp_program)));
  }
  BRAGG_ASSIGN_OR_RETURN(Pipe from_init, MakePipe());
  BRAGG_ASSIGN_OR_RETURN(Pipe report, MakePipe());  // the child's errno if it fails
  BRAGG_ASSIGN_OR_RETURN(UniqueFd log, OpenFile(log_path, O_WRONLY | O_CREAT | O_TRUNC, 0600));
  plan.fds[0] = to_init.read.get();
  plan.fds[1] = from_init.write.get();
  plan.fds[2] = log.get();
  plan.report = report.write.get();
  plan.exec_fd = in.runsc_copy;
  BRAGG_ASSIGN_OR_RETURN(ChildProcess launcher, SpawnLauncher(plan));
  report.write.Reset();
  LaunchReport failed{};
  ssize_t n;
  do {
    n = ::read(report.read.get(), &failed, sizeof(failed));
  } while (n < 0 && errno == EINTR);
  if (n != 0) {  // it exited before its exec: killed and reaped with `launcher`
    return n == sizeof(failed)
               ? ErrnoError(failed.step, "runsc launcher for " + spec.id, failed.err)
               : absl::InternalError("the runsc launcher died before its exec");
  }
  to_init.read.Reset();
  from_init.write.Reset();
  log.Reset();
  out.t_forked = Clock::now();

  // runsc holds the namespace, and the mounts in it, from here on.
  (void)layer.Release();
  (void)root.Release();
  for (ScopedMount& m : inner) {
    (void)m.Release();
  }
  out.sandbox = std::make_unique<GvisorSandbox>(bundle, spec.cgroup, std::move(upper_fd));
  out.sandbox->runsc_pid_ = launcher.pid();
  out.sandbox->runsc_ = std::move(launcher);
  out.sandbox->fs_.emplace(std::move(fs));
  out.to_init = std::move(to_init.write);
  out.from_init = std::move(from_init.read);
  out.log_path = log_path;
  return out;
}

}  // namespace

Result<std::unique_ptr<RuntimeSandbox>> GvisorRuntime::Start(const LaunchSpec& spec) {
  if (spec.image == nullptr || spec.cgroup == nullptr) {
    return absl::InvalidArgumentError("GvisorRuntime::Start: image and cgroup are required");
  }
  const std::string bundle = fmt::format("{}/{}", dir_, spec.id);
  BRAGG_RETURN_IF_ERROR(MakeDirs(bundle, 0700));
  // The bundle's mounts are made in a mount namespace of their own: a copy of the agent's,
  // taken now (so a sandbox sees what the host has mounted up to its start), private (nothing
  // the host mounts later reaches the sandbox, nothing of the sandbox reaches the host). A
  // thread gets it (unshare(CLONE_NEWNS) moves the calling thread only), mounts, and starts
  // runsc, which inherits it; then the thread ends, and runsc is the namespace's last process:
  // when it is gone, so are the mounts. Nothing of a sandbox is in the host's mount table,
  // and no copy there holds the host's mount points (a bind of the host's /usr copies every
  // mount beneath it; in the host's namespace such a copy fails `rmdir` of that mount point
  // with EBUSY for as long as the sandbox lives).
  Result<Staged> staged = absl::InternalError("the gVisor staging thread did not run");
  try {
    std::thread staging([&] {
      if (::unshare(CLONE_NEWNS) != 0) {
        staged = ErrnoError("unshare", "CLONE_NEWNS for the bundle's mounts");
      } else if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
        staged = ErrnoError("mount", "/ private for the bundle's mounts");
      } else {
        staged = StageBundle(spec, bundle,
                             StageInputs{options_, runsc_path_, runsc_copy_.get(), policy_});
      }
    });
    staging.join();
  } catch (const std::system_error& e) {  // no thread to be had (the agent's pids limit)
    staged = absl::ResourceExhaustedError(
        fmt::format("starting the gVisor staging thread: {}", e.what()));
  }
  // From here on this thread's view: the bundle is plain directories and files (and on a
  // failure, whatever the thread mounted went with its namespace).
  if (!staged.ok()) {
    (void)RemoveTree(bundle);
    return staged.status();
  }
  std::unique_ptr<GvisorSandbox> sandbox = std::move(staged->sandbox);
  BRAGG_ASSIGN_OR_RETURN(sandbox->init_, InitClient::CreateStream(std::move(staged->to_init),
                                                                  std::move(staged->from_init)));
  if (Status ready = sandbox->init_->WaitReady(kReadyTimeout); !ready.ok()) {
    std::string why = LogTail(staged->log_path);
    (void)sandbox->Stop();
    return absl::InternalError(fmt::format("gVisor sandbox {} did not start: {}: {}", spec.id,
                                           std::string(ready.message()), why));
  }
  const Clock::time_point t_ready = Clock::now();
  auto ms = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  spdlog::debug(
      "gvisor sandbox {} started in {:.2f} ms: bundle mounts {:.2f}, config {:.2f}, launcher "
      "(cgroup join, exec of runsc) {:.2f}, runsc run to Ready {:.2f}",
      spec.id, ms(staged->t_begin, t_ready), ms(staged->t_begin, staged->t_mounted),
      ms(staged->t_mounted, staged->t_config), ms(staged->t_config, staged->t_forked),
      ms(staged->t_forked, t_ready));
  return std::unique_ptr<RuntimeSandbox>(std::move(sandbox));
}

}  // namespace bragg::pbox
