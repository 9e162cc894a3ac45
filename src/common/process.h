#pragma once

// An owning type for a child process, with a pidfd so that waits and kills never hit a
// recycled pid.

#include <sys/resource.h>
#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"

namespace bragg {

struct ExitInfo {
  int exit_code = -1;  // valid when signal == 0
  int signal = 0;      // terminating signal, 0 if it exited
  struct rusage usage {};
};

// Owns a child pid (and its pidfd). Destruction SIGKILLs and reaps a child still running.
// Move-only; not thread-safe.
class ChildProcess {
 public:
  ChildProcess() = default;
  // Takes ownership of `pid`, a child of this process. Opens a pidfd for it.
  static Result<ChildProcess> Adopt(pid_t pid);
  ~ChildProcess();
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  int pidfd() const { return pidfd_.get(); }
  bool running() const { return pid_ > 0; }

  Status Signal(int sig);
  // Waits for exit. `timeout` nullopt waits forever; DeadlineExceeded if still running.
  Result<ExitInfo> Wait(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  // Gives up ownership: the caller reaps the pid.
  pid_t Release();

 private:
  ChildProcess(pid_t pid, UniqueFd pidfd) : pid_(pid), pidfd_(std::move(pidfd)) {}
  void KillAndReap();
  pid_t pid_ = -1;
  UniqueFd pidfd_;
};

// Starts `fn(arg)` in a child that shares this process's memory until it execs or exits
// (CLONE_VM | CLONE_VFORK, like posix_spawn: no copy of our page tables; the calling thread
// waits until then), on a stack of its own. Every signal is blocked around the clone so that
// no handler of ours runs in the child on our memory; the child unblocks what it needs before
// its exec. `flags`: more clone flags (namespaces). `fn` may make system calls only: it runs
// on our memory, beside our other threads. Errors name `what`.
Result<ChildProcess> SpawnSharingMemory(int (*fn)(void*), void* arg, int flags, size_t stack_bytes,
                                        const std::string& what);

struct SpawnOptions {
  std::vector<std::string> env;  // empty: inherit
  std::string cwd;
  int stdin_fd = -1;   // -1: /dev/null
  int stdout_fd = -1;  // -1: inherit
  int stderr_fd = -1;  // -1: inherit
  bool new_session = false;
};

// posix_spawnp of argv[0]. The child's fds other than 0-2 are close-on-exec by convention.
Result<ChildProcess> Spawn(const std::vector<std::string>& argv, const SpawnOptions& options = {});

// Human-readable "exit 3" / "killed by SIGKILL".
std::string DescribeExit(const ExitInfo& info);

// The executable `name`: itself if it holds a '/', else the first in $PATH, then in
// /usr/sbin, /usr/bin and /usr/local/bin (PATH of a service may lack them). NotFound
// (naming where it looked) if none may be executed.
Result<std::string> FindExecutable(const std::string& name);

// The value of the environment variable `name`; "" when it is unset.
std::string GetEnv(const char* name);

}  // namespace bragg
