#include "pbox/init/init_fds.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/syscall.h>

#include "pbox/init/raw_syscall.h"

namespace bragg::pbox {
namespace {

// A decimal fd number as /proc/self/fd names it; false for anything else ("." and "..").
bool ParseFd(const char* s, int* out) {
  if (*s == '\0') {
    return false;
  }
  long v = 0;
  for (; *s != '\0'; ++s) {
    if (*s < '0' || *s > '9' || v > (1 << 30)) {
      return false;
    }
    v = v * 10 + (*s - '0');
  }
  *out = static_cast<int>(v);
  return true;
}

}  // namespace

bool CloseFdsListedInProc(int first) {
  // Closing while listing is safe: entries are only removed behind the cursor, and a second
  // pass catches anything missed. getdents64 into a stack buffer: no allocation, so this may
  // run in a child forked from a multithreaded process.
  for (int pass = 0; pass < 2; ++pass) {
    long dir = RawSyscall(SYS_openat, AT_FDCWD, reinterpret_cast<long>("/proc/self/fd"),
                          O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) {
      return false;
    }
    alignas(8) char buf[4096];
    while (true) {
      long n = RawSyscall(SYS_getdents64, dir, reinterpret_cast<long>(buf), sizeof(buf));
      if (n < 0) {
        (void)RawSyscall(SYS_close, dir);
        return false;
      }
      if (n == 0) {
        break;
      }
      for (long off = 0; off < n;) {
        auto* d = reinterpret_cast<struct dirent64*>(buf + off);
        off += d->d_reclen;
        int fd = 0;
        if (ParseFd(d->d_name, &fd) && fd >= first && fd != dir) {
          (void)RawSyscall(SYS_close, fd);
        }
      }
    }
    (void)RawSyscall(SYS_close, dir);
  }
  return true;
}

void CloseFdsFrom(int first) {
  if (RawSyscall(SYS_close_range, first, static_cast<long>(~0U), 0) == 0 ||
      CloseFdsListedInProc(first)) {
    return;
  }
  struct rlimit rl = {};
  long max = RawSyscall(SYS_prlimit64, 0, RLIMIT_NOFILE, 0, reinterpret_cast<long>(&rl)) == 0
                 ? static_cast<long>(rl.rlim_cur)
                 : -1;
  if (max < 0 || max > 65536) {
    max = 65536;
  }
  for (long fd = first; fd < max; ++fd) {
    (void)RawSyscall(SYS_close, fd);
  }
}

size_t WriteAvailable(int fd, std::string_view data, bool* broken) {
  *broken = false;
  size_t written = 0;
  while (written < data.size()) {
    long n = RawSyscall(SYS_write, fd, reinterpret_cast<long>(data.data() + written),
                        static_cast<long>(data.size() - written));
    if (n > 0) {
      written += static_cast<size_t>(n);
    } else if (n == -EAGAIN) {
      break;
    } else if (n != -EINTR) {
      *broken = true;
      break;
    }
  }
  return written;
}

}  // namespace bragg::pbox
