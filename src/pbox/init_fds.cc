#include "pbox/init_fds.h"

#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

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
    int dir = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) {
      return false;
    }
    alignas(8) char buf[4096];
    while (true) {
      long n = syscall(SYS_getdents64, dir, buf, sizeof(buf));
      if (n < 0) {
        close(dir);
        return false;
      }
      if (n == 0) {
        break;
      }
      for (long off = 0; off < n;) {
        struct Dirent64 {
          uint64_t ino;
          int64_t off;
          unsigned short reclen;
          unsigned char type;
          char name[1];
        };
        auto* d = reinterpret_cast<Dirent64*>(buf + off);
        off += d->reclen;
        int fd = 0;
        if (ParseFd(d->name, &fd) && fd >= first && fd != dir) {
          close(fd);
        }
      }
    }
    close(dir);
  }
  return true;
}

void CloseFdsFrom(int first) {
  if (syscall(SYS_close_range, first, ~0U, 0) == 0 || CloseFdsListedInProc(first)) {
    return;
  }
  long max = sysconf(_SC_OPEN_MAX);
  if (max < 0 || max > 65536) {
    max = 65536;
  }
  for (int fd = first; fd < max; ++fd) {
    close(fd);
  }
}

}  // namespace bragg::pbox
