#include "reshard/file_copy.h"

#include <fmt/format.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <utility>

namespace bragg::reshard {
namespace {

// A write whose source bytes the kernel could not read: from our own buffers that cannot
// happen, so they came from a mapping whose file was truncated under it.
Status WriteError(const char* call, const std::string& name) {
  if (errno == EFAULT) {
    return absl::FailedPreconditionError(
        fmt::format("{} {}: the source's mapped pages are gone (was the checkpoint truncated "
                    "while it was converted?)",
                    call, name));
  }
  return ErrnoError(call, name);
}

// SIGBUS on a guarded read (MappedRange::Equals) jumps back to the read; any other goes where
// it went before the handler was installed.
struct FaultGuard {
  sigjmp_buf env;
  const char* lo = nullptr;
  const char* hi = nullptr;
};
thread_local FaultGuard* volatile t_guard = nullptr;
struct sigaction g_previous_sigbus;

void OnSigbus(int sig, siginfo_t* info, void* context) {
  FaultGuard* g = t_guard;
  const char* addr = static_cast<const char*>(info->si_addr);
  if (g != nullptr && addr >= g->lo && addr < g->hi) {
    t_guard = nullptr;
    siglongjmp(g->env, 1);
  }
  const struct sigaction& prev = g_previous_sigbus;
  const bool sent = info->si_code <= 0;  // kill(), sigqueue(), ...: not a fault
  if ((prev.sa_flags & SA_SIGINFO) != 0 && prev.sa_sigaction != nullptr) {
    prev.sa_sigaction(sig, info, context);
    return;
  }
  if (prev.sa_handler == SIG_IGN && sent) {
    return;
  }
  if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN) {
    prev.sa_handler(sig);
    return;
  }
  // The default action, as without this handler: for a fault, returning re-runs the access,
  // which now ends the process; a sent SIGBUS is sent again, and arrives when this returns.
  signal(SIGBUS, SIG_DFL);
  if (sent) {
    raise(SIGBUS);
  }
}

void InstallSigbusHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    (void)sigaction(SIGBUS, &sa, &g_previous_sigbus);
  });
}

}  // namespace

Status PreadAll(int fd, char* buf, uint64_t n, uint64_t off, const std::string& name) {
  uint64_t done = 0;
  while (done < n) {
    ssize_t r = ::pread(fd, buf + done, n - done, static_cast<off_t>(off + done));
    if (r < 0 && errno == EINTR) {
      continue;
    }
    if (r < 0) {
      return ErrnoError("pread", name);
    }
    if (r == 0) {
      return absl::InvalidArgumentError(fmt::format(
          "{} ends at byte {}, before the data the metadata points to", name, off + done));
    }
    done += static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
}

Status PwriteAll(int fd, const char* buf, uint64_t n, uint64_t off, const std::string& name) {
  uint64_t done = 0;
  while (done < n) {
    ssize_t r = ::pwrite(fd, buf + done, n - done, static_cast<off_t>(off + done));
    if (r < 0 && errno == EINTR) {
      continue;
    }
    if (r < 0) {
      return WriteError("pwrite", name);
    }
    done += static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
}

Status PwritevAll(int fd, struct iovec* iov, size_t iovcnt, uint64_t off, const std::string& name) {
  while (iovcnt > 0) {
    ssize_t r = ::pwritev(fd, iov, static_cast<int>(iovcnt), static_cast<off_t>(off));
    if (r < 0 && errno == EINTR) {
      continue;
    }
    if (r < 0) {
      return WriteError("pwritev", name);
    }
    off += static_cast<uint64_t>(r);
    size_t n = static_cast<size_t>(r);
    while (iovcnt > 0 && n >= iov->iov_len) {
      n -= iov->iov_len;
      ++iov;
      --iovcnt;
    }
    if (iovcnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + n;
      iov->iov_len -= n;
    }
  }
  return absl::OkStatus();
}

Result<uint64_t> CopyFileRangeAll(int in_fd, uint64_t in_off, int out_fd, uint64_t out_off,
                                  uint64_t n, const std::string& in_name,
                                  const std::string& out_name) {
  uint64_t done = 0;
  while (done < n) {
    loff_t src = static_cast<loff_t>(in_off + done);
    loff_t dst = static_cast<loff_t>(out_off + done);
    ssize_t r = ::copy_file_range(in_fd, &src, out_fd, &dst, n - done, 0);
    if (r < 0 && errno == EINTR) {
      continue;
    }
    if (r < 0) {
      switch (errno) {
        // copy_file_range(2): EXDEV across file systems (kernels before 5.3, and since 5.19
        // unless both are the same type that implements it), EINVAL for files it cannot copy
        // (not regular, special file systems), ENOSYS without the syscall, EOPNOTSUPP/ENOTSUP,
        // EBADF from some FUSE/network file systems, EPERM/ETXTBSY from seccomp filters and
        // overlay file systems. The data can still be copied through user memory.
        case EXDEV:
        case EINVAL:
        case ENOSYS:
        case EOPNOTSUPP:
        case EBADF:
        case EPERM:
        case ETXTBSY:
          return done;
        default:
          return ErrnoError("copy_file_range", fmt::format("{} -> {}", in_name, out_name));
      }
    }
    if (r == 0) {
      // 0 means end of file, except from file systems that copy nothing rather than fail
      // (some FUSE and network ones): the caller copies the rest another way.
      struct stat st;
      if (::fstat(in_fd, &st) == 0 && static_cast<uint64_t>(st.st_size) > in_off + done) {
        return done;
      }
      return absl::InvalidArgumentError(fmt::format(
          "{} ends at byte {}, before the data the metadata points to", in_name, in_off + done));
    }
    done += static_cast<uint64_t>(r);
  }
  return done;
}

MappedRange::MappedRange(MappedRange&& o) noexcept
    : base_(std::exchange(o.base_, nullptr)),
      lead_(std::exchange(o.lead_, 0)),
      mapped_(std::exchange(o.mapped_, 0)) {}

MappedRange& MappedRange::operator=(MappedRange&& o) noexcept {
  if (this != &o) {
    Reset();
    base_ = std::exchange(o.base_, nullptr);
    lead_ = std::exchange(o.lead_, 0);
    mapped_ = std::exchange(o.mapped_, 0);
  }
  return *this;
}

void MappedRange::Reset() {
  if (base_ != nullptr) {
    ::munmap(base_, mapped_);
    base_ = nullptr;
    lead_ = 0;
    mapped_ = 0;
  }
}

Result<MappedRange> MappedRange::Map(int fd, uint64_t off, uint64_t len, const std::string& name) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return ErrnoError("fstat", name);
  }
  if (len == 0 || off + len > static_cast<uint64_t>(st.st_size)) {
    return absl::InvalidArgumentError(
        fmt::format("{} ends at byte {}, before the data the metadata points to ([{}, {}))", name,
                    st.st_size, off, off + len));
  }
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  MappedRange m;
  const uint64_t start = off & ~(page - 1);
  m.lead_ = off - start;
  m.mapped_ = m.lead_ + len;
  void* p = ::mmap(nullptr, m.mapped_, PROT_READ, MAP_SHARED | MAP_POPULATE, fd,
                   static_cast<off_t>(start));
  if (p == MAP_FAILED) {
    m.mapped_ = 0;
    return ErrnoError("mmap", fmt::format("{} [{}, {})", name, off, off + len));
  }
  m.base_ = p;
  return m;
}

Result<bool> MappedRange::Equals(uint64_t at, const char* other, uint64_t n,
                                 const std::string& name) const {
  if (at + n > mapped_ - lead_) {
    return absl::OutOfRangeError(fmt::format("{}: [{}, {}) is outside the mapped {} bytes", name,
                                             at, at + n, mapped_ - lead_));
  }
  InstallSigbusHandler();
  const char* p = data() + at;
  FaultGuard guard;
  guard.lo = p;
  guard.hi = p + n;
  if (sigsetjmp(guard.env, 1) != 0) {
    return absl::FailedPreconditionError(
        fmt::format("{}: its mapped pages are gone (SIGBUS): the file was truncated while it "
                    "was read",
                    name));
  }
  t_guard = &guard;
  const bool same = std::memcmp(p, other, n) == 0;
  t_guard = nullptr;
  return same;
}

}  // namespace bragg::reshard
