#pragma once

// cpp-httplib pieces shared by every httplib server binary (bragg-gateway's helpers, bragg-sim-
// worker, bragg-engine's server). Its own library, bragg_common_http, so that the rest of
// common/ does not depend on httplib.

#include <httplib.h>

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"

namespace bragg {

// httplib task queue that grows a thread per connection when all are busy, up to `max_threads`,
// and keeps idle threads for reuse: httplib serves one connection per thread, and a pool of
// fixed size would queue long-lived streams behind each other. When the kernel refuses a new
// thread (pid_max, threads-max, a pids cgroup, RLIMIT_NPROC, memory) the connection waits for
// a thread already there, as it does at the cap, and a warning says so once per refusal streak:
// the refusal used to escape httplib's accept loop and end the process. Thread-safe.
class ElasticTaskQueue : public httplib::TaskQueue {
 public:
  // Starts a thread running `fn`; throws std::system_error when it cannot (std::thread's way).
  using ThreadStarter = std::function<std::thread(std::function<void()> fn)>;

  explicit ElasticTaskQueue(size_t max_threads, ThreadStarter start = nullptr);
  ~ElasticTaskQueue() override;
  void enqueue(std::function<void()> fn) override;
  void shutdown() override;

 private:
  void Loop();
  ThreadStarter start_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;
  size_t max_threads_;
  bool stop_ = false;
  bool refused_ = false;  // the last attempt to start a thread failed
};

// Binds `server` to `host`:`port` (0: any free port) and raises its listen backlog (Debian's
// httplib listens with a backlog of 5). Returns the port bound; Unavailable when the port is
// in use (SO_REUSEPORT is not set, unlike httplib's default).
Result<int> BindServer(httplib::Server& server, const std::string& host, int port);

// Serves `server`, bound with BindServer, on a new thread and returns that thread once the
// accept loop runs: httplib's stop() does nothing before then, so a stop() right after the
// start would leave the thread in accept() for good. Internal (the thread joined) when the loop
// ended before it ran. Stop with server.stop(), then join the thread.
Result<std::thread> ServeInBackground(httplib::Server& server);

}  // namespace bragg
