#pragma once

// The native runtime: each sandbox is a process tree in its own mount, pid, network (loopback
// only), ipc, uts and cgroup namespaces, whose root is an OverlayFS of the image over a
// private writable layer on a size-limited tmpfs, all mounted inside the sandbox's own mount
// namespace (the agent's namespace gains no mounts, and the kernel drops them all when the
// sandbox's last process dies, even if the agent was SIGKILLed). PID 1 is pbox-init; all
// capabilities are dropped, no_new_privs is set and a seccomp filter is loaded before it
// runs. The agent reaches the root filesystem through /proc/<init pid>/root.
//
// Rootless (an agent without root, NativeRuntimeOptions::rootless): the same, with each
// sandbox in its own user namespace as well, which owns the others. The agent's user and group
// are mapped to root inside and nothing else is: files of other host users (the host image's
// /usr) read as nobody, and sandbox processes cannot change to another user. Device nodes are
// bind mounts of the host's, and the overlay keeps its metadata in user.overlay.* xattrs
// (`userxattr`, Linux 5.11). Where the kernel refuses that overlay (before 5.11), the root is
// a fuse-overlayfs instead (RootFs::kFuse): the agent's ids are mapped to themselves in an
// outer user namespace, where fuse-overlayfs runs with CAP_SYS_ADMIN there (ambient) but a
// uid that is not 0, so that it mounts without `allow_other`: the kernel then lets in every
// process of the agent's uid, the sandbox's (nested in that namespace) and the agent itself
// (the file API, through /proc/<pid>/root). Its daemon stays in the agent's cgroup (a paused
// sandbox does not freeze the file system the agent reads) and exits when the sandbox's
// mount namespace, the only one left holding the mount, goes.

#include <sys/resource.h>

#include <memory>
#include <string>

#include "common/status.h"
#include "common/unique_fd.h"
#include "pbox/runtime/runtime.h"
#include "pbox/runtime/seccomp_filter.h"

namespace bragg::pbox {

struct NativeRuntimeOptions {
  std::string state_dir;   // the runtime uses <state_dir>/mnt as a private mount point
  std::string init_path;   // the static pbox-init binary
  bool cgroup_v2 = false;  // use clone3(CLONE_INTO_CGROUP) and a cgroup namespace
  // Each sandbox in its own user namespace (the agent runs without root).
  bool rootless = false;
  // Rootless: how sandboxes' roots are mounted. "kernel": the kernel's OverlayFS in the
  // sandbox's user namespace (Linux 5.11); "fuse": fuse-overlayfs; "auto": the kernel's where
  // it allows it, else fuse-overlayfs. Root mode: "auto" or "kernel".
  std::string overlay = "auto";
  std::string fuse_overlayfs = "fuse-overlayfs";  // its binary: a path or a name in PATH
};

enum class RootFs { kKernelOverlay, kFuseOverlay };

class NativeRuntime : public Runtime {
 public:
  // Opens pbox-init, builds the seccomp program. Errors say what is missing. Raises the
  // agent's soft limit on open files to the hard limit (each sandbox holds about three fds in
  // the agent: at the usual soft limit of 1024 the agent stopped at 335 sandboxes); sandboxes
  // get the limit the agent started with. Rootless: tries a sandbox's namespaces and mounts
  // once, in a child that then exits; FailedPrecondition naming the cause (user namespaces
  // refused; a kernel before 5.11 without a usable fuse-overlayfs) if the host refuses them.
  // InvalidArgument for an unknown `overlay`, or "fuse" as root.
  static Result<std::unique_ptr<NativeRuntime>> Create(const NativeRuntimeOptions& options);

  // Removes the sandboxes' mount point directory if it is empty (every sandbox gone): a clean
  // stop leaves nothing for `pboxd --reap`.
  ~NativeRuntime() override;

  std::string name() const override { return "native"; }
  bool rootless() const { return options_.rootless; }
  RootFs root_fs() const { return root_fs_; }
  // "overlayfs" (the kernel's) or "fuse-overlayfs".
  const char* root_fs_name() const {
    return root_fs_ == RootFs::kFuseOverlay ? "fuse-overlayfs" : "overlayfs";
  }
  Result<std::unique_ptr<RuntimeSandbox>> Start(const LaunchSpec& spec) override;
  // The limit on open files sandboxes get: the agent's own before Create raised it.
  const struct rlimit& sandbox_nofile() const { return sandbox_nofile_; }

 private:
  NativeRuntime(NativeRuntimeOptions options, UniqueFd init_exe, SeccompProgram seccomp)
      : options_(std::move(options)),
        init_exe_(std::move(init_exe)),
        seccomp_(std::move(seccomp)) {}
  // Rootless: probes the kernel's overlay, then fuse-overlayfs, as options_.overlay says.
  Status ChooseRootFs();

  NativeRuntimeOptions options_;
  RootFs root_fs_ = RootFs::kKernelOverlay;
  std::string fuse_overlayfs_;  // its path, found by Create (kFuseOverlay)
  std::string mount_point_;
  UniqueFd init_exe_;
  SeccompProgram seccomp_;
  struct rlimit sandbox_nofile_ = {};
};

}  // namespace bragg::pbox
