#include "pbox/client/data_client.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <memory>

#include "common/fs.h"
#include "fmt/format.h"

namespace bragg::pbox::client {
namespace {

using Clock = std::chrono::steady_clock;

// A transfer that moves nothing for this long fails (the agent's own stall limit is 30 s).
constexpr int kIoTimeoutSeconds = 60;

// Socket buffers that hold a MiB-sized transfer whole: the sender then writes it in one call
// instead of waking the receiver every 200 KiB. Best effort (capped by net.core.wmem_max).
constexpr int kSocketBufferBytes = 2 << 20;

void SetTimeouts(int fd) {
  struct timeval tv = {kIoTimeoutSeconds, 0};
  (void)::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  (void)::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  (void)::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &kSocketBufferBytes, sizeof(kSocketBufferBytes));
  (void)::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &kSocketBufferBytes, sizeof(kSocketBufferBytes));
}

Status ConnectionError(std::string_view call, int err) {
  if (err == EAGAIN) {
    return absl::DeadlineExceededError(
        fmt::format("data connection: {} made no progress for {} s", call, kIoTimeoutSeconds));
  }
  return absl::UnavailableError(fmt::format("data connection: {}: {}", call, std::strerror(err)));
}

// Reads exactly `size` bytes; DataLoss if the agent closes first.
Status RecvFull(int fd, char* out, size_t size) {
  size_t got = 0;
  while (got < size) {
    ssize_t n = ::recv(fd, out + got, size - got, MSG_WAITALL);
    if (n > 0) {
      got += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n == 0) {
      return absl::DataLossError(
          fmt::format("data connection: the agent closed it after {} of {} bytes", got, size));
    }
    return ConnectionError("recv", errno);
  }
  return absl::OkStatus();
}

// Sends every byte of `iov` (which it consumes).
Status SendAll(int fd, std::vector<struct iovec> iov) {
  size_t i = 0;
  while (i < iov.size()) {
    struct msghdr msg = {};
    msg.msg_iov = iov.data() + i;
    msg.msg_iovlen = iov.size() - i;
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      return ConnectionError("send", errno);
    }
    size_t left = static_cast<size_t>(n);
    while (i < iov.size() && left >= iov[i].iov_len) {
      left -= iov[i].iov_len;
      ++i;
    }
    if (i < iov.size()) {
      iov[i].iov_base = static_cast<char*>(iov[i].iov_base) + left;
      iov[i].iov_len -= left;
    }
  }
  return absl::OkStatus();
}

// Reads one status frame. OK frames are returned; an agent error becomes a Status.
Result<DataStatus> ReadStatus(int fd) {
  char head[kDataStatusHeadBytes];
  BRAGG_RETURN_IF_ERROR(RecvFull(fd, head, sizeof(head)));
  DataStatus st;
  BRAGG_ASSIGN_OR_RETURN(uint32_t length,
                         ParseDataStatusHead(std::string_view(head, sizeof(head)), &st));
  st.message.resize(length);
  BRAGG_RETURN_IF_ERROR(RecvFull(fd, st.message.data(), length));
  if (st.code != absl::StatusCode::kOk) {
    return Status(st.code, st.message);
  }
  return st;
}

// After a failed send the agent may have refused the transfer: its reason beats EPIPE.
Status ReasonAfterSendError(int fd, Status send_error) {
  auto st = ReadStatus(fd);
  if (!st.ok() && st.status().code() != absl::StatusCode::kDataLoss &&
      st.status().code() != absl::StatusCode::kUnavailable) {
    return st.status();
  }
  return send_error;
}

}  // namespace

Result<UniqueFd> DataPool::Dial(const std::string& endpoint) const {
  if (endpoint.rfind("unix://", 0) == 0) {
    std::string path = endpoint.substr(7);
    struct sockaddr_un addr = {};
    addr.sun_family = AF_UNIX;
    if (path.size() >= sizeof(addr.sun_path)) {
      return absl::InvalidArgumentError(fmt::format("data socket path {} is too long", path));
    }
    std::memcpy(addr.sun_path, path.data(), path.size());
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) {
      return ErrnoError("socket", endpoint);
    }
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      return absl::UnavailableError(
          fmt::format("cannot connect to the data socket {}: {}", path, std::strerror(errno)));
    }
    SetTimeouts(fd.get());
    return fd;
  }
  if (endpoint.rfind("tcp://", 0) != 0) {
    return absl::InvalidArgumentError(
        fmt::format("data endpoint \"{}\" is not understood", endpoint));
  }
  std::string hostport = endpoint.substr(6);
  size_t colon = hostport.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(fmt::format("data endpoint \"{}\" has no port", endpoint));
  }
  std::string host = hostport.substr(0, colon);
  std::string port = hostport.substr(colon + 1);
  if (host.empty()) {
    host = tcp_host_;
  }
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  struct addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  struct addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) {
    return absl::UnavailableError(
        fmt::format("cannot resolve data host {}: {}", host, ::gai_strerror(rc)));
  }
  std::unique_ptr<struct addrinfo, decltype(&::freeaddrinfo)> owned(res, ::freeaddrinfo);
  int err = ECONNREFUSED;
  for (struct addrinfo* a = res; a != nullptr; a = a->ai_next) {
    UniqueFd fd(::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) {
      err = errno;
      continue;
    }
    if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) == 0) {
      int one = 1;
      (void)::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      SetTimeouts(fd.get());
      return fd;
    }
    err = errno;
  }
  return absl::UnavailableError(
      fmt::format("cannot connect to the data port {}:{}: {}", host, port, std::strerror(err)));
}

Result<UniqueFd> DataPool::Acquire(const std::string& endpoint) {
  std::vector<Idle> stale;  // closed outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto now = Clock::now();
    while (!idle_.empty()) {
      // The newest first: it is the least likely to have been closed by the agent.
      auto it = idle_.end() - 1;
      for (; it != idle_.begin() && it->endpoint != endpoint; --it) {
      }
      if (it->endpoint != endpoint) {
        break;
      }
      Idle candidate = std::move(*it);
      idle_.erase(it);
      struct pollfd p = {candidate.fd.get(), POLLIN | POLLRDHUP, 0};
      // An idle connection has nothing to read: anything there (EOF, a reset, stray bytes)
      // means the agent closed it or it is out of step.
      if (now - candidate.since < kMaxIdleAge && ::poll(&p, 1, 0) == 0) {
        return std::move(candidate.fd);
      }
      stale.push_back(std::move(candidate));
    }
  }
  return Dial(endpoint);
}

void DataPool::Release(const std::string& endpoint, UniqueFd fd) {
  std::lock_guard<std::mutex> lock(mu_);
  if (idle_.size() >= kMaxIdle) {
    idle_.erase(idle_.begin());
  }
  idle_.push_back(Idle{endpoint, std::move(fd), Clock::now()});
}

Result<DataStatus> DataPool::Upload(const std::string& endpoint, const Ticket& ticket,
                                    std::string_view data) {
  BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, Acquire(endpoint));
  DataRequest req{.op = DataOp::kUpload, .size = data.size(), .ticket = ticket};
  std::string head = EncodeDataRequest(req);
  std::vector<struct iovec> iov = {
      {head.data(), head.size()},
      {const_cast<char*>(data.data()), data.size()},
      {const_cast<char*>(kUploadTrailer.data()), kUploadTrailer.size()}};
  if (Status s = SendAll(fd.get(), std::move(iov)); !s.ok()) {
    return ReasonAfterSendError(fd.get(), s);
  }
  BRAGG_ASSIGN_OR_RETURN(DataStatus st, ReadStatus(fd.get()));
  Release(endpoint, std::move(fd));
  return st;
}

Result<DataStatus> DataPool::UploadFile(const std::string& endpoint, const Ticket& ticket, int file,
                                        off_t offset, uint64_t size) {
  BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, Acquire(endpoint));
  DataRequest req{.op = DataOp::kUpload, .size = size, .ticket = ticket};
  std::string head = EncodeDataRequest(req);
  if (Status s = SendAll(fd.get(), {{head.data(), head.size()}}); !s.ok()) {
    return ReasonAfterSendError(fd.get(), s);
  }
  uint64_t left = size;
  while (left > 0) {
    ssize_t n =
        ::sendfile(fd.get(), file, &offset, static_cast<size_t>(std::min<uint64_t>(left, 1 << 30)));
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0) {
      return ReasonAfterSendError(fd.get(), ConnectionError("sendfile", errno));
    }
    if (n == 0) {
      // The source shrank: closing without the trailer makes the agent discard the upload.
      return absl::DataLossError(
          fmt::format("the upload source ended {} bytes early (it shrank while being sent)", left));
    }
    left -= static_cast<uint64_t>(n);
  }
  if (Status s =
          SendAll(fd.get(), {{const_cast<char*>(kUploadTrailer.data()), kUploadTrailer.size()}});
      !s.ok()) {
    return ReasonAfterSendError(fd.get(), s);
  }
  BRAGG_ASSIGN_OR_RETURN(DataStatus st, ReadStatus(fd.get()));
  Release(endpoint, std::move(fd));
  return st;
}

Result<DataStatus> DataPool::Download(const std::string& endpoint, const Ticket& ticket,
                                      std::string* out, int sink) {
  BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, Acquire(endpoint));
  DataRequest req{.op = DataOp::kDownload, .size = 0, .ticket = ticket};
  std::string head = EncodeDataRequest(req);
  if (Status s = SendAll(fd.get(), {{head.data(), head.size()}}); !s.ok()) {
    return ReasonAfterSendError(fd.get(), s);
  }
  BRAGG_ASSIGN_OR_RETURN(DataStatus st, ReadStatus(fd.get()));
  if (sink < 0) {
    if (st.bytes > out->max_size()) {
      return absl::ResourceExhaustedError("download larger than a string can hold");
    }
    out->resize(static_cast<size_t>(st.bytes));
    BRAGG_RETURN_IF_ERROR(RecvFull(fd.get(), out->data(), out->size()));
  } else {
    std::string buf(static_cast<size_t>(std::min<uint64_t>(st.bytes, 1 << 20)), '\0');
    uint64_t left = st.bytes;
    while (left > 0) {
      size_t chunk = static_cast<size_t>(std::min<uint64_t>(left, buf.size()));
      Status s = RecvFull(fd.get(), buf.data(), chunk);
      if (s.ok()) {
        s = WriteAll(sink, std::string_view(buf.data(), chunk));
      }
      if (!s.ok()) {
        // Part of the file is in `sink` already: not an error to retry elsewhere.
        return absl::DataLossError(fmt::format("download stopped after {} of {} bytes: {}",
                                               st.bytes - left, st.bytes,
                                               std::string(s.message())));
      }
      left -= chunk;
    }
  }
  Release(endpoint, std::move(fd));
  return st;
}

}  // namespace bragg::pbox::client
