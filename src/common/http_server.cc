#include "common/http_server.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <memory>
#include <system_error>
#include <utility>

namespace bragg {

ElasticTaskQueue::ElasticTaskQueue(size_t max_threads, ThreadStarter start)
    : start_(start ? std::move(start)
                   : [](std::function<void()> fn) { return std::thread(std::move(fn)); }),
      max_threads_(max_threads) {}

ElasticTaskQueue::~ElasticTaskQueue() { shutdown(); }

void ElasticTaskQueue::enqueue(std::function<void()> fn) {
  std::unique_lock<std::mutex> lock(mu_);
  jobs_.push_back(std::move(fn));
  // Each job is a connection that may stay open for long: never leave one waiting for a thread
  // when the cap allows another.
  if (jobs_.size() > idle_ && threads_.size() < max_threads_) {
    try {
      threads_.push_back(start_([this] { Loop(); }));
      if (refused_) {
        refused_ = false;
        spdlog::info("http server: threads start again ({} now)", threads_.size());
      }
      return;
    } catch (const std::system_error& e) {
      if (!refused_) {
        refused_ = true;
        spdlog::warn(
            "http server: the kernel refused thread {} ({}); new connections wait for one of "
            "the {} there (pid_max, threads-max, a pids cgroup or RLIMIT_NPROC is reached)",
            threads_.size() + 1, e.what(), threads_.size());
      }
    }
  }
  cv_.notify_one();
}

void ElasticTaskQueue::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
    --idle_;
    if (jobs_.empty()) {
      return;
    }
    std::function<void()> fn = std::move(jobs_.back());
    jobs_.pop_back();
    lock.unlock();
    fn();
    lock.lock();
  }
}

void ElasticTaskQueue::shutdown() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    threads.swap(threads_);
  }
  cv_.notify_all();
  for (auto& t : threads) {
    t.join();
  }
}

namespace {

// Debian's libcpp-httplib is built with a listen backlog of 5: a burst of rollouts connecting at
// once overflows it and connections fail. Linux lets listen() be called again on a listening
// socket to change the backlog; httplib keeps its fd private, so find it by its port.
void RaiseBacklog(int port) {
  for (int fd = 3; fd < 65536; ++fd) {
    int listening = 0;
    socklen_t len = sizeof(listening);
    if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0) {
      if (errno == EBADF && fd > 4096) {
        break;
      }
      continue;
    }
    sockaddr_storage addr{};
    socklen_t alen = sizeof(addr);
    if (listening == 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &alen) != 0) {
      continue;
    }
    int bound = addr.ss_family == AF_INET ? ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port)
                : addr.ss_family == AF_INET6
                    ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                    : -1;
    if (bound == port) {
      ::listen(fd, SOMAXCONN);
      return;
    }
  }
}

}  // namespace

Result<int> BindServer(httplib::Server& server, const std::string& host, int port) {
  // httplib's default also sets SO_REUSEPORT, with which a second server binds a port already
  // listened on and the kernel splits connections between the two: a port in use must be
  // refused. SO_REUSEADDR alone still lets a restart bind over connections in TIME_WAIT.
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  if (port == 0) {
    port = server.bind_to_any_port(host);
    if (port <= 0) {
      return absl::UnavailableError(fmt::format("cannot bind {}:0", host));
    }
  } else if (!server.bind_to_port(host, port)) {
    return absl::UnavailableError(fmt::format(
        "cannot bind {}:{}: is the port in use? pick another with --listen", host, port));
  }
  RaiseBacklog(port);
  return port;
}

Result<std::thread> ServeInBackground(httplib::Server& server) {
  auto ended = std::make_shared<std::atomic<bool>>(false);
  std::thread thread([&server, ended] {
    server.listen_after_bind();
    ended->store(true);
  });
  while (!server.is_running() && !ended->load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!server.is_running() && ended->load()) {
    thread.join();
    return absl::InternalError("the HTTP server's accept loop ended as it started");
  }
  return thread;
}

}  // namespace bragg
