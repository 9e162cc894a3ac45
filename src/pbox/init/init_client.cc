#include "pbox/init/init_client.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "fmt/format.h"
#include "pbox/init/init_fds.h"
#include "pbox/init/init_protocol.h"
#include "spdlog/spdlog.h"

namespace bragg::pbox {
namespace {

namespace proto = init_protocol;

static_assert(InitClient::kMaxSpawnBytes == proto::kMaxArgEnvBytes,
              "the client's limit must be the protocol's");

Status ChannelClosed() { return absl::UnavailableError("sandbox init exited"); }

void SetBuffer(int fd, int force_opt, int opt, int bytes) {
  if (::setsockopt(fd, SOL_SOCKET, force_opt, &bytes, sizeof(bytes)) != 0) {
    // Without CAP_NET_ADMIN the kernel caps the size at net.core.[rw]mem_max (doubled),
    // which still holds one kMaxFrameBytes frame on default sysctls.
    (void)::setsockopt(fd, SOL_SOCKET, opt, &bytes, sizeof(bytes));
  }
}

// Writes all of `data`; send(MSG_NOSIGNAL) on sockets so that a closed peer is EPIPE, not
// SIGPIPE (pipes rely on the process ignoring SIGPIPE, as pboxd does).
bool WriteFully(int fd, std::string_view data, int* err) {
  bool socket = true;
  while (!data.empty()) {
    ssize_t n = socket ? ::send(fd, data.data(), data.size(), MSG_NOSIGNAL)
                       : ::write(fd, data.data(), data.size());
    if (n < 0 && socket && errno == ENOTSOCK) {
      socket = false;
      continue;
    }
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      *err = n < 0 ? errno : EIO;
      return false;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

// Stream transport: the client's own descriptor of a caller's stdio fd. Output fds must not
// block the writer thread: a pipe is reopened through /proc as a new, non-blocking open file
// description (so the caller's stays as it is); anything else (a socket, a file) is
// duplicated and set non-blocking, which the caller's descriptor then shares.
Result<UniqueFd> RelayFd(int fd, bool output) {
  if (output) {
    struct stat st;
    if (::fstat(fd, &st) == 0 && S_ISFIFO(st.st_mode)) {
      UniqueFd reopened(
          ::open(fmt::format("/proc/self/fd/{}", fd).c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC));
      if (reopened.valid()) {
        return reopened;
      }
    }
  }
  UniqueFd dup(::fcntl(fd, F_DUPFD_CLOEXEC, 3));
  if (!dup.valid()) {
    return ErrnoError("fcntl", "F_DUPFD_CLOEXEC of a stdio fd");
  }
  if (output) {
    int flags = ::fcntl(dup.get(), F_GETFL);
    if (flags < 0 || ::fcntl(dup.get(), F_SETFL, flags | O_NONBLOCK) != 0) {
      return ErrnoError("fcntl", "O_NONBLOCK on an output fd");
    }
  }
  return dup;
}

}  // namespace

struct InitClient::PendingSpawn {
  UniqueFd done_fd;  // handed to the ProcessHandle
  std::string program;
  bool done = false;
  Result<std::shared_ptr<ProcessHandle>> result = absl::UnknownError("spawn pending");
  std::optional<ProcessExit> early_exit;  // Exited that overtook Spawned
  std::condition_variable cv;
};

// ---------------------------------------------------------------------------- ProcessHandle

Result<ProcessExit> ProcessHandle::Wait(std::optional<std::chrono::milliseconds> timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  auto ready = [this] { return exit_.has_value(); };
  if (!timeout.has_value()) {
    cv_.wait(lock, ready);
  } else if (!cv_.wait_for(lock, *timeout, ready)) {
    return absl::DeadlineExceededError(
        fmt::format("process {} (pid {}) still running after {} ms", id_, pid_, timeout->count()));
  }
  return *exit_;
}

bool ProcessHandle::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return exit_.has_value();
}

void ProcessHandle::Complete(Result<ProcessExit> exit) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (exit_.has_value()) {
      return;
    }
    exit_ = std::move(exit);
    uint64_t one = 1;
    if (::write(done_fd_.get(), &one, sizeof(one)) != sizeof(one)) {
      spdlog::warn("process {}: cannot signal its done eventfd: {}", id_, strerror(errno));
    }
  }
  cv_.notify_all();
}

// ------------------------------------------------------------------------------- InitClient

Result<std::unique_ptr<InitClient>> InitClient::Create(UniqueFd channel) {
  if (!channel.valid()) {
    return absl::InvalidArgumentError("InitClient needs a channel fd");
  }
  int type = 0;
  socklen_t len = sizeof(type);
  if (::getsockopt(channel.get(), SOL_SOCKET, SO_TYPE, &type, &len) != 0) {
    return ErrnoError("getsockopt", "SO_TYPE");
  }
  if (type != SOCK_SEQPACKET) {
    return absl::InvalidArgumentError(
        "the pbox-init channel must be an AF_UNIX SOCK_SEQPACKET socket");
  }
  SetBuffer(channel.get(), SO_SNDBUFFORCE, SO_SNDBUF, 2 * proto::kMaxFrameBytes);
  SetBuffer(channel.get(), SO_RCVBUFFORCE, SO_RCVBUF, 2 * proto::kMaxFrameBytes);
  std::unique_ptr<InitClient> client(new InitClient(std::move(channel)));
  client->reader_ = std::thread(&InitClient::ReaderLoop, client.get());
  return client;
}

Result<std::unique_ptr<InitClient>> InitClient::CreateStream(UniqueFd to_init, UniqueFd from_init) {
  for (const UniqueFd* fd : {&to_init, &from_init}) {
    struct stat st;
    if (!fd->valid() || ::fstat(fd->get(), &st) != 0) {
      return absl::InvalidArgumentError("InitClient::CreateStream needs two open fds");
    }
    if (!S_ISFIFO(st.st_mode) && !S_ISSOCK(st.st_mode)) {
      return absl::InvalidArgumentError("the pbox-init stream must be pipes or sockets");
    }
  }
  UniqueFd stop_fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!stop_fd.valid()) {
    return ErrnoError("eventfd", "stream stop");
  }
  UniqueFd wake_fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd.valid()) {
    return ErrnoError("eventfd", "output writer");
  }
  std::unique_ptr<InitClient> client(new InitClient(std::move(to_init), std::move(from_init)));
  client->stop_fd_ = std::move(stop_fd);
  client->writer_wake_ = std::move(wake_fd);
  client->writer_ = std::thread(&InitClient::WriterLoop, client.get());
  client->reader_ = std::thread(&InitClient::ReaderLoop, client.get());
  return client;
}

InitClient::InitClient(UniqueFd channel) : channel_(std::move(channel)) {}

InitClient::InitClient(UniqueFd to_init, UniqueFd from_init)
    : channel_(std::move(from_init)), to_init_(std::move(to_init)), stream_(true) {}

InitClient::~InitClient() {
  if (stream_) {
    // Stops the reader and the stdin pumps; closing the stream tells init the agent is gone.
    uint64_t one = 1;
    (void)!::write(stop_fd_.get(), &one, sizeof(one));
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    stdin_cv_.notify_all();
    {
      std::lock_guard<std::mutex> lock(send_mu_);
      to_init_.Reset();
    }
  } else {
    // Wakes the reader (recvmsg returns 0) and tells init that the agent is gone.
    (void)::shutdown(channel_.get(), SHUT_RDWR);
  }
  if (reader_.joinable()) {
    reader_.join();
  }
  if (writer_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      writer_stop_ = true;
    }
    WakeWriter();
    writer_.join();
  }
  // Exits that still waited for their output to be taken: the caller gets them all the same.
  for (auto& [id, out] : outputs_) {
    if (out.exited != nullptr) {
      out.exited->Complete(out.exit);
    }
  }
  std::list<StdinPumpThread> pumps;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pumps.swap(pumps_);
  }
  for (StdinPumpThread& p : pumps) {
    p.thread.join();
  }
}

Status InitClient::WaitReady(std::chrono::milliseconds timeout) {
  if (!stream_) {
    return absl::OkStatus();
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (!ready_cv_.wait_for(lock, timeout, [this] { return ready_ || !alive_.load(); })) {
    return absl::DeadlineExceededError(
        fmt::format("pbox-init did not report ready within {} ms", timeout.count()));
  }
  if (!ready_) {
    return absl::UnavailableError("pbox-init exited before it was ready");
  }
  return absl::OkStatus();
}

Status InitClient::SendFrame(const std::string& bytes, const std::vector<int>& fds) {
  if (stream_) {
    std::string framed = proto::StreamPrefix(bytes.size()) + bytes;
    std::lock_guard<std::mutex> lock(send_mu_);
    if (!to_init_.valid()) {
      return ChannelClosed();
    }
    int err = 0;
    if (!WriteFully(to_init_.get(), framed, &err)) {
      if (err == EPIPE || err == ECONNRESET) {
        return ChannelClosed();
      }
      return ErrnoError("write", "pbox-init stream", err);
    }
    return absl::OkStatus();
  }
  iovec iov = {const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * proto::kMaxFds)];
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  while (true) {
    ssize_t n = ::sendmsg(channel_.get(), &msg, MSG_NOSIGNAL);
    if (n >= 0) {
      return absl::OkStatus();
    }
    int err = errno;
    if (err == EINTR) {
      continue;
    }
    if (err == EPIPE || err == ECONNRESET || err == ENOTCONN) {
      return ChannelClosed();
    }
    if (err == EMSGSIZE) {
      return absl::InvalidArgumentError(
          fmt::format("frame of {} bytes does not fit the channel's socket buffer", bytes.size()));
    }
    return ErrnoError("sendmsg", "pbox-init channel", err);
  }
}

Result<std::shared_ptr<ProcessHandle>> InitClient::Spawn(const SpawnRequest& request) {
  if (request.argv.empty()) {
    return absl::InvalidArgumentError("spawn: argv is empty");
  }
  size_t bytes = proto::ArgEnvBytes(request.argv, request.env);
  if (bytes > kMaxSpawnBytes) {
    return absl::InvalidArgumentError(
        fmt::format("spawn {}: argv and env take {} bytes, more than the {} allowed",
                    request.argv[0], bytes, kMaxSpawnBytes));
  }
  proto::SpawnFrame frame;
  frame.argv = request.argv;
  frame.env = request.env;
  frame.cwd = request.cwd;
  std::vector<int> fds;
  const int stdio[3] = {request.stdin_fd, request.stdout_fd, request.stderr_fd};
  const uint32_t null_bits[3] = {proto::kStdinNull, proto::kStdoutNull, proto::kStderrNull};
  // Stream transport: our own duplicates of the caller's fds, relayed by this client.
  UniqueFd relay[3];
  for (int i = 0; i < 3; ++i) {
    if (stdio[i] < 0) {
      frame.flags |= null_bits[i];
    } else if (stream_) {
      BRAGG_ASSIGN_OR_RETURN(relay[i], RelayFd(stdio[i], /*output=*/i > 0));
    } else {
      fds.push_back(stdio[i]);
    }
  }
  if (stream_) {
    frame.flags |= proto::kStreamStdio;
  }
  UniqueFd done_fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!done_fd.valid()) {
    return ErrnoError("eventfd", "");
  }
  UniqueFd stdin_wake;
  if (relay[0].valid()) {
    stdin_wake.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!stdin_wake.valid()) {
      return ErrnoError("eventfd", "stdin relay");
    }
  }
  PendingSpawn pending;
  pending.done_fd = std::move(done_fd);
  pending.program = request.argv[0];
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!alive_.load()) {
      return ChannelClosed();
    }
    frame.id = next_id_++;
    pending_[frame.id] = &pending;
    if (stream_ && (relay[1].valid() || relay[2].valid())) {
      CommandOutput& out = outputs_[frame.id];
      for (int i = 0; i < 2; ++i) {
        out.sinks[i].fd = std::move(relay[i + 1]);
        out.sinks[i].eof = !out.sinks[i].fd.valid();  // /dev/null: no pipe, no EOF to come
      }
    }
    if (stdin_wake.valid()) {
      // Before the Spawn goes out, so that no StdinCredit or Exited can miss it.
      stdin_windows_[frame.id].wake = std::move(stdin_wake);
    }
  }
  auto forget = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.erase(frame.id);
    outputs_.erase(frame.id);
    stdin_windows_.erase(frame.id);
  };
  std::string wire;
  std::string error;
  if (!proto::EncodeFrame(frame, &wire, &error)) {
    forget();
    return absl::InvalidArgumentError(fmt::format("spawn {}: {}", request.argv[0], error));
  }
  Status sent = SendFrame(wire, fds);
  std::unique_lock<std::mutex> lock(mu_);
  if (!sent.ok() && !pending.done) {
    pending_.erase(frame.id);
    outputs_.erase(frame.id);
    stdin_windows_.erase(frame.id);
    return Annotate(sent, fmt::format("spawn {}", request.argv[0]));
  }
  pending.cv.wait(lock, [&] { return pending.done; });
  if (!pending.result.ok()) {
    outputs_.erase(frame.id);  // init made no pipes: no EOF will come
    stdin_windows_.erase(frame.id);
  } else if (!relay[0].valid() || !alive_.load()) {
    stdin_windows_.erase(frame.id);
  } else {
    // The pumps of commands whose stdin has ended go first: a long-lived sandbox would
    // otherwise keep a thread (its stack and descriptor) for every command it ever fed.
    for (auto it = pumps_.begin(); it != pumps_.end();) {
      if (it->finished) {
        it->thread.join();  // it only returns now: it holds nothing of ours
        it = pumps_.erase(it);
      } else {
        ++it;
      }
    }
    StdinPumpThread& pump = pumps_.emplace_back();
    try {
      pump.thread = std::thread(&InitClient::StdinPump, this, frame.id, std::move(relay[0]), &pump);
    } catch (const std::system_error& e) {
      // No thread to be had: the command's stdin is cut (writes to it fail) rather than lost
      // with the command.
      pumps_.pop_back();
      stdin_windows_.erase(frame.id);
      spdlog::warn("spawn {}: no thread to relay its stdin: {}", request.argv[0], e.what());
    }
  }
  return std::move(pending.result);
}

void InitClient::StdinPump(uint64_t id, UniqueFd stdin_fd, StdinPumpThread* self) {
  absl::Cleanup finished = [this, self, id] {
    std::lock_guard<std::mutex> lock(mu_);
    self->finished = true;
    stdin_windows_.erase(id);
  };
  int wake_fd = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = stdin_windows_.find(id);
    if (it == stdin_windows_.end()) {
      return;
    }
    // std::map nodes are stable and only this thread erases its own: the fd outlives the loop.
    wake_fd = it->second.wake.get();
  }
  std::string chunk(proto::kMaxDataBytes, '\0');
  std::string wire;
  std::string error;
  while (true) {
    // At most what the window allows: init buffers no more than that for this command.
    size_t allowed = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      StdinWindow& window = stdin_windows_.at(id);
      stdin_cv_.wait(lock, [&] { return stopping_ || window.closed || window.credit > 0; });
      if (stopping_ || window.closed) {
        return;
      }
      allowed = std::min(window.credit, chunk.size());
    }
    pollfd fds[3] = {
        {stdin_fd.get(), POLLIN, 0}, {stop_fd_.get(), POLLIN, 0}, {wake_fd, POLLIN, 0}};
    int n = ::poll(fds, 3, -1);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0 || fds[1].revents != 0 || fds[2].revents != 0) {
      return;  // stopping, or the command exited: nothing reads its stdin any more
    }
    ssize_t got = ::read(stdin_fd.get(), chunk.data(), allowed);
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) {
      continue;
    }
    if (got > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      stdin_windows_.at(id).credit -= static_cast<size_t>(got);
    }
    proto::StdinFrame frame{id, got > 0 ? chunk.substr(0, static_cast<size_t>(got)) : ""};
    if (!proto::EncodeFrame(frame, &wire, &error) || !SendFrame(wire, {}).ok() || got <= 0) {
      return;  // EOF sent (or the channel is gone)
    }
  }
}

void InitClient::HandleOutput(proto::OutputFrame frame) {
  auto it = outputs_.find(frame.id);
  if (it == outputs_.end()) {
    return;  // no pipe was asked for
  }
  OutputSink& sink = it->second.sinks[frame.stream == proto::OutputStream::kStdout ? 0 : 1];
  if (sink.eof) {
    return;
  }
  if (frame.data.empty()) {
    sink.eof = true;  // the caller's read end sees EOF once the queue is written
    if (sink.queue.empty()) {
      sink.fd.Reset();
    }
    WakeWriter();
    return;
  }
  if (sink.queue.size() + sink.uncredited + frame.data.size() > proto::kStdioWindowBytes) {
    // pbox-init runs inside the sandbox: what it sends past its window is not buffered.
    spdlog::warn("pbox-init stream: process {} sent output past its window; dropping the stream",
                 frame.id);
    sink.queue.clear();
    sink.fd.Reset();
    sink.eof = true;
    WakeWriter();
    return;
  }
  if (sink.fd.valid()) {
    sink.queue += frame.data;
  } else {
    sink.uncredited += frame.data.size();  // the caller's reader went away: dropped
  }
  WakeWriter();
}

void InitClient::WakeWriter() {
  uint64_t one = 1;
  (void)!::write(writer_wake_.get(), &one, sizeof(one));
}

void InitClient::WriterLoop() {
  struct Credit {
    uint64_t id;
    proto::OutputStream stream;
    size_t bytes;
  };
  std::vector<pollfd> fds;
  std::vector<std::pair<uint64_t, int>> polled;  // (process id, stream) of fds[i]
  std::vector<Credit> credits;
  std::vector<std::pair<std::shared_ptr<ProcessHandle>, ProcessExit>> exits;
  std::string wire;
  std::string error;
  // Writes what the caller's pipe takes now; drops the stream once its reader is gone.
  auto flush = [](OutputSink& sink) {
    size_t written = 0;
    if (sink.fd.valid() && !sink.queue.empty()) {
      bool broken = false;
      written = WriteAvailable(sink.fd.get(), sink.queue, &broken);
      if (broken) {  // EPIPE: nobody reads this stream any more
        written = sink.queue.size();
        sink.fd.Reset();
      }
    }
    sink.queue.erase(0, written);
    sink.uncredited += written;
    if (sink.queue.empty() && sink.eof) {
      sink.fd.Reset();
    }
  };
  while (true) {
    fds.clear();
    polled.clear();
    credits.clear();
    exits.clear();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (writer_stop_) {
        return;
      }
      for (auto it = outputs_.begin(); it != outputs_.end();) {
        CommandOutput& out = it->second;
        bool idle = true;
        for (int i = 0; i < 2; ++i) {
          OutputSink& sink = out.sinks[i];
          if (!sink.queue.empty()) {
            fds.push_back({sink.fd.get(), POLLOUT, 0});
            polled.emplace_back(it->first, i);
          }
          if (sink.uncredited >= proto::kStdioCreditBatchBytes ||
              (sink.uncredited > 0 && sink.queue.empty())) {
            credits.push_back({it->first,
                               i == 0 ? proto::OutputStream::kStdout : proto::OutputStream::kStderr,
                               sink.uncredited});
            sink.uncredited = 0;
          }
          idle = idle && sink.queue.empty() && sink.eof && !sink.fd.valid();
        }
        const bool written = out.sinks[0].queue.empty() && out.sinks[1].queue.empty();
        if (written && out.exited != nullptr) {
          exits.emplace_back(std::move(out.exited), out.exit);
          out.exited = nullptr;
        }
        it = idle && out.exited == nullptr ? outputs_.erase(it) : std::next(it);
      }
    }
    for (auto& [handle, exit] : exits) {
      handle->Complete(exit);
    }
    for (const Credit& c : credits) {
      // Blocking is fine here: pbox-init reads its stream all the time. A channel that is
      // gone needs no credit.
      proto::OutputCreditFrame frame{c.id, c.stream, static_cast<uint32_t>(c.bytes)};
      if (proto::EncodeFrame(frame, &wire, &error)) {
        (void)SendFrame(wire, {});
      }
    }
    fds.push_back({writer_wake_.get(), POLLIN, 0});
    int n = ::poll(fds.data(), fds.size(), -1);
    if (n < 0 && errno != EINTR) {
      spdlog::error("pbox-init stream: output writer: poll: {}", strerror(errno));
      return;
    }
    if (n <= 0) {
      continue;
    }
    if (fds.back().revents != 0) {
      uint64_t count = 0;
      (void)!::read(writer_wake_.get(), &count, sizeof(count));
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i + 1 < fds.size(); ++i) {
      if (fds[i].revents == 0) {
        continue;
      }
      // Looked up again: the reader may have closed the fd meanwhile (EOF, channel end).
      if (auto it = outputs_.find(polled[i].first); it != outputs_.end()) {
        flush(it->second.sinks[polled[i].second]);
      }
    }
  }
}

bool InitClient::ReadStreamFrame(std::string* frame) {
  // Reads exactly `want` bytes into `out`, waking up for stop_fd_.
  auto read_exact = [this](size_t want, std::string* out) -> bool {
    out->resize(want);
    size_t got = 0;
    while (got < want) {
      pollfd fds[2] = {{channel_.get(), POLLIN, 0}, {stop_fd_.get(), POLLIN, 0}};
      int n = ::poll(fds, 2, -1);
      if (n < 0 && errno == EINTR) {
        continue;
      }
      if (n < 0 || fds[1].revents != 0) {
        return false;
      }
      ssize_t r = ::read(channel_.get(), out->data() + got, want - got);
      if (r < 0 && (errno == EINTR || errno == EAGAIN)) {
        continue;
      }
      if (r < 0) {
        spdlog::warn("pbox-init stream: read: {}", strerror(errno));
        return false;
      }
      if (r == 0) {
        if (got != 0) {
          spdlog::warn("pbox-init stream: EOF inside a frame");
        }
        return false;
      }
      got += static_cast<size_t>(r);
    }
    return true;
  };
  std::string prefix;
  if (!read_exact(proto::kStreamPrefixBytes, &prefix)) {
    return false;
  }
  size_t len = 0;
  std::string error;
  if (!proto::ParseStreamPrefix(prefix, &len, &error)) {
    spdlog::warn("pbox-init stream: {}; closing it", error);
    return false;
  }
  return read_exact(len, frame);
}

Status InitClient::Kill(uint64_t process_id, int signal, bool whole_tree) {
  if (signal < 0 || signal > proto::kMaxSignal) {
    return absl::InvalidArgumentError(fmt::format("kill: signal {} out of range", signal));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!alive_.load()) {
      return ChannelClosed();
    }
    if (live_.count(process_id) == 0) {
      return absl::NotFoundError(fmt::format("kill: process {} is not running", process_id));
    }
  }
  std::string wire;
  std::string error;
  if (!proto::EncodeFrame(proto::KillFrame{process_id, signal, whole_tree}, &wire, &error)) {
    return absl::InternalError(fmt::format("kill: {}", error));
  }
  return SendFrame(wire, {});
}

void InitClient::ReaderLoop() {
  if (stream_) {
    std::string bytes;
    while (ReadStreamFrame(&bytes)) {
      proto::DecodeResult decoded = proto::DecodeFrame(bytes, 0);
      if (!decoded.frame.has_value()) {
        spdlog::warn("pbox-init stream: bad frame: {}", decoded.error);
        continue;
      }
      HandleFrame(std::move(*decoded.frame));
    }
    ChannelDied();
    return;
  }
  std::vector<char> buffer(proto::kMaxFrameBytes);
  while (true) {
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * proto::kMaxFds)];
    iovec iov = {buffer.data(), buffer.size()};
    msghdr msg = {};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = ::recvmsg(channel_.get(), &msg, MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0) {
      spdlog::warn("pbox-init channel: recvmsg: {}", strerror(errno));
      break;
    }
    const size_t num_fds = proto::TakeReceivedFds(msg).size();  // init never sends fds: closed
    if (n == 0 && num_fds == 0) {
      break;
    }
    if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
      spdlog::warn("pbox-init channel: dropping an oversized frame");
      continue;
    }
    proto::DecodeResult decoded =
        proto::DecodeFrame(std::string_view(buffer.data(), static_cast<size_t>(n)), num_fds);
    if (!decoded.frame.has_value()) {
      spdlog::warn("pbox-init channel: bad frame: {}", decoded.error);
      continue;
    }
    HandleFrame(std::move(*decoded.frame));
  }
  ChannelDied();
}

void InitClient::HandleFrame(proto::Frame frame) {
  std::shared_ptr<ProcessHandle> to_complete;
  Result<ProcessExit> exit = absl::UnknownError("");
  std::unique_lock<std::mutex> lock(mu_);
  auto finish_pending = [&](uint64_t id, Result<std::shared_ptr<ProcessHandle>> result) {
    auto it = pending_.find(id);
    PendingSpawn* p = it->second;
    pending_.erase(it);
    p->result = std::move(result);
    p->done = true;
    p->cv.notify_all();
  };
  // The command is gone: its stdin pump stops (init drops what it would still send).
  auto close_stdin = [&](uint64_t id) {
    if (auto it = stdin_windows_.find(id); it != stdin_windows_.end()) {
      it->second.closed = true;
      uint64_t one = 1;
      (void)!::write(it->second.wake.get(), &one, sizeof(one));
      stdin_cv_.notify_all();
    }
  };
  if (auto* f = std::get_if<proto::SpawnedFrame>(&frame)) {
    auto it = pending_.find(f->id);
    if (it == pending_.end()) {
      spdlog::warn("pbox-init channel: Spawned for unknown id {}", f->id);
      return;
    }
    std::shared_ptr<ProcessHandle> handle(
        new ProcessHandle(f->id, f->pid, std::move(it->second->done_fd)));
    if (it->second->early_exit.has_value()) {
      to_complete = handle;
      exit = *it->second->early_exit;
    } else {
      live_[f->id] = handle;
    }
    finish_pending(f->id, handle);
  } else if (auto* f = std::get_if<proto::SpawnFailedFrame>(&frame)) {
    auto it = pending_.find(f->id);
    if (it == pending_.end()) {
      spdlog::warn("pbox-init channel: SpawnFailed for unknown id {}", f->id);
      return;
    }
    if (f->stage == proto::SpawnStage::kExec) {
      close_stdin(f->id);
      std::shared_ptr<ProcessHandle> handle(
          new ProcessHandle(f->id, f->pid, std::move(it->second->done_fd)));
      ProcessExit e;
      e.exit_code = 127;
      e.spawn_errno = f->err != 0 ? f->err : EIO;
      e.error = f->message;
      to_complete = handle;
      exit = e;
      finish_pending(f->id, handle);
    } else {
      finish_pending(
          f->id,
          Status(ErrnoToCode(f->err) == absl::StatusCode::kOk ? absl::StatusCode::kInternal
                                                              : ErrnoToCode(f->err),
                 fmt::format("pbox-init could not start {}: {}", it->second->program, f->message)));
    }
  } else if (auto* f = std::get_if<proto::StdinCreditFrame>(&frame); f != nullptr && stream_) {
    auto it = stdin_windows_.find(f->id);
    if (it == stdin_windows_.end()) {
      return;  // its pump has ended
    }
    if (it->second.credit + f->bytes > proto::kStdioWindowBytes) {
      spdlog::warn("pbox-init stream: stdin credit for process {} beyond the window", f->id);
      it->second.credit = proto::kStdioWindowBytes;
    } else {
      it->second.credit += f->bytes;
    }
    stdin_cv_.notify_all();
  } else if (auto* f = std::get_if<proto::ExitedFrame>(&frame)) {
    close_stdin(f->id);
    ProcessExit e;
    e.exit_code = f->signal != 0 ? -1 : f->exit_code;
    e.signal = f->signal;
    e.user_us = f->user_us;
    e.system_us = f->system_us;
    e.max_rss_kb = f->max_rss_kb;
    if (auto it = live_.find(f->id); it != live_.end()) {
      to_complete = std::move(it->second);
      live_.erase(it);
      exit = e;
    } else if (auto pit = pending_.find(f->id); pit != pending_.end()) {
      pit->second->early_exit = e;
    } else {
      spdlog::warn("pbox-init channel: Exited for unknown id {}", f->id);
    }
  } else if (auto* f = std::get_if<proto::ErrorFrame>(&frame)) {
    if (pending_.count(f->id) != 0) {
      finish_pending(
          f->id, absl::InternalError(fmt::format("pbox-init refused the spawn: {}", f->message)));
    } else {
      spdlog::warn("pbox-init reported an error for id {}: {}", f->id, f->message);
    }
  } else if (auto* f = std::get_if<proto::OutputFrame>(&frame); f != nullptr && stream_) {
    HandleOutput(std::move(*f));
  } else if (std::holds_alternative<proto::ReadyFrame>(frame) && stream_) {
    ready_ = true;
    ready_cv_.notify_all();
  } else {
    spdlog::warn("pbox-init channel: unexpected frame from init");
  }
  if (to_complete != nullptr && exit.ok()) {
    // The caller learns of the exit only once the output that came before it is in its
    // pipes, as when the command wrote into them itself.
    auto it = outputs_.find(to_complete->id());
    if (it != outputs_.end() &&
        (!it->second.sinks[0].queue.empty() || !it->second.sinks[1].queue.empty())) {
      it->second.exited = std::move(to_complete);
      it->second.exit = *exit;
      to_complete = nullptr;
      WakeWriter();
    }
  }
  lock.unlock();
  if (to_complete != nullptr) {
    to_complete->Complete(std::move(exit));
  }
}

void InitClient::ChannelDied() {
  std::map<uint64_t, std::shared_ptr<ProcessHandle>> live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    alive_.store(false);
    for (auto& [id, p] : pending_) {
      p->result = ChannelClosed();
      p->done = true;
      p->cv.notify_all();
    }
    pending_.clear();
    live.swap(live_);
    for (auto& [id, out] : outputs_) {
      for (OutputSink& sink : out.sinks) {
        sink.eof = true;  // the callers' readers see EOF once what came is written
        if (sink.queue.empty()) {
          sink.fd.Reset();
        }
      }
    }
    stopping_ = true;
    stdin_cv_.notify_all();
    ready_cv_.notify_all();
  }
  if (stream_) {
    uint64_t one = 1;
    (void)!::write(stop_fd_.get(), &one, sizeof(one));
    WakeWriter();
  }
  for (auto& [id, handle] : live) {
    handle->Complete(ChannelClosed());
  }
}

}  // namespace bragg::pbox
