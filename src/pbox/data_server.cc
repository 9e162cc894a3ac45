#include "pbox/data_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <system_error>

#include "common/fs.h"
#include "fmt/format.h"
#include "pbox/sandbox.h"
#include "pbox/service.h"
#include "spdlog/spdlog.h"

namespace bragg::pbox {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr size_t kPipeBytes = 1 << 20;
// Socket buffers that take a MiB-sized transfer whole, so that sender and receiver do not wake
// each other every 200 KiB. Best effort (capped by net.core.{w,r}mem_max).
constexpr int kSocketBufferBytes = 2 << 20;
constexpr size_t kCopyBytes = 256 << 10;
// After refusing an upload, the agent reads (and drops) what the client still sends for up to
// this long, so that the client reads the refusal instead of a connection reset.
constexpr milliseconds kDrainTime{2000};
constexpr uint64_t kDrainBytes = 256ull << 20;

int PollMs(milliseconds timeout) {
  return static_cast<int>(std::min<int64_t>(timeout.count(), INT32_MAX));
}

// Waits until `fd` is ready for `events`. DeadlineExceeded when `timeout` passes first.
Status WaitFor(int fd, short events, milliseconds timeout, std::string_view what) {
  for (;;) {
    struct pollfd p = {fd, events, 0};
    int n = ::poll(&p, 1, PollMs(timeout));
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0) {
      return ErrnoError("poll", what);
    }
    if (n == 0) {
      return absl::DeadlineExceededError(fmt::format(
          "{}: no progress for {} ms: the data connection stalled", what, timeout.count()));
    }
    return absl::OkStatus();
  }
}

// Reads exactly `size` bytes unless the peer closes first; returns how many were read. Fails
// when no byte comes for `timeout`, and, given `by`, when the whole has not come by then (a
// request's header: a peer that sends it a byte at a time must not hold the connection, and
// its thread, for `timeout` per byte).
Result<size_t> ReadFull(int fd, char* out, size_t size, milliseconds timeout,
                        std::optional<Clock::time_point> by = std::nullopt) {
  size_t got = 0;
  while (got < size) {
    ssize_t n = ::recv(fd, out + got, size - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
      continue;
    }
    if (n == 0) {
      break;
    }
    if (errno == EINTR) {
      continue;
    }
    if (errno != EAGAIN) {
      return ErrnoError("recv", "data connection");
    }
    milliseconds wait = timeout;
    if (by.has_value()) {
      auto left = std::chrono::duration_cast<milliseconds>(*by - Clock::now());
      if (left <= milliseconds(0)) {
        return absl::DeadlineExceededError("data connection: the request header did not arrive");
      }
      wait = std::min(wait, left);
    }
    BRAGG_RETURN_IF_ERROR(WaitFor(fd, POLLIN, wait, "data connection"));
  }
  return got;
}

Status WriteFull(int fd, std::string_view data, milliseconds timeout, int flags = 0) {
  while (!data.empty()) {
    ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL | flags);
    if (n >= 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (errno == EINTR) {
      continue;
    }
    if (errno == EAGAIN) {
      BRAGG_RETURN_IF_ERROR(WaitFor(fd, POLLOUT, timeout, "data connection"));
      continue;
    }
    return ErrnoError("send", "data connection");
  }
  return absl::OkStatus();
}

DataStatus StatusFrame(const Status& s) {
  DataStatus out;
  out.code = s.code();
  out.message = std::string(s.message());
  return out;
}

// Reads and drops what the peer still sends, for a bounded time and size.
void Drain(int fd, uint64_t limit) {
  auto deadline = Clock::now() + kDrainTime;
  char buf[64 << 10];
  uint64_t dropped = 0;
  while (dropped < limit) {
    auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0 || !WaitFor(fd, POLLIN, left, "drain").ok()) {
      return;
    }
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) {
      continue;
    }
    if (n <= 0) {
      return;
    }
    dropped += static_cast<uint64_t>(n);
  }
}

Status WriteFileError(int err, const std::string& path) {
  if (err == ENOSPC || err == EDQUOT) {
    return absl::ResourceExhaustedError(fmt::format(
        "{}: no space left in the sandbox (its disk limit): the upload was discarded", path));
  }
  return ErrnoError("write", path, err);
}

Status ShortData(const std::string& path, uint64_t got, uint64_t want) {
  return absl::DataLossError(
      fmt::format("{}: the data connection closed after {} of {} bytes: the upload was discarded",
                  path, got, want));
}

// Moves `left` bytes from the socket to `file` through `buf` (the path without splice).
Status CopyToFile(int sock, int file, uint64_t left, uint64_t* moved, const std::string& path,
                  milliseconds stall, uint64_t want) {
  std::string buf(static_cast<size_t>(std::min<uint64_t>(left, kCopyBytes)), '\0');
  while (left > 0) {
    size_t chunk = static_cast<size_t>(std::min<uint64_t>(left, buf.size()));
    BRAGG_ASSIGN_OR_RETURN(size_t n, ReadFull(sock, buf.data(), chunk, stall));
    if (n == 0) {
      return ShortData(path, *moved, want);
    }
    size_t off = 0;
    while (off < n) {
      ssize_t w = ::write(file, buf.data() + off, n - off);
      if (w < 0 && errno == EINTR) {
        continue;
      }
      if (w < 0) {
        return WriteFileError(errno, path);
      }
      off += static_cast<size_t>(w);
    }
    left -= n;
    *moved += n;
  }
  return absl::OkStatus();
}

// Socket -> pipe -> file with splice(2); falls back to CopyToFile where the filesystem or the
// socket cannot splice.
Status ReceiveInto(int sock, int file, uint64_t size, const std::string& path, milliseconds stall,
                   Pipe* pipe, bool* pipe_ready) {
  uint64_t moved = 0;
  if (!*pipe_ready) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) {
      return ErrnoError("pipe2", "data connection");
    }
    pipe->read.Reset(fds[0]);
    pipe->write.Reset(fds[1]);
    // Larger than the default 64 KiB: fewer splice calls per MiB. Best effort.
    (void)::fcntl(fds[1], F_SETPIPE_SZ, static_cast<int>(kPipeBytes));
    *pipe_ready = true;
  }
  while (moved < size) {
    ssize_t n = ::splice(sock, nullptr, pipe->write.get(), nullptr,
                         static_cast<size_t>(std::min<uint64_t>(size - moved, kPipeBytes)),
                         SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      if (errno == EAGAIN) {
        BRAGG_RETURN_IF_ERROR(WaitFor(sock, POLLIN, stall, path));
        continue;
      }
      if (errno == EINVAL && moved == 0) {
        return CopyToFile(sock, file, size, &moved, path, stall, size);
      }
      return ErrnoError("splice from the data connection", path);
    }
    if (n == 0) {
      return ShortData(path, moved, size);
    }
    size_t in_pipe = static_cast<size_t>(n);
    while (in_pipe > 0) {
      ssize_t m = ::splice(pipe->read.get(), nullptr, file, nullptr, in_pipe, SPLICE_F_MOVE);
      if (m < 0 && errno == EINTR) {
        continue;
      }
      if (m < 0 && errno == EINVAL) {
        // The filesystem has no splice_write: empty the pipe by hand, then copy the rest.
        char buf[64 << 10];
        while (in_pipe > 0) {
          ssize_t r = ::read(pipe->read.get(), buf, std::min(in_pipe, sizeof(buf)));
          if (r <= 0) {
            return ErrnoError("read", "data pipe");
          }
          for (ssize_t off = 0; off < r;) {
            ssize_t w = ::write(file, buf + off, static_cast<size_t>(r - off));
            if (w < 0 && errno == EINTR) {
              continue;
            }
            if (w < 0) {
              return WriteFileError(errno, path);
            }
            off += w;
          }
          in_pipe -= static_cast<size_t>(r);
        }
        moved += static_cast<uint64_t>(n);
        return CopyToFile(sock, file, size - moved, &moved, path, stall, size);
      }
      if (m <= 0) {
        return WriteFileError(m < 0 ? errno : EIO, path);
      }
      in_pipe -= static_cast<size_t>(m);
    }
    moved += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

// An upload: `size` bytes into the grant's temporary file, the trailer, then the rename.
Status Upload(int sock, TransferGrant& grant, milliseconds stall, Pipe* pipe, bool* pipe_ready,
              DataStatus* out) {
  PendingFile& file = *grant.pending;
  BRAGG_RETURN_IF_ERROR(
      ReceiveInto(sock, file.fd(), grant.size, grant.path, stall, pipe, pipe_ready));
  char trailer[4];
  BRAGG_ASSIGN_OR_RETURN(size_t n, ReadFull(sock, trailer, sizeof(trailer), stall));
  if (n != sizeof(trailer)) {
    return ShortData(grant.path, grant.size, grant.size + sizeof(trailer));
  }
  if (std::string_view(trailer, sizeof(trailer)) != kUploadTrailer) {
    return absl::InvalidArgumentError(
        fmt::format("{}: more data than the {} bytes the ticket is for: the upload was discarded",
                    grant.path, grant.size));
  }
  if (auto sb = grant.sandbox.lock(); sb == nullptr || sb->destroying()) {
    return absl::NotFoundError("the sandbox of this transfer was destroyed during the upload");
  }
  BRAGG_RETURN_IF_ERROR(file.Commit(grant.mode));
  struct stat st;
  if (::fstat(file.fd(), &st) != 0) {
    return ErrnoError("fstat", grant.path);
  }
  out->bytes = grant.size;
  out->mode = st.st_mode & 07777;
  out->mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return absl::OkStatus();
}

// A download: the status frame with the byte count, then the bytes with sendfile(2). An error
// after the frame went out can only close the connection (the client sees a short read).
Status Download(int sock, TransferGrant& grant, milliseconds stall, uint64_t* sent, bool* replied) {
  struct stat st;
  if (::fstat(grant.file.get(), &st) != 0) {
    return ErrnoError("fstat", grant.path);
  }
  uint64_t size = static_cast<uint64_t>(st.st_size);
  uint64_t count = size > grant.offset ? std::min(size - grant.offset, grant.size) : 0;
  DataStatus ok;
  ok.bytes = count;
  ok.mode = st.st_mode & 07777;
  ok.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  *replied = true;
  BRAGG_RETURN_IF_ERROR(WriteFull(sock, EncodeDataStatus(ok), stall, count > 0 ? MSG_MORE : 0));
  off_t offset = static_cast<off_t>(grant.offset);
  uint64_t left = count;
  while (left > 0) {
    ssize_t n = ::sendfile(sock, grant.file.get(), &offset,
                           static_cast<size_t>(std::min<uint64_t>(left, 1 << 30)));
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      if (errno == EAGAIN) {
        BRAGG_RETURN_IF_ERROR(WaitFor(sock, POLLOUT, stall, grant.path));
        continue;
      }
      return ErrnoError("sendfile", grant.path);
    }
    if (n == 0) {
      return absl::DataLossError(
          fmt::format("{}: the file shrank during the download", grant.path));
    }
    left -= static_cast<uint64_t>(n);
    *sent += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

Result<UniqueFd> ListenUnix(const std::string& path) {
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        fmt::format("data socket path {} is longer than {} bytes: use a shorter --listen path",
                    path, sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) {
    return ErrnoError("socket(AF_UNIX)", path);
  }
  ::unlink(path.c_str());  // a stale socket of a dead agent
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoError("bind", path);
  }
  if (::chmod(path.c_str(), 0660) != 0) {
    return ErrnoError("chmod", path);
  }
  if (::listen(fd.get(), 1024) != 0) {
    return ErrnoError("listen", path);
  }
  return fd;
}

Result<UniqueFd> ListenTcp(const std::string& host, uint16_t* port) {
  std::string h = host;
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') {
    h = h.substr(1, h.size() - 2);
  }
  struct addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  struct addrinfo* res = nullptr;
  std::string service = std::to_string(*port);
  int rc = ::getaddrinfo(h.empty() ? nullptr : h.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) {
    return absl::InvalidArgumentError(
        fmt::format("data channel: cannot resolve {}: {}", host, ::gai_strerror(rc)));
  }
  std::unique_ptr<struct addrinfo, decltype(&::freeaddrinfo)> owned(res, ::freeaddrinfo);
  const std::string what = fmt::format("{}:{}", host, *port);
  UniqueFd fd(::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) {
    return ErrnoError("socket", what);
  }
  int one = 1;
  (void)::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), res->ai_addr, res->ai_addrlen) != 0) {
    return ErrnoError("bind", what);
  }
  if (::listen(fd.get(), 1024) != 0) {
    return ErrnoError("listen", what);
  }
  struct sockaddr_storage bound = {};
  socklen_t len = sizeof(bound);
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    return ErrnoError("getsockname", what);
  }
  *port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return fd;
}

}  // namespace

DataServer::DataServer(TransferTickets* tickets, DataServerOptions options,
                       const AgentMetrics* metrics)
    : tickets_(tickets), options_(options), metrics_(metrics) {}

Result<std::unique_ptr<DataServer>> DataServer::Start(TransferTickets* tickets,
                                                      const std::vector<std::string>& unix_paths,
                                                      const std::vector<std::string>& tcp_hosts,
                                                      uint16_t tcp_port, DataServerOptions options,
                                                      const AgentMetrics* metrics) {
  std::unique_ptr<DataServer> s(new DataServer(tickets, options, metrics));
  for (const std::string& grpc_path : unix_paths) {
    std::string path = DataSocketPathFor(grpc_path);
    BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, ListenUnix(path));
    s->listeners_.push_back(std::move(fd));
    s->unix_paths_.push_back(path);
    if (s->unix_endpoint_.empty()) {
      s->unix_endpoint_ = "unix://" + path;
    }
  }
  uint16_t port = tcp_port;
  for (const std::string& host : tcp_hosts) {
    BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, ListenTcp(host, &port));
    s->listeners_.push_back(std::move(fd));
  }
  s->tcp_port_ = tcp_hosts.empty() ? 0 : port;
  s->stop_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!s->stop_) {
    return ErrnoError("eventfd", "data channel");
  }
  DataServer* raw = s.get();
  s->acceptor_ = std::thread([raw] { raw->AcceptLoop(); });
  return s;
}

DataServer::~DataServer() {
  uint64_t one = 1;
  if (stop_) {
    (void)!::write(stop_.get(), &one, sizeof(one));
  }
  if (acceptor_.joinable()) {
    acceptor_.join();
  }
  std::unique_lock<std::mutex> lock(mu_);
  stopping_ = true;
  for (int fd : open_) {
    ::shutdown(fd, SHUT_RDWR);
  }
  idle_.wait(lock, [this] { return open_.empty(); });
  lock.unlock();
  for (const std::string& path : unix_paths_) {
    ::unlink(path.c_str());
  }
}

size_t DataServer::connections() const {
  std::lock_guard<std::mutex> lock(mu_);
  return open_.size();
}

void DataServer::AcceptLoop() {
  std::vector<struct pollfd> fds;
  fds.push_back({stop_.get(), POLLIN, 0});
  for (const UniqueFd& l : listeners_) {
    fds.push_back({l.get(), POLLIN, 0});
  }
  auto next_sweep = Clock::now();
  for (;;) {
    int n = ::poll(fds.data(), fds.size(), 1000);
    if (n < 0 && errno != EINTR) {
      spdlog::error("data channel: poll: {}", std::strerror(errno));
      return;
    }
    if ((fds[0].revents & POLLIN) != 0) {
      return;
    }
    if (Clock::now() >= next_sweep) {
      // Expired tickets hold temporary files: drop them within a second of their expiry.
      tickets_->Sweep();
      next_sweep = Clock::now() + milliseconds(1000);
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if ((fds[i].revents & POLLIN) == 0) {
        continue;
      }
      for (;;) {
        int c = ::accept4(fds[i].fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (c < 0) {
          if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
            spdlog::warn("data channel: accept: {}", std::strerror(errno));
          }
          break;
        }
        UniqueFd sock(c);
        std::unique_lock<std::mutex> lock(mu_);
        if (open_.size() >= options_.max_connections && !waiting_.empty()) {
          // Room from the longest idle connection: its thread sees EOF and ends (its client
          // finds the connection closed when it next takes it from its pool, and dials again).
          ::shutdown(waiting_.front(), SHUT_RDWR);
          waiting_.erase(waiting_.begin());
        } else if (open_.size() >= options_.max_connections) {
          lock.unlock();
          DataStatus busy = StatusFrame(absl::ResourceExhaustedError(
              fmt::format("the agent has {} data connections open, its limit: retry, or close idle "
                          "connections",
                          options_.max_connections)));
          std::string frame = EncodeDataStatus(busy);
          (void)!::send(sock.get(), frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
          continue;
        }
        open_.insert(sock.get());
        lock.unlock();
        int one = 1;
        (void)::setsockopt(sock.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        (void)::setsockopt(sock.get(), SOL_SOCKET, SO_SNDBUF, &kSocketBufferBytes,
                           sizeof(kSocketBufferBytes));
        (void)::setsockopt(sock.get(), SOL_SOCKET, SO_RCVBUF, &kSocketBufferBytes,
                           sizeof(kSocketBufferBytes));
        const int raw = sock.get();
        try {
          std::thread([this, s = std::move(sock)]() mutable { Serve(std::move(s)); }).detach();
        } catch (const std::system_error& e) {
          // No thread to be had (RLIMIT_NPROC, memory): refuse this connection only (the
          // lambda that owned its fd is gone, and closed it).
          spdlog::warn("data channel: cannot start a connection thread: {}", e.what());
          std::lock_guard<std::mutex> relock(mu_);
          open_.erase(raw);
        }
      }
    }
  }
}

void DataServer::Serve(UniqueFd sock) {
  const int fd = sock.get();
  Pipe pipe;
  bool pipe_ready = false;
  for (bool first = true;; first = false) {
    // Between transfers a pooled connection may sit idle; mid-request it may not stall.
    if (!first) {
      std::lock_guard<std::mutex> lock(mu_);
      waiting_.push_back(fd);
    }
    const bool woke =
        WaitFor(fd, POLLIN, first ? options_.stall_timeout : options_.idle_timeout, "data").ok();
    if (!first) {
      std::lock_guard<std::mutex> lock(mu_);
      std::erase(waiting_, fd);
    }
    if (!woke) {
      break;
    }
    char head[kDataRequestBytes];
    Result<size_t> got = ReadFull(fd, head, sizeof(head), options_.stall_timeout,
                                  Clock::now() + options_.stall_timeout);
    if (!got.ok() || *got == 0) {
      break;
    }
    Result<DataRequest> req = ParseDataRequest(std::string_view(head, *got));
    if (!req.ok()) {
      (void)WriteFull(fd, EncodeDataStatus(StatusFrame(req.status())), options_.stall_timeout);
      // Closing with unread bytes would reset the connection before the client reads why.
      ::shutdown(fd, SHUT_WR);
      Drain(fd, kDrainBytes);
      break;
    }
    Result<TransferGrant> grant = tickets_->Redeem(req->ticket, req->op);
    Status failed;
    std::shared_ptr<Sandbox> sb;
    if (!grant.ok()) {
      failed = grant.status();
    } else if (sb = grant->sandbox.lock(); sb == nullptr || sb->destroying()) {
      failed = absl::NotFoundError("the sandbox of this transfer was destroyed");
    } else if (req->op == DataOp::kUpload && req->size != grant->size) {
      failed = absl::InvalidArgumentError(
          fmt::format("{}: the request says {} bytes, the ticket is for {}", grant->path, req->size,
                      grant->size));
    }
    if (!failed.ok()) {
      (void)WriteFull(fd, EncodeDataStatus(StatusFrame(failed)), options_.stall_timeout);
      ::shutdown(fd, SHUT_WR);
      Drain(fd, std::min<uint64_t>(req->size, kDrainBytes) + kUploadTrailer.size());
      break;
    }
    Sandbox::TransferHold hold(sb);  // no idle TTL while the bytes move
    auto t0 = Clock::now();
    if (req->op == DataOp::kUpload) {
      DataStatus done;
      Status s = Upload(fd, *grant, options_.stall_timeout, &pipe, &pipe_ready, &done);
      if (!s.ok()) {
        grant = absl::CancelledError("");  // the temporary file goes now, before the reply
        (void)WriteFull(fd, EncodeDataStatus(StatusFrame(s)), options_.stall_timeout);
        ::shutdown(fd, SHUT_WR);
        Drain(fd, kDrainBytes);
        break;
      }
      uint64_t bytes = done.bytes;
      grant = absl::CancelledError("");  // releases the client's slot before it can ask again
      if (metrics_ != nullptr) {
        metrics_->bytes_uploaded->Inc(bytes);
        metrics_->upload_seconds->Observe(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      if (!WriteFull(fd, EncodeDataStatus(done), options_.stall_timeout).ok()) {
        break;
      }
    } else {
      uint64_t sent = 0;
      bool replied = false;
      Status s = Download(fd, *grant, options_.stall_timeout, &sent, &replied);
      grant = absl::CancelledError("");
      if (metrics_ != nullptr) {
        metrics_->bytes_downloaded->Inc(sent);
        metrics_->download_seconds->Observe(
            std::chrono::duration<double>(Clock::now() - t0).count());
      }
      if (!s.ok()) {
        if (!replied) {
          (void)WriteFull(fd, EncodeDataStatus(StatusFrame(s)), options_.stall_timeout);
          ::shutdown(fd, SHUT_WR);
          Drain(fd, kDrainBytes);
        }
        break;
      }
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  open_.erase(fd);
  std::erase(waiting_, fd);
  sock.Reset();
  idle_.notify_all();
}

}  // namespace bragg::pbox
