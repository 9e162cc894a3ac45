#include "fake_runtime.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "common/fs.h"
#include "pbox/cgroup/testing/null_cgroup.h"
#include "pbox/init/init_protocol.h"

namespace bragg::pbox::fuzz {
namespace {

namespace proto = init_protocol;

std::atomic<int> g_live_sandboxes{0};
std::atomic<int> g_live_cgroups{0};

void Send(int sock, const proto::Frame& frame) {
  std::string wire;
  std::string error;
  if (proto::EncodeFrame(frame, &wire, &error)) {
    (void)::send(sock, wire.data(), wire.size(), MSG_NOSIGNAL);
  }
}

// The init side of the channel: answers until the agent closes its end.
void FakeInitLoop(int sock) {
  std::vector<char> buffer(proto::kMaxFrameBytes);
  int32_t next_pid = 2;
  while (true) {
    iovec iov = {buffer.data(), buffer.size()};
    msghdr msg = {};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * proto::kMaxFds)];
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    std::vector<UniqueFd> fds = proto::TakeReceivedFds(msg);
    if (n <= 0) {
      return;
    }
    proto::DecodeResult r =
        proto::DecodeFrame(std::string_view(buffer.data(), static_cast<size_t>(n)), fds.size());
    if (!r.frame.has_value()) {
      if (r.id.has_value()) {
        Send(sock, proto::ErrorFrame{*r.id, "bad frame: " + r.error.substr(0, 1000)});
      }
      continue;
    }
    auto* spawn = std::get_if<proto::SpawnFrame>(&*r.frame);
    if (spawn == nullptr) {
      continue;  // Kill: every fake process has exited already
    }
    int32_t pid = next_pid++;
    Send(sock, proto::SpawnedFrame{spawn->id, pid});
    // The fds arrive in the order stdin, stdout, stderr, for the streams not sent to /dev/null.
    size_t next_fd = (spawn->flags & proto::kStdinNull) ? 0 : 1;
    if ((spawn->flags & proto::kStdoutNull) == 0 && next_fd < fds.size()) {
      std::string echo;
      for (const auto& a : spawn->argv) {
        echo += a;
        echo += ' ';
      }
      echo.resize(std::min<size_t>(echo.size(), 4096));
      echo += '\n';
      (void)WriteAll(fds[next_fd].get(), echo);
    }
    fds.clear();
    Send(sock, proto::ExitedFrame{spawn->id, static_cast<int32_t>(spawn->argv.size() % 256), 0, 1,
                                  1, 1024});
  }
}

class FakeSandbox : public RuntimeSandbox {
 public:
  FakeSandbox(TempDir root, SandboxFs fs, std::unique_ptr<InitClient> init, UniqueFd init_end)
      : root_(std::move(root)),
        fs_(std::move(fs)),
        init_end_(std::move(init_end)),
        init_(std::move(init)) {
    thread_ = std::thread(FakeInitLoop, init_end_.get());
    ++g_live_sandboxes;
  }
  ~FakeSandbox() override {
    (void)Stop();
    init_.reset();  // closes the agent's end; the fake init sees EOF and returns
    if (thread_.joinable()) {
      thread_.join();
    }
    --g_live_sandboxes;
  }
  InitClient* init() override { return init_.get(); }
  const SandboxFs& fs() const override { return fs_; }
  pid_t init_pid() const override { return 1; }
  Status Stop() override {
    // As when PID 1 dies: the channel closes and every waiter is released.
    stopped_ = true;
    (void)::shutdown(init_end_.get(), SHUT_RDWR);
    return absl::OkStatus();
  }
  // The root directory stands in for the overlay's upper directory: CloneSandbox copies
  // whatever the script wrote into it.
  Result<UniqueFd> OpenWritableLayer() override {
    if (stopped_) {
      return absl::FailedPreconditionError("the sandbox is stopped");
    }
    return OpenFile(root_.path(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  }

 private:
  TempDir root_;
  SandboxFs fs_;
  UniqueFd init_end_;
  std::unique_ptr<InitClient> init_;
  std::thread thread_;
  std::atomic<bool> stopped_{false};
};

class FakeCgroup : public testing::NullCgroup {
 public:
  explicit FakeCgroup(std::string name) : NullCgroup(std::move(name)) { ++g_live_cgroups; }
  ~FakeCgroup() override { (void)Destroy(); }
  Status Destroy() override {
    if (!destroyed_.exchange(true)) {
      --g_live_cgroups;
    }
    return absl::OkStatus();
  }

 private:
  std::atomic<bool> destroyed_{false};
};

}  // namespace

Result<std::unique_ptr<RuntimeSandbox>> FakeRuntime::Start(const LaunchSpec& spec) {
  BRAGG_ASSIGN_OR_RETURN(TempDir root, TempDir::Create("/tmp", "pbox-fuzz-"));
  BRAGG_ASSIGN_OR_RETURN(SandboxFs fs, SandboxFs::Open(root.path()));
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    return ErrnoError("socketpair", spec.id);
  }
  UniqueFd init_end(sv[1]);
  BRAGG_ASSIGN_OR_RETURN(std::unique_ptr<InitClient> init, InitClient::Create(UniqueFd(sv[0])));
  return std::unique_ptr<RuntimeSandbox>(
      new FakeSandbox(std::move(root), std::move(fs), std::move(init), std::move(init_end)));
}

int FakeRuntime::live() { return g_live_sandboxes.load(); }

Result<std::unique_ptr<Cgroup>> FakeCgroupManager::CreateCgroup(const std::string& name,
                                                                const CgroupLimits& limits) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    last_ = limits;
  }
  return std::unique_ptr<Cgroup>(new FakeCgroup(name));
}

CgroupLimits FakeCgroupManager::last_limits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_;
}

int FakeCgroupManager::live() { return g_live_cgroups.load(); }

}  // namespace bragg::pbox::fuzz
