#include "pbox/init/init_fds.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <string>

namespace bragg::pbox {
namespace {

bool IsOpen(int fd) { return fcntl(fd, F_GETFD) != -1; }

// Runs `close_from(first)` in a forked child holding fds below and above `first` (one far above
// every fd in use, as a high RLIMIT_NOFILE allows) and reports, through the exit status, which
// survived: 0 when exactly those below `first` are open afterwards.
int CloseInChild(const std::function<void(int)>& close_from) {
  pid_t pid = fork();
  if (pid == 0) {
    int low = open("/dev/null", O_RDONLY);  // below `first`
    const int first = 20;
    if (low < 0 || low >= first) {
      _exit(10);
    }
    int high[] = {first, first + 1, first + 7, 900};
    for (int fd : high) {
      if (dup2(low, fd) != fd) {
        _exit(11);
      }
    }
    close_from(first);
    if (!IsOpen(low) || !IsOpen(0) || !IsOpen(1) || !IsOpen(2)) {
      _exit(12);
    }
    for (int fd : high) {
      if (IsOpen(fd)) {
        _exit(13);
      }
    }
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status);
}

TEST(InitFdsTest, CloseFdsFromKeepsLowerFdsAndClosesTheRest) {
  EXPECT_EQ(CloseInChild([](int first) { CloseFdsFrom(first); }), 0);
}

// The path of kernels (and gVisor releases) without close_range.
TEST(InitFdsTest, ProcListingClosesTheSameFds) {
  EXPECT_EQ(CloseInChild([](int first) {
              if (!CloseFdsListedInProc(first)) {
                _exit(14);
              }
            }),
            0);
}

// Closing while listing must not skip entries: more fds than one getdents64 buffer holds.
TEST(InitFdsTest, ProcListingClosesMoreFdsThanOneDirectoryRead) {
  pid_t pid = fork();
  if (pid == 0) {
    struct rlimit rl = {4096, 4096};
    (void)setrlimit(RLIMIT_NOFILE, &rl);
    for (int fd = 100; fd < 1600; ++fd) {
      if (dup2(0, fd) != fd) {
        _exit(11);
      }
    }
    if (!CloseFdsListedInProc(100)) {
      _exit(14);
    }
    for (int fd = 100; fd < 1600; ++fd) {
      if (IsOpen(fd)) {
        _exit(13);
      }
    }
    _exit(IsOpen(0) ? 0 : 12);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(InitFdsTest, WriteAvailableTakesWhatThePipeTakesAndSaysWhenItIsBroken) {
  signal(SIGPIPE, SIG_IGN);
  int p[2];
  ASSERT_EQ(pipe2(p, O_NONBLOCK | O_CLOEXEC), 0);
  ASSERT_EQ(fcntl(p[1], F_SETPIPE_SZ, 4096), 4096);
  bool broken = true;
  EXPECT_EQ(WriteAvailable(p[1], "", &broken), 0u);
  EXPECT_FALSE(broken);
  // More than the pipe holds: what fits is taken, the rest is left, and it is not an error.
  const std::string data(10000, 'x');
  EXPECT_EQ(WriteAvailable(p[1], data, &broken), 4096u);
  EXPECT_FALSE(broken);
  EXPECT_EQ(WriteAvailable(p[1], data, &broken), 0u);  // full: EAGAIN
  EXPECT_FALSE(broken);
  // Drained, it takes a pipe's worth again.
  char buf[4096];
  ASSERT_EQ(read(p[0], buf, sizeof(buf)), 4096);
  EXPECT_EQ(WriteAvailable(p[1], data, &broken), 4096u);
  EXPECT_FALSE(broken);
  // The reader gone: broken, nothing taken.
  close(p[0]);
  EXPECT_EQ(WriteAvailable(p[1], data, &broken), 0u);
  EXPECT_TRUE(broken);
  close(p[1]);
  // Not a writable fd at all: broken too.
  EXPECT_EQ(WriteAvailable(-1, data, &broken), 0u);
  EXPECT_TRUE(broken);
}

}  // namespace
}  // namespace bragg::pbox
