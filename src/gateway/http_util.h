#pragma once

// Small pieces shared by the gateway and the simulated worker on top of cpp-httplib.

#include <httplib.h>
#include <signal.h>

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace bragg::gateway {

struct HostPort {
  std::string host;
  int port = 0;
};

// "127.0.0.1:8080" or "http://127.0.0.1:8080" (no path). InvalidArgument otherwise.
Result<HostPort> ParseHostPort(std::string_view text);

// For a server's main(): ignores SIGPIPE (a write to a hung-up client then fails with EPIPE
// instead of killing the process) and blocks SIGINT and SIGTERM in this thread and every
// thread started after it. Returns the blocked set for WaitForTermination.
sigset_t BlockTerminationSignals();
// Raises the soft RLIMIT_NOFILE to the hard limit: a proxied connection costs the gateway two
// descriptors. Returns the new soft limit; Internal if getrlimit/setrlimit fail.
Result<uint64_t> RaiseFileLimit();
// Waits until SIGINT or SIGTERM arrives.
void WaitForTermination(const sigset_t& set);

// The life of a server binary once its flags are parsed: parses `listen` (HOST:PORT), raises
// the file limit (a warning if it cannot), blocks the termination signals for every thread
// started after it, then `start` builds and starts the server on that address and returns the
// URL it serves on; "listening on URL" goes to stdout (scripts read the port from it when they
// asked for port 0) and, once SIGINT or SIGTERM arrives, `stop` runs. Returns main()'s exit
// code: 0; 2 for a bad `listen`; 1 when `start` failed. Errors are logged.
int ServeUntilTerminated(std::string_view listen,
                         const std::function<Result<std::string>(const HostPort&)>& start,
                         const std::function<void()>& stop);

// httplib task queue that grows a thread per connection when all are busy, up to `max_threads`,
// and keeps idle threads for reuse: httplib serves one connection per thread, and a pool of
// fixed size would queue long-lived streams behind each other. Thread-safe.
class ElasticTaskQueue : public httplib::TaskQueue {
 public:
  explicit ElasticTaskQueue(size_t max_threads);
  ~ElasticTaskQueue() override;
  void enqueue(std::function<void()> fn) override;
  void shutdown() override;

 private:
  void Loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;
  size_t max_threads_;
  bool stop_ = false;
};

// Keep-alive connections to one upstream, reused across requests. Thread-safe.
class ClientPool {
 public:
  explicit ClientPool(HostPort target);
  // A connected-or-fresh client; give it back with Release when the exchange ended cleanly.
  std::unique_ptr<httplib::Client> Acquire();
  void Release(std::unique_ptr<httplib::Client> client);
  const HostPort& target() const { return target_; }

 private:
  HostPort target_;
  std::mutex mu_;
  std::vector<std::unique_ptr<httplib::Client>> idle_;
};

// Binds `server` to `host`:`port` (0: any free port). Returns the port bound.
Result<int> BindServer(httplib::Server& server, const std::string& host, int port);

// A JSON error body {"error": {"message": ...}} with `status`.
void SetError(httplib::Response& res, int status, std::string_view message);

}  // namespace bragg::gateway
