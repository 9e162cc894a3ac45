#include "pbox/init_pid_namespace.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <vector>

#include "pbox/init_fds.h"

namespace bragg::pbox {
namespace {

constexpr int kReadyFd = 3;

std::string ErrnoText(const char* call, const std::string& what, int err) {
  return std::string(call) + "(" + what + "): " + strerror(err);
}

bool ClearCapabilities(std::string* error) {
  struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
  struct __user_cap_data_struct data[2];
  memset(data, 0, sizeof(data));
  if (syscall(SYS_capset, &header, data) != 0) {
    *error = ErrnoText("capset", "none", errno);
    return false;
  }
  return true;
}

bool ReadSeccompProgram(const char* path, std::vector<sock_filter>* out, std::string* error) {
  UniqueFd fd(open(path, O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    *error = ErrnoText("open", path, errno);
    return false;
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) {
    *error = ErrnoText("fstat", path, errno);
    return false;
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  if (bytes == 0 || bytes % sizeof(sock_filter) != 0 ||
      bytes / sizeof(sock_filter) > BPF_MAXINSNS) {
    *error = std::string(path) + ": not a seccomp program (" + std::to_string(bytes) + " bytes)";
    return false;
  }
  out->resize(bytes / sizeof(sock_filter));
  size_t done = 0;
  while (done < bytes) {
    ssize_t n = read(fd.get(), reinterpret_cast<char*>(out->data()) + done, bytes - done);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      *error = n < 0 ? ErrnoText("read", path, errno) : std::string(path) + ": short read";
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

// What the holder's child is started with, and where it leaves the step that failed: under
// vfork the child shares the parent's memory until it execs, so the parent reads it there.
struct HolderLaunch {
  const char* self_exe = nullptr;
  int ready_write = -1;
  const char* volatile failed_call = nullptr;
  const char* volatile failed_what = nullptr;
  volatile int failed_errno = 0;
};

// Leaves the failed step for the parent (see HolderLaunch) and ends the vforked child.
[[noreturn]] void HolderChildFailed(HolderLaunch* launch, const char* call, const char* what) {
  launch->failed_errno = errno;
  launch->failed_what = what;
  launch->failed_call = call;
  _exit(1);
}

// The vforked child, PID 1 of the new namespace: mounts its proc, then execs the holder. It
// runs on the parent's memory and stack (the parent waits until the execve): system calls
// only, no allocation, no stdio.
[[noreturn]] void HolderChild(HolderLaunch* launch) {
  if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0) {
    HolderChildFailed(launch, "mount", "proc on /proc");
  }
  if (launch->ready_write == kReadyFd ? fcntl(kReadyFd, F_SETFD, 0) != 0
                                      : dup2(launch->ready_write, kReadyFd) != kReadyFd) {
    HolderChildFailed(launch, "dup2", "the holder's readiness pipe");
  }
  // A fresh image without environment: /proc/1/environ and the memory behind it hold nothing
  // of pbox-init's.
  char* const argv[] = {const_cast<char*>("pbox-init"), const_cast<char*>(kHolderFlag), nullptr};
  char* const envp[] = {nullptr};
  execve(launch->self_exe, argv, envp);
  HolderChildFailed(launch, "execve", launch->self_exe);
}

}  // namespace

bool EnterCommandNamespace(const char* seccomp_file, CommandNamespace* out, std::string* error) {
  std::vector<sock_filter> filter;
  if (!ReadSeccompProgram(seccomp_file, &filter, error)) {
    return false;
  }
  // Our own binary, re-executed as the holder (argv[0] need not be a path).
  char self_exe[4096];
  ssize_t len = readlink("/proc/self/exe", self_exe, sizeof(self_exe) - 1);
  if (len <= 0) {
    *error = ErrnoText("readlink", "/proc/self/exe", errno);
    return false;
  }
  self_exe[len] = '\0';
  out->outer_proc.Reset(open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!out->outer_proc.valid()) {
    *error = ErrnoText("open", "/proc", errno);
    return false;
  }
  if (unshare(CLONE_NEWNS | CLONE_NEWPID) != 0) {
    *error = ErrnoText("unshare", "CLONE_NEWNS|CLONE_NEWPID", errno);
    return false;
  }
  // Nothing mounted from here on may propagate out of the new mount namespace.
  (void)mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr);
  int ready[2];
  if (pipe2(ready, O_CLOEXEC) != 0) {
    *error = ErrnoText("pipe2", "holder", errno);
    return false;
  }
  UniqueFd ready_read(ready[0]);
  UniqueFd ready_write(ready[1]);
  // vfork: no copy of our address space for a child that only mounts and execs (under
  // gVisor's ptrace platform a new address space is a new host stub process).
  HolderLaunch launch;
  launch.self_exe = self_exe;
  launch.ready_write = ready_write.get();
  pid_t pid = vfork();
  if (pid < 0) {
    *error = ErrnoText("vfork", "holder", errno);
    return false;
  }
  if (pid == 0) {
    HolderChild(&launch);
  }
  out->holder = pid;
  ready_write.Reset();
  if (launch.failed_call != nullptr) {
    int status = 0;
    (void)waitpid(pid, &status, 0);
    *error = "the PID namespace holder did not start: " +
             ErrnoText(launch.failed_call, launch.failed_what, launch.failed_errno);
    return false;
  }
  // The rest of our own set-up runs while the holder's image loads; commands only start once
  // it has said "ok" (below), when it holds no fd of ours any more. The program's file is no
  // business of commands'.
  (void)umount2(seccomp_file, MNT_DETACH);
  // Capabilities are numbered from 0 without gaps; EINVAL is the first past the last one.
  for (int cap = 0; cap <= 63; ++cap) {
    if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0) {
      if (errno == EINVAL) {
        break;
      }
      *error = ErrnoText("prctl", "PR_CAPBSET_DROP " + std::to_string(cap), errno);
      return false;
    }
  }
  (void)prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
  if (!ClearCapabilities(error)) {
    return false;
  }
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
    *error = ErrnoText("prctl", "PR_SET_NO_NEW_PRIVS", errno);
    return false;
  }
  struct sock_fprog prog = {static_cast<unsigned short>(filter.size()), filter.data()};
  if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
    *error = ErrnoText("prctl", "PR_SET_SECCOMP", errno);
    return false;
  }
  char buf[2] = {0, 0};
  ssize_t n;
  do {
    n = read(ready_read.get(), buf, sizeof(buf));
  } while (n < 0 && errno == EINTR);
  if (n != 2 || buf[0] != 'o' || buf[1] != 'k') {
    int status = 0;
    (void)waitpid(pid, &status, 0);
    *error = "the PID namespace holder did not start (its error is above)";
    return false;
  }
  return true;
}

int HolderMain() {
  // As early as possible: until then /proc/1 of the namespace answers to anyone.
  if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
    fprintf(stderr, "pbox-init holder: prctl(PR_SET_DUMPABLE): %s\n", strerror(errno));
    return 1;
  }
  std::string error;
  if (!ClearCapabilities(&error)) {
    fprintf(stderr, "pbox-init holder: %s\n", error.c_str());
    return 1;
  }
  // Every catchable signal stays blocked (a command may send them); SIGCHLD is waited for.
  sigset_t all;
  sigfillset(&all);
  if (sigprocmask(SIG_BLOCK, &all, nullptr) != 0) {
    fprintf(stderr, "pbox-init holder: sigprocmask: %s\n", strerror(errno));
    return 1;
  }
  // No fds at all once ready (/proc/1/fd of the namespace is empty): what pbox-init had on
  // 0 and 1 (its channel) goes first, stderr (runsc's log) before the report.
  close(0);
  close(1);
  CloseFdsFrom(kReadyFd + 1);
  close(2);
  if (write(kReadyFd, "ok", 2) != 2) {
    return 1;
  }
  close(kReadyFd);
  sigset_t chld;
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  for (;;) {
    siginfo_t info;
    (void)sigwaitinfo(&chld, &info);
    while (waitpid(-1, nullptr, WNOHANG) > 0) {
    }
  }
}

}  // namespace bragg::pbox
