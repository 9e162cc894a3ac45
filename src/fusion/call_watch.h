#pragma once

// Notices HTTP clients that hang up while their /run_code call runs (or waits for a slot), so
// that their sandbox is destroyed at once instead of running to its timeout for nobody.
//
// cpp-httplib 0.11 tells a handler nothing about its connection: FindConnectionFd finds the
// connection's descriptor by its addresses (the handler's thread keeps it open until the
// handler returns, so the descriptor cannot be reused meanwhile), and one thread polls every
// watched descriptor for POLLRDHUP/POLLHUP (the peer closed or reset the connection).

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "common/status.h"

namespace bragg::fusion {

// The descriptor of this process's TCP connection whose local port is `local_port` and whose
// peer is `remote_addr`:`remote_port` (IPv4 or IPv6 text). NotFound if there is none.
Result<int> FindConnectionFd(const std::string& remote_addr, int remote_port, int local_port);

class CallWatch;

// One call being watched, from Register until destroyed (RAII: its destructor unregisters it).
// Used by the handler's thread; `cancelled` and `SetSandbox` may race with the watch thread.
class WatchedCall {
 public:
  WatchedCall(const WatchedCall&) = delete;
  WatchedCall& operator=(const WatchedCall&) = delete;
  ~WatchedCall();

  // True once the client is known to be gone.
  bool cancelled() const;
  // Records the call's sandbox (empty: none now), for the watch to destroy if the client goes.
  // Returns false (recording nothing) if the client is already gone: the caller destroys it.
  bool SetSandbox(const std::string& sandbox_id);

 private:
  friend class CallWatch;
  WatchedCall(CallWatch* watch, uint64_t id) : watch_(watch), id_(id) {}
  CallWatch* watch_;
  uint64_t id_;
};

// Thread-safe. `destroy` is called on the watch's thread with the sandbox of a call whose client
// went away; it must be safe to call concurrently with the handler's own clean-up (destroying a
// sandbox twice: the second fails, which `destroy` ignores). Must outlive every WatchedCall.
class CallWatch {
 public:
  using DestroyFn = std::function<void(const std::string& sandbox_id)>;
  explicit CallWatch(DestroyFn destroy,
                     std::chrono::milliseconds interval = std::chrono::milliseconds(100));
  ~CallWatch();
  CallWatch(const CallWatch&) = delete;
  CallWatch& operator=(const CallWatch&) = delete;

  // Watches the connection on `fd` (< 0: not watched; the call is then never cancelled).
  std::unique_ptr<WatchedCall> Register(int fd);

  // Calls cancelled so far (for the metrics line and tests).
  uint64_t cancelled_total() const { return cancelled_total_.load(); }

 private:
  friend class WatchedCall;
  struct Entry {
    int fd;
    bool cancelled = false;
    std::string sandbox_id;
  };
  void Loop();

  DestroyFn destroy_;
  std::chrono::milliseconds interval_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Entry> calls_;
  uint64_t next_id_ = 1;
  bool stop_ = false;
  std::atomic<uint64_t> cancelled_total_{0};
  std::thread thread_;
};

}  // namespace bragg::fusion
