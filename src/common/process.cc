#include "common/process.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <sstream>

#include "fmt/format.h"

extern char** environ;

namespace bragg {

Result<ChildProcess> ChildProcess::Adopt(pid_t pid) {
  int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) {
    return ErrnoError("pidfd_open", std::to_string(pid));
  }
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  return ChildProcess(pid, UniqueFd(fd));
}

ChildProcess::~ChildProcess() { KillAndReap(); }

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)), pidfd_(std::move(other.pidfd_)) {}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    KillAndReap();
    pid_ = std::exchange(other.pid_, -1);
    pidfd_ = std::move(other.pidfd_);
  }
  return *this;
}

void ChildProcess::KillAndReap() {
  if (pid_ <= 0) {
    return;
  }
  (void)Signal(SIGKILL);
  siginfo_t info;
  while (::waitid(P_PIDFD, static_cast<id_t>(pidfd_.get()), &info, WEXITED) != 0 &&
         errno == EINTR) {
  }
  pid_ = -1;
  pidfd_.Reset();
}

Status ChildProcess::Signal(int sig) {
  if (pid_ <= 0) {
    return absl::FailedPreconditionError("no child process");
  }
  if (::syscall(SYS_pidfd_send_signal, pidfd_.get(), sig, nullptr, 0) != 0 && errno != ESRCH) {
    return ErrnoError("pidfd_send_signal", std::to_string(pid_));
  }
  return absl::OkStatus();
}

Result<ExitInfo> ChildProcess::Wait(std::optional<std::chrono::milliseconds> timeout) {
  if (pid_ <= 0) {
    return absl::FailedPreconditionError("no child process");
  }
  if (timeout.has_value()) {
    struct pollfd p = {pidfd_.get(), POLLIN, 0};
    int r;
    do {
      r = ::poll(&p, 1, static_cast<int>(timeout->count()));
    } while (r < 0 && errno == EINTR);
    if (r == 0) {
      return absl::DeadlineExceededError(fmt::format("pid {} still running", pid_));
    }
  }
  ExitInfo out;
  int status = 0;
  pid_t r;
  do {
    r = ::wait4(pid_, &status, 0, &out.usage);
  } while (r < 0 && errno == EINTR);
  if (r < 0) {
    return ErrnoError("wait4", std::to_string(pid_));
  }
  pid_ = -1;
  pidfd_.Reset();
  if (WIFEXITED(status)) {
    out.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    out.signal = WTERMSIG(status);
  }
  return out;
}

pid_t ChildProcess::Release() {
  pidfd_.Reset();
  return std::exchange(pid_, -1);
}

Result<ChildProcess> Spawn(const std::vector<std::string>& argv, const SpawnOptions& options) {
  if (argv.empty()) {
    return absl::InvalidArgumentError("Spawn: empty argv");
  }
  std::vector<char*> cargv;
  for (const auto& a : argv) {
    cargv.push_back(const_cast<char*>(a.c_str()));
  }
  cargv.push_back(nullptr);
  std::vector<char*> cenv;
  for (const auto& e : options.env) {
    cenv.push_back(const_cast<char*>(e.c_str()));
  }
  cenv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (options.stdin_fd >= 0) {
    posix_spawn_file_actions_adddup2(&actions, options.stdin_fd, 0);
  } else {
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  }
  if (options.stdout_fd >= 0) {
    posix_spawn_file_actions_adddup2(&actions, options.stdout_fd, 1);
  }
  if (options.stderr_fd >= 0) {
    posix_spawn_file_actions_adddup2(&actions, options.stderr_fd, 2);
  }
  if (!options.cwd.empty()) {
    posix_spawn_file_actions_addchdir_np(&actions, options.cwd.c_str());
  }
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  short flags = POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF;
  if (options.new_session) {
    flags |= POSIX_SPAWN_SETSID;
  }
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr, flags);

  pid_t pid = -1;
  int rc = ::posix_spawnp(&pid, cargv[0], &actions, &attr, cargv.data(),
                          options.env.empty() ? environ : cenv.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    return ErrnoError("posix_spawnp", argv[0], rc);
  }
  return ChildProcess::Adopt(pid);
}

std::string DescribeExit(const ExitInfo& info) {
  if (info.signal != 0) {
    return fmt::format("killed by signal {} ({})", info.signal, strsignal(info.signal));
  }
  return fmt::format("exit {}", info.exit_code);
}

std::string GetEnv(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

Result<ChildProcess> SpawnSharingMemory(int (*fn)(void*), void* arg, int flags, size_t stack_bytes,
                                        const std::string& what) {
  void* stack = ::mmap(nullptr, stack_bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
  if (stack == MAP_FAILED) {
    return ErrnoError("mmap", "the stack of " + what);
  }
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pid_t pid = ::clone(fn, static_cast<char*>(stack) + stack_bytes,
                      CLONE_VM | CLONE_VFORK | SIGCHLD | flags, arg);
  int clone_errno = errno;
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  ::munmap(stack, stack_bytes);  // the child has exec'd or exited (CLONE_VFORK)
  if (pid < 0) {
    return ErrnoError("clone", what, clone_errno);
  }
  return ChildProcess::Adopt(pid);
}

Result<std::string> FindExecutable(const std::string& name) {
  if (name.find('/') != std::string::npos) {
    if (::access(name.c_str(), X_OK) != 0) {
      return ErrnoError("access", name);
    }
    return name;
  }
  const char* path = ::getenv("PATH");
  const std::string searched = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  std::stringstream dirs(searched + ":/usr/sbin:/usr/bin:/usr/local/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
  }
  return absl::NotFoundError(fmt::format(
      "{} not found in PATH ({}) or /usr/sbin, /usr/bin, /usr/local/bin", name, searched));
}

}  // namespace bragg
