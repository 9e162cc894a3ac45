#pragma once

// The runtime interface: what turns a sandbox spec into isolated processes. The native
// runtime (native_runtime.h) uses Linux namespaces directly; others (gVisor) plug in here.

#include <fcntl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "pbox/cgroup/cgroup.h"
#include "pbox/image/image_store.h"
#include "pbox/init/init_client.h"
#include "pbox/runtime/sandbox_fs.h"

namespace bragg::pbox {

struct LaunchSpec {
  std::string id;
  const Image* image = nullptr;  // borrowed; outlives the sandbox
  uint64_t disk_bytes = 0;       // size of the writable layer
  uint64_t shm_bytes = 64 << 20;
  std::string hostname;
  Cgroup* cgroup = nullptr;  // borrowed; already holds the limits; outlives the sandbox
  // The process limit (0: none). The cgroup holds it too; a runtime whose processes the pids
  // cgroup cannot see (gVisor: they are tasks of its kernel) enforces it itself.
  uint32_t pids = 0;
  // Frozen layers of a clone (frozen_layer.h), top first: stacked above image->lower_dirs.
  std::vector<std::string> frozen_lower_dirs;
};

// The kernel side of one running sandbox: its pbox-init, its root filesystem. Destruction
// kills every process of the sandbox and releases everything the runtime holds for it (the
// cgroup is its owner's to remove). Thread-safe for init() and fs() use; Stop() once.
class RuntimeSandbox {
 public:
  virtual ~RuntimeSandbox() = default;
  virtual InitClient* init() = 0;
  virtual const SandboxFs& fs() const = 0;
  // Host pid of the sandbox's PID 1.
  virtual pid_t init_pid() const = 0;
  // Kills every process (through the cgroup) and waits for PID 1 to be reaped.
  virtual Status Stop() = 0;
  // A new read-only fd of the sandbox's writable layer (the OverlayFS upper directory as it
  // is on its own filesystem: whiteouts and overlay xattrs visible), for CloneSandbox.
  // FailedPrecondition once stopped; Unimplemented where the runtime has no such directory.
  virtual Result<UniqueFd> OpenWritableLayer() {
    return absl::UnimplementedError("this runtime cannot clone sandboxes");
  }

 protected:
  // OpenWritableLayer for a runtime that holds an O_PATH or directory fd of the layer in
  // `layer` (closed once stopped); the caller holds whatever guards `layer`.
  static Result<UniqueFd> ReopenLayer(const UniqueFd& layer) {
    if (!layer.valid()) {
      return absl::FailedPreconditionError("the sandbox was stopped");
    }
    int fd = ::openat(layer.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
      return ErrnoError("open", "the sandbox's writable layer");
    }
    return UniqueFd(fd);
  }

 public:
  // Removes `path` (the tree below it with `recursive`) from the sandbox's filesystem for the
  // agent's file API, with SandboxFs::Remove's semantics and errors. A runtime whose kernel
  // caches the files (gVisor) removes them through that kernel too, so that it lets go of
  // them (and of their disk space) at once.
  virtual Status Remove(const std::string& path, bool recursive) {
    return fs().Remove(path, recursive);
  }
  // Makes what the sandbox's processes wrote so far reach the writable layer on the host
  // (what a copy through OpenWritableLayer sees), for CloneSandbox before it freezes the
  // sandbox. OK at once where the processes' writes land there directly (the native runtime:
  // the host kernel's page cache is the layer). Blocks at most about `timeout`.
  virtual Status FlushWrites(std::chrono::milliseconds /*timeout*/) { return absl::OkStatus(); }
};

class Runtime {
 public:
  virtual ~Runtime() = default;
  virtual std::string name() const = 0;
  // The pids cgroup limit for a sandbox whose processes are limited to `pids` (0: none): the
  // same where the sandbox's processes are host processes.
  virtual uint32_t HostPidsLimit(uint32_t pids) const { return pids; }
  // Thread-safe.
  virtual Result<std::unique_ptr<RuntimeSandbox>> Start(const LaunchSpec& spec) = 0;
};

}  // namespace bragg::pbox
