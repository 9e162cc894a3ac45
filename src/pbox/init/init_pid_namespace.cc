#include "pbox/init/init_pid_namespace.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <vector>

#include "pbox/init/init_fds.h"
#include "pbox/init/init_protocol.h"
#include "pbox/init/raw_syscall.h"

extern char** environ;

namespace bragg::pbox {
namespace {

std::string ErrnoText(const char* call, const std::string& what, int err) {
  return std::string(call) + "(" + what + "): " + strerror(err);
}

bool ClearCapabilities(std::string* error) {
  struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
  struct __user_cap_data_struct data[2];
  memset(data, 0, sizeof(data));
  if (syscall(SYS_capset, &header, data) != 0) {
    *error = ErrnoText("capset", "none", errno);
    return false;
  }
  return true;
}

// Reads from `fd` until its end or `cap` bytes: the count, or -1 with errno set.
ssize_t ReadUpTo(int fd, char* buf, size_t cap) {
  size_t done = 0;
  while (done < cap) {
    ssize_t n = read(fd, buf + done, cap - done);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0) {
      return -1;
    }
    if (n == 0) {
      break;
    }
    done += static_cast<size_t>(n);
  }
  return static_cast<ssize_t>(done);
}

// The capability bounding set, from the CapBnd line of `proc_dir`/self/status.
bool ReadBoundingSet(int proc_dir, uint64_t* out, std::string* error) {
  UniqueFd fd(openat(proc_dir, "self/status", O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    *error = ErrnoText("open", "/proc/self/status", errno);
    return false;
  }
  char buf[8192];
  ssize_t len = ReadUpTo(fd.get(), buf, sizeof(buf) - 1);
  if (len < 0) {
    *error = ErrnoText("read", "/proc/self/status", errno);
    return false;
  }
  buf[len] = '\0';
  static constexpr char kKey[] = "\nCapBnd:\t";
  const char* at = strstr(buf, kKey);
  char* end = nullptr;
  if (at != nullptr) {
    errno = 0;
    *out = strtoull(at + strlen(kKey), &end, 16);
  }
  if (at == nullptr || end == at + strlen(kKey) || errno != 0 || *end != '\n') {
    *error = "/proc/self/status: no readable CapBnd line";
    return false;
  }
  return true;
}

// What the holder is started with. It runs on its own stack in pbox-init's memory.
struct HolderArgs {
  int ready_write = -1;  // the readiness pipe: "ok" once set up
};

// Writes "pbox-init holder: <step> failed (errno N)" to stderr (runsc's log) and exits 1.
[[noreturn]] void HolderFailed(const char* step, long ret) {
  char msg[160];
  size_t n = 0;
  auto put = [&](const char* text) {
    while (*text != '\0' && n < sizeof(msg) - 1) {
      msg[n++] = *text++;
    }
  };
  put("pbox-init holder: ");
  put(step);
  put(" failed (errno ");
  char digits[24];
  int k = 0;
  unsigned long v = static_cast<unsigned long>(ret < 0 ? -ret : ret);
  do {
    digits[k++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v != 0 && k < 23);
  while (k > 0 && n < sizeof(msg) - 2) {
    msg[n++] = digits[--k];
  }
  put(")\n");
  (void)RawSyscall(SYS_write, 2, reinterpret_cast<long>(msg), static_cast<long>(n));
  RawSyscall(SYS_exit, 1);
  __builtin_unreachable();
}

// The holder, PID 1 of the commands' namespace: a clone of pbox-init sharing its memory (no
// new address space, no image to load: under gVisor each costs milliseconds of sentry work),
// but with its own fds, credentials and signal state. Mounts the namespace's proc, drops every
// capability, blocks every signal, closes every fd, says "ok" and reaps orphans forever.
// System calls only (RawSyscall, and CloseFdsFrom, which makes only those), no library call
// that could touch pbox-init's state.
int HolderMain(void* arg) {
  const int ready = static_cast<HolderArgs*>(arg)->ready_write;
  // The holder goes with pbox-init. In a sandbox the container's end takes both anyway; run
  // natively (pbox-init --isolate outside a PID namespace of its own), the holder would
  // otherwise outlive it, an orphan reaping nothing forever. pbox-init is single-threaded, so
  // the thread that made the holder is pbox-init itself; and it waits for the holder's "ok"
  // below before it goes on, so it cannot have ended normally before this line.
  (void)RawSyscall(SYS_prctl, PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
  long r = RawSyscall(SYS_mount, reinterpret_cast<long>("proc"), reinterpret_cast<long>("/proc"),
                      reinterpret_cast<long>("proc"), MS_NOSUID | MS_NODEV | MS_NOEXEC, 0);
  if (r != 0) {
    HolderFailed("mount(proc on /proc)", r);
  }
  struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
  struct __user_cap_data_struct data[2] = {};
  if ((r = RawSyscall(SYS_capset, reinterpret_cast<long>(&header), reinterpret_cast<long>(data))) !=
      0) {
    HolderFailed("capset(none)", r);
  }
  // Every catchable signal stays blocked (a command may send them); SIGCHLD is waited for.
  uint64_t all = ~uint64_t{0};
  if ((r = RawSyscall(SYS_rt_sigprocmask, SIG_BLOCK, reinterpret_cast<long>(&all), 0,
                      sizeof(all))) != 0) {
    HolderFailed("rt_sigprocmask", r);
  }
  // No fds at all once ready (/proc/1/fd of the namespace is empty): the readiness pipe takes
  // fd 0 (pbox-init's channel there goes), then everything above it goes, the channel on 1
  // and stderr (runsc's log) included, and the pipe last.
  if ((r = RawSyscall(SYS_dup3, ready, 0, 0)) != 0) {
    HolderFailed("dup3(the readiness pipe, 0)", r);
  }
  CloseFdsFrom(1);
  (void)RawSyscall(SYS_write, 0, reinterpret_cast<long>("ok"), 2);
  (void)RawSyscall(SYS_close, 0);
  uint64_t chld = uint64_t{1} << (SIGCHLD - 1);
  for (;;) {
    (void)RawSyscall(SYS_rt_sigtimedwait, reinterpret_cast<long>(&chld), 0, 0, sizeof(chld));
    while (RawSyscall(SYS_wait4, -1, 0, WNOHANG, 0) > 0) {
    }
  }
}

// Overwrites pbox-init's environment strings in place. /proc/PID/environ reads them from the
// process's memory, which the holder (PID 1 of the commands' namespace, whose /proc commands
// can read) shares; pbox-init itself never reads its environment (commands get theirs from
// the agent).
void WipeEnvironment() {
  if (environ == nullptr) {
    return;
  }
  for (char** e = environ; *e != nullptr; ++e) {
    memset(*e, 0, strlen(*e));
  }
  environ = nullptr;
}

}  // namespace

bool ReadProgramPreamble(int fd, std::vector<sock_filter>* out, std::string* error) {
  namespace proto = init_protocol;
  char prefix[proto::kStreamPrefixBytes];
  ssize_t n = ReadUpTo(fd, prefix, sizeof(prefix));
  if (n != static_cast<ssize_t>(sizeof(prefix))) {
    *error = n < 0 ? ErrnoText("read", "the seccomp program's length", errno)
                   : "the channel ended before the seccomp program";
    return false;
  }
  size_t bytes = 0;
  if (!proto::ParseProgramPrefix(std::string_view(prefix, sizeof(prefix)), &bytes, error)) {
    return false;
  }
  out->resize(bytes / sizeof(sock_filter));
  n = ReadUpTo(fd, reinterpret_cast<char*>(out->data()), bytes);
  if (n != static_cast<ssize_t>(bytes)) {
    *error = n < 0 ? ErrnoText("read", "the seccomp program", errno)
                   : "the channel ended inside the seccomp program";
    return false;
  }
  return true;
}

bool EnterCommandNamespace(std::span<const sock_filter> filter, CommandNamespace* out,
                           std::string* error) {
  if (filter.empty() || filter.size() > BPF_MAXINSNS) {
    *error = "seccomp program of " + std::to_string(filter.size()) + " instructions";
    return false;
  }
  out->outer_proc.Reset(open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!out->outer_proc.valid()) {
    *error = ErrnoText("open", "/proc", errno);
    return false;
  }
  uint64_t bounding = 0;
  if (!ReadBoundingSet(out->outer_proc.get(), &bounding, error)) {
    return false;
  }
  if (unshare(CLONE_NEWNS | CLONE_NEWPID) != 0) {
    *error = ErrnoText("unshare", "CLONE_NEWNS|CLONE_NEWPID", errno);
    return false;
  }
  // Nothing mounted from here on may propagate out of the new mount namespace.
  (void)mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr);
  int ready[2];
  if (pipe2(ready, O_CLOEXEC) != 0) {
    *error = ErrnoText("pipe2", "holder", errno);
    return false;
  }
  UniqueFd ready_read(ready[0]);
  UniqueFd ready_write(ready[1]);
  WipeEnvironment();
  // The holder's stack, in our memory for good (the holder lives as long as the namespace),
  // with an inaccessible page below it: an overflow faults instead of writing into ours.
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  constexpr size_t kHolderStack = 64 * 1024;
  void* stack = mmap(nullptr, page + kHolderStack, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
  if (stack == MAP_FAILED) {
    *error = ErrnoText("mmap", "the holder's stack", errno);
    return false;
  }
  if (mprotect(stack, page, PROT_NONE) != 0) {
    *error = ErrnoText("mprotect", "the holder's stack guard", errno);
    return false;
  }
  static HolderArgs args;  // read by the holder at its start, never written again
  args.ready_write = ready_write.get();
  // CLONE_VM without CLONE_THREAD: a process of its own (own fds, credentials, signals) that
  // needs no address space of its own. It is the first child since the unshare, so PID 1.
  pid_t pid =
      clone(HolderMain, static_cast<char*>(stack) + page + kHolderStack, CLONE_VM | SIGCHLD, &args);
  if (pid < 0) {
    *error = ErrnoText("clone", "holder", errno);
    return false;
  }
  out->holder = pid;
  ready_write.Reset();
  // The rest of our own set-up runs while the holder sets up; commands only start once it has
  // said "ok" (below), when it holds no fd of ours any more.
  // Only what the bounding set holds (the agent's bundle gives two): a system call per
  // capability the kernel knows would be 41 round trips to the sentry.
  for (int cap = 0; cap < 64; ++cap) {
    if ((bounding >> cap & 1) != 0 && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0) {
      *error = ErrnoText("prctl", "PR_CAPBSET_DROP " + std::to_string(cap), errno);
      return false;
    }
  }
  (void)prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
  if (!ClearCapabilities(error)) {
    return false;
  }
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
    *error = ErrnoText("prctl", "PR_SET_NO_NEW_PRIVS", errno);
    return false;
  }
  struct sock_fprog prog = {static_cast<unsigned short>(filter.size()),
                            const_cast<sock_filter*>(filter.data())};
  if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
    *error = ErrnoText("prctl", "PR_SET_SECCOMP", errno);
    return false;
  }
  char buf[2] = {0, 0};
  ssize_t n;
  do {
    n = read(ready_read.get(), buf, sizeof(buf));
  } while (n < 0 && errno == EINTR);
  if (n != 2 || buf[0] != 'o' || buf[1] != 'k') {
    int status = 0;
    (void)waitpid(pid, &status, 0);
    *error = "the PID namespace holder did not start (its error is above)";
    return false;
  }
  return true;
}

}  // namespace bragg::pbox
