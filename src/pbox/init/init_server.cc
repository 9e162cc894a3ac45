#include "pbox/init/init_server.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <thread>

#include "pbox/init/init_fds.h"

namespace bragg::pbox {
namespace {

namespace proto = init_protocol;

void Log(const char* format, ...) __attribute__((format(printf, 1, 2)));
void Log(const char* format, ...) {
  char line[1024];
  va_list args;
  va_start(args, format);
  vsnprintf(line, sizeof(line), format, args);
  va_end(args);
  fprintf(stderr, "pbox-init: %s\n", line);
}

std::string ErrnoText(const char* call, const std::string& arg, int err) {
  return std::string(call) + "(" + arg + "): " + strerror(err);
}

// Sent by the forked child through its CLOEXEC pipe when chdir or exec fails.
struct ChildError {
  int32_t err;
  char message[512];
};

// Everything the forked child needs, prepared before fork so that the child only makes
// async-signal-safe calls.
struct ExecPlan {
  std::vector<std::string> candidates;  // full paths to try, in PATH order
  std::vector<char*> argv;
  std::vector<char*> env;
  std::vector<char*> sh_argv;  // {"/bin/sh", <candidate>, argv[1..]} for ENOEXEC scripts
  std::string cwd;
  std::string name;
};

ExecPlan MakePlan(proto::SpawnFrame& frame, const std::string& default_path) {
  ExecPlan plan;
  for (auto& s : frame.argv) {
    plan.argv.push_back(s.data());
  }
  plan.argv.push_back(nullptr);
  for (auto& s : frame.env) {
    plan.env.push_back(s.data());
  }
  plan.env.push_back(nullptr);
  plan.cwd = frame.cwd.empty() ? "/" : frame.cwd;
  plan.name = frame.argv[0];
  const std::string& file = frame.argv[0];
  if (file.find('/') != std::string::npos) {
    plan.candidates.push_back(file);
  } else if (!file.empty()) {
    std::string path = default_path;
    for (const auto& kv : frame.env) {
      if (kv.rfind("PATH=", 0) == 0) {
        path = kv.substr(5);
        break;  // getenv() semantics: the first one wins
      }
    }
    size_t start = 0;
    while (true) {
      size_t end = path.find(':', start);
      std::string dir = path.substr(start, end == std::string::npos ? end : end - start);
      // POSIX: an empty PATH element means the current directory.
      plan.candidates.push_back((dir.empty() ? std::string(".") : dir) + "/" + file);
      if (end == std::string::npos) {
        break;
      }
      start = end + 1;
    }
  }
  plan.sh_argv.push_back(const_cast<char*>("/bin/sh"));
  plan.sh_argv.push_back(nullptr);
  for (size_t i = 1; i < frame.argv.size(); ++i) {
    plan.sh_argv.push_back(frame.argv[i].data());
  }
  plan.sh_argv.push_back(nullptr);
  return plan;
}

[[noreturn]] void ChildFail(int err_fd, int err, const char* call, const char* arg) {
  ChildError e;
  memset(&e, 0, sizeof(e));
  e.err = err;
  snprintf(e.message, sizeof(e.message), "%s(%s): %s", call, arg, strerror(err));
  ssize_t unused = write(err_fd, &e, sizeof(e));
  (void)unused;
  _exit(127);
}

// Runs in the forked child; never returns.
[[noreturn]] void ChildMain(ExecPlan& plan, const int stdio[3], int err_write) {
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  // Every disposition back to default, through the raw system call: libc's sigaction()
  // refuses the two real-time signals it reserves (32, 33), and those can arrive ignored.
  struct KernelSigaction {
    void (*handler)(int);
    unsigned long flags;
    void (*restorer)();
    uint64_t mask;
  } dfl = {SIG_DFL, 0, nullptr, 0};
  for (int sig = 1; sig <= 64; ++sig) {
    if (sig != SIGKILL && sig != SIGSTOP) {
      syscall(SYS_rt_sigaction, sig, &dfl, nullptr, sizeof(uint64_t));
    }
  }
  setsid();
  // A child subreaper (kept across execve): what the command's descendants orphan by
  // double-forking or setsid() is reparented to the command, not to us, so a timeout's
  // KillTree still finds it. Best effort: without it, detached processes die with the sandbox.
  (void)prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
  // pbox-init protects itself from the OOM killer (-999); commands must stay killable, and
  // raising one's own score needs no privilege.
  {
    UniqueFd fd(open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC));
    if (fd.valid()) {
      ssize_t unused = write(fd.get(), "0", 1);
      (void)unused;
    }
  }

  // The stdio fds may themselves sit on 0-2 (or on each other's targets): move them all above
  // the error pipe's final slot first, then dup2 into place.
  int moved[3];
  for (int i = 0; i < 3; ++i) {
    moved[i] = fcntl(stdio[i], F_DUPFD_CLOEXEC, 10);
    if (moved[i] < 0) {
      ChildFail(err_write, errno, "fcntl", "F_DUPFD");
    }
  }
  int err_moved = fcntl(err_write, F_DUPFD_CLOEXEC, 10);
  if (err_moved < 0) {
    ChildFail(err_write, errno, "fcntl", "F_DUPFD");
  }
  for (int i = 0; i < 3; ++i) {
    if (dup2(moved[i], i) < 0) {
      ChildFail(err_moved, errno, "dup2", "stdio");
    }
  }
  if (dup3(err_moved, 3, O_CLOEXEC) < 0) {
    ChildFail(err_moved, errno, "dup3", "3");
  }
  const int err_fd = 3;
  CloseFdsFrom(4);

  if (chdir(plan.cwd.c_str()) != 0) {
    ChildFail(err_fd, errno, "chdir", plan.cwd.c_str());
  }
  int err = ENOENT;
  bool saw_eacces = false;
  for (auto& candidate : plan.candidates) {
    execve(candidate.c_str(), plan.argv.data(), plan.env.data());
    int e = errno;
    if (e == ENOEXEC) {
      // execvp's fallback for scripts without a #! line.
      plan.sh_argv[1] = candidate.data();
      execve("/bin/sh", plan.sh_argv.data(), plan.env.data());
      err = e;
      break;
    }
    if (e == EACCES) {
      saw_eacces = true;
      continue;
    }
    if (e == ENOENT || e == ENOTDIR || e == ESTALE || e == ENODEV || e == ETIMEDOUT) {
      continue;
    }
    err = e;
    saw_eacces = false;
    break;
  }
  if (saw_eacces) {
    err = EACCES;
  }
  ChildFail(err_fd, err, "execvp", plan.name.c_str());
}

bool ParseInt(const char* s, int* out) {
  if (*s == '\0') {
    return false;
  }
  char* end = nullptr;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno != 0 || *end != '\0' || v < 0 || v > 1 << 20) {
    return false;
  }
  *out = static_cast<int>(v);
  return true;
}

void SetBuffer(int fd, int force_opt, int opt, int bytes) {
  if (setsockopt(fd, SOL_SOCKET, force_opt, &bytes, sizeof(bytes)) != 0) {
    // Without CAP_NET_ADMIN the kernel caps this at net.core.[rw]mem_max (doubled), which
    // still holds a frame of kMaxFrameBytes on default sysctls.
    (void)setsockopt(fd, SOL_SOCKET, opt, &bytes, sizeof(bytes));
  }
}

}  // namespace

bool ParseInitFlags(int argc, char** argv, int* channel_fd, std::string* error, bool* stream) {
  *channel_fd = 3;
  if (stream != nullptr) {
    *stream = false;
  }
  for (int i = 1; i < argc; ++i) {
    const char* arg = argv[i];
    constexpr const char kFlag[] = "--channel-fd=";
    if (strncmp(arg, kFlag, sizeof(kFlag) - 1) == 0) {
      if (!ParseInt(arg + sizeof(kFlag) - 1, channel_fd)) {
        *error = std::string("bad --channel-fd value: ") + arg;
        return false;
      }
    } else if (stream != nullptr && strcmp(arg, "--stream") == 0) {
      *stream = true;
    } else {
      *error =
          std::string("unknown flag: ") + arg + " (usage: pbox-init [--channel-fd=N] [--stream])";
      return false;
    }
  }
  return true;
}

UniqueFd InitServer::PrepareProcess(std::string* error) {
  // Received fds take the lowest free numbers; keep 0-2 occupied so they never land there.
  for (int fd = 0; fd < 3; ++fd) {
    if (fcntl(fd, F_GETFD) < 0 && errno == EBADF) {
      // Landed on `fd`: kept open for good, which is the point.
      UniqueFd null_fd(open("/dev/null", O_RDWR));
      if (null_fd.get() == fd) {
        (void)null_fd.Release();
      }
    }
  }

  signal(SIGPIPE, SIG_IGN);
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGCHLD);
  if (sigprocmask(SIG_BLOCK, &mask, nullptr) != 0) {
    *error = ErrnoText("sigprocmask", "SIGCHLD", errno);
    return UniqueFd();
  }
  int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sfd < 0) {
    *error = ErrnoText("signalfd", "SIGCHLD", errno);
    return UniqueFd();
  }
  UniqueFd signal_fd(sfd);
  if (getpid() != 1 && prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0) {
    *error = ErrnoText("prctl", "PR_SET_CHILD_SUBREAPER", errno);
    return UniqueFd();
  }
  return signal_fd;
}

std::unique_ptr<InitServer> InitServer::Create(UniqueFd channel, InitServerOptions options,
                                               std::string* error) {
  struct stat st;
  if (fstat(channel.get(), &st) != 0) {
    *error = ErrnoText("fstat", "channel fd " + std::to_string(channel.get()), errno);
    return nullptr;
  }
  if (!S_ISSOCK(st.st_mode)) {
    *error = "channel fd " + std::to_string(channel.get()) + " is not a socket";
    return nullptr;
  }
  int type = 0;
  socklen_t len = sizeof(type);
  if (getsockopt(channel.get(), SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_SEQPACKET) {
    *error = "channel fd " + std::to_string(channel.get()) + " is not a SOCK_SEQPACKET socket";
    return nullptr;
  }
  if (fcntl(channel.get(), F_SETFD, FD_CLOEXEC) != 0) {
    *error = ErrnoText("fcntl", "F_SETFD", errno);
    return nullptr;
  }
  SetBuffer(channel.get(), SO_SNDBUFFORCE, SO_SNDBUF, 2 * proto::kMaxFrameBytes);
  SetBuffer(channel.get(), SO_RCVBUFFORCE, SO_RCVBUF, 2 * proto::kMaxFrameBytes);
  UniqueFd signal_fd = PrepareProcess(error);
  if (!signal_fd.valid()) {
    return nullptr;
  }
  return std::unique_ptr<InitServer>(new InitServer(std::move(channel), UniqueFd(),
                                                    std::move(signal_fd), std::move(options),
                                                    getpid() == 1, /*stream=*/false));
}

std::unique_ptr<InitServer> InitServer::CreateStream(UniqueFd in, UniqueFd out,
                                                     InitServerOptions options,
                                                     std::string* error) {
  // The channel usually arrives on fds 0 and 1: move it above 2 (close-on-exec, so commands
  // never inherit it) and let PrepareProcess put /dev/null there.
  UniqueFd fds[2];
  UniqueFd* given[2] = {&in, &out};
  for (int i = 0; i < 2; ++i) {
    struct stat st;
    if (fstat(given[i]->get(), &st) != 0) {
      *error = ErrnoText("fstat", "stream fd " + std::to_string(given[i]->get()), errno);
      return nullptr;
    }
    if (!S_ISFIFO(st.st_mode) && !S_ISSOCK(st.st_mode)) {
      *error = "stream fd " + std::to_string(given[i]->get()) + " is not a pipe or a socket";
      return nullptr;
    }
    int fd = fcntl(given[i]->get(), F_DUPFD_CLOEXEC, 3);
    if (fd < 0) {
      *error = ErrnoText("fcntl", "F_DUPFD_CLOEXEC", errno);
      return nullptr;
    }
    fds[i].Reset(fd);
  }
  in.Reset();
  out.Reset();
  if (fcntl(fds[0].get(), F_SETFL, O_NONBLOCK) != 0) {
    *error = ErrnoText("fcntl", "O_NONBLOCK", errno);
    return nullptr;
  }
  UniqueFd signal_fd = PrepareProcess(error);
  if (!signal_fd.valid()) {
    return nullptr;
  }
  std::unique_ptr<InitServer> server(new InitServer(std::move(fds[0]), std::move(fds[1]),
                                                    std::move(signal_fd), std::move(options),
                                                    getpid() == 1, /*stream=*/true));
  server->Send(proto::ReadyFrame{});
  if (server->channel_failed_) {
    *error = "cannot send Ready on the stream";
    return nullptr;
  }
  return server;
}

InitServer::InitServer(UniqueFd channel, UniqueFd out, UniqueFd signal_fd,
                       InitServerOptions options, bool pid1, bool stream)
    : channel_(std::move(channel)),
      out_(std::move(out)),
      signal_fd_(std::move(signal_fd)),
      options_(std::move(options)),
      pid1_(pid1),
      stream_(stream),
      buffer_(proto::kMaxFrameBytes) {}

InitServer::~InitServer() = default;

int InitServer::Run() {
  // What each polled fd is: the channel, the signalfd, a child's error pipe, or (stream
  // transport) a command's stdin (kind 3) or stdout/stderr (kinds 4, 5).
  struct Polled {
    int kind;
    uint64_t id;
  };
  std::vector<pollfd> fds;
  std::vector<Polled> what;
  while (!channel_closed_) {
    fds.clear();
    what.clear();
    fds.push_back({channel_.get(), POLLIN, 0});
    what.push_back({0, 0});
    fds.push_back({signal_fd_.get(), POLLIN, 0});
    what.push_back({1, 0});
    for (const auto& [id, child] : children_) {
      if (child.err_pipe.valid()) {
        fds.push_back({child.err_pipe.get(), POLLIN, 0});
        what.push_back({2, id});
      }
    }
    for (const auto& [id, st] : streams_) {
      if (st.stdin_write.valid() && (!st.stdin_pending.empty() || st.stdin_eof)) {
        fds.push_back({st.stdin_write.get(), POLLOUT, 0});
        what.push_back({3, id});
      }
      for (int i = 0; i < 2; ++i) {
        // A full window leaves the pipe unread: the command blocks on it, as on a pipe of the
        // native runtime, until the agent's reader catches up.
        if (st.out[i].valid() && st.out_unacked[i] < proto::kStdioWindowBytes) {
          fds.push_back({st.out[i].get(), POLLIN, 0});
          what.push_back({4 + i, id});
        }
      }
    }
    int n = poll(fds.data(), fds.size(), -1);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      Log("poll: %s", strerror(errno));
      channel_failed_ = true;
      break;
    }
    // Output before reaping, so that what a command wrote goes out before its Exited frame.
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) {
        continue;
      }
      switch (what[i].kind) {
        case 3:
          FlushStdin(what[i].id);
          break;
        case 4:
        case 5:
          PumpOutput(what[i].id, what[i].kind - 4, /*drain=*/false);
          break;
        default:
          break;
      }
    }
    if (fds[1].revents != 0) {
      signalfd_siginfo info;
      while (read(signal_fd_.get(), &info, sizeof(info)) == sizeof(info)) {
      }
      ReapChildren();
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents != 0 && what[i].kind == 2) {
        HandleErrorPipe(what[i].id);
      }
    }
    if (fds[0].revents != 0) {
      if (!(stream_ ? ReadStream() : ReadChannel())) {
        break;
      }
    }
  }
  KillEverything();
  return channel_failed_ ? 1 : 0;
}

bool InitServer::ReadStream() {
  char chunk[64 * 1024];
  ssize_t n = read(channel_.get(), chunk, sizeof(chunk));
  if (n < 0) {
    if (errno == EINTR || errno == EAGAIN) {
      return true;
    }
    Log("read on the stream: %s; shutting down", strerror(errno));
    channel_failed_ = true;
    channel_closed_ = true;
    return false;
  }
  if (n == 0) {
    channel_closed_ = true;
    return false;
  }
  stream_in_.append(chunk, static_cast<size_t>(n));
  size_t pos = 0;
  while (stream_in_.size() - pos >= proto::kStreamPrefixBytes) {
    size_t len = 0;
    std::string error;
    if (!proto::ParseStreamPrefix(
            std::string_view(stream_in_).substr(pos, proto::kStreamPrefixBytes), &len, &error)) {
      // Frame boundaries are lost: nothing after this can be trusted.
      Log("bad stream frame: %s; shutting down", error.c_str());
      channel_failed_ = true;
      channel_closed_ = true;
      return false;
    }
    if (stream_in_.size() - pos - proto::kStreamPrefixBytes < len) {
      break;
    }
    Dispatch(proto::DecodeFrame(
                 std::string_view(stream_in_).substr(pos + proto::kStreamPrefixBytes, len), 0),
             {});
    pos += proto::kStreamPrefixBytes + len;
    if (channel_closed_) {
      return false;
    }
  }
  stream_in_.erase(0, pos);
  return true;
}

bool InitServer::ReadChannel() {
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * proto::kMaxFds)];
  iovec iov = {buffer_.data(), buffer_.size()};
  msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n = recvmsg(channel_.get(), &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0) {
    if (errno == EINTR || errno == EAGAIN) {
      return true;
    }
    Log("recvmsg on the channel: %s; shutting down", strerror(errno));
    channel_failed_ = true;
    channel_closed_ = true;
    return false;
  }
  std::vector<UniqueFd> fds = proto::TakeReceivedFds(msg);
  if (n == 0 && fds.empty()) {
    channel_closed_ = true;
    return false;
  }
  if ((msg.msg_flags & MSG_TRUNC) != 0) {
    Log("dropping a frame larger than %zu bytes", proto::kMaxFrameBytes);
    return true;
  }
  if ((msg.msg_flags & MSG_CTRUNC) != 0) {
    Log("dropping a frame with more than %zu fds", proto::kMaxFds);
    return true;
  }
  proto::DecodeResult decoded =
      proto::DecodeFrame(std::string_view(buffer_.data(), static_cast<size_t>(n)), fds.size());
  Dispatch(std::move(decoded), std::move(fds));
  return !channel_closed_;
}

void InitServer::Dispatch(proto::DecodeResult decoded, std::vector<UniqueFd> fds) {
  if (!decoded.frame.has_value()) {
    Log("bad frame: %s", decoded.error.c_str());
    if (decoded.id.has_value()) {
      SendError(*decoded.id, "bad frame: " + decoded.error);
    }
    return;
  }
  if (auto* spawn = std::get_if<proto::SpawnFrame>(&*decoded.frame)) {
    HandleSpawn(std::move(*spawn), std::move(fds));
  } else if (auto* kill_frame = std::get_if<proto::KillFrame>(&*decoded.frame)) {
    HandleKill(*kill_frame);
  } else if (auto* stdin_frame = std::get_if<proto::StdinFrame>(&*decoded.frame);
             stdin_frame != nullptr && stream_) {
    HandleStdin(std::move(*stdin_frame));
  } else if (auto* credit = std::get_if<proto::OutputCreditFrame>(&*decoded.frame);
             credit != nullptr && stream_) {
    HandleOutputCredit(*credit);
  } else {
    const uint64_t id = std::visit([](const auto& f) { return f.id; }, *decoded.frame);
    Log("unexpected frame for id %llu from the agent", static_cast<unsigned long long>(id));
    SendError(id, "frame type not accepted by pbox-init");
  }
}

void InitServer::HandleSpawn(proto::SpawnFrame frame, std::vector<UniqueFd> fds) {
  const uint64_t id = frame.id;
  if (children_.count(id) != 0 || streams_.count(id) != 0) {
    SendError(id, "duplicate process id " + std::to_string(id));
    return;
  }
  auto fail_setup = [&](int err, std::string message) {
    proto::SpawnFailedFrame f;
    f.id = id;
    f.stage = proto::SpawnStage::kSetup;
    f.err = err;
    f.message = std::move(message);
    Send(f);
  };
  const bool streamed = (frame.flags & proto::kStreamStdio) != 0;
  if (streamed != stream_) {
    SendError(id, streamed ? "streamed stdio needs the stream transport"
                           : "the stream transport relays stdio: set kStreamStdio");
    return;
  }
  UniqueFd null_fd;
  int stdio[3];
  size_t next = 0;
  const uint32_t null_bits[3] = {proto::kStdinNull, proto::kStdoutNull, proto::kStderrNull};
  // Streamed: init's ends of the command's stdio pipes, and the command's ends (closed in
  // init once forked).
  Streams streams;
  UniqueFd child_ends[3];
  for (int i = 0; i < 3; ++i) {
    if ((frame.flags & null_bits[i]) == 0 && streamed) {
      int p[2];
      if (pipe2(p, O_CLOEXEC) != 0) {
        fail_setup(errno, ErrnoText("pipe2", "stdio", errno));
        return;
      }
      UniqueFd read_end(p[0]), write_end(p[1]);
      UniqueFd& mine = i == 0 ? streams.stdin_write : streams.out[i - 1];
      mine = std::move(i == 0 ? write_end : read_end);
      child_ends[i] = std::move(i == 0 ? read_end : write_end);
      (void)fcntl(mine.get(), F_SETFL, O_NONBLOCK);
      stdio[i] = child_ends[i].get();
      continue;
    }
    if ((frame.flags & null_bits[i]) == 0) {
      stdio[i] = fds[next++].get();
      continue;
    }
    if (!null_fd.valid()) {
      null_fd.Reset(open("/dev/null", O_RDWR | O_CLOEXEC));
      if (!null_fd.valid()) {
        fail_setup(errno, ErrnoText("open", "/dev/null", errno));
        return;
      }
    }
    stdio[i] = null_fd.get();
  }
  ExecPlan plan = MakePlan(frame, options_.default_path);
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) {
    fail_setup(errno, ErrnoText("pipe2", "O_CLOEXEC", errno));
    return;
  }
  UniqueFd err_read(pipe_fds[0]);
  UniqueFd err_write(pipe_fds[1]);
  pid_t pid = fork();
  if (pid < 0) {
    fail_setup(errno, ErrnoText("fork", plan.name, errno));
    return;
  }
  if (pid == 0) {
    ChildMain(plan, stdio, err_write.get());
  }
  err_write.Reset();
  for (UniqueFd& end : child_ends) {
    end.Reset();
  }
  if (streamed) {
    streams_[id] = std::move(streams);
  }
  (void)fcntl(err_read.get(), F_SETFL, O_NONBLOCK);
  Child child;
  child.id = id;
  child.pid = pid;
  child.err_pipe = std::move(err_read);
  children_.emplace(id, std::move(child));
  ids_by_pid_[pid] = id;
}

void InitServer::HandleErrorPipe(uint64_t id) {
  auto it = children_.find(id);
  if (it == children_.end() || !it->second.err_pipe.valid()) {
    return;
  }
  Child& child = it->second;
  ChildError e;
  memset(&e, 0, sizeof(e));
  ssize_t n = read(child.err_pipe.get(), &e, sizeof(e));
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
    return;
  }
  child.err_pipe.Reset();
  if (n <= 0) {
    // EOF: the exec succeeded (the pipe was closed by CLOEXEC).
    child.state = State::kRunning;
    Send(proto::SpawnedFrame{id, child.pid});
    if (child.early_exit.has_value()) {
      FinishExit(*child.early_exit);
    }
    return;
  }
  proto::SpawnFailedFrame f;
  f.id = id;
  f.stage = proto::SpawnStage::kExec;
  f.pid = child.pid;
  if (static_cast<size_t>(n) >= sizeof(e.err)) {
    f.err = e.err;
    e.message[sizeof(e.message) - 1] = '\0';
    f.message = e.message;
  } else {
    f.err = EIO;
    f.message = "short error report from the forked child";
  }
  child.state = State::kFailed;
  Send(f);
  if (child.early_exit.has_value()) {
    Forget(id);
  }
}

void InitServer::HandleKill(const proto::KillFrame& frame) {
  auto it = children_.find(frame.id);
  if (it == children_.end() || it->second.state == State::kFailed) {
    return;  // already exited: the Exited frame is on its way or was sent
  }
  const pid_t pid = it->second.pid;
  if (frame.whole_tree) {
    KillTree(pid, frame.signal);  // the group too
  } else if (kill(-pid, frame.signal) != 0 && errno != ESRCH) {
    Log("kill(-%d, %d): %s", pid, frame.signal, strerror(errno));
  }
}

void InitServer::ReapChildren() {
  while (true) {
    int status = 0;
    rusage usage;
    memset(&usage, 0, sizeof(usage));
    pid_t pid = wait4(-1, &status, WNOHANG, &usage);
    if (pid <= 0) {
      return;
    }
    if (pid == options_.exit_with_pid) {
      Log("the PID namespace of commands ended (its PID 1 exited with status %d); shutting down",
          status);
      channel_failed_ = true;
      channel_closed_ = true;
      continue;
    }
    auto pit = ids_by_pid_.find(pid);
    if (pit == ids_by_pid_.end()) {
      continue;  // an orphan that was reparented to us
    }
    const uint64_t id = pit->second;
    auto it = children_.find(id);
    if (it == children_.end()) {
      ids_by_pid_.erase(pit);
      continue;
    }
    proto::ExitedFrame f;
    f.id = id;
    if (WIFEXITED(status)) {
      f.exit_code = WEXITSTATUS(status);
    } else if (WIFSIGNALED(status)) {
      f.signal = WTERMSIG(status);
    }
    f.user_us = static_cast<int64_t>(usage.ru_utime.tv_sec) * 1000000 + usage.ru_utime.tv_usec;
    f.system_us = static_cast<int64_t>(usage.ru_stime.tv_sec) * 1000000 + usage.ru_stime.tv_usec;
    f.max_rss_kb = usage.ru_maxrss;
    Child& child = it->second;
    switch (child.state) {
      case State::kStarting:
        // The error pipe has not been read yet; report once we know whether exec worked.
        child.early_exit = f;
        break;
      case State::kRunning:
        FinishExit(f);
        break;
      case State::kFailed:
        Forget(id);
        break;
    }
  }
}

void InitServer::Forget(uint64_t id) {
  auto it = children_.find(id);
  if (it == children_.end()) {
    return;
  }
  ids_by_pid_.erase(it->second.pid);
  children_.erase(it);
  // Nobody reads the command's stdin any more (a background child that still could is not
  // worth holding data for); its output pipes stay until EOF.
  if (auto st = streams_.find(id); st != streams_.end()) {
    st->second.stdin_write.Reset();
    st->second.stdin_pending.clear();
    MaybeForgetStreams(id);
  }
}

void InitServer::HandleStdin(proto::StdinFrame frame) {
  auto it = streams_.find(frame.id);
  if (it == streams_.end()) {
    return;  // exited (its Exited frame stops the agent's relay) or never streamed
  }
  Streams& st = it->second;
  if (st.stdin_refused) {
    return;
  }
  if (frame.data.empty()) {
    st.stdin_eof = true;
    FlushStdin(frame.id);
    return;
  }
  if (st.stdin_pending.size() + st.stdin_uncredited + frame.data.size() >
      proto::kStdioWindowBytes) {
    // Only a broken agent sends past its window; buffering what it sends would let it grow
    // this process (the sandbox's memory) without bound.
    Log("process %llu: stdin sent past its window of %zu bytes; closing its stdin",
        static_cast<unsigned long long>(frame.id), proto::kStdioWindowBytes);
    SendError(frame.id, "stdin sent past the window of " +
                            std::to_string(proto::kStdioWindowBytes) +
                            " bytes; the command's stdin is closed");
    st.stdin_refused = true;
    st.stdin_pending.clear();
    st.stdin_write.Reset();
    MaybeForgetStreams(frame.id);
    return;
  }
  if (!st.stdin_write.valid()) {
    // The command closed its stdin (or it was never a pipe): dropped, and the window
    // reopened, as a pipe without reader would fail the writes without blocking them.
    st.stdin_uncredited += frame.data.size();
    CreditStdin(frame.id, st);
    return;
  }
  st.stdin_pending += frame.data;
  FlushStdin(frame.id);
}

void InitServer::FlushStdin(uint64_t id) {
  auto it = streams_.find(id);
  if (it == streams_.end() || !it->second.stdin_write.valid()) {
    return;
  }
  Streams& st = it->second;
  // What the pipe does not take now waits for POLLOUT.
  bool broken = false;
  size_t written = WriteAvailable(st.stdin_write.get(), st.stdin_pending, &broken);
  if (broken) {  // EPIPE: the command closed its stdin; drop what it will never read.
    written = st.stdin_pending.size();
    st.stdin_write.Reset();
  }
  st.stdin_pending.erase(0, written);
  st.stdin_uncredited += written;
  if (st.stdin_pending.empty() && st.stdin_eof) {
    st.stdin_write.Reset();
  }
  CreditStdin(id, st);
}

void InitServer::CreditStdin(uint64_t id, Streams& st) {
  if (st.stdin_uncredited == 0 ||
      (st.stdin_uncredited < proto::kStdioCreditBatchBytes && !st.stdin_pending.empty())) {
    return;
  }
  Send(proto::StdinCreditFrame{id, static_cast<uint32_t>(st.stdin_uncredited)});
  st.stdin_uncredited = 0;
}

InitServer::Pumped InitServer::PumpOutput(uint64_t id, int stream, bool drain) {
  auto it = streams_.find(id);
  if (it == streams_.end() || !it->second.out[stream].valid()) {
    return Pumped::kEof;
  }
  Streams& st = it->second;
  UniqueFd& fd = st.out[stream];
  proto::OutputFrame f;
  f.id = id;
  f.stream = stream == 0 ? proto::OutputStream::kStdout : proto::OutputStream::kStderr;
  std::string chunk(proto::kMaxDataBytes, '\0');
  // Without `drain`, one read per wakeup keeps one chatty command from starving the others.
  for (int reads = 0; drain || reads < 1; ++reads) {
    const size_t room = proto::kStdioWindowBytes - st.out_unacked[stream];
    if (room == 0) {
      return Pumped::kWindowFull;
    }
    ssize_t n = read(fd.get(), chunk.data(), std::min(chunk.size(), room));
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0 && errno == EAGAIN) {
      return Pumped::kEmpty;
    }
    if (n <= 0) {
      f.data.clear();
      Send(f);  // EOF (or a read error, which ends the stream the same way)
      fd.Reset();
      MaybeForgetStreams(id);
      return Pumped::kEof;
    }
    f.data.assign(chunk.data(), static_cast<size_t>(n));
    st.out_unacked[stream] += static_cast<size_t>(n);
    Send(f);
    if (channel_closed_) {
      return Pumped::kEof;
    }
  }
  return Pumped::kRead;
}

void InitServer::HandleOutputCredit(const proto::OutputCreditFrame& frame) {
  auto it = streams_.find(frame.id);
  if (it == streams_.end()) {
    return;  // both pipes ended and the process exited: nothing left to send
  }
  const int stream = frame.stream == proto::OutputStream::kStdout ? 0 : 1;
  size_t& unacked = it->second.out_unacked[stream];
  if (frame.bytes > unacked) {
    Log("process %llu: output credit of %u bytes for %zu sent",
        static_cast<unsigned long long>(frame.id), frame.bytes, unacked);
    SendError(frame.id, "output credit beyond what was sent");
    return;
  }
  unacked -= frame.bytes;
  if (it->second.exit.has_value()) {
    FlushExit(frame.id);
  }
}

void InitServer::FinishExit(const proto::ExitedFrame& frame) {
  // No Kill may reach the pid any more (it can be reused once reaped).
  Forget(frame.id);
  auto it = streams_.find(frame.id);
  if (it == streams_.end()) {
    Send(frame);
    return;
  }
  it->second.exit = frame;
  it->second.out_drained[0] = it->second.out_drained[1] = false;
  FlushExit(frame.id);
}

void InitServer::FlushExit(uint64_t id) {
  // Everything the process wrote is in its pipes now: send it ahead of the exit, as far as
  // the windows let it go; the rest follows credits.
  for (int i = 0; i < 2; ++i) {
    auto it = streams_.find(id);
    if (it == streams_.end() || !it->second.exit.has_value()) {
      return;
    }
    if (!it->second.out_drained[i]) {
      Pumped p = PumpOutput(id, i, /*drain=*/true);
      it = streams_.find(id);
      if (it == streams_.end()) {
        return;
      }
      it->second.out_drained[i] = p != Pumped::kWindowFull;
    }
  }
  auto it = streams_.find(id);
  if (it == streams_.end() || !it->second.out_drained[0] || !it->second.out_drained[1]) {
    return;
  }
  proto::ExitedFrame f = *it->second.exit;
  it->second.exit.reset();
  Send(f);
  MaybeForgetStreams(id);
}

void InitServer::MaybeForgetStreams(uint64_t id) {
  auto it = streams_.find(id);
  if (it != streams_.end() && !it->second.stdin_write.valid() && !it->second.out[0].valid() &&
      !it->second.out[1].valid() && !it->second.exit.has_value() && children_.count(id) == 0) {
    streams_.erase(it);
  }
}

void InitServer::Send(const proto::Frame& frame) {
  if (channel_closed_) {
    return;
  }
  std::string bytes;
  std::string error;
  if (!proto::EncodeFrame(frame, &bytes, &error)) {
    Log("cannot encode a reply: %s", error.c_str());
    return;
  }
  if (stream_) {
    if (!WriteChannel(proto::StreamPrefix(bytes.size()) + bytes)) {
      // EPIPE: the agent closed its end while a reply was on its way, the same end as EOF on
      // the read side (a clean shutdown), not a failure of the channel.
      if (errno != EPIPE) {
        Log("write on the stream: %s; shutting down", strerror(errno));
        channel_failed_ = true;
      }
      channel_closed_ = true;
    }
    return;
  }
  while (true) {
    ssize_t n = send(channel_.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n >= 0) {
      return;
    }
    if (errno == EINTR) {
      continue;
    }
    // EPIPE, ECONNRESET: the agent closed its end (see above), not a failure.
    if (errno != EPIPE && errno != ECONNRESET) {
      Log("send on the channel: %s; shutting down", strerror(errno));
      channel_failed_ = true;
    }
    channel_closed_ = true;
    return;
  }
}

bool InitServer::WriteChannel(const std::string& bytes) {
  // Blocking: the agent reads the stream all the time, so this waits only while the agent
  // hands earlier output on.
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = write(out_.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

void InitServer::SendError(uint64_t id, const std::string& message) {
  proto::ErrorFrame f;
  f.id = id;
  f.message = message.substr(0, proto::kMaxMessageBytes);
  for (char& c : f.message) {
    if (c == '\0') {
      c = '?';
    }
  }
  Send(f);
}

std::vector<InitServer::ProcEntry> InitServer::ScanProc() const {
  std::vector<ProcEntry> out;
  const int root = options_.proc_dir.valid() ? options_.proc_dir.get() : AT_FDCWD;
  const char* root_name = options_.proc_dir.valid() ? "." : options_.proc_root.c_str();
  UniqueFd dir_fd(openat(root, root_name, O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  DIR* dir = dir_fd.valid() ? fdopendir(dir_fd.get()) : nullptr;
  if (dir == nullptr) {
    Log("opendir(%s): %s", options_.proc_root.c_str(), strerror(errno));
    return out;
  }
  (void)dir_fd.Release();  // closedir() closes it
  const pid_t self = getpid();
  while (dirent* entry = readdir(dir)) {
    int pid = 0;
    if (!ParseInt(entry->d_name, &pid) || pid <= 0 || pid == self) {
      continue;
    }
    std::string path = options_.proc_dir.valid()
                           ? std::string(entry->d_name) + "/stat"
                           : options_.proc_root + "/" + entry->d_name + "/stat";
    UniqueFd fd(openat(root, path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) {
      continue;  // exited meanwhile
    }
    char buf[1024];
    ssize_t n = read(fd.get(), buf, sizeof(buf) - 1);
    if (n <= 0) {
      continue;
    }
    buf[n] = '\0';
    // "pid (comm) state ppid pgrp session ...": comm may contain spaces and parentheses, so
    // parse from the last ')'.
    const char* p = strrchr(buf, ')');
    char state = 0;
    int ppid = 0;
    int pgrp = 0;
    int session = 0;
    if (p == nullptr || sscanf(p + 1, " %c %d %d %d", &state, &ppid, &pgrp, &session) != 4) {
      continue;
    }
    out.push_back(ProcEntry{pid, ppid, pgrp, session, state == 'Z' || state == 'X'});
  }
  closedir(dir);
  return out;
}

void InitServer::KillTree(pid_t root, int signal) {
  // Pids of the tree, and the sessions and process groups its members lead or share. A session
  // or group can only be joined from inside it, so no other command's process matches.
  std::set<pid_t> members = {root};
  std::set<pid_t> sessions = {root};
  std::set<pid_t> groups = {root};
  std::vector<pid_t> signalled;
  std::set<pid_t> seen;
  // For SIGKILL every member is stopped first and killed last: a stopped process cannot fork,
  // and a live parent keeps its children findable (a dead one hands them to us).
  const bool stop_first = signal == SIGKILL;
  constexpr int kMaxPasses = 16;
  int pass = 0;
  for (; pass < kMaxPasses; ++pass) {
    const std::vector<ProcEntry> procs = ScanProc();
    // Grow to a fixed point: a member's child, or anyone in a member's session or group.
    bool grew = true;
    while (grew) {
      grew = false;
      for (const ProcEntry& e : procs) {
        if (members.count(e.pid) != 0) {
          continue;
        }
        if (members.count(e.ppid) != 0 || sessions.count(e.session) != 0 ||
            groups.count(e.pgrp) != 0) {
          members.insert(e.pid);
          sessions.insert(e.session);
          groups.insert(e.pgrp);
          grew = true;
        }
      }
    }
    bool fresh = false;
    for (const ProcEntry& e : procs) {
      if (members.count(e.pid) == 0 || e.zombie || !seen.insert(e.pid).second) {
        continue;
      }
      fresh = true;
      signalled.push_back(e.pid);
      if (kill(e.pid, stop_first ? SIGSTOP : signal) != 0 && errno != ESRCH) {
        Log("kill(%d, %d): %s", e.pid, signal, strerror(errno));
      }
    }
    if (!fresh) {
      break;
    }
  }
  if (pass == kMaxPasses) {
    Log("process tree of %d still growing after %d passes", root, kMaxPasses);
  }
  if (stop_first) {
    for (pid_t pid : signalled) {
      (void)kill(pid, SIGKILL);
    }
  }
}

void InitServer::KillEverything() {
  if (pid1_) {
    // PID 1 of the sandbox's pid namespace: this reaches every other process in it, and our
    // exit makes the kernel kill whatever is left.
    (void)kill(-1, SIGKILL);
    return;
  }
  for (const auto& [id, child] : children_) {
    KillTree(child.pid, SIGKILL);
  }
  // As a subreaper every descendant (even one that left the session) is reparented to us
  // once its parent dies, so killing our children until none are left covers them all.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < deadline) {
    std::vector<pid_t> children;
    for (const ProcEntry& e : ScanProc()) {
      if (e.ppid == getpid()) {
        children.push_back(e.pid);
        (void)kill(e.pid, SIGKILL);
      }
    }
    while (waitpid(-1, nullptr, WNOHANG) > 0) {
    }
    if (children.empty() && waitpid(-1, nullptr, WNOHANG) < 0 && errno == ECHILD) {
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  Log("some processes survived shutdown");
}

}  // namespace bragg::pbox
