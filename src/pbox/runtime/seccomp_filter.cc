#include "pbox/runtime/seccomp_filter.h"

#include <errno.h>
#include <sched.h>
#include <seccomp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <memory>

#include "common/fs.h"
#include "fmt/format.h"

namespace bragg::pbox {
namespace {

constexpr const char* kDenied[] = {
    // file systems and mounts
    "mount",
    "umount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "open_by_handle_at",
    "name_to_handle_at",
    "quotactl",
    "quotactl_fd",
    "swapon",
    "swapoff",
    // kernel and modules
    "init_module",
    "finit_module",
    "delete_module",
    "create_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "bpf",
    "perf_event_open",
    "lookup_dcookie",
    "syslog",
    "iopl",
    "ioperm",
    "acct",
    "uselib",
    "_sysctl",
    "sysfs",
    "nfsservctl",
    "vhangup",
    // keyrings
    "keyctl",
    "add_key",
    "request_key",
    // namespaces
    "unshare",
    "setns",
    // time
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "stime",
    // big attack surfaces a sandboxed tool does not need
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "fanotify_init",
    "kcmp",
};

struct CtxDeleter {
  void operator()(void* ctx) const { seccomp_release(ctx); }
};

}  // namespace

SeccompProgram::SeccompProgram(SeccompProgram&& other) noexcept
    : filter_(std::move(other.filter_)), denied_(std::move(other.denied_)) {
  fprog_.len = static_cast<unsigned short>(filter_.size());
  fprog_.filter = filter_.data();
  other.fprog_ = {};
}

SeccompProgram& SeccompProgram::operator=(SeccompProgram&& other) noexcept {
  filter_ = std::move(other.filter_);
  denied_ = std::move(other.denied_);
  fprog_.len = static_cast<unsigned short>(filter_.size());
  fprog_.filter = filter_.data();
  other.fprog_ = {};
  return *this;
}

Result<SeccompProgram> SeccompProgram::BuildDefault() {
  std::unique_ptr<void, CtxDeleter> ctx(seccomp_init(SCMP_ACT_ALLOW));
  if (!ctx) {
    return absl::InternalError("seccomp_init failed");
  }
  // Syscalls through a foreign ABI (int 0x80, x32) are killed: the filter below only knows
  // the native numbers.
  if (int rc = seccomp_attr_set(ctx.get(), SCMP_FLTATR_ACT_BADARCH, SCMP_ACT_KILL_PROCESS);
      rc != 0) {
    return ErrnoError("seccomp_attr_set", "ACT_BADARCH", -rc);
  }
  SeccompProgram out;
  for (const char* name : kDenied) {
    int nr = seccomp_syscall_resolve_name(name);
    if (nr == __NR_SCMP_ERROR || nr < 0) {
      continue;  // not a syscall on this architecture
    }
    if (int rc = seccomp_rule_add(ctx.get(), SCMP_ACT_ERRNO(EPERM), nr, 0); rc != 0) {
      return ErrnoError("seccomp_rule_add", name, -rc);
    }
    out.denied_.emplace_back(name);
  }
  // clone: deny any namespace flag (one rule per flag: BPF has no "masked not-equal").
  // clone3 passes flags in memory that BPF cannot read, so it answers ENOSYS and libc falls
  // back to clone.
  for (uint64_t flag : {CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID,
                        CLONE_NEWNET, CLONE_NEWCGROUP}) {
    if (int rc = seccomp_rule_add(ctx.get(), SCMP_ACT_ERRNO(EPERM), SCMP_SYS(clone), 1,
                                  SCMP_A0(SCMP_CMP_MASKED_EQ, flag, flag));
        rc != 0) {
      return ErrnoError("seccomp_rule_add", "clone", -rc);
    }
  }
  if (int rc = seccomp_rule_add(ctx.get(), SCMP_ACT_ERRNO(ENOSYS), SCMP_SYS(clone3), 0); rc != 0) {
    return ErrnoError("seccomp_rule_add", "clone3", -rc);
  }
  out.denied_.emplace_back("clone(CLONE_NEW*)");
  out.denied_.emplace_back("clone3");
  // personality: only the default and the query.
  if (int rc = seccomp_rule_add(ctx.get(), SCMP_ACT_ERRNO(EPERM), SCMP_SYS(personality), 1,
                                SCMP_A0(SCMP_CMP_NE, 0xffffffff));
      rc != 0) {
    return ErrnoError("seccomp_rule_add", "personality", -rc);
  }

  int memfd = ::memfd_create("pbox-seccomp", MFD_CLOEXEC);
  if (memfd < 0) {
    return ErrnoError("memfd_create", "pbox-seccomp");
  }
  UniqueFd fd(memfd);
  if (int rc = seccomp_export_bpf(ctx.get(), fd.get()); rc != 0) {
    return ErrnoError("seccomp_export_bpf", "", -rc);
  }
  off_t size = ::lseek(fd.get(), 0, SEEK_END);
  if (size <= 0 || size % sizeof(struct sock_filter) != 0) {
    return absl::InternalError(fmt::format("seccomp_export_bpf wrote {} bytes", size));
  }
  out.filter_.resize(static_cast<size_t>(size) / sizeof(struct sock_filter));
  if (::pread(fd.get(), out.filter_.data(), static_cast<size_t>(size), 0) != size) {
    return ErrnoError("pread", "seccomp program");
  }
  out.fprog_.len = static_cast<unsigned short>(out.filter_.size());
  out.fprog_.filter = out.filter_.data();
  return out;
}

}  // namespace bragg::pbox
