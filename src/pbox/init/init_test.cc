// Drives the real static pbox-init binary through InitClient, on both transports: a
// SOCK_SEQPACKET socketpair (fds passed) and the stream transport over pipes (stdio relayed).

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/fs.h"
#include "common/process.h"
#include "fmt/format.h"
#include "pbox/init/init_client.h"
#include "pbox/init/init_protocol.h"

namespace bragg::pbox {
namespace {

using std::chrono::milliseconds;
namespace proto = init_protocol;

constexpr const char kInitPath[] = PBOX_INIT_PATH;

struct RunningInit {
  ChildProcess process;  // pbox-init (or, in a new pid namespace, the parent that waits for it)
  UniqueFd channel;      // the agent's end
};

// Starts pbox-init with its end of a fresh socketpair at fd 3. With `new_pid_ns`, an
// intermediate child unshares a pid namespace so that pbox-init runs as its PID 1.
Result<RunningInit> StartInit(bool new_pid_ns = false) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    return ErrnoError("socketpair", "");
  }
  UniqueFd agent(sv[0]);
  UniqueFd init_end(sv[1]);
  pid_t pid = ::fork();
  if (pid < 0) {
    return ErrnoError("fork", "");
  }
  if (pid == 0) {
    if (::dup2(init_end.get(), 3) < 0) {
      _exit(120);
    }
    if (new_pid_ns) {
      if (::unshare(CLONE_NEWPID) != 0) {
        _exit(121);
      }
      pid_t init = ::fork();
      if (init < 0) {
        _exit(122);
      }
      if (init > 0) {
        ::close(3);
        int status = 0;
        while (::waitpid(init, &status, 0) < 0 && errno == EINTR) {
        }
        _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
      }
    }
    ::execl(kInitPath, "pbox-init", "--channel-fd=3", nullptr);
    _exit(127);
  }
  BRAGG_ASSIGN_OR_RETURN(ChildProcess child, ChildProcess::Adopt(pid));
  return RunningInit{std::move(child), std::move(agent)};
}

// Starts `pbox-init --stream` with pipes on its stdin and stdout, as the gVisor runtime does;
// `extra_flag`, when given, is one more argument (e.g. --isolate=FILE).
Result<std::pair<RunningInit, UniqueFd>> StartStreamInit(const char* extra_flag = nullptr) {
  BRAGG_ASSIGN_OR_RETURN(Pipe to_init, MakePipe());
  BRAGG_ASSIGN_OR_RETURN(Pipe from_init, MakePipe());
  pid_t pid = ::fork();
  if (pid < 0) {
    return ErrnoError("fork", "");
  }
  if (pid == 0) {
    if (::dup2(to_init.read.get(), 0) < 0 || ::dup2(from_init.write.get(), 1) < 0) {
      _exit(120);
    }
    ::execl(kInitPath, "pbox-init", "--stream", extra_flag, nullptr);
    _exit(127);
  }
  BRAGG_ASSIGN_OR_RETURN(ChildProcess child, ChildProcess::Adopt(pid));
  return std::pair{RunningInit{std::move(child), std::move(from_init.read)},
                   std::move(to_init.write)};
}

// Reads exactly `n` bytes (the stream tests' frame reader).
Status ReadFull(int fd, char* buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::read(fd, buf + got, n - got);
    if (r < 0 && errno == EINTR) {
      continue;
    }
    if (r <= 0) {
      return absl::UnavailableError("short read");
    }
    got += static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

// The next length-prefixed frame on a stream-transport fd; nullopt at EOF or on a malformed
// prefix, and (with a failure recorded) when nothing comes within `timeout_ms` (-1: wait).
std::optional<proto::Frame> ReadStreamFrame(int fd, int timeout_ms = -1) {
  if (timeout_ms >= 0) {
    pollfd p = {fd, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) != 1) {
      ADD_FAILURE() << "no frame within " << timeout_ms << " ms";
      return std::nullopt;
    }
  }
  std::string prefix(proto::kStreamPrefixBytes, '\0');
  if (!ReadFull(fd, prefix.data(), prefix.size()).ok()) {
    return std::nullopt;
  }
  size_t len = 0;
  std::string error;
  if (!proto::ParseStreamPrefix(prefix, &len, &error)) {
    return std::nullopt;
  }
  std::string body(len, '\0');
  if (!ReadFull(fd, body.data(), len).ok()) {
    return std::nullopt;
  }
  return proto::DecodeFrame(body, 0).frame;
}

// Encodes `frame` and writes it with its length prefix; false (with a failure recorded when
// it cannot be encoded) otherwise.
bool WriteStreamFrame(int fd, const proto::Frame& frame) {
  std::string bytes;
  std::string error;
  if (!proto::EncodeFrame(frame, &bytes, &error)) {
    ADD_FAILURE() << error;
    return false;
  }
  return WriteAll(fd, proto::StreamPrefix(bytes.size()) + bytes).ok();
}

bool ProcessGone(pid_t pid) {
  std::string stat;
  auto s = ReadFileToString(fmt::format("/proc/{}/stat", pid));
  if (!s.ok()) {
    return true;
  }
  auto close = s->rfind(')');
  return close != std::string::npos && s->size() > close + 2 && (*s)[close + 2] == 'Z';
}

bool WaitGone(pid_t pid, milliseconds within) {
  auto deadline = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < deadline) {
    if (ProcessGone(pid)) {
      return true;
    }
    std::this_thread::sleep_for(milliseconds(10));
  }
  return ProcessGone(pid);
}

// Field `field` (1-based, as in proc(5)) of /proc/PID/stat; -1 when unreadable.
long StatField(pid_t pid, int field) {
  auto s = ReadFileToString(fmt::format("/proc/{}/stat", pid));
  if (!s.ok()) {
    return -1;
  }
  std::istringstream in(s->substr(s->rfind(')') + 2));
  std::string token;
  for (int i = 3; in >> token; ++i) {
    if (i == field) {
      return field == 3 ? token[0] : std::stol(token);
    }
  }
  return -1;
}

// Reads `fd` until EOF; false if it did not reach EOF within `within`.
bool ReadToEof(int fd, std::string* out, milliseconds within = milliseconds(10000)) {
  auto deadline = std::chrono::steady_clock::now() + within;
  char buf[4096];
  while (true) {
    auto left =
        std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return false;
    }
    pollfd p = {fd, POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) {
      continue;
    }
    if (r <= 0) {
      return false;
    }
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      return n == 0;
    }
    out->append(buf, static_cast<size_t>(n));
  }
}

// Reads one line (without the newline) from `fd`.
std::string ReadLine(int fd) {
  std::string line;
  char c;
  while (::read(fd, &c, 1) == 1 && c != '\n') {
    line.push_back(c);
  }
  return line;
}

// VmRSS of `pid` in KiB; -1 when unreadable.
long RssKb(pid_t pid) {
  auto s = ReadFileToString(fmt::format("/proc/{}/status", pid));
  if (!s.ok()) {
    return -1;
  }
  auto at = s->find("VmRSS:");
  return at == std::string::npos ? -1 : std::stol(s->substr(at + 6));
}

// Writes `total` bytes into the non-blocking `fd` for at most `within`; returns how many
// went in (fewer when the reader stopped taking them).
size_t WriteFor(int fd, size_t total, milliseconds within) {
  const std::string chunk(64 * 1024, 's');
  const auto deadline = std::chrono::steady_clock::now() + within;
  size_t done = 0;
  while (done < total && std::chrono::steady_clock::now() < deadline) {
    pollfd p = {fd, POLLOUT, 0};
    if (::poll(&p, 1, 50) <= 0) {
      continue;
    }
    ssize_t n = ::write(fd, chunk.data(), std::min(chunk.size(), total - done));
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
      break;
    }
  }
  return done;
}

struct Captured {
  ProcessExit exit;
  std::string out;
  std::string err;
};

// GetParam(): the stream transport.
class InitTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    // The stream client writes into pipes; pboxd ignores SIGPIPE, and so does this test.
    ::signal(SIGPIPE, SIG_IGN);
    if (GetParam()) {
      auto init = StartStreamInit();
      ASSERT_TRUE(init.ok()) << init.status();
      init_ = std::move(init->first.process);
      auto client =
          InitClient::CreateStream(std::move(init->second), std::move(init->first.channel));
      ASSERT_TRUE(client.ok()) << client.status();
      client_ = std::move(*client);
      ASSERT_TRUE(client_->WaitReady(milliseconds(10000)).ok());
    } else {
      auto init = StartInit();
      ASSERT_TRUE(init.ok()) << init.status();
      init_ = std::move(init->process);
      auto client = InitClient::Create(std::move(init->channel));
      ASSERT_TRUE(client.ok()) << client.status();
      client_ = std::move(*client);
    }
    auto dir = TempDir::Create("/tmp", "pbox-init-test-");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = std::move(*dir);
  }

  void TearDown() override {
    client_.reset();
    if (init_.running()) {
      auto exit = init_.Wait(milliseconds(10000));
      ASSERT_TRUE(exit.ok()) << exit.status();
      if (expect_clean_init_exit_) {
        EXPECT_EQ(exit->signal, 0);
        EXPECT_EQ(exit->exit_code, 0);
      }
    }
  }

  // Runs argv with pipes on stdin/stdout/stderr and collects the output.
  Captured Run(std::vector<std::string> argv, std::vector<std::string> env = {},
               std::string cwd = "", std::string input = "") {
    Captured c;
    auto in = MakePipe();
    auto out = MakePipe();
    auto err = MakePipe();
    EXPECT_TRUE(in.ok() && out.ok() && err.ok());
    SpawnRequest req;
    req.argv = std::move(argv);
    req.env = std::move(env);
    req.cwd = std::move(cwd);
    req.stdin_fd = in->read.get();
    req.stdout_fd = out->write.get();
    req.stderr_fd = err->write.get();
    auto handle = client_->Spawn(req);
    EXPECT_TRUE(handle.ok()) << handle.status();
    if (!handle.ok()) {
      return c;
    }
    in->read.Reset();
    out->write.Reset();
    err->write.Reset();
    EXPECT_TRUE(WriteAll(in->write.get(), input).ok());
    in->write.Reset();
    EXPECT_TRUE(ReadToEof(out->read.get(), &c.out));
    EXPECT_TRUE(ReadToEof(err->read.get(), &c.err));
    auto exit = (*handle)->Wait(milliseconds(30000));
    EXPECT_TRUE(exit.ok()) << exit.status();
    if (exit.ok()) {
      c.exit = *exit;
    }
    return c;
  }

  std::shared_ptr<ProcessHandle> SpawnOk(std::vector<std::string> argv, int stdout_fd = -1) {
    SpawnRequest req;
    req.argv = std::move(argv);
    req.stdout_fd = stdout_fd;
    auto handle = client_->Spawn(req);
    EXPECT_TRUE(handle.ok()) << handle.status();
    return handle.ok() ? *handle : nullptr;
  }

  std::string WriteScript(const std::string& name, const std::string& body, mode_t mode) {
    std::string path = dir_.path() + "/" + name;
    EXPECT_TRUE(WriteStringToFile(path, body).ok());
    EXPECT_EQ(::chmod(path.c_str(), mode), 0);
    return path;
  }

  ChildProcess init_;
  std::unique_ptr<InitClient> client_;
  TempDir dir_;
  bool expect_clean_init_exit_ = true;
};

TEST_P(InitTest, ReportsExitCodes) {
  EXPECT_EQ(Run({"true"}).exit.exit_code, 0);
  Captured c = Run({"sh", "-c", "exit 3"});
  EXPECT_EQ(c.exit.exit_code, 3);
  EXPECT_EQ(c.exit.signal, 0);
  EXPECT_EQ(c.exit.spawn_errno, 0);
  EXPECT_EQ(Run({"sh", "-c", "exit 255"}).exit.exit_code, 255);
}

TEST_P(InitTest, StdoutAndStderrGoThroughPipes) {
  Captured c = Run({"sh", "-c", "echo out; echo err >&2; echo more"});
  EXPECT_EQ(c.out, "out\nmore\n");
  EXPECT_EQ(c.err, "err\n");
  EXPECT_EQ(c.exit.exit_code, 0);
}

TEST_P(InitTest, StdinComesFromThePipe) {
  std::string input;
  for (int i = 0; i < 10000; ++i) {
    input += fmt::format("line {}\n", i);
  }
  Captured c = Run({"cat"}, {}, "", input);
  EXPECT_EQ(c.out, input);
  EXPECT_EQ(c.exit.exit_code, 0);
}

TEST_P(InitTest, StdinRelaysOfEndedCommandsAreJoined) {
  // Stream transport: a thread relays each command's stdin; a long-lived sandbox must not keep
  // one for every command it ever fed.
  for (int i = 0; i < 64; ++i) {
    Captured c = Run({"cat"}, {}, "", fmt::format("input {}\n", i));
    ASSERT_EQ(c.out, fmt::format("input {}\n", i));
  }
  if (GetParam()) {
    EXPECT_LE(client_->stdin_pumps(), 2u);
  } else {
    EXPECT_EQ(client_->stdin_pumps(), 0u);  // seqpacket: the command gets the fd itself
  }
}

TEST_P(InitTest, MinusOneMeansDevNull) {
  auto out = MakePipe();
  ASSERT_TRUE(out.ok());
  // stdin is /dev/null, so cat sees EOF at once; stderr is /dev/null as well.
  auto h = SpawnOk({"sh", "-c", "cat; echo done; echo hidden >&2"}, out->write.get());
  ASSERT_NE(h, nullptr);
  out->write.Reset();
  std::string text;
  EXPECT_TRUE(ReadToEof(out->read.get(), &text));
  EXPECT_EQ(text, "done\n");
  auto exit = h->Wait(milliseconds(10000));
  ASSERT_TRUE(exit.ok());
  EXPECT_EQ(exit->exit_code, 0);
}

TEST_P(InitTest, EnvIsExactlyWhatWasGiven) {
  // No PATH in env: the default PATH finds `env`.
  Captured c = Run({"env"}, {"A=1", "B=two words"});
  EXPECT_EQ(c.out, "A=1\nB=two words\n");
  EXPECT_EQ(c.exit.exit_code, 0);
}

TEST_P(InitTest, CwdIsHonoured) {
  Captured c = Run({"sh", "-c", "pwd; echo $FOO"}, {"FOO=bar"}, dir_.path());
  EXPECT_EQ(c.out, dir_.path() + "\nbar\n");
  EXPECT_EQ(Run({"pwd"}).out, "/\n");  // "" means "/"
}

TEST_P(InitTest, LooksUpArgv0InThePathFromEnv) {
  ASSERT_TRUE(MakeDirs(dir_.path() + "/bin").ok());
  ASSERT_TRUE(MakeDirs(dir_.path() + "/noexec").ok());
  WriteScript("bin/mytool", "#!/bin/sh\necho mytool \"$@\"\n", 0755);
  WriteScript("noexec/mytool", "#!/bin/sh\necho wrong\n", 0644);
  // A non-executable match is skipped in favour of a later executable one.
  Captured c = Run({"mytool", "x"}, {"PATH=" + dir_.path() + "/noexec:" + dir_.path() + "/bin"});
  EXPECT_EQ(c.out, "mytool x\n");
  EXPECT_EQ(c.exit.exit_code, 0);
  EXPECT_EQ(c.exit.spawn_errno, 0);

  // Only a non-executable match: EACCES, like execvp.
  Captured denied = Run({"mytool"}, {"PATH=" + dir_.path() + "/noexec"});
  EXPECT_EQ(denied.exit.spawn_errno, EACCES);
  EXPECT_EQ(denied.exit.exit_code, 127);

  // Not on this PATH at all.
  Captured missing = Run({"mytool"}, {"PATH=/usr/bin:/bin"});
  EXPECT_EQ(missing.exit.spawn_errno, ENOENT);

  // A script without #! runs under /bin/sh, as with execvp.
  WriteScript("bin/plain", "echo plain script\n", 0755);
  EXPECT_EQ(Run({"plain"}, {"PATH=" + dir_.path() + "/bin"}).out, "plain script\n");
}

TEST_P(InitTest, MissingProgramYieldsEnoentAnd127) {
  for (const std::string program : {"/nonexistent/program", "no-such-program-pbox"}) {
    SpawnRequest req;
    req.argv = {program, "arg"};
    auto handle = client_->Spawn(req);
    ASSERT_TRUE(handle.ok()) << handle.status();
    auto exit = (*handle)->Wait(milliseconds(10000));
    ASSERT_TRUE(exit.ok()) << exit.status();
    EXPECT_EQ(exit->spawn_errno, ENOENT);
    EXPECT_EQ(exit->exit_code, 127);
    EXPECT_EQ(exit->signal, 0);
    EXPECT_NE(exit->error.find("execvp(" + program + ")"), std::string::npos) << exit->error;
    EXPECT_NE(exit->error.find("No such file"), std::string::npos) << exit->error;
    EXPECT_TRUE((*handle)->done());
  }
  // Directories are not programs.
  SpawnRequest req;
  req.argv = {"/tmp"};
  auto handle = client_->Spawn(req);
  ASSERT_TRUE(handle.ok());
  EXPECT_EQ((*handle)->Wait()->spawn_errno, EACCES);
}

TEST_P(InitTest, BadCwdIsReportedLikeAnExecFailure) {
  Captured c = Run({"true"}, {}, "/nonexistent-cwd");
  EXPECT_EQ(c.exit.spawn_errno, ENOENT);
  EXPECT_EQ(c.exit.exit_code, 127);
  EXPECT_NE(c.exit.error.find("chdir(/nonexistent-cwd)"), std::string::npos) << c.exit.error;
  std::string file = WriteScript("file", "x", 0644);
  EXPECT_EQ(Run({"true"}, {}, file).exit.spawn_errno, ENOTDIR);
}

TEST_P(InitTest, DeathBySignalIsReported) {
  Captured c = Run({"sh", "-c", "kill -TERM $$"});
  EXPECT_EQ(c.exit.signal, SIGTERM);
  EXPECT_EQ(c.exit.exit_code, -1);
  EXPECT_EQ(Run({"sh", "-c", "kill -KILL $$"}).exit.signal, SIGKILL);
}

TEST_P(InitTest, SignalsAreNotInheritedBlockedOrIgnored) {
  // init ignores SIGPIPE and blocks SIGCHLD; the command must see defaults.
  Captured c = Run({"sh", "-c", "grep -E '^(SigBlk|SigIgn)' /proc/self/status"});
  EXPECT_NE(c.out.find("SigBlk:\t0000000000000000"), std::string::npos) << c.out;
  EXPECT_NE(c.out.find("SigIgn:\t0000000000000000"), std::string::npos) << c.out;
}

TEST_P(InitTest, CommandLeadsItsOwnSessionWithNoStrayFds) {
  Captured c = Run({"sh", "-c", "ls /proc/self/fd"});
  // 0, 1, 2 and the fd ls opens for the directory; nothing of init's.
  EXPECT_EQ(c.out, "0\n1\n2\n3\n") << c.out;
  auto out = MakePipe();
  ASSERT_TRUE(out.ok());
  auto h = SpawnOk({"sh", "-c", "echo $$; exec sleep 100"}, out->write.get());
  ASSERT_NE(h, nullptr);
  out->write.Reset();
  EXPECT_EQ(std::stoi(ReadLine(out->read.get())), h->pid());
  EXPECT_EQ(StatField(h->pid(), 5), h->pid());  // pgrp
  EXPECT_EQ(StatField(h->pid(), 6), h->pid());  // session
  ASSERT_TRUE(client_->Kill(h->id(), SIGKILL, false).ok());
  EXPECT_EQ(h->Wait(milliseconds(10000))->signal, SIGKILL);
}

TEST_P(InitTest, KillSignalsTheProcessGroup) {
  auto out = MakePipe();
  ASSERT_TRUE(out.ok());
  auto h = SpawnOk({"sh", "-c", "sleep 100 & echo $!; wait"}, out->write.get());
  ASSERT_NE(h, nullptr);
  out->write.Reset();
  pid_t background = std::stoi(ReadLine(out->read.get()));
  EXPECT_FALSE(h->Wait(milliseconds(100)).ok());  // still running
  ASSERT_TRUE(client_->Kill(h->id(), SIGTERM, false).ok());
  auto exit = h->Wait(milliseconds(10000));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(exit->signal, SIGTERM);
  EXPECT_TRUE(WaitGone(background, milliseconds(5000)));
  // The process is gone: killing it again is NotFound, not an error on the wire.
  EXPECT_EQ(client_->Kill(h->id(), SIGTERM, false).code(), absl::StatusCode::kNotFound);
}

TEST_P(InitTest, KillWholeTreeReachesAProcessThatLeftTheGroup) {
  const std::string script = R"(perl -e '$|=1; setpgrp(0,0); print "$$\n"; sleep 100' & wait)";
  auto out_a = MakePipe();
  auto out_b = MakePipe();
  ASSERT_TRUE(out_a.ok() && out_b.ok());
  auto a = SpawnOk({"sh", "-c", script}, out_a->write.get());
  auto b = SpawnOk({"sh", "-c", script}, out_b->write.get());
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  out_a->write.Reset();
  out_b->write.Reset();
  pid_t perl_a = std::stoi(ReadLine(out_a->read.get()));
  pid_t perl_b = std::stoi(ReadLine(out_b->read.get()));
  ASSERT_EQ(StatField(perl_b, 5), perl_b);    // its own process group
  ASSERT_EQ(StatField(perl_b, 6), b->pid());  // still in the command's session

  // Group kill only: the shell dies, the perl in its own group survives.
  ASSERT_TRUE(client_->Kill(a->id(), SIGKILL, false).ok());
  EXPECT_EQ(a->Wait(milliseconds(10000))->signal, SIGKILL);
  std::this_thread::sleep_for(milliseconds(200));
  EXPECT_FALSE(ProcessGone(perl_a));

  // Whole tree: both go.
  ASSERT_TRUE(client_->Kill(b->id(), SIGKILL, true).ok());
  EXPECT_EQ(b->Wait(milliseconds(10000))->signal, SIGKILL);
  EXPECT_TRUE(WaitGone(perl_b, milliseconds(5000)));

  // Closing the channel takes the survivor with it.
  client_.reset();
  EXPECT_TRUE(WaitGone(perl_a, milliseconds(5000)));
}

TEST_P(InitTest, KillWholeTreeReachesDetachedProcesses) {
  // Three ways out of the command's session: a setsid child whose parent lives, a setsid
  // grandchild orphaned by its parent's exit, and a double fork that leaves a daemon behind.
  const std::string script =
      "setsid sleep 1000 & echo $!; "
      "setsid sh -c 'sleep 1000 & echo $!'; "
      "(setsid sh -c 'sleep 1000 & echo $!' &); "
      "sleep 1000";
  auto out = MakePipe();
  auto other_out = MakePipe();
  ASSERT_TRUE(out.ok() && other_out.ok());
  auto root = SpawnOk({"sh", "-c", script}, out->write.get());
  auto other = SpawnOk({"sleep", "1000"}, other_out->write.get());
  ASSERT_NE(root, nullptr);
  ASSERT_NE(other, nullptr);
  out->write.Reset();
  std::vector<pid_t> detached;
  for (int i = 0; i < 3; ++i) {
    detached.push_back(std::stoi(ReadLine(out->read.get())));
  }
  for (pid_t pid : detached) {
    // None is in the command's session or group: a session or group kill misses them all.
    // `$!` is printed as soon as the shell forked, before the child has exec'd setsid and left
    // the session: wait for it to leave (a liveness bound), then check.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (StatField(pid, 5) == root->pid() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(milliseconds(5));
    }
    ASSERT_NE(StatField(pid, 6), root->pid()) << pid;
    ASSERT_NE(StatField(pid, 5), root->pid()) << pid;
  }

  ASSERT_TRUE(client_->Kill(root->id(), SIGKILL, true).ok());
  EXPECT_EQ(root->Wait(milliseconds(10000))->signal, SIGKILL);
  for (pid_t pid : detached) {
    EXPECT_TRUE(WaitGone(pid, milliseconds(5000))) << pid;
  }
  // EOF: nothing that held the command's stdout is left.
  std::string rest;
  EXPECT_TRUE(ReadToEof(out->read.get(), &rest, milliseconds(5000)));
  // Another command is untouched.
  EXPECT_FALSE(other->done());
  EXPECT_FALSE(ProcessGone(other->pid()));
  ASSERT_TRUE(client_->Kill(other->id(), SIGKILL, true).ok());
  EXPECT_EQ(other->Wait(milliseconds(10000))->signal, SIGKILL);
}

TEST_P(InitTest, ReportsRusage) {
  Captured busy = Run({"perl", "-e", "my $x = 0; $x += $_ for 1..5000000; print $x > 0"});
  EXPECT_EQ(busy.out, "1");
  EXPECT_GT(busy.exit.user_us, 0);
  EXPECT_GT(busy.exit.user_us + busy.exit.system_us, 10000);  // well over 10 ms of CPU

  // A 60 MiB string is written byte by byte, so every page is touched.
  Captured big = Run({"perl", "-e", "my $s = 'a' x (60 * 1024 * 1024); print length($s)"});
  EXPECT_EQ(big.out, std::to_string(60 * 1024 * 1024));
  EXPECT_GE(big.exit.max_rss_kb, 50 * 1024);
  EXPECT_LT(Run({"true"}).exit.max_rss_kb, 50 * 1024);
}

TEST_P(InitTest, ManyConcurrentSpawnsAllComplete) {
  constexpr int kThreads = 8;
  constexpr int kPerThread = 25;
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::pair<int, std::shared_ptr<ProcessHandle>>> handles;
      for (int i = 0; i < kPerThread; ++i) {
        int code = (t * kPerThread + i) % 200;
        SpawnRequest req;
        req.argv = {"sh", "-c", fmt::format("exit {}", code)};
        auto h = client_->Spawn(req);
        if (h.ok()) {
          handles.emplace_back(code, *h);
        } else {
          ADD_FAILURE() << h.status();
        }
      }
      for (auto& [code, h] : handles) {
        auto exit = h->Wait(milliseconds(60000));
        if (exit.ok() && exit->exit_code == code) {
          ok.fetch_add(1);
        } else {
          ADD_FAILURE() << "process " << h->id() << ": "
                        << (exit.ok() ? std::to_string(exit->exit_code) : exit.status().ToString());
        }
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  EXPECT_EQ(ok.load(), kThreads * kPerThread);
}

TEST_P(InitTest, DoneFdBecomesReadableAndWaitTimesOut) {
  auto h = SpawnOk({"sleep", "0.3"});
  ASSERT_NE(h, nullptr);
  EXPECT_GT(h->pid(), 0);
  EXPECT_FALSE(h->done());
  auto early = h->Wait(milliseconds(10));
  EXPECT_EQ(early.status().code(), absl::StatusCode::kDeadlineExceeded);
  pollfd p = {h->done_fd(), POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 0), 0);
  EXPECT_EQ(::poll(&p, 1, 10000), 1);
  EXPECT_TRUE(h->done());
  EXPECT_EQ(h->Wait()->exit_code, 0);
  EXPECT_EQ(h->Wait()->exit_code, 0);  // repeatable
}

TEST_P(InitTest, OrphansAreReaped) {
  // Five grandchildren are orphaned at once; init (a subreaper here) must reap them.
  Captured c = Run({"sh", "-c", "for i in 1 2 3 4 5; do (sleep 0.2 &); done; exit 0"});
  EXPECT_EQ(c.exit.exit_code, 0);
  auto zombies_or_children = [&] {
    int n = 0;
    for (const auto& dir : std::filesystem::directory_iterator("/proc")) {
      std::string name = dir.path().filename();
      if (name.find_first_not_of("0123456789") != std::string::npos) {
        continue;
      }
      pid_t pid = std::stoi(name);
      if (StatField(pid, 4) == init_.pid()) {
        ++n;
      }
    }
    return n;
  };
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (zombies_or_children() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_EQ(zombies_or_children(), 0);
}

TEST_P(InitTest, ClosingTheChannelKillsEverything) {
  auto out = MakePipe();
  ASSERT_TRUE(out.ok());
  // `setsid` escapes the session; the subreaper shutdown must still find it.
  auto h = SpawnOk({"sh", "-c", "setsid sleep 1000 & echo $$; sleep 1000"}, out->write.get());
  ASSERT_NE(h, nullptr);
  out->write.Reset();
  EXPECT_EQ(std::stoi(ReadLine(out->read.get())), h->pid());
  auto start = std::chrono::steady_clock::now();
  client_.reset();
  // EOF on the pipe means every holder of its write end (sh and both sleeps) is dead.
  std::string rest;
  // Liveness bounds only (a loaded 2-core machine can take a while to run the reaper).
  EXPECT_TRUE(ReadToEof(out->read.get(), &rest, milliseconds(10000)));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_TRUE(WaitGone(h->pid(), milliseconds(10000)));
  auto exit = h->Wait(milliseconds(1000));
  EXPECT_EQ(exit.status().code(), absl::StatusCode::kUnavailable);
}

TEST_P(InitTest, RefusesBadRequestsWithoutSending) {
  SpawnRequest big;
  big.argv = {"echo", std::string(InitClient::kMaxSpawnBytes, 'x')};
  auto r = client_->Spawn(big);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("allowed"), std::string::npos);

  SpawnRequest big_env;
  big_env.argv = {"true"};
  big_env.env.assign(20000, std::string(20, 'e'));
  EXPECT_EQ(client_->Spawn(big_env).status().code(), absl::StatusCode::kInvalidArgument);

  EXPECT_EQ(client_->Spawn(SpawnRequest{}).status().code(), absl::StatusCode::kInvalidArgument);
  SpawnRequest nul;
  nul.argv = {std::string("a\0b", 3)};
  EXPECT_EQ(client_->Spawn(nul).status().code(), absl::StatusCode::kInvalidArgument);

  EXPECT_EQ(client_->Kill(12345, SIGKILL, true).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Kill(1, 99, true).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->Kill(1, -1, true).code(), absl::StatusCode::kInvalidArgument);

  // The channel is still fine, and a near-limit argv goes through.
  EXPECT_TRUE(client_->alive());
  SpawnRequest near;
  // (Linux refuses a single string over 128 KiB, so split it.)
  near.argv = {"sh",
               "-c",
               "echo ${#1} ${#2}",
               "sh",
               std::string(100 * 1024, 'y'),
               std::string(100 * 1024, 'z')};
  auto out = MakePipe();
  ASSERT_TRUE(out.ok());
  near.stdout_fd = out->write.get();
  auto h = client_->Spawn(near);
  ASSERT_TRUE(h.ok()) << h.status();
  out->write.Reset();
  std::string text;
  EXPECT_TRUE(ReadToEof(out->read.get(), &text));
  EXPECT_EQ(text, "102400 102400\n");
  EXPECT_EQ((*h)->Wait()->exit_code, 0);
}

TEST_P(InitTest, InitDeathFailsEverythingPending) {
  expect_clean_init_exit_ = false;
  auto h = SpawnOk({"sleep", "1000"});
  ASSERT_NE(h, nullptr);
  ASSERT_TRUE(init_.Signal(SIGKILL).ok());
  auto exit = h->Wait(milliseconds(10000));
  EXPECT_EQ(exit.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(exit.status().message().find("sandbox init exited"), std::string::npos);
  pollfd p = {h->done_fd(), POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 0), 1);
  EXPECT_FALSE(client_->alive());
  SpawnRequest req;
  req.argv = {"true"};
  EXPECT_EQ(client_->Spawn(req).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client_->Kill(h->id(), SIGKILL, false).code(), absl::StatusCode::kUnavailable);
  // The orphaned sleep is not init's business any more; clean it up.
  ::kill(h->pid(), SIGKILL);
}

TEST_P(InitTest, LargeBinaryStdinAndOutputRoundTrip) {
  // 1 MiB of every byte value (NULs included) through cat, and a second copy to stderr: both
  // must arrive whole, in order, before the exit is known.
  std::string input;
  for (size_t i = 0; i < (1u << 20); ++i) {
    input.push_back(static_cast<char>((i * 131 + i / 251) & 0xff));
  }
  auto in = MakePipe();
  auto out = MakePipe();
  auto err = MakePipe();
  ASSERT_TRUE(in.ok() && out.ok() && err.ok());
  SpawnRequest req;
  req.argv = {"sh", "-c", "tee /dev/stderr"};
  req.stdin_fd = in->read.get();
  req.stdout_fd = out->write.get();
  req.stderr_fd = err->write.get();
  auto h = client_->Spawn(req);
  ASSERT_TRUE(h.ok()) << h.status();
  in->read.Reset();
  out->write.Reset();
  err->write.Reset();
  std::thread writer([&] {
    EXPECT_TRUE(WriteAll(in->write.get(), input).ok());
    in->write.Reset();
  });
  std::string got_err;
  std::thread err_reader([&] { EXPECT_TRUE(ReadToEof(err->read.get(), &got_err)); });
  std::string got_out;
  EXPECT_TRUE(ReadToEof(out->read.get(), &got_out, milliseconds(30000)));
  writer.join();
  err_reader.join();
  EXPECT_EQ(got_out.size(), input.size());
  EXPECT_TRUE(got_out == input);
  EXPECT_TRUE(got_err == input);
  EXPECT_EQ((*h)->Wait(milliseconds(30000))->exit_code, 0);
}

TEST_P(InitTest, OutputWrittenJustBeforeExitIsNotLost) {
  for (int i = 0; i < 20; ++i) {
    Captured c = Run({"sh", "-c", "head -c 200000 /dev/zero; echo end >&2; exit 7"});
    EXPECT_EQ(c.exit.exit_code, 7);
    EXPECT_EQ(c.out.size(), 200000u);
    EXPECT_EQ(c.err, "end\n");
  }
}

TEST_P(InitTest, ACommandThatClosesStdinEarlyDoesNotStallOthers) {
  // `true` never reads its stdin; the data sent for it must be dropped, not block init.
  auto in = MakePipe();
  ASSERT_TRUE(in.ok());
  SpawnRequest req;
  req.argv = {"true"};
  req.stdin_fd = in->read.get();
  auto h = client_->Spawn(req);
  ASSERT_TRUE(h.ok()) << h.status();
  in->read.Reset();
  EXPECT_EQ((*h)->Wait(milliseconds(10000))->exit_code, 0);
  std::thread writer([&] {
    (void)WriteAll(in->write.get(), std::string(256 * 1024, 'x'));  // EPIPE is fine
    in->write.Reset();
  });
  EXPECT_EQ(Run({"echo", "still here"}).out, "still here\n");
  writer.join();
}

TEST_P(InitTest, StdinOfACommandThatDoesNotReadIsBounded) {
  // Stream transport: the agent relays stdin only as far as pbox-init's credit allows, so a
  // command that never reads holds up its writer (as a pipe would) instead of growing init.
  if (!GetParam()) {
    GTEST_SKIP() << "the seqpacket transport hands the command the caller's pipe itself";
  }
  auto in = MakePipe();
  ASSERT_TRUE(in.ok());
  SpawnRequest req;
  req.argv = {"sleep", "30"};
  req.stdin_fd = in->read.get();
  auto h = client_->Spawn(req);
  ASSERT_TRUE(h.ok()) << h.status();
  in->read.Reset();
  const long rss_before = RssKb(init_.pid());
  ASSERT_GT(rss_before, 0);
  ASSERT_EQ(::fcntl(in->write.get(), F_SETFL, O_NONBLOCK), 0);
  // Pipes on both sides (64 KiB each), the relay's chunk and the window: well under 4 MiB.
  const size_t taken = WriteFor(in->write.get(), 64u << 20, milliseconds(3000));
  EXPECT_LT(taken, 4u << 20);
  EXPECT_LT(RssKb(init_.pid()), rss_before + 16 * 1024);
  // Init still serves: another command runs, and a Kill reaches the stuck one.
  EXPECT_EQ(Run({"echo", "still here"}).out, "still here\n");
  ASSERT_TRUE(client_->Kill((*h)->id(), SIGKILL, false).ok());
  auto exit = (*h)->Wait(milliseconds(20000));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(exit->signal, SIGKILL);
  // Its exit stops the relay: the writer sees the pipe's reader go.
  const auto deadline = std::chrono::steady_clock::now() + milliseconds(20000);
  bool broken = false;
  while (!broken && std::chrono::steady_clock::now() < deadline) {
    broken = ::write(in->write.get(), "x", 1) < 0 && errno == EPIPE;
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_TRUE(broken);
}

TEST_P(InitTest, LargeStdinThroughTheWindowArrivesWhole) {
  // 32 MiB and a bit (not a multiple of any chunk or window) through cat: every credit must
  // come back for the stream to finish, and the bytes in order.
  std::string input(32u * 1024 * 1024 + 12345, '\0');
  for (size_t i = 0; i < input.size(); ++i) {
    input[i] = static_cast<char>((i * 2654435761u) >> 13);
  }
  auto in = MakePipe();
  auto out = MakePipe();
  ASSERT_TRUE(in.ok() && out.ok());
  SpawnRequest req;
  req.argv = {"cat"};
  req.stdin_fd = in->read.get();
  req.stdout_fd = out->write.get();
  auto h = client_->Spawn(req);
  ASSERT_TRUE(h.ok()) << h.status();
  in->read.Reset();
  out->write.Reset();
  std::thread writer([&] {
    EXPECT_TRUE(WriteAll(in->write.get(), input).ok());
    in->write.Reset();
  });
  std::string got;
  got.reserve(input.size());
  EXPECT_TRUE(ReadToEof(out->read.get(), &got, milliseconds(120000)));
  writer.join();
  EXPECT_EQ(got.size(), input.size());
  EXPECT_TRUE(got == input);
  auto exit = (*h)->Wait(milliseconds(30000));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(exit->exit_code, 0);
}

TEST_P(InitTest, OutputNobodyReadsDoesNotStallOtherCommands) {
  // The caller never reads the first command's stdout (yet): on the stream transport its
  // output must wait in its own window, not in the reader that serves the whole sandbox.
  constexpr size_t kBytes = 16u << 20;
  auto out = MakePipe();
  ASSERT_TRUE(out.ok());
  SpawnRequest req;
  req.argv = {"head", "-c", std::to_string(kBytes), "/dev/zero"};
  req.stdout_fd = out->write.get();
  auto stuck = client_->Spawn(req);
  ASSERT_TRUE(stuck.ok()) << stuck.status();
  out->write.Reset();
  // Another command's Spawned, output and Exited all arrive meanwhile (in a thread, so that
  // a stalled client fails the test instead of hanging it).
  auto other = std::async(std::launch::async, [this] { return Run({"echo", "still here"}); });
  const bool in_time = other.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  EXPECT_TRUE(in_time) << "a caller that does not read stalled the other command";
  // The stuck caller gets every byte once it reads, then EOF, then the exit.
  std::string got;
  got.reserve(kBytes);
  EXPECT_TRUE(ReadToEof(out->read.get(), &got, milliseconds(120000)));
  EXPECT_EQ(got.size(), kBytes);
  EXPECT_EQ(got.find_first_not_of('\0'), std::string::npos);
  if (in_time || other.wait_for(std::chrono::seconds(30)) == std::future_status::ready) {
    Captured c = other.get();
    EXPECT_EQ(c.out, "still here\n");
    EXPECT_EQ(c.exit.exit_code, 0);
  }
  auto exit = (*stuck)->Wait(milliseconds(30000));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(exit->exit_code, 0);
}

TEST_P(InitTest, ExitWaitsForTheOutputBeforeIt) {
  // 200 kB fits the stream's window but not the caller's pipe: the command exits at once on
  // the stream transport, yet its exit must not reach the caller before its output, as on
  // the native runtime (where the command itself blocks on the pipe).
  auto out = MakePipe();
  ASSERT_TRUE(out.ok());
  SpawnRequest req;
  req.argv = {"head", "-c", "200000", "/dev/zero"};
  req.stdout_fd = out->write.get();
  auto h = client_->Spawn(req);
  ASSERT_TRUE(h.ok()) << h.status();
  out->write.Reset();
  EXPECT_EQ((*h)->Wait(milliseconds(1000)).status().code(), absl::StatusCode::kDeadlineExceeded);
  std::string got;
  EXPECT_TRUE(ReadToEof(out->read.get(), &got));
  EXPECT_EQ(got.size(), 200000u);
  auto exit = (*h)->Wait(milliseconds(30000));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(exit->exit_code, 0);
}

INSTANTIATE_TEST_SUITE_P(Transports, InitTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Stream" : "SeqPacket";
                         });

// Talks to pbox-init directly with hand-made frames.
class RawInitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto init = StartInit();
    ASSERT_TRUE(init.ok()) << init.status();
    init_ = std::move(init->process);
    channel_ = std::move(init->channel);
    int size = 4 * proto::kMaxFrameBytes;
    ::setsockopt(channel_.get(), SOL_SOCKET, SO_SNDBUF, &size, sizeof(size));
    timeval tv = {10, 0};
    ::setsockopt(channel_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }

  void SendRaw(const std::string& bytes, std::vector<int> fds = {}) {
    iovec iov = {const_cast<char*>(bytes.data()), bytes.size()};
    msghdr msg = {};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
    if (!fds.empty()) {
      msg.msg_control = control.data();
      msg.msg_controllen = control.size();
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    ASSERT_EQ(::sendmsg(channel_.get(), &msg, MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()))
        << strerror(errno);
  }

  std::optional<proto::Frame> Receive() {
    std::string buf(proto::kMaxFrameBytes, '\0');
    ssize_t n = ::recv(channel_.get(), buf.data(), buf.size(), 0);
    if (n <= 0) {
      return std::nullopt;
    }
    auto r = proto::DecodeFrame(std::string_view(buf.data(), n), 0);
    EXPECT_TRUE(r.frame.has_value()) << r.error;
    return r.frame;
  }

  std::string Encode(const proto::Frame& f) {
    std::string out;
    std::string error;
    EXPECT_TRUE(proto::EncodeFrame(f, &out, &error)) << error;
    return out;
  }

  ChildProcess init_;
  UniqueFd channel_;
};

TEST_F(RawInitTest, SurvivesHostileFrames) {
  auto null_fd = OpenFile("/dev/null", O_RDWR);
  ASSERT_TRUE(null_fd.ok());
  int fd = null_fd->get();

  SendRaw("garbage that is not a frame");
  SendRaw(std::string(proto::kMaxFrameBytes + 100, 'P'));  // oversized: dropped
  // A Spawn with the wrong number of fds has a readable id: answered with Error.
  SendRaw(Encode(proto::SpawnFrame{41, 0, "/", {"true"}, {}}), {fd});
  auto reply = Receive();
  ASSERT_TRUE(reply.has_value());
  ASSERT_TRUE(std::holds_alternative<proto::ErrorFrame>(*reply));
  EXPECT_EQ(std::get<proto::ErrorFrame>(*reply).id, 41u);
  // Too many fds for any frame.
  SendRaw(Encode(proto::SpawnFrame{42, 0, "/", {"true"}, {}}), {fd, fd, fd, fd, fd});
  // An init->agent frame sent to init.
  SendRaw(Encode(proto::SpawnedFrame{43, 1}));
  reply = Receive();
  ASSERT_TRUE(reply.has_value());
  ASSERT_TRUE(std::holds_alternative<proto::ErrorFrame>(*reply));
  EXPECT_EQ(std::get<proto::ErrorFrame>(*reply).id, 43u);
  // Kill of an unknown id is ignored.
  SendRaw(Encode(proto::KillFrame{999, SIGKILL, true}));

  // Still serving: a valid spawn gets Spawned, then Exited.
  SendRaw(Encode(proto::SpawnFrame{44, proto::kAllNullFlags, "/", {"sh", "-c", "exit 7"}, {}}));
  reply = Receive();
  ASSERT_TRUE(reply.has_value());
  ASSERT_TRUE(std::holds_alternative<proto::SpawnedFrame>(*reply));
  reply = Receive();
  ASSERT_TRUE(reply.has_value());
  ASSERT_TRUE(std::holds_alternative<proto::ExitedFrame>(*reply));
  EXPECT_EQ(std::get<proto::ExitedFrame>(*reply).id, 44u);
  EXPECT_EQ(std::get<proto::ExitedFrame>(*reply).exit_code, 7);

  // A duplicate id of a running process is refused.
  SendRaw(Encode(proto::SpawnFrame{45, proto::kAllNullFlags, "/", {"sleep", "100"}, {}}));
  reply = Receive();
  ASSERT_TRUE(reply.has_value() && std::holds_alternative<proto::SpawnedFrame>(*reply));
  SendRaw(Encode(proto::SpawnFrame{45, proto::kAllNullFlags, "/", {"true"}, {}}));
  reply = Receive();
  ASSERT_TRUE(reply.has_value() && std::holds_alternative<proto::ErrorFrame>(*reply));

  EXPECT_TRUE(init_.running());
  channel_.Reset();
  auto exit = init_.Wait(milliseconds(10000));
  ASSERT_TRUE(exit.ok());
  EXPECT_EQ(exit->exit_code, 0);
}

TEST(InitFlagsTest, BadFlagsAndChannelsAreRefused) {
  for (auto args : std::vector<std::vector<std::string>>{
           {"--channel-fd=abc"}, {"--bogus"}, {"--channel-fd="}, {"--channel-fd=0"}}) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      std::vector<char*> argv = {const_cast<char*>("pbox-init")};
      for (auto& a : args) {
        argv.push_back(a.data());
      }
      argv.push_back(nullptr);
      int devnull = ::open("/dev/null", O_RDWR);
      ::dup2(devnull, 2);
      ::execv(kInitPath, argv.data());
      _exit(99);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    // fd 0 is not a SOCK_SEQPACKET socket; the others are bad flags.
    EXPECT_NE(WEXITSTATUS(status), 0) << args[0];
    EXPECT_NE(WEXITSTATUS(status), 99);
  }
}

TEST(InitPid1Test, ClosingTheChannelKillsThePidNamespace) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "needs root (CAP_SYS_ADMIN) to unshare a pid namespace";
  }
  auto init = StartInit(/*new_pid_ns=*/true);
  ASSERT_TRUE(init.ok()) << init.status();
  auto client = InitClient::Create(std::move(init->channel));
  ASSERT_TRUE(client.ok()) << client.status();
  auto out = MakePipe();
  ASSERT_TRUE(out.ok());
  SpawnRequest req;
  req.argv = {"sh", "-c", "setsid sleep 1000 & sleep 1000 & echo $$; wait"};
  req.stdout_fd = out->write.get();
  auto h = (*client)->Spawn(req);
  if (!h.ok() && h.status().code() == absl::StatusCode::kUnavailable) {
    GTEST_SKIP() << "cannot create a pid namespace here";
  }
  ASSERT_TRUE(h.ok()) << h.status();
  out->write.Reset();
  // Inside the namespace init is PID 1, so the first command gets a small pid.
  EXPECT_EQ(std::stoi(ReadLine(out->read.get())), (*h)->pid());
  EXPECT_LT((*h)->pid(), 10);
  client->reset();
  std::string rest;
  EXPECT_TRUE(ReadToEof(out->read.get(), &rest, milliseconds(2000)));
  auto exit = init->process.Wait(milliseconds(5000));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(exit->exit_code, 0);
}

// pbox-init --isolate (what the gVisor runtime starts), run natively as root: commands live in
// a PID namespace of their own behind a holder, without capabilities, under the given seccomp
// program; pbox-init still finds their trees (through its own /proc) and ends when the holder
// dies.
class IsolatedInitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) {
      GTEST_SKIP() << "needs root (CAP_SYS_ADMIN) to unshare a pid namespace";
    }
    ::signal(SIGPIPE, SIG_IGN);
    auto dir = TempDir::Create("/tmp", "pbox-init-isolated-");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = std::move(*dir);
    // pbox-init inherits the test's environment: this entry must not be readable through the
    // holder's /proc/1/environ.
    ::setenv(kSecretName, kSecretValue, 1);
    auto init = StartStreamInit("--isolate");
    ::unsetenv(kSecretName);
    ASSERT_TRUE(init.ok()) << init.status();
    // Allow-all, as the agent sends its program: ahead of the frames, on the same pipe. The
    // test is about the mechanism; the agent's real program is the native one.
    struct sock_filter allow = BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    ASSERT_TRUE(
        WriteAll(init->second.get(), proto::ProgramPreamble(std::string_view(
                                         reinterpret_cast<const char*>(&allow), sizeof(allow))))
            .ok());
    init_ = std::move(init->first.process);
    auto client = InitClient::CreateStream(std::move(init->second), std::move(init->first.channel));
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    ASSERT_TRUE(client_->WaitReady(milliseconds(10000)).ok());
  }

  std::string RunSh(const std::string& script) {
    auto out = MakePipe();
    EXPECT_TRUE(out.ok());
    SpawnRequest req;
    req.argv = {"sh", "-c", script};
    req.stdout_fd = out->write.get();
    auto h = client_->Spawn(req);
    EXPECT_TRUE(h.ok()) << h.status();
    out->write.Reset();
    std::string text;
    EXPECT_TRUE(ReadToEof(out->read.get(), &text));
    if (h.ok()) {
      EXPECT_TRUE((*h)->Wait(milliseconds(30000)).ok());
    }
    return text;
  }

  // The holder: the child of pbox-init that is PID 1 of a namespace of its own (the last
  // field of its NSpid line is 1).
  pid_t Holder() {
    for (const auto& dir : std::filesystem::directory_iterator("/proc")) {
      std::string name = dir.path().filename();
      if (name.find_first_not_of("0123456789") != std::string::npos) {
        continue;
      }
      pid_t pid = std::stoi(name);
      auto status = ReadFileToString(fmt::format("/proc/{}/status", pid));
      if (!status.ok() || StatField(pid, 4) != init_.pid()) {
        continue;
      }
      size_t at = status->find("\nNSpid:");
      size_t end = status->find('\n', at + 1);
      if (at != std::string::npos && end != std::string::npos &&
          status->compare(end - 2, 2, "\t1") == 0) {
        return pid;
      }
    }
    return -1;
  }

  static constexpr char kSecretName[] = "PBOX_INIT_TEST_SECRET";
  static constexpr char kSecretValue[] = "hunter2-not-for-commands";
  TempDir dir_;
  ChildProcess init_;
  std::unique_ptr<InitClient> client_;
};

TEST_F(IsolatedInitTest, CommandsSeeOnlyTheirNamespaceWithoutCapabilities) {
  std::string out = RunSh(
      "echo $$; ls /proc | grep -c '^[0-9]'; tr -d '\\000' < /proc/1/environ | wc -c; "
      "test -e /proc/" +
      std::to_string(init_.pid()) +
      " && echo init-visible; grep -E '^(CapEff|CapBnd|Seccomp):' /proc/self/status");
  std::istringstream lines(out);
  std::string line;
  std::getline(lines, line);
  EXPECT_LT(std::stoi(line), 10) << out;  // a small pid: the holder is 1
  std::getline(lines, line);
  EXPECT_LE(std::stoi(line), 5) << out;  // the holder, sh and its pipeline only
  std::getline(lines, line);
  EXPECT_EQ(std::stoi(line), 0) << out;  // the holder's environment holds only NUL bytes
  EXPECT_EQ(out.find("init-visible"), std::string::npos) << out;
  EXPECT_NE(out.find("CapEff:\t0000000000000000"), std::string::npos) << out;
  EXPECT_NE(out.find("CapBnd:\t0000000000000000"), std::string::npos) << out;
  EXPECT_NE(out.find("Seccomp:\t2"), std::string::npos) << out;
  pid_t holder = Holder();
  ASSERT_GT(holder, 0);
  // From the host: the holder's environment (the memory it shares with pbox-init) is there
  // but wiped, it holds no fd, and it has no capability.
  auto env = ReadFileToString(fmt::format("/proc/{}/environ", holder));
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_FALSE(env->empty());
  EXPECT_EQ(env->find_first_not_of('\0'), std::string::npos);
  EXPECT_EQ(env->find(kSecretValue), std::string::npos);
  size_t fds = 0;
  for ([[maybe_unused]] const auto& fd :
       std::filesystem::directory_iterator(fmt::format("/proc/{}/fd", holder))) {
    ++fds;
  }
  EXPECT_EQ(fds, 0u);
  auto status = ReadFileToString(fmt::format("/proc/{}/status", holder));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_NE(status->find("CapEff:\t0000000000000000"), std::string::npos) << *status;
  EXPECT_NE(status->find("CapPrm:\t0000000000000000"), std::string::npos) << *status;
  // Every catchable signal blocked: SigBlk shows all but SIGKILL and SIGSTOP, and SIGCHLD
  // while the holder waits for it (sigtimedwait unblocks what it waits for).
  size_t blk = status->find("\nSigBlk:\t");
  ASSERT_NE(blk, std::string::npos) << *status;
  const uint64_t mask = std::stoull(status->substr(blk + 9, 16), nullptr, 16);
  auto bit = [](int sig) { return uint64_t{1} << (sig - 1); };
  EXPECT_EQ(mask | bit(SIGKILL) | bit(SIGSTOP) | bit(SIGCHLD), ~uint64_t{0}) << *status;
  EXPECT_NE(mask & bit(SIGTERM), 0u);
}

TEST_F(IsolatedInitTest, KillWholeTreeStillFindsTheTree) {
  // pbox-init's pids are not the namespace's: only its own /proc lets it see the tree.
  auto out = MakePipe();
  ASSERT_TRUE(out.ok());
  SpawnRequest req;
  req.argv = {"sh", "-c", "sleep 1000 & sleep 1000 & echo up; wait"};
  req.stdout_fd = out->write.get();
  auto h = client_->Spawn(req);
  ASSERT_TRUE(h.ok()) << h.status();
  out->write.Reset();
  EXPECT_EQ(ReadLine(out->read.get()), "up");
  ASSERT_TRUE(client_->Kill((*h)->id(), SIGKILL, /*whole_tree=*/true).ok());
  auto exit = (*h)->Wait(milliseconds(10000));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(exit->signal, SIGKILL);
  // EOF: both sleeps (holding the pipe's write end) are dead too.
  std::string rest;
  EXPECT_TRUE(ReadToEof(out->read.get(), &rest, milliseconds(5000)));
}

TEST_F(IsolatedInitTest, TheHolderGoesWithInit) {
  // Natively no PID namespace of pbox-init's own takes the holder with it: the holder must not
  // outlive pbox-init (SIGKILLed, the way the agent ends a sandbox's processes).
  pid_t holder = Holder();
  ASSERT_GT(holder, 0);
  ASSERT_EQ(::kill(init_.pid(), SIGKILL), 0);
  auto exit = init_.Wait(milliseconds(10000));
  ASSERT_TRUE(exit.ok()) << exit.status();
  bool gone = false;
  for (int i = 0; i < 200 && !gone; ++i) {
    auto status = ReadFileToString(fmt::format("/proc/{}/status", holder));
    gone = !status.ok() || status->find("\nState:\tZ") != std::string::npos;
    if (!gone) {
      std::this_thread::sleep_for(milliseconds(10));
    }
  }
  EXPECT_TRUE(gone) << "the holder " << holder << " outlived pbox-init";
}

TEST_F(IsolatedInitTest, HolderDeathEndsInit) {
  auto h = client_->Spawn(SpawnRequest{.argv = {"sleep", "1000"}});
  ASSERT_TRUE(h.ok()) << h.status();
  pid_t holder = Holder();
  ASSERT_GT(holder, 0);
  ASSERT_EQ(::kill(holder, SIGKILL), 0);
  auto exit = init_.Wait(milliseconds(10000));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(exit->exit_code, 1);
  // The namespace's end killed the command: reported as SIGKILL, or lost with pbox-init.
  auto sleep_exit = (*h)->Wait(milliseconds(5000));
  if (sleep_exit.ok()) {
    EXPECT_EQ(sleep_exit->signal, SIGKILL);
  } else {
    EXPECT_EQ(sleep_exit.status().code(), absl::StatusCode::kUnavailable) << sleep_exit.status();
  }
}

// --isolate takes no value, and pbox-init refuses to serve unless a well-formed program
// arrives first: an empty, odd-sized or oversized length, or a channel that ends before or
// inside the program, each end it with a non-zero status and nothing run.
TEST(IsolatedInitFlagsTest, IsolateNeedsTheStreamAndAProgram) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "needs root (CAP_SYS_ADMIN) to unshare a pid namespace";
  }
  ::signal(SIGPIPE, SIG_IGN);
  struct Case {
    const char* flag;
    std::string bytes;  // what the channel carries before it closes
  };
  const std::string program(16, '\0');
  std::vector<Case> cases = {
      {"--isolate=/dev/pbox-seccomp", proto::ProgramPreamble(program)},
      {"--isolate", ""},
      {"--isolate", std::string("\x08\x00", 2)},
      {"--isolate", proto::StreamPrefix(0)},
      {"--isolate", proto::StreamPrefix(12) + std::string(12, '\0')},
      {"--isolate", proto::StreamPrefix(proto::kMaxProgramBytes + 8)},
      {"--isolate", proto::StreamPrefix(64) + std::string(40, '\0')},
  };
  std::string error;
  size_t len = 0;
  EXPECT_TRUE(proto::ParseProgramPrefix(proto::StreamPrefix(8), &len, &error));
  EXPECT_EQ(len, 8u);
  EXPECT_FALSE(proto::ParseProgramPrefix(proto::StreamPrefix(12), &len, &error));
  EXPECT_NE(error.find("multiple of 8"), std::string::npos) << error;
  for (size_t i = 0; i < cases.size(); ++i) {
    auto init = StartStreamInit(cases[i].flag);
    ASSERT_TRUE(init.ok()) << init.status();
    (void)WriteAll(init->second.get(), cases[i].bytes);
    init->second.Reset();
    auto exit = init->first.process.Wait(milliseconds(10000));
    ASSERT_TRUE(exit.ok()) << exit.status();
    EXPECT_NE(exit->exit_code, 0) << "case " << i;
    // No Ready frame: it never served.
    std::string out;
    EXPECT_TRUE(ReadToEof(init->first.channel.get(), &out, milliseconds(2000)));
    EXPECT_TRUE(out.empty()) << "case " << i;
  }
}

// The stream transport against hostile bytes: a bad frame inside a well-formed prefix is
// answered with an Error frame and the stream goes on; a prefix that loses the frame boundary
// ends pbox-init (exit 1), killing what it ran.
TEST(StreamInitTest, SurvivesBadFramesAndStopsOnABrokenStream) {
  ::signal(SIGPIPE, SIG_IGN);
  auto init = StartStreamInit();
  ASSERT_TRUE(init.ok()) << init.status();
  ChildProcess process = std::move(init->first.process);
  UniqueFd from_init = std::move(init->first.channel);
  UniqueFd to_init = std::move(init->second);
  auto read_frame = [&] { return ReadStreamFrame(from_init.get()); };
  auto ready = read_frame();
  ASSERT_TRUE(ready.has_value());
  EXPECT_TRUE(std::holds_alternative<proto::ReadyFrame>(*ready));

  // A header with id 42 and garbage behind it, correctly framed: Error for id 42.
  std::string bad;
  std::string error;
  ASSERT_TRUE(proto::EncodeFrame(proto::KillFrame{42, 9, false}, &bad, &error));
  bad += "trailing";
  ASSERT_TRUE(WriteAll(to_init.get(), proto::StreamPrefix(bad.size()) + bad).ok());
  auto answer = read_frame();
  ASSERT_TRUE(answer.has_value());
  auto* e = std::get_if<proto::ErrorFrame>(&*answer);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->id, 42u);

  // A Spawn without kStreamStdio asks for fds the stream cannot carry: refused.
  ASSERT_TRUE(WriteStreamFrame(to_init.get(), proto::SpawnFrame{7, 0, "/", {"true"}, {}}));
  answer = read_frame();
  ASSERT_TRUE(answer.has_value());
  ASSERT_TRUE(std::holds_alternative<proto::ErrorFrame>(*answer));

  // A streamed Spawn works, with its output relayed.
  ASSERT_TRUE(WriteStreamFrame(
      to_init.get(), proto::SpawnFrame{8,
                                       proto::kStreamStdio | proto::kStdinNull | proto::kStderrNull,
                                       "/",
                                       {"echo", "hi"},
                                       {}}));
  std::string out;
  bool exited = false;
  bool eof = false;
  while (!exited || !eof) {
    answer = read_frame();
    ASSERT_TRUE(answer.has_value());
    if (auto* o = std::get_if<proto::OutputFrame>(&*answer)) {
      ASSERT_FALSE(exited) << "output after the exit";
      out += o->data;
      eof = o->data.empty();
    } else if (auto* x = std::get_if<proto::ExitedFrame>(&*answer)) {
      EXPECT_EQ(x->exit_code, 0);
      exited = true;
    }
  }
  EXPECT_EQ(out, "hi\n");

  // A length of 4 GiB - 1: the frame boundary is lost, init gives up with exit 1.
  ASSERT_TRUE(WriteAll(to_init.get(), std::string("\xff\xff\xff\xff", 4)).ok());
  auto exit = process.Wait(milliseconds(10000));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(exit->exit_code, 1);
}

// A sender that ignores the stdin window (only a broken agent would) is refused with an Error
// frame instead of being buffered: init's memory stays bounded whatever the agent sends.
TEST(StreamInitTest, RefusesStdinPastTheWindow) {
  ::signal(SIGPIPE, SIG_IGN);
  auto init = StartStreamInit();
  ASSERT_TRUE(init.ok()) << init.status();
  ChildProcess process = std::move(init->first.process);
  UniqueFd from_init = std::move(init->first.channel);
  UniqueFd to_init = std::move(init->second);
  // Bounded, so that an init that never answers fails the test instead of hanging it.
  auto read_frame = [&] { return ReadStreamFrame(from_init.get(), 20000); };
  auto send = [&](const proto::Frame& f) { ASSERT_TRUE(WriteStreamFrame(to_init.get(), f)); };
  auto ready = read_frame();
  ASSERT_TRUE(ready.has_value());
  ASSERT_TRUE(std::holds_alternative<proto::ReadyFrame>(*ready));
  const long rss_before = RssKb(process.pid());

  send(proto::SpawnFrame{
      1, proto::kStreamStdio | proto::kStdoutNull | proto::kStderrNull, "/", {"sleep", "30"}, {}});
  // 16 MiB of stdin for a command that never reads, without waiting for any credit.
  const std::string data(proto::kMaxDataBytes, 'z');
  for (int i = 0; i < 256; ++i) {
    send(proto::StdinFrame{1, data});
  }
  size_t credited = 0;
  bool refused = false;
  while (!refused) {
    auto f = read_frame();
    ASSERT_TRUE(f.has_value());
    if (auto* c = std::get_if<proto::StdinCreditFrame>(&*f)) {
      credited += c->bytes;
    } else if (auto* e = std::get_if<proto::ErrorFrame>(&*f)) {
      EXPECT_EQ(e->id, 1u);
      EXPECT_NE(e->message.find("window"), std::string::npos) << e->message;
      refused = true;
    }
  }
  // Only what the pipe took was credited: the command never read.
  EXPECT_LE(credited, 1u << 20);
  EXPECT_LT(RssKb(process.pid()), rss_before + 8 * 1024);
  // The stream goes on: the command is still there to kill.
  send(proto::KillFrame{1, SIGKILL, false});
  bool exited = false;
  while (!exited) {
    auto f = read_frame();
    ASSERT_TRUE(f.has_value());
    if (auto* x = std::get_if<proto::ExitedFrame>(&*f)) {
      EXPECT_EQ(x->id, 1u);
      EXPECT_EQ(x->signal, SIGKILL);
      exited = true;
    }
  }
  to_init.Reset();
  auto exit = process.Wait(milliseconds(10000));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(exit->exit_code, 0);
}

// The agent's end against a pbox-init (it runs inside the sandbox) that sends output past its
// window: the stream is dropped rather than buffered, and the reader goes on.
TEST(StreamClientTest, DropsOutputSentPastTheWindow) {
  ::signal(SIGPIPE, SIG_IGN);
  auto to_init = MakePipe();
  auto from_init = MakePipe();
  auto out = MakePipe();
  ASSERT_TRUE(to_init.ok() && from_init.ok() && out.ok());
  auto client = InitClient::CreateStream(std::move(to_init->write), std::move(from_init->read));
  ASSERT_TRUE(client.ok()) << client.status();
  auto send = [&](const proto::Frame& f) { return WriteStreamFrame(from_init->write.get(), f); };
  ASSERT_TRUE(send(proto::ReadyFrame{}));
  ASSERT_TRUE((*client)->WaitReady(milliseconds(10000)).ok());
  SpawnRequest req;
  req.argv = {"flood"};
  req.stdout_fd = out->write.get();
  auto spawned = std::async(std::launch::async, [&] { return (*client)->Spawn(req); });
  // The Spawn frame: id 1 (the client's first).
  auto spawn = ReadStreamFrame(to_init->read.get());
  ASSERT_TRUE(spawn.has_value());
  const uint64_t id = std::get<proto::SpawnFrame>(*spawn).id;
  ASSERT_TRUE(send(proto::SpawnedFrame{id, 42}));
  auto handle = spawned.get();
  ASSERT_TRUE(handle.ok()) << handle.status();
  out->write.Reset();
  // 8 MiB without waiting for credit, while the caller reads nothing: the client must take
  // it all without blocking (past the window it drops the stream).
  auto flood = std::async(std::launch::async, [&] {
    const std::string data(proto::kMaxDataBytes, 'f');
    for (int i = 0; i < 128; ++i) {
      if (!send(proto::OutputFrame{id, proto::OutputStream::kStdout, data})) {
        return false;
      }
    }
    return true;
  });
  const bool taken = flood.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  EXPECT_TRUE(taken) << "the client's reader blocked on the caller's pipe";
  std::string got;
  EXPECT_TRUE(ReadToEof(out->read.get(), &got, milliseconds(30000)));
  EXPECT_LE(got.size(), proto::kStdioWindowBytes);
  EXPECT_TRUE(flood.get());
  // The reader still serves: the exit arrives.
  ASSERT_TRUE(send(proto::ExitedFrame{id, 0, 0, 0, 0, 0}));
  auto exit = (*handle)->Wait(milliseconds(10000));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(exit->exit_code, 0);
  from_init->write.Reset();
}

// The one-shot helpers (init_helpers.h), run on the host here: they are plain programs.
int RunHelper(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {kInitPath};
  argv.insert(argv.end(), args.begin(), args.end());
  SpawnOptions opts;
  auto child = Spawn(argv, opts);
  if (!child.ok()) {
    ADD_FAILURE() << child.status();
    return -1;
  }
  auto exit = child->Wait(milliseconds(30000));
  if (!exit.ok() || exit->signal != 0) {
    ADD_FAILURE() << "helper did not exit";
    return -1;
  }
  return exit->exit_code;
}

TEST(InitHelpersTest, RemoveTreeFollowsNoSymlinkAndReportsWhatIsLeft) {
  auto tmp = TempDir::Create("/tmp", "pbox-init-helpers-");
  ASSERT_TRUE(tmp.ok()) << tmp.status();
  const std::string d = tmp->path();
  ASSERT_TRUE(MakeDirs(d + "/outside/keep", 0755).ok());
  ASSERT_TRUE(WriteStringToFile(d + "/outside/keep/f", "keep").ok());
  ASSERT_TRUE(MakeDirs(d + "/tree/a/b", 0755).ok());
  ASSERT_TRUE(WriteStringToFile(d + "/tree/a/b/f", "x").ok());
  ASSERT_TRUE(WriteStringToFile(d + "/tree/.hidden", "x").ok());
  ASSERT_EQ(::symlink((d + "/outside").c_str(), (d + "/tree/a/link").c_str()), 0);
  ASSERT_EQ(::symlink((d + "/outside").c_str(), (d + "/dirlink").c_str()), 0);

  // Not recursive: a non-empty directory stays (exit 1), a file and an empty dir go.
  EXPECT_EQ(RunHelper({"--remove", d + "/tree"}), 1);
  ASSERT_TRUE(MakeDirs(d + "/empty", 0755).ok());
  EXPECT_EQ(RunHelper({"--remove", d + "/empty"}), 0);
  EXPECT_EQ(RunHelper({"--remove", d + "/missing"}), 1);
  // A symlink to a directory is removed as a link, its target untouched.
  EXPECT_EQ(RunHelper({"--remove-tree", d + "/dirlink"}), 0);
  EXPECT_EQ(RunHelper({"--remove-tree", d + "/tree"}), 0);
  struct stat st;
  EXPECT_NE(::lstat((d + "/tree").c_str(), &st), 0);
  EXPECT_NE(::lstat((d + "/dirlink").c_str(), &st), 0);
  EXPECT_EQ(ReadFileToString(d + "/outside/keep/f").value_or(""), "keep");
  EXPECT_EQ(RunHelper({"--remove-tree", d + "/tree"}), 1);  // nothing there: not "removed"

  // Bad usage: relative paths, missing or extra arguments.
  EXPECT_EQ(RunHelper({"--remove", "relative"}), 2);
  EXPECT_EQ(RunHelper({"--remove-tree"}), 2);
  EXPECT_EQ(RunHelper({"--remove", d, d}), 2);
  EXPECT_EQ(RunHelper({"--sync"}), 0);
  EXPECT_EQ(RunHelper({"--sync", "x"}), 2);
  EXPECT_EQ(RunHelper({"--sync", d + "/outside"}), 2);
  EXPECT_EQ(ReadFileToString(d + "/outside/keep/f").value_or(""), "keep");
}

}  // namespace
}  // namespace bragg::pbox
