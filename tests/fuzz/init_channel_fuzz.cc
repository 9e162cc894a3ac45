// Fuzzes the agent's end of the pbox-init channel: a real InitClient reads whatever frames a
// (broken or hostile) pbox-init sends while a Spawn waits for its answer. Whatever arrives,
// the Spawn returns (a handle or an error), the handle's Wait returns once the channel is gone,
// fds that came with frames are closed, and nothing crashes.
//
// Input: a sequence of records  u8 flags, u16 length (LE), `length` bytes of frame.
//   flags bit 0: attach one fd (init never sends fds; the agent must close it)
//   flags bit 1: stop the Spawn's wait here (close the channel after this frame)

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <future>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "common/fs.h"
#include "pbox/init/init_client.h"
#include "pbox/init/init_protocol.h"
#include "spdlog/spdlog.h"

namespace pb = bragg::pbox;

namespace {

int LowestFreeFd() {
  int fd = ::dup(0);
  ::close(fd);
  return fd;
}

void SendWithFd(int sock, std::string_view bytes, int fd) {
  iovec iov = {const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  (void)::sendmsg(sock, &msg, MSG_NOSIGNAL);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const int baseline = LowestFreeFd();
  {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
      std::abort();
    }
    bragg::UniqueFd init_end(sv[1]);
    auto client = pb::InitClient::Create(bragg::UniqueFd(sv[0]));
    if (!client.ok()) {
      std::abort();
    }
    auto out = bragg::MakePipe();
    if (!out.ok()) {
      std::abort();
    }
    pb::SpawnRequest req;
    req.argv = {"prog", "arg"};
    req.env = {"A=b"};
    req.cwd = "/";
    req.stdout_fd = out->write.get();
    auto spawn = std::async(std::launch::async, [&] { return (*client)->Spawn(req); });
    // The Spawn frame reaches "init" first (drained here so the socket never fills up).
    std::vector<char> buf(bragg::pbox::init_protocol::kMaxFrameBytes);
    (void)::recv(init_end.get(), buf.data(), buf.size(), 0);
    size_t pos = 0;
    while (pos + 3 <= size) {
      uint8_t flags = data[pos];
      size_t len = data[pos + 1] | (static_cast<size_t>(data[pos + 2]) << 8);
      pos += 3;
      len = std::min(len, size - pos);
      std::string_view frame(reinterpret_cast<const char*>(data + pos), len);
      pos += len;
      int extra = (flags & 1) ? ::open("/dev/null", O_RDONLY | O_CLOEXEC) : -1;
      SendWithFd(init_end.get(), frame, extra);
      if (extra >= 0) {
        ::close(extra);
      }
      if (flags & 2) {
        break;
      }
    }
    // pbox-init goes away: every waiter must be released.
    init_end.Reset();
    auto handle = spawn.get();
    if (handle.ok()) {
      auto exit = (*handle)->Wait(std::chrono::seconds(30));
      if (!exit.ok() && exit.status().code() == absl::StatusCode::kDeadlineExceeded) {
        std::cerr << "init_channel_fuzz: Wait hung after the channel closed\n";
        std::abort();
      }
    }
    if ((*client)->alive()) {
      // The reader saw EOF; alive() turns false once it noticed.
      for (int i = 0; i < 1000 && (*client)->alive(); ++i) {
        ::usleep(1000);
      }
      if ((*client)->alive()) {
        std::cerr << "init_channel_fuzz: client alive after the channel closed\n";
        std::abort();
      }
    }
  }
  // A leaked fd stays; one that another thread of the process holds for a moment does not,
  // so look again before calling it a leak. (libFuzzer keeps pipes to llvm-symbolizer open
  // once it has printed a NEW_FUNC line: scripts/run-fuzzers passes -print_funcs=0.)
  int now = LowestFreeFd();
  for (int i = 0; i < 100 && now > baseline; ++i) {
    ::usleep(2000);
    now = LowestFreeFd();
  }
  if (now > baseline) {
    char what[256] = {};
    std::string link = "/proc/self/fd/" + std::to_string(baseline);
    ssize_t n = ::readlink(link.c_str(), what, sizeof(what) - 1);
    std::cerr << "init_channel_fuzz: fd leak (lowest free fd " << now << ", was " << baseline
              << "; fd " << baseline << " is " << (n > 0 ? what : "?") << ")\n";
    std::abort();
  }
  return 0;
}
