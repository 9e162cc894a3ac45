#include "pbox/runtime/native_runtime.h"

#include <fcntl.h>
#include <linux/capability.h>
#include <linux/magic.h>
#include <linux/seccomp.h>
#include <linux/securebits.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/utsname.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "common/fs.h"
#include "common/process.h"
#include "fmt/format.h"
#include "pbox/runtime/read_only_tree.h"
#include "spdlog/spdlog.h"

namespace bragg::pbox {
namespace {

// Steps of the child's setup, reported to the parent with errno when one fails.
enum Step : int {
  kStepSync = 1,
  kStepIdMap,
  kStepCgroupNs,
  kStepPrivate,
  kStepTmpfs,
  kStepLayerDirs,
  kStepOverlay,
  kStepBind,
  kStepBindRo,
  kStepDev,
  kStepDevNodes,
  kStepShm,
  kStepProc,
  kStepProcRo,
  kStepLoopback,
  kStepHostname,
  kStepPivot,
  kStepCaps,
  kStepNoNewPrivs,
  kStepSeccomp,
  kStepFds,
  kStepExec,
  kStepLayerFd,
  kStepFuseExec,
  kStepFuseMount,
  kStepSandboxClone,
};

const char* StepName(int step) {
  switch (step) {
    case kStepSync:
      return "waiting for the agent";
    case kStepIdMap:
      return "writing the user namespace's uid and gid maps";
    case kStepCgroupNs:
      return "unshare(CLONE_NEWCGROUP)";
    case kStepPrivate:
      return "making mounts private";
    case kStepTmpfs:
      return "mounting the writable layer's tmpfs";
    case kStepLayerDirs:
      return "creating the writable layer";
    case kStepOverlay:
      return "mounting the overlay root";
    case kStepBind:
      return "bind-mounting an image directory";
    case kStepBindRo:
      return "making a bind mount read-only";
    case kStepDev:
      return "mounting /dev";
    case kStepDevNodes:
      return "creating /dev nodes";
    case kStepShm:
      return "mounting /dev/shm";
    case kStepProc:
      return "mounting /proc";
    case kStepProcRo:
      return "protecting /proc";
    case kStepLoopback:
      return "bringing up loopback";
    case kStepHostname:
      return "setting the hostname";
    case kStepPivot:
      return "pivot_root";
    case kStepCaps:
      return "dropping capabilities";
    case kStepNoNewPrivs:
      return "setting no_new_privs";
    case kStepSeccomp:
      return "loading the seccomp filter";
    case kStepFds:
      return "arranging file descriptors";
    case kStepExec:
      return "executing pbox-init";
    case kStepLayerFd:
      return "passing the writable layer to the agent";
    case kStepFuseExec:
      return "executing fuse-overlayfs";
    case kStepFuseMount:
      return "mounting the root with fuse-overlayfs";
    case kStepSandboxClone:
      return "starting the sandbox in the fuse-overlayfs namespace";
  }
  return "unknown step";
}

struct ChildError {
  int step;
  int err;  // errno; for kStepFuseMount, -(exit status) when fuse-overlayfs failed
};

[[noreturn]] void FailTo(int err_write, int step, int err) {
  ChildError e{step, err};
  ssize_t unused = ::write(err_write, &e, sizeof(e));
  (void)unused;
  ::_exit(127);
}

std::string DescribeChildError(const ChildError& e) {
  if (e.step == kStepFuseMount && e.err < 0) {
    return fmt::format("{}: it exited with status {} (its own message is in pboxd's log)",
                       StepName(e.step), -e.err);
  }
  return fmt::format("{}: {}", StepName(e.step), strerror(e.err));
}

// A stack for a child that shares our memory (CLONE_VM), mapped before the clone.
class MappedStack {
 public:
  static Result<MappedStack> Map(size_t bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (p == MAP_FAILED) {
      return ErrnoError("mmap", "a child's stack");
    }
    return MappedStack(static_cast<char*>(p), bytes);
  }
  MappedStack(MappedStack&& o) noexcept
      : base_(std::exchange(o.base_, nullptr)), bytes_(o.bytes_) {}
  MappedStack& operator=(MappedStack&& o) noexcept {
    std::swap(base_, o.base_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~MappedStack() {
    if (base_ != nullptr) {
      ::munmap(base_, bytes_);
    }
  }
  char* top() const { return base_ + bytes_; }

 private:
  MappedStack(char* base, size_t bytes) : base_(base), bytes_(bytes) {}
  char* base_;
  size_t bytes_;
};

// fuse-overlayfs as a sandbox's outer process (or the probe) runs it: everything built before
// the clone, since the processes using it may make system calls only.
struct FuseSpawn {
  int err_write = -1;
  std::string exe;
  std::vector<std::string> args;
  std::vector<char*> argv;  // into args, null-terminated
  std::string root;         // where it mounts
  char* stack_top = nullptr;

  void Prepare(std::string exe_path, const std::string& lower, const std::string& upper,
               const std::string& work, std::string mount_point) {
    exe = std::move(exe_path);
    root = std::move(mount_point);
    // writeback=0: with the kernel's writeback cache, writes past the layer's size would be
    // taken into the page cache and fail only at close (a `dd` with no count never ends);
    // without it each write reaches the layer and gets its ENOSPC.
    args = {"fuse-overlayfs", "-o",
            fmt::format("lowerdir={},upperdir={},workdir={},writeback=0", lower, upper, work),
            root};
    argv.clear();
    for (std::string& a : args) {
      argv.push_back(a.data());
    }
    argv.push_back(nullptr);
  }
};

// The exec of fuse-overlayfs, in a CLONE_VM | CLONE_VFORK child of a process that holds every
// capability in a user namespace where its uid is not 0. CAP_SYS_ADMIN (to mount) goes
// through the exec as an ambient capability: with a uid other than 0 there, fuse-overlayfs
// mounts without `allow_other` (as root it would force it, and the kernel would then let no
// process outside that namespace in, the agent included).
[[noreturn]] void FuseExecMain(FuseSpawn& f) {
  struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
  struct __user_cap_data_struct data[2];
  std::memset(data, 0, sizeof(data));
  if (::syscall(SYS_capget, &header, data) != 0) {
    FailTo(f.err_write, kStepFuseExec, errno);
  }
  data[CAP_TO_INDEX(CAP_SYS_ADMIN)].inheritable |= CAP_TO_MASK(CAP_SYS_ADMIN);
  if (::syscall(SYS_capset, &header, data) != 0 ||
      ::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_SYS_ADMIN, 0, 0) != 0 ||
      ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
    FailTo(f.err_write, kStepFuseExec, errno);
  }
  // stdin and stdout /dev/null; stderr stays pboxd's log, where its errors then appear.
  int null_fd = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  if (null_fd < 0 || ::dup2(null_fd, 0) != 0 || ::dup2(null_fd, 1) != 1 ||
      ::syscall(SYS_close_range, 3, ~0U, CLOSE_RANGE_CLOEXEC) != 0) {
    FailTo(f.err_write, kStepFuseExec, errno);
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);  // the clone ran with every signal blocked
  char* const envp[] = {const_cast<char*>("PATH=/usr/local/bin:/usr/bin:/bin"), nullptr};
  ::execve(f.exe.c_str(), f.argv.data(), envp);
  FailTo(f.err_write, kStepFuseExec, errno);
}

// Runs fuse-overlayfs and waits until its root is mounted (it forks its daemon and exits 0 once
// the mount is up). 0, or the step that failed with *err (ChildError's). System calls only.
int MountFuseOverlay(FuseSpawn& f, int* err) {
  pid_t pid = ::clone([](void* a) -> int { FuseExecMain(*static_cast<FuseSpawn*>(a)); },
                      f.stack_top, CLONE_VM | CLONE_VFORK | SIGCHLD, &f);
  if (pid < 0) {
    *err = errno;
    return kStepFuseExec;
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      *err = errno;
      return kStepFuseMount;
    }
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    *err = -(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
    return kStepFuseMount;
  }
  struct statfs sfs;
  if (::statfs(f.root.c_str(), &sfs) != 0) {
    *err = errno;
    return kStepFuseMount;
  }
  if (sfs.f_type != FUSE_SUPER_MAGIC) {
    *err = ENODEV;
    return kStepFuseMount;
  }
  return 0;
}

struct DevNode {
  const char* name;
  unsigned major;
  unsigned minor;
};
constexpr DevNode kDevNodes[] = {{"null", 1, 3},   {"zero", 1, 5},    {"full", 1, 7},
                                 {"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0}};

// /proc entries made read-only or hidden inside sandboxes (what runc does by default).
constexpr const char* kProcReadOnly[] = {"sys", "sysrq-trigger", "irq", "bus", "fs"};
constexpr const char* kProcMasked[] = {"kcore", "keys", "timer_list", "sched_debug",
                                       "latency_stats"};

// Everything the child needs, computed before clone: after clone in a multithreaded agent the
// child may only make system calls (no allocation, no locks).
struct ChildPlan {
  int err_write = -1;
  int channel = -1;
  int init_exe = -1;
  int layer_sock = -1;  // the writable layer's fd goes back to the agent here (SCM_RIGHTS)
  std::vector<std::string> cgroup_procs;  // the child moves itself into each
  const struct sock_fprog* seccomp = nullptr;
  struct rlimit nofile = {};  // the sandbox's limit on open files (the agent's own is raised)
  std::string mount_point, tmpfs_opts, upper, work, root, overlay_opts;
  std::vector<std::pair<std::string, std::string>> binds;  // host source, path under root
  std::string dev, shm, shm_opts, proc, hostname;
  std::vector<std::string> dev_nodes, dev_links_from, dev_links_to;
  // Rootless: the maps written to /proc/self/{uid,gid}_map; device nodes are bind mounts of
  // the host's (a user namespace may not mknod them).
  bool rootless = false;
  std::string uid_map, gid_map;
  std::vector<std::string> dev_sources;
  std::vector<std::string> proc_ro, proc_masked;
  // Rootless with fuse-overlayfs (FuseOuterMain): the outer user namespace's maps (the agent's
  // ids to themselves, or to 1 for an agent that is root of its own namespace), fuse-overlayfs,
  // the sandbox's clone flags and stack, and the sandbox's pid once started (written by the
  // outer process, read by the agent after it exits).
  bool fuse = false;
  std::string outer_uid_map, outer_gid_map;
  FuseSpawn fuse_spawn;
  int sandbox_flags = 0;
  char* sandbox_stack_top = nullptr;
  pid_t sandbox_pid = -1;
};

[[noreturn]] void Fail(const ChildPlan& plan, int step) { FailTo(plan.err_write, step, errno); }

int BindReadOnly(const char* path) {
  if (::mount(path, path, nullptr, MS_BIND | MS_REC, nullptr) != 0) {
    return -1;
  }
  return ::mount(nullptr, path, nullptr, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV,
                 nullptr);
}

// The writable layer's tmpfs is mounted only in the sandbox's mount namespace (with
// fuse-overlayfs, its outer one, which only the daemon keeps) and, after pivot_root detaches
// the old root, under no path at all: nothing in /proc/<pid>/root or /proc/<pid>/mountinfo
// leads to it. So the child hands the agent an O_PATH fd of the upper
// directory over a socket before the pivot; the agent keeps it (it pins the tmpfs only while
// the sandbox lives, see NativeSandbox::Stop) and reads the layer through it to clone.
void SendWritableLayer(const ChildPlan& plan) {
  UniqueFd fd(::open(plan.upper.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd.valid()) {
    Fail(plan, kStepLayerFd);
  }
  char byte = 'L';
  struct iovec iov = {&byte, 1};
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  std::memset(control, 0, sizeof(control));
  struct msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  struct cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  const int raw_fd = fd.get();
  std::memcpy(CMSG_DATA(c), &raw_fd, sizeof(int));
  if (::sendmsg(plan.layer_sock, &msg, MSG_NOSIGNAL) != 1) {
    Fail(plan, kStepLayerFd);
  }
}

// The agent's end of SendWritableLayer, read once the child has exec'd.
Result<UniqueFd> ReceiveWritableLayer(int sock, const std::string& id) {
  char byte = 0;
  struct iovec iov = {&byte, 1};
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  struct msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = ::recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    return ErrnoError("recvmsg", fmt::format("writable layer of sandbox {}", id));
  }
  struct cmsghdr* c = CMSG_FIRSTHDR(&msg);
  if (n != 1 || c == nullptr || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS ||
      c->cmsg_len != CMSG_LEN(sizeof(int))) {
    return absl::InternalError(
        fmt::format("sandbox {}: setup sent no writable layer descriptor", id));
  }
  int fd;
  std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
  return UniqueFd(fd);
}

// Writes `data` to the file at `path`; false on any failure (errno set). System calls only.
bool WriteOnce(const char* path, const std::string& data) {
  UniqueFd fd(::open(path, O_WRONLY | O_CLOEXEC));
  return fd.valid() &&
         ::write(fd.get(), data.data(), data.size()) == static_cast<ssize_t>(data.size());
}

// Rootless: maps this process's new user namespace (one id each, once setgroups is denied, as
// an unprivileged process may); false on any failure (errno set). System calls only.
bool WriteIdMaps(const std::string& uid_map, const std::string& gid_map) {
  return WriteOnce("/proc/self/uid_map", uid_map) && WriteOnce("/proc/self/setgroups", "deny") &&
         WriteOnce("/proc/self/gid_map", gid_map);
}

// Rootless: what a sandbox's setup needs of the kernel, tried once when the agent starts (a
// user namespace owning a mount and a PID namespace, a tmpfs and an OverlayFS with `userxattr`
// in it, a /proc of that PID namespace), so that a host without them stops the agent with the
// reason instead of failing every create.
struct RootlessProbe {
  int err_write = -1;
  std::string uid_map, gid_map, mount_point, lower, upper, work, root, overlay_opts, proc;
  FuseSpawn* fuse = nullptr;  // set: the root is a fuse-overlayfs mount
};

[[noreturn]] void ProbeFail(const RootlessProbe& p, int step) { FailTo(p.err_write, step, errno); }

// The same steps as ChildMain's, in a child that exits once the overlay is mounted: its
// namespaces, and the mounts in them, go with it. System calls only.
[[noreturn]] void ProbeMain(RootlessProbe& p) {
  if (!WriteIdMaps(p.uid_map, p.gid_map)) {
    ProbeFail(p, kStepIdMap);
  }
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    ProbeFail(p, kStepPrivate);
  }
  if (::mount("pbox-probe", p.mount_point.c_str(), "tmpfs", MS_NOSUID | MS_NODEV,
              "size=1m,mode=0755") != 0) {
    ProbeFail(p, kStepTmpfs);
  }
  for (const std::string* d : {&p.lower, &p.upper, &p.work, &p.root, &p.proc}) {
    if (::mkdir(d->c_str(), 0755) != 0) {
      ProbeFail(p, kStepLayerDirs);
    }
  }
  if (p.fuse != nullptr) {
    // Its daemon is in this PID namespace, and goes with the probe, its PID 1.
    int err = 0;
    if (int step = MountFuseOverlay(*p.fuse, &err); step != 0) {
      FailTo(p.err_write, step, err);
    }
  } else if (::mount("overlay", p.root.c_str(), "overlay", MS_NOSUID | MS_NODEV,
                     p.overlay_opts.c_str()) != 0) {
    ProbeFail(p, kStepOverlay);
  }
  if (::mount("proc", p.proc.c_str(), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0) {
    ProbeFail(p, kStepProc);
  }
  ::_exit(0);
}

// With fuse-overlayfs, the ids fuse-overlayfs runs as in the outer user namespace: the agent's
// own, or 1 where the agent is root of its namespace (a uid other than 0, see FuseExecMain).
uid_t OuterId(uid_t id) { return id != 0 ? id : 1; }

// `fuse_exe` set: the root is mounted by fuse-overlayfs (that binary) in a user namespace where
// the agent's ids map to themselves, as FuseOuterMain does. *failed_step: the step the probe
// failed at, 0 if none or unknown.
Status ProbeRootlessSetup(const std::string& mount_point, const std::string* fuse_exe,
                          int* failed_step) {
  *failed_step = 0;
  RootlessProbe p;
  const uid_t uid = ::geteuid();
  const gid_t gid = ::getegid();
  p.uid_map = fuse_exe != nullptr ? fmt::format("{} {} 1\n", OuterId(uid), uid)
                                  : fmt::format("0 {} 1\n", uid);
  p.gid_map = fuse_exe != nullptr ? fmt::format("{} {} 1\n", OuterId(gid), gid)
                                  : fmt::format("0 {} 1\n", gid);
  p.mount_point = mount_point;
  p.lower = mount_point + "/lower";
  p.upper = mount_point + "/upper";
  p.work = mount_point + "/work";
  p.root = mount_point + "/root";
  p.proc = mount_point + "/proc";
  p.overlay_opts =
      fmt::format("lowerdir={},upperdir={},workdir={},userxattr", p.lower, p.upper, p.work);
  BRAGG_ASSIGN_OR_RETURN(Pipe err, MakePipe());
  p.err_write = err.write.get();
  FuseSpawn fuse;
  std::optional<MappedStack> fuse_stack;
  if (fuse_exe != nullptr) {
    BRAGG_ASSIGN_OR_RETURN(fuse_stack, MappedStack::Map(64 << 10));
    fuse.Prepare(*fuse_exe, p.lower, p.upper, p.work, p.root);
    fuse.err_write = p.err_write;
    fuse.stack_top = fuse_stack->top();
    p.fuse = &fuse;
  }
  Result<ChildProcess> spawned = SpawnSharingMemory(
      [](void* arg) -> int { ProbeMain(*static_cast<RootlessProbe*>(arg)); }, &p,
      CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID, 64 << 10, "the rootless setup probe");
  if (!spawned.ok()) {
    return Annotate(spawned.status(),
                    "a rootless pboxd puts each sandbox in a user namespace, and this host "
                    "refuses one to uid " +
                        std::to_string(::geteuid()) +
                        ": unprivileged user namespaces are off (sysctl "
                        "user.max_user_namespaces, kernel.unprivileged_userns_clone on Debian "
                        "before 11, kernel.apparmor_restrict_unprivileged_userns on Ubuntu), or "
                        "a seccomp profile (a container's) refuses CLONE_NEWUSER; run pboxd as "
                        "root, or allow them");
  }
  err.write.Reset();
  ChildError e{0, 0};
  ssize_t n;
  do {
    n = ::read(err.read.get(), &e, sizeof(e));
  } while (n < 0 && errno == EINTR);
  Result<ExitInfo> exit = spawned->Wait(std::chrono::milliseconds(10000));
  if (n == 0 && exit.ok() && exit->signal == 0 && exit->exit_code == 0) {
    return absl::OkStatus();
  }
  struct utsname uts = {};
  ::uname(&uts);
  const std::string why =
      n == sizeof(e) ? DescribeChildError(e) : std::string("the probe died without a report");
  if (n == sizeof(e)) {
    *failed_step = e.step;
  }
  if (n == sizeof(e) && e.step == kStepOverlay) {
    return absl::FailedPreconditionError(fmt::format(
        "a rootless pboxd mounts each sandbox's root as an OverlayFS in the sandbox's user "
        "namespace, with its metadata in user.* xattrs (`userxattr`, Linux 5.11), and this "
        "kernel ({}) refuses it ({}); install fuse-overlayfs (pboxd --overlay auto or fuse "
        "then mounts sandboxes' roots with it), or run pboxd as root on this host, or on "
        "Linux 5.11 or later",
        uts.release, why));
  }
  if (n == sizeof(e) && (e.step == kStepFuseExec || e.step == kStepFuseMount)) {
    return absl::FailedPreconditionError(fmt::format(
        "a rootless pboxd with --overlay fuse mounts each sandbox's root with {} in a user "
        "namespace of its own, and that fails on this host (kernel {}) at {}",
        fuse_exe != nullptr ? *fuse_exe : "fuse-overlayfs", uts.release, why));
  }
  if (n == sizeof(e) && e.step == kStepProc && e.err == EPERM) {
    // The kernel lets a user namespace mount a new /proc only where the /proc it sees is
    // wholly visible; a container runtime's masked paths (files mounted over /proc/kcore,
    // /proc/keys, ...) make it refuse.
    return absl::FailedPreconditionError(fmt::format(
        "a rootless pboxd mounts a /proc of each sandbox's own PID namespace, and the kernel "
        "refuses it ({}): the /proc pboxd sees has paths masked by mounts over them, as a "
        "container runtime masks them by default, and a user namespace may not mount a /proc "
        "that would reveal them; run pboxd with /proc unmasked (Kubernetes: securityContext "
        "procMount: Unmasked, which needs hostUsers: false; podman: --security-opt "
        "unmask=ALL; docker: --security-opt systempaths=unconfined), or as root",
        why));
  }
  return absl::FailedPreconditionError(fmt::format(
      "a rootless sandbox's setup fails on this host (kernel {}) at {}", uts.release, why));
}

// The writable layer: a size-limited tmpfs at the mount point, with the overlay's upper, work
// and root directories, the upper one's fd sent to the agent. System calls only.
void MountWritableLayer(const ChildPlan& plan) {
  if (::mount("pbox", plan.mount_point.c_str(), "tmpfs", MS_NOSUID | MS_NODEV,
              plan.tmpfs_opts.c_str()) != 0) {
    Fail(plan, kStepTmpfs);
  }
  for (const std::string* d : {&plan.upper, &plan.work, &plan.root}) {
    if (::mkdir(d->c_str(), 0755) != 0) {
      Fail(plan, kStepLayerDirs);
    }
  }
  SendWritableLayer(plan);
}

[[noreturn]] void ChildMain(ChildPlan& plan);

// Rootless with fuse-overlayfs: the sandbox's outer process, in a user namespace where the
// agent's ids map to themselves and a mount namespace of its own. It mounts the writable
// layer, runs fuse-overlayfs on it (whose daemon stays here, in the agent's cgroup and PID
// namespace), starts the sandbox (ChildMain, as the agent's child: CLONE_PARENT) in a user
// namespace nested in this one, whose mount namespace is a copy of this one's, and drops the
// mount here: from then on the sandbox's namespace (and the agent's fd of its root) hold the
// fuse mount alone, and its daemon exits when they go. Runs like ChildMain, sharing the
// agent's memory: system calls only.
[[noreturn]] void FuseOuterMain(ChildPlan& plan) {
  ::umask(0);
  if (!WriteIdMaps(plan.outer_uid_map, plan.outer_gid_map)) {
    Fail(plan, kStepIdMap);
  }
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    Fail(plan, kStepPrivate);
  }
  MountWritableLayer(plan);
  int err = 0;
  if (int step = MountFuseOverlay(plan.fuse_spawn, &err); step != 0) {
    FailTo(plan.err_write, step, err);
  }
  pid_t pid = ::clone([](void* arg) -> int { ChildMain(*static_cast<ChildPlan*>(arg)); },
                      plan.sandbox_stack_top,
                      CLONE_VM | CLONE_VFORK | CLONE_PARENT | plan.sandbox_flags, &plan);
  if (pid < 0) {
    Fail(plan, kStepSandboxClone);
  }
  // Read by the agent once this process has exited (CLONE_VFORK: it waits for that).
  __atomic_store_n(&plan.sandbox_pid, pid, __ATOMIC_RELEASE);
  ::umount2(plan.root.c_str(), MNT_DETACH);
  ::_exit(0);
}

// Runs on its own stack in the agent's address space (CLONE_VM | CLONE_VFORK) while the
// calling agent thread waits for its exec: system calls only, no allocation, no locks.

[[noreturn]] void ChildMain(ChildPlan& plan) {
  ::umask(0);
  // Into the sandbox's cgroups before anything else runs ("0" is the writing process), then
  // a cgroup namespace rooted there.
  for (const std::string& procs : plan.cgroup_procs) {
    UniqueFd fd(::open(procs.c_str(), O_WRONLY | O_CLOEXEC));
    if (!fd.valid() || ::write(fd.get(), "0", 1) != 1) {
      Fail(plan, kStepSync);
    }
  }
  // Rootless: the clone made a user namespace, in which the child holds every capability but
  // whose ids map to nothing yet (files it created would fail with EOVERFLOW). An unprivileged
  // process may map its own ids, one each, once setgroups is denied.
  if (plan.rootless && !WriteIdMaps(plan.uid_map, plan.gid_map)) {
    Fail(plan, kStepIdMap);
  }
  if (::unshare(CLONE_NEWCGROUP) != 0) {
    Fail(plan, kStepCgroupNs);
  }
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    Fail(plan, kStepPrivate);
  }
  if (plan.fuse) {
    // The outer process mounted the layer and the root (FuseOuterMain). Copied into this user
    // namespace's mount namespace, that mount is locked, and pivot_root refuses a locked root:
    // the root becomes a bind of it made here.
    if (::mount(plan.root.c_str(), plan.root.c_str(), nullptr, MS_BIND | MS_REC, nullptr) != 0) {
      Fail(plan, kStepOverlay);
    }
  } else {
    MountWritableLayer(plan);
    if (::mount("overlay", plan.root.c_str(), "overlay", MS_NOSUID | MS_NODEV,
                plan.overlay_opts.c_str()) != 0) {
      Fail(plan, kStepOverlay);
    }
  }
  for (const auto& [source, target] : plan.binds) {
    if (::mount(source.c_str(), target.c_str(), nullptr, MS_BIND | MS_REC, nullptr) != 0) {
      Fail(plan, kStepBind);
    }
    if (int err = SetTreeReadOnly(target.c_str()); err == ENOSYS) {
      // An older kernel: a plain bind, without the mounts beneath the source, which a
      // remount would leave writable.
      if (::umount2(target.c_str(), MNT_DETACH) != 0 ||
          ::mount(source.c_str(), target.c_str(), nullptr, MS_BIND, nullptr) != 0) {
        Fail(plan, kStepBind);
      }
      if (::mount(nullptr, target.c_str(), nullptr,
                  MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, nullptr) != 0) {
        Fail(plan, kStepBindRo);
      }
    } else if (err != 0) {
      errno = err;
      Fail(plan, kStepBindRo);
    }
  }
  if (::mount("pbox-dev", plan.dev.c_str(), "tmpfs", MS_NOSUID | MS_NOEXEC,
              "mode=0755,size=64k,nr_inodes=64") != 0) {
    Fail(plan, kStepDev);
  }
  for (size_t i = 0; i < plan.dev_nodes.size(); ++i) {
    const DevNode& n = kDevNodes[i];
    if (plan.rootless) {
      // A tmpfs mounted in a user namespace is nodev: the host's node, bound onto a file.
      UniqueFd target(
          ::open(plan.dev_nodes[i].c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0666));
      if (!target.valid() || ::mount(plan.dev_sources[i].c_str(), plan.dev_nodes[i].c_str(),
                                     nullptr, MS_BIND, nullptr) != 0) {
        Fail(plan, kStepDevNodes);
      }
    } else if (::mknod(plan.dev_nodes[i].c_str(), S_IFCHR | 0666, makedev(n.major, n.minor)) != 0) {
      Fail(plan, kStepDevNodes);
    }
  }
  for (size_t i = 0; i < plan.dev_links_from.size(); ++i) {
    if (::symlink(plan.dev_links_to[i].c_str(), plan.dev_links_from[i].c_str()) != 0) {
      Fail(plan, kStepDevNodes);
    }
  }
  if (::mkdir(plan.shm.c_str(), 01777) != 0 ||
      ::mount("pbox-shm", plan.shm.c_str(), "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
              plan.shm_opts.c_str()) != 0) {
    Fail(plan, kStepShm);
  }
  if (::mount("proc", plan.proc.c_str(), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0) {
    Fail(plan, kStepProc);
  }
  for (const std::string& p : plan.proc_ro) {
    if (BindReadOnly(p.c_str()) != 0 && errno != ENOENT) {
      Fail(plan, kStepProcRo);
    }
  }
  for (const std::string& p : plan.proc_masked) {
    if (::mount("/dev/null", p.c_str(), nullptr, MS_BIND, nullptr) != 0 && errno != ENOENT) {
      Fail(plan, kStepProcRo);
    }
  }
  {
    UniqueFd s(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    struct ifreq ifr;
    std::memset(&ifr, 0, sizeof(ifr));
    std::strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
    if (!s.valid() || ::ioctl(s.get(), SIOCGIFFLAGS, &ifr) != 0) {
      Fail(plan, kStepLoopback);
    }
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (::ioctl(s.get(), SIOCSIFFLAGS, &ifr) != 0) {
      Fail(plan, kStepLoopback);
    }
  }
  if (::sethostname(plan.hostname.data(), plan.hostname.size()) != 0) {
    Fail(plan, kStepHostname);
  }
  // pivot_root(".", ".") stacks the old root on the new one; detaching "." then drops it.
  if (::chdir(plan.root.c_str()) != 0 || ::syscall(SYS_pivot_root, ".", ".") != 0 ||
      ::umount2(".", MNT_DETACH) != 0 || ::chdir("/") != 0) {
    Fail(plan, kStepPivot);
  }
  // Capabilities: lock root out of regaining them on exec, then empty every set.
  if (::prctl(PR_SET_SECUREBITS, SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP |
                                     SECBIT_NO_SETUID_FIXUP_LOCKED | SECBIT_KEEP_CAPS_LOCKED) !=
      0) {
    Fail(plan, kStepCaps);
  }
  for (int cap = 0; cap <= 63; ++cap) {
    if (::prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno != EINVAL) {
      Fail(plan, kStepCaps);
    }
  }
  if (::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0) {
    Fail(plan, kStepCaps);
  }
  {
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    std::memset(data, 0, sizeof(data));
    if (::syscall(SYS_capset, &header, data) != 0) {
      Fail(plan, kStepCaps);
    }
  }
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
    Fail(plan, kStepNoNewPrivs);
  }
  if (::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, plan.seccomp) != 0) {
    Fail(plan, kStepSeccomp);
  }
  // fds: the channel becomes 3; stdin and stdout /dev/null; stderr stays the agent's log.
  // Everything still needed moves above 10 first so that dup2 cannot close it.
  plan.err_write = ::fcntl(plan.err_write, F_DUPFD_CLOEXEC, 10);
  int exe = ::fcntl(plan.init_exe, F_DUPFD_CLOEXEC, 10);
  int channel = ::fcntl(plan.channel, F_DUPFD_CLOEXEC, 10);
  int null_fd = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  if (exe < 0 || channel < 0 || null_fd < 0 || ::dup2(null_fd, 0) != 0 || ::dup2(null_fd, 1) != 1 ||
      ::dup2(channel, 3) != 3) {
    Fail(plan, kStepFds);
  }
  // Everything above 3 closes on exec, the error pipe included: EOF there means success.
  if (::syscall(SYS_close_range, 4, ~0U, CLOSE_RANGE_CLOEXEC) != 0) {
    Fail(plan, kStepFds);
  }
  // Last: until exec closes them, the agent's fds (maybe above the sandbox's limit) are here.
  if (::setrlimit(RLIMIT_NOFILE, &plan.nofile) != 0) {
    Fail(plan, kStepFds);
  }
  const char* argv[] = {"pbox-init", "--channel-fd=3", nullptr};
  const char* envp[] = {"PATH=/usr/local/bin:/usr/bin:/bin", nullptr};
  ::syscall(SYS_execveat, exe, "", argv, envp, AT_EMPTY_PATH);
  Fail(plan, kStepExec);
}

class NativeSandbox : public RuntimeSandbox {
 public:
  NativeSandbox(ChildProcess init_process, std::unique_ptr<InitClient> init, SandboxFs fs,
                Cgroup* cgroup, UniqueFd writable_layer, bool fuse_root)
      : init_process_(std::move(init_process)),
        init_(std::move(init)),
        fs_(std::move(fs)),
        cgroup_(cgroup),
        init_pid_(init_process_.pid()),
        writable_layer_(std::move(writable_layer)),
        fuse_root_(fuse_root) {}

  ~NativeSandbox() override { (void)Stop(); }

  InitClient* init() override { return init_.get(); }
  const SandboxFs& fs() const override { return fs_; }
  pid_t init_pid() const override { return init_pid_; }

  Result<UniqueFd> OpenWritableLayer() override {
    std::lock_guard<std::mutex> lock(layer_mu_);
    return ReopenLayer(writable_layer_);
  }

  // A fuse-overlayfs root: pages the sandbox's processes dirtied through shared mappings are
  // in the kernel's cache of the fuse mount until written back to the daemon, which writes
  // them to the layer; syncfs writes them back. The kernel's overlay: the layer's own pages.
  Status FlushWrites(std::chrono::milliseconds /*timeout*/) override {
    if (!fuse_root_) {
      return absl::OkStatus();
    }
    // The root's fd may be O_PATH, which syncfs refuses.
    UniqueFd root(::openat(fs_.root_fd(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!root.valid() || ::syncfs(root.get()) != 0) {
      return ErrnoError("syncfs", "the sandbox's fuse-overlayfs root");
    }
    return absl::OkStatus();
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
    Status status = cgroup_->KillAll();
    // Killing the cgroup killed PID 1 too, which takes the namespace (and its mounts) along.
    (void)init_process_.Signal(SIGKILL);
    auto exit = init_process_.Wait(std::chrono::milliseconds(5000));
    if (!exit.ok()) {
      status.Update(Annotate(exit.status(), "waiting for sandbox init"));
    }
    // init_ stays: commands still holding it get Unavailable from the dead channel.
    return status;
  }

 private:
  ChildProcess init_process_;
  std::unique_ptr<InitClient> init_;
  SandboxFs fs_;
  Cgroup* cgroup_;
  pid_t init_pid_;
  bool stopped_ = false;
  std::mutex layer_mu_;
  UniqueFd writable_layer_;
  bool fuse_root_;
};

}  // namespace

NativeRuntime::~NativeRuntime() {
  if (!mount_point_.empty()) {
    ::rmdir(mount_point_.c_str());  // ENOTEMPTY: a sandbox is left, for the next start to reap
  }
}

Result<std::unique_ptr<NativeRuntime>> NativeRuntime::Create(const NativeRuntimeOptions& options) {
  int fd = ::open(options.init_path.c_str(), O_PATH | O_CLOEXEC);
  if (fd < 0) {
    return Annotate(ErrnoError("open", options.init_path),
                    "pbox-init not found: pass --init-path or install it beside pboxd");
  }
  UniqueFd exe(fd);
  BRAGG_ASSIGN_OR_RETURN(SeccompProgram seccomp, SeccompProgram::BuildDefault());
  std::unique_ptr<NativeRuntime> rt(new NativeRuntime(options, std::move(exe), std::move(seccomp)));
  rt->mount_point_ = options.state_dir + "/mnt";
  BRAGG_RETURN_IF_ERROR(MakeDirs(rt->mount_point_, 0700));
  if (options.overlay != "auto" && options.overlay != "kernel" && options.overlay != "fuse") {
    return absl::InvalidArgumentError(
        fmt::format("--overlay {}: expected auto, kernel or fuse", options.overlay));
  }
  if (!options.rootless && options.overlay == "fuse") {
    return absl::InvalidArgumentError(
        "--overlay fuse is for a rootless pboxd: as root, sandboxes' roots are the kernel's "
        "OverlayFS");
  }
  if (options.rootless) {
    BRAGG_RETURN_IF_ERROR(rt->ChooseRootFs());
  }
  if (::getrlimit(RLIMIT_NOFILE, &rt->sandbox_nofile_) != 0) {
    return ErrnoError("getrlimit", "RLIMIT_NOFILE");
  }
  if (rt->sandbox_nofile_.rlim_cur < rt->sandbox_nofile_.rlim_max) {
    struct rlimit raised = {rt->sandbox_nofile_.rlim_max, rt->sandbox_nofile_.rlim_max};
    if (::setrlimit(RLIMIT_NOFILE, &raised) != 0) {
      return ErrnoError("setrlimit", "RLIMIT_NOFILE");
    }
    spdlog::info("open files limit raised from {} to {} (sandboxes keep {})",
                 rt->sandbox_nofile_.rlim_cur, raised.rlim_cur, rt->sandbox_nofile_.rlim_cur);
  }
  return rt;
}

Status NativeRuntime::ChooseRootFs() {
  int failed_step = 0;
  Status kernel = absl::OkStatus();
  if (options_.overlay != "fuse") {
    kernel = ProbeRootlessSetup(mount_point_, nullptr, &failed_step);
    if (kernel.ok() || options_.overlay == "kernel" || failed_step != kStepOverlay) {
      return kernel;
    }
  }
  // --overlay fuse, or auto on a kernel that refuses an OverlayFS in a user namespace.
  Status fuse = [&]() -> Status {
    Result<std::string> exe = FindExecutable(options_.fuse_overlayfs);
    if (!exe.ok()) {
      return absl::FailedPreconditionError(
          fmt::format("fuse-overlayfs: {} (Debian and Ubuntu: the package fuse-overlayfs; or "
                      "pass --fuse-overlayfs PATH)",
                      std::string(exe.status().message())));
    }
    int fd = ::open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      struct stat st = {};
      const bool found = ::stat("/dev/fuse", &st) == 0;
      return absl::FailedPreconditionError(fmt::format(
          "fuse-overlayfs needs /dev/fuse, which uid {} may not open ({}{}); most "
          "distributions make it mode 0666",
          ::geteuid(), strerror(err),
          found
              ? fmt::format(": mode {:04o}, owner {}:{}", st.st_mode & 07777, st.st_uid, st.st_gid)
              : std::string()));
    }
    ::close(fd);
    BRAGG_RETURN_IF_ERROR(ProbeRootlessSetup(mount_point_, &*exe, &failed_step));
    fuse_overlayfs_ = *exe;
    return absl::OkStatus();
  }();
  if (!fuse.ok()) {
    return options_.overlay == "fuse"
               ? fuse
               : absl::FailedPreconditionError(
                     fmt::format("{}; and fuse-overlayfs, the way round, is not usable here: {}",
                                 std::string(kernel.message()), std::string(fuse.message())));
  }
  root_fs_ = RootFs::kFuseOverlay;
  if (options_.overlay == "auto") {
    spdlog::warn("{}: sandboxes' roots are fuse-overlayfs mounts instead ({})",
                 std::string(kernel.message()), fuse_overlayfs_);
  }
  return absl::OkStatus();
}

Result<std::unique_ptr<RuntimeSandbox>> NativeRuntime::Start(const LaunchSpec& spec) {
  if (spec.image == nullptr || spec.cgroup == nullptr) {
    return absl::InvalidArgumentError("NativeRuntime::Start: image and cgroup are required");
  }
  ChildPlan plan;
  plan.mount_point = mount_point_;
  plan.tmpfs_opts = fmt::format("size={},mode=0755", spec.disk_bytes);
  plan.upper = mount_point_ + "/upper";
  plan.work = mount_point_ + "/work";
  plan.root = mount_point_ + "/root";
  std::string lower;
  for (const std::string& dir : spec.frozen_lower_dirs) {
    lower += (lower.empty() ? "" : ":") + dir;
  }
  for (const std::string& dir : spec.image->lower_dirs) {
    lower += (lower.empty() ? "" : ":") + dir;
  }
  plan.overlay_opts =
      fmt::format("lowerdir={},upperdir={},workdir={}", lower, plan.upper, plan.work);
  // Rootless with fuse-overlayfs: the sandbox's stack, and fuse-overlayfs's, mapped here.
  std::optional<MappedStack> sandbox_stack, fuse_stack;
  if (options_.rootless) {
    // trusted.overlay.* needs root in the host's user namespace; without its xattrs the
    // overlay could not mark a directory opaque (rm -r then mkdir fails with EIO).
    plan.overlay_opts += ",userxattr";
    plan.rootless = true;
    plan.uid_map = fmt::format("0 {} 1\n", ::geteuid());
    plan.gid_map = fmt::format("0 {} 1\n", ::getegid());
  }
  if (root_fs_ == RootFs::kFuseOverlay) {
    plan.fuse = true;
    const uid_t uid = ::geteuid();
    const gid_t gid = ::getegid();
    plan.outer_uid_map = fmt::format("{} {} 1\n", OuterId(uid), uid);
    plan.outer_gid_map = fmt::format("{} {} 1\n", OuterId(gid), gid);
    plan.uid_map = fmt::format("0 {} 1\n", OuterId(uid));
    plan.gid_map = fmt::format("0 {} 1\n", OuterId(gid));
    plan.fuse_spawn.Prepare(fuse_overlayfs_, lower, plan.upper, plan.work, plan.root);
    BRAGG_ASSIGN_OR_RETURN(sandbox_stack, MappedStack::Map(256 << 10));
    BRAGG_ASSIGN_OR_RETURN(fuse_stack, MappedStack::Map(64 << 10));
    plan.sandbox_stack_top = sandbox_stack->top();
    plan.fuse_spawn.stack_top = fuse_stack->top();
    plan.sandbox_flags =
        CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS;
  }
  for (const BindMount& b : spec.image->binds) {
    plan.binds.emplace_back(b.source, plan.root + b.target);
  }
  plan.dev = plan.root + "/dev";
  for (const DevNode& n : kDevNodes) {
    plan.dev_nodes.push_back(fmt::format("{}/{}", plan.dev, n.name));
    plan.dev_sources.push_back(fmt::format("/dev/{}", n.name));
  }
  for (auto [from, to] : {std::pair{"fd", "/proc/self/fd"},
                          {"stdin", "/proc/self/fd/0"},
                          {"stdout", "/proc/self/fd/1"},
                          {"stderr", "/proc/self/fd/2"}}) {
    plan.dev_links_from.push_back(fmt::format("{}/{}", plan.dev, from));
    plan.dev_links_to.push_back(to);
  }
  plan.shm = plan.dev + "/shm";
  plan.shm_opts = fmt::format("size={},mode=1777", spec.shm_bytes);
  plan.proc = plan.root + "/proc";
  for (const char* p : kProcReadOnly) {
    plan.proc_ro.push_back(fmt::format("{}/{}", plan.proc, p));
  }
  for (const char* p : kProcMasked) {
    plan.proc_masked.push_back(fmt::format("{}/{}", plan.proc, p));
  }
  plan.hostname = spec.hostname.empty() ? "pbox" : spec.hostname;
  plan.seccomp = seccomp_.prog();
  plan.init_exe = init_exe_.get();
  plan.nofile = sandbox_nofile_;

  plan.cgroup_procs = spec.cgroup->ProcsFiles();

  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    return ErrnoError("socketpair", "init channel");
  }
  UniqueFd agent_end(sv[0]), child_end(sv[1]);
  int lv[2];
  if (::socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, lv) != 0) {
    return ErrnoError("socketpair", "writable layer channel");
  }
  UniqueFd layer_agent_end(lv[0]), layer_child_end(lv[1]);
  plan.layer_sock = layer_child_end.get();
  BRAGG_ASSIGN_OR_RETURN(Pipe err, MakePipe());
  plan.err_write = err.write.get();
  plan.fuse_spawn.err_write = plan.err_write;
  plan.channel = child_end.get();

  // The child shares the agent's memory until it execs (like posix_spawn): no copy of the
  // agent's page tables, which with a large agent costs more than the rest of the setup.
  // Rootless: the user namespace is created first and owns the others.
  // With fuse-overlayfs, the outer process (FuseOuterMain) starts the sandbox as our child.
  Result<ChildProcess> spawned =
      plan.fuse ? SpawnSharingMemory(
                      [](void* arg) -> int { FuseOuterMain(*static_cast<ChildPlan*>(arg)); }, &plan,
                      CLONE_NEWUSER | CLONE_NEWNS, 256 << 10, spec.id)
                : SpawnSharingMemory(
                      [](void* arg) -> int { ChildMain(*static_cast<ChildPlan*>(arg)); }, &plan,
                      CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS |
                          (options_.rootless ? CLONE_NEWUSER : 0),
                      256 << 10, spec.id);
  if (!spawned.ok() && (options_.rootless || absl::IsPermissionDenied(spawned.status()))) {
    return Annotate(spawned.status(),
                    options_.rootless
                        ? "cannot create a user namespace: unprivileged user namespaces are off "
                          "on this host (sysctl user.max_user_namespaces, or "
                          "kernel.apparmor_restrict_unprivileged_userns on Ubuntu)"
                        : "cannot create sandbox namespaces");
  }
  if (!spawned.ok()) {
    return spawned.status();
  }
  ChildProcess child = std::move(*spawned);
  if (plan.fuse) {
    // The outer process has exited (it never execs, and CLONE_VFORK waited for it).
    Result<ExitInfo> outer = child.Wait(std::chrono::milliseconds(10000));
    const pid_t sandbox_pid = __atomic_load_n(&plan.sandbox_pid, __ATOMIC_ACQUIRE);
    child = ChildProcess();
    if (sandbox_pid > 0) {
      // Ours (CLONE_PARENT), exec'd or dead: adopted either way, so that it is reaped.
      BRAGG_ASSIGN_OR_RETURN(child, ChildProcess::Adopt(sandbox_pid));
    } else if (!outer.ok()) {
      return Annotate(outer.status(), fmt::format("sandbox {}: its outer process", spec.id));
    }
  }
  child_end.Reset();
  layer_child_end.Reset();
  err.write.Reset();
  ChildError child_error{0, 0};
  ssize_t n;
  do {
    n = ::read(err.read.get(), &child_error, sizeof(child_error));
  } while (n < 0 && errno == EINTR);
  if (n != 0) {
    std::string why = n == sizeof(child_error) ? DescribeChildError(child_error)
                                               : std::string("setup died without a report");
    return absl::InternalError(fmt::format("sandbox {} setup failed at {}", spec.id, why));
  }
  if (!child.running()) {
    return absl::InternalError(
        fmt::format("sandbox {}: its outer process ended without starting it", spec.id));
  }
  // PID 1 is spared by the OOM killer; pbox-init resets its commands' score to 0.
  (void)WriteControlFile(fmt::format("/proc/{}/oom_score_adj", child.pid()), "-999");
  BRAGG_ASSIGN_OR_RETURN(UniqueFd writable_layer,
                         ReceiveWritableLayer(layer_agent_end.get(), spec.id));
  BRAGG_ASSIGN_OR_RETURN(SandboxFs fs, SandboxFs::Open(fmt::format("/proc/{}/root", child.pid())));
  BRAGG_ASSIGN_OR_RETURN(std::unique_ptr<InitClient> init,
                         InitClient::Create(std::move(agent_end)));
  return std::unique_ptr<RuntimeSandbox>(new NativeSandbox(std::move(child), std::move(init),
                                                           std::move(fs), spec.cgroup,
                                                           std::move(writable_layer), plan.fuse));
}

}  // namespace bragg::pbox
