#include "fusion/call_watch.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/unique_fd.h"

namespace bragg::fusion {
namespace {

// "1.2.3.4"/"::1" and a port from a socket address; false for other families.
bool AddressOf(const sockaddr_storage& ss, std::string* addr, int* port) {
  char text[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
    *port = ntohs(in->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof(text));
    *port = ntohs(in6->sin6_port);
  } else {
    return false;
  }
  *addr = text;
  return true;
}

}  // namespace

Result<int> FindConnectionFd(const std::string& remote_addr, int remote_port, int local_port) {
  UniqueDir dir(opendir("/proc/self/fd"));
  if (dir == nullptr) {
    return ErrnoError("opendir", "/proc/self/fd");
  }
  while (dirent* entry = readdir(dir.get())) {
    char* end = nullptr;
    long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == dirfd(dir.get())) {
      continue;
    }
    sockaddr_storage local{}, peer{};
    socklen_t local_len = sizeof(local), peer_len = sizeof(peer);
    if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
        getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) {
      continue;
    }
    std::string local_addr, peer_addr;
    int lport = 0, pport = 0;
    if (!AddressOf(local, &local_addr, &lport) || !AddressOf(peer, &peer_addr, &pport)) {
      continue;
    }
    if (lport == local_port && pport == remote_port && peer_addr == remote_addr) {
      return static_cast<int>(fd);
    }
  }
  return absl::NotFoundError("no connection from " + remote_addr + ":" +
                             std::to_string(remote_port));
}

WatchedCall::~WatchedCall() {
  std::lock_guard<std::mutex> lock(watch_->mu_);
  watch_->calls_.erase(id_);
}

bool WatchedCall::cancelled() const {
  std::lock_guard<std::mutex> lock(watch_->mu_);
  auto it = watch_->calls_.find(id_);
  return it != watch_->calls_.end() && it->second.cancelled;
}

bool WatchedCall::SetSandbox(const std::string& sandbox_id) {
  std::lock_guard<std::mutex> lock(watch_->mu_);
  auto it = watch_->calls_.find(id_);
  if (it == watch_->calls_.end()) {
    return true;
  }
  if (it->second.cancelled) {
    return false;
  }
  it->second.sandbox_id = sandbox_id;
  return true;
}

CallWatch::CallWatch(DestroyFn destroy, std::chrono::milliseconds interval)
    : destroy_(std::move(destroy)), interval_(interval), thread_([this] { Loop(); }) {}

CallWatch::~CallWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::unique_ptr<WatchedCall> CallWatch::Register(int fd) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t id = next_id_++;
  calls_.emplace(id, Entry{.fd = fd});
  return std::unique_ptr<WatchedCall>(new WatchedCall(this, id));
}

void CallWatch::Loop() {
  std::vector<uint64_t> ids;
  std::vector<pollfd> fds;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, interval_, [this] { return stop_; });
    if (stop_) {
      break;
    }
    ids.clear();
    fds.clear();
    for (const auto& [id, entry] : calls_) {
      if (entry.fd >= 0 && !entry.cancelled) {
        ids.push_back(id);
        fds.push_back(pollfd{.fd = entry.fd, .events = POLLRDHUP, .revents = 0});
      }
    }
    if (fds.empty()) {
      continue;
    }
    // Polled under the lock: a call cannot unregister, and httplib cannot close and reuse its
    // descriptor, while it is polled. poll with timeout 0 does not block.
    if (poll(fds.data(), fds.size(), 0) <= 0) {
      continue;
    }
    std::vector<std::string> doomed;
    for (size_t i = 0; i < fds.size(); ++i) {
      if ((fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) == 0) {
        continue;
      }
      Entry& entry = calls_[ids[i]];
      entry.cancelled = true;
      cancelled_total_.fetch_add(1);
      if (!entry.sandbox_id.empty()) {
        doomed.push_back(std::move(entry.sandbox_id));
        entry.sandbox_id.clear();
      }
    }
    lock.unlock();
    for (const std::string& id : doomed) {
      destroy_(id);
    }
    lock.lock();
  }
}

}  // namespace bragg::fusion
