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

#include "common/serve.h"
#include "common/status.h"

namespace bragg::gateway {

// The serving helpers of every server binary live in common/serve.h.
using ::bragg::BlockTerminationSignals;
using ::bragg::HostPort;
using ::bragg::ParseHostPort;
using ::bragg::RaiseFileLimit;
using ::bragg::ServeUntilTerminated;
using ::bragg::WaitForTermination;

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
