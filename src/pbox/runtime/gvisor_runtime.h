#pragma once

// The gVisor runtime: each sandbox is a `runsc run` of an OCI bundle the agent writes under
// <state_dir>/gvisor/<id>. The application kernel (the sentry) and its file proxy (the gofer)
// run as host processes in the sandbox's cgroup, so the cgroup limits (memory included) cover
// them; PID 1 inside is pbox-init in its stream mode (--stream), talking to the agent over
// runsc's stdin and stdout, since fds cannot be passed into gVisor.
//
// Root filesystem: the agent mounts it on the host (an OverlayFS of the image's lower layers
// over a private writable layer on a size-limited tmpfs) at <bundle>/rootfs and gives it to
// runsc as the bundle root with --file-access=shared, so that the agent's file operations
// (SandboxFs on that path) and the sandbox see each other's writes. The image's read-only
// binds (the "host" image's /usr) and pbox-init itself are OCI bind mounts. Network "none":
// --network=none (loopback only).
//
// Cleanup: Stop() kills the cgroup (runsc, sentry, gofer and every sandboxed process), then
// unmounts the rootfs and removes the bundle. If the agent dies, pbox-init reads EOF and
// exits, which ends the container; what a SIGKILLed agent leaves (processes in the cgroups,
// mounts under <state_dir>/gvisor) is removed by the next agent at start (RemoveStale).

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "fmt/format.h"
#include "pbox/runtime/runtime.h"

namespace bragg::pbox {

struct GvisorRuntimeOptions {
  std::string state_dir;            // bundles live in <state_dir>/gvisor
  std::string init_path;            // the static pbox-init binary
  std::string runsc = "runsc";      // path, or a name looked up in PATH
  std::string platform = "ptrace";  // ptrace, systrap or kvm
  // Run runsc from a copy on a tmpfs of huge pages (huge=always). Every sandbox starts runsc
  // five times (`runsc run`, then the gofer and the sandbox, which each execute themselves
  // again), and each start of the 24 MB static Go binary faults in its text: from huge pages
  // that is a few faults instead of hundreds (runsc --version: 9.5 against 13.9 ms of CPU
  // here; a gVisor create on one CPU ~10 ms sooner). The tmpfs is mounted at
  // <state_dir>/gvisor/bin only while runsc is copied in, then detached: the agent holds the
  // copy open and starts runsc from that fd (execveat), so nothing stays mounted and the
  // memory (24 MB) goes with the agent and the last runsc process. Where the kernel gives
  // tmpfs no huge pages, or the copy fails, runsc runs from where it is.
  bool runsc_huge_pages = true;
  // RLIMIT_NOFILE of the sandbox's processes (both 0: runsc's default, the host's limit), as
  // the native runtime gives its sandboxes (NativeRuntime::sandbox_nofile()).
  uint64_t nofile_soft = 0;
  uint64_t nofile_hard = 0;
};

// What the agent imposes inside every gVisor sandbox beyond the spec's own limits.
struct GvisorSandboxPolicy {
  // The native runtime's deny list (SeccompProgram::denied()), given to gVisor as the OCI
  // seccomp filter of the sandbox's processes (runsc --oci-seccomp); empty: none.
  std::vector<std::string> denied_syscalls;
  // The native runtime's seccomp program (SeccompProgram, classic BPF: struct sock_filter[]
  // bytes). When set, pbox-init puts commands in a PID namespace of their own, where it is
  // invisible (gVisor does not honour PR_SET_DUMPABLE for /proc/1/fd; init_pid_namespace.h),
  // then loads this program itself, sent ahead of the frames on its stdin (the program
  // preamble, init_protocol.h): it starts with CAP_SYS_ADMIN and CAP_SETPCAP, which it drops
  // before it serves, and the OCI filter (denied_syscalls) is not used.
  std::string init_seccomp_program;
  uint64_t nofile_soft = 0;  // RLIMIT_NOFILE; both 0: leave runsc's
  uint64_t nofile_hard = 0;
};

class GvisorRuntime : public Runtime {
 public:
  // Checks runsc and pbox-init exist, the platform is known, and removes what a killed agent
  // left under <state_dir>/gvisor. FailedPrecondition when runsc is missing.
  static Result<std::unique_ptr<GvisorRuntime>> Create(const GvisorRuntimeOptions& options);

  // Removes <state_dir>/gvisor (its seccomp.bpf, the runsc copy, any bundle left) once every
  // sandbox is gone: a clean stop leaves nothing for `pboxd --reap`.
  ~GvisorRuntime() override;

  std::string name() const override { return "gvisor"; }
  // The copy of runsc on huge pages that sandboxes are started from (a read-only fd), or -1
  // when they run runsc_path().
  int runsc_copy_fd() const { return runsc_copy_.get(); }
  const std::string& runsc_path() const { return runsc_path_; }
  // The sandbox's processes are limited inside gVisor (RLIMIT_NPROC); the pids cgroup bounds
  // gVisor's own host tasks, several per sandboxed process under ptrace (a stub process per
  // address space with a thread per sentry thread that entered it; 64 processes inside took
  // 392 host tasks here). At that bound the sentry cannot make a stub and the sandbox dies.
  // Capped at the kernel's PID_MAX_LIMIT (pids.max refuses more).
  uint32_t HostPidsLimit(uint32_t pids) const override {
    return pids == 0 ? 0 : static_cast<uint32_t>(std::min<uint64_t>(pids * 8ull + 512, 4194304));
  }
  Result<std::unique_ptr<RuntimeSandbox>> Start(const LaunchSpec& spec) override;

  // Unmounts every mount under `dir` (deepest first) and removes it. Used at start.
  static Status RemoveStale(const std::string& dir);

 private:
  GvisorRuntime(GvisorRuntimeOptions options, std::string runsc_path)
      : options_(std::move(options)), runsc_path_(std::move(runsc_path)) {}

  GvisorRuntimeOptions options_;
  std::string runsc_path_;  // resolved
  UniqueFd runsc_copy_;     // the copy on huge pages (close-on-exec), or none
  std::string dir_;         // <state_dir>/gvisor
  GvisorSandboxPolicy policy_;
};

// A runtime the agent knows but cannot run here (runsc missing): every Start fails with the
// reason, so that asking for it is FailedPrecondition rather than "unknown runtime".
class UnavailableRuntime : public Runtime {
 public:
  UnavailableRuntime(std::string name, Status why) : name_(std::move(name)), why_(std::move(why)) {}
  std::string name() const override { return name_; }
  Result<std::unique_ptr<RuntimeSandbox>> Start(const LaunchSpec&) override {
    return absl::FailedPreconditionError(fmt::format("runtime {} is not available on this node: {}",
                                                     name_, std::string(why_.message())));
  }

 private:
  std::string name_;
  Status why_;
};

// The OCI runtime config (config.json) for one sandbox, as the runtime writes it. Exposed for
// tests and the benchmark's hand-run `runsc run`.
// `rootfs`: the host path of the sandbox's root (the bundle's rootfs mount).
std::string GvisorBundleConfig(const LaunchSpec& spec, const std::string& init_path,
                               const std::string& rootfs, const GvisorSandboxPolicy& policy = {});

// The path a file-API path (relative to the sandbox root) names for the sandbox's own
// processes, for pbox-init's helpers run inside (init_helpers.h): absolute, without "." or
// empty components. nullopt where the agent must not act from inside: the root, paths with
// ".." (their meaning depends on the symlinks on the way, which the host side resolves its
// own way), and paths under /proc and /dev (gVisor's own filesystems there, not the disk).
// Exposed for tests.
std::optional<std::string> GvisorHelperPath(const std::string& path);

}  // namespace bragg::pbox
