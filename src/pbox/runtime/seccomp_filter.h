#pragma once

// The seccomp filter applied to every native sandbox, built once with libseccomp and kept as
// a classic BPF program that a freshly cloned child can load with one prctl() (no allocation,
// safe after clone in a multithreaded agent).

#include <linux/filter.h>

#include <string>
#include <vector>

#include "common/status.h"

namespace bragg::pbox {

class SeccompProgram {
 public:
  // Denies (EPERM) what a sandbox has no business calling: mount and the new mount API,
  // pivot_root, module loading, kexec, bpf, keyrings, perf_event_open, reboot, swap, clock
  // and time setting, namespace creation (unshare, setns, clone with CLONE_NEW*; clone3 gets
  // ENOSYS so libc falls back to clone, whose flags can be checked), io_uring, userfaultfd,
  // open_by_handle_at, quotactl, acct, syslog, personality changes. Other architectures'
  // syscall ABIs (i386 and x32 entry points) kill the process.
  static Result<SeccompProgram> BuildDefault();

  // For prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, prog()). Valid while this object lives.
  const struct sock_fprog* prog() const { return &fprog_; }
  size_t instructions() const { return filter_.size(); }
  // Names of the denied syscalls, for docs and tests.
  const std::vector<std::string>& denied() const { return denied_; }

  SeccompProgram(SeccompProgram&& other) noexcept;
  SeccompProgram& operator=(SeccompProgram&& other) noexcept;
  SeccompProgram(const SeccompProgram&) = delete;
  SeccompProgram& operator=(const SeccompProgram&) = delete;

 private:
  SeccompProgram() = default;
  std::vector<struct sock_filter> filter_;
  struct sock_fprog fprog_ {};
  std::vector<std::string> denied_;
};

}  // namespace bragg::pbox
