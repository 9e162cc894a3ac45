#pragma once

// The gateway's workers: one Worker record per worker, grouped in pools (main, prefill, decode),
// each pool with the Router that picks its workers, and the fleet's weight version.
//
// Locking: each Pool has one mutex guarding its Worker records, held only while a record is
// read or written, never across I/O. The Router (router.h) keeps its own mutex over its own
// per-worker table (health, load, cache tree), indexed like the records; the only nesting is
// Pool::AddWorker, which holds the pool's mutex around Router::AddWorker so that indices agree
// (never the reverse order). A worker is in the Router a moment before its record exists, so
// code walking the Router's workers stops at Pool::size(). Records are never removed: a
// ClientPool* from Pool::Client stays valid for the pool's lifetime. The fleet's version has its
// own mutex, never held with another.

#include <array>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "gateway/http_util.h"
#include "gateway/router.h"

namespace bragg::gateway {

// What the gateway keeps about one worker beside the Router's table. Guarded by its Pool's mutex.
struct Worker {
  std::string url;                     // canonical "http://HOST:PORT"
  std::unique_ptr<ClientPool> client;  // keep-alive connections for blocking control calls
  std::string version;                 // last known weight version, "" when unknown
  int health_failures = 0;             // consecutive failed health checks
  // Taken out by a weight update or a version check: the health loop admits it only after a
  // version check (and a continue_generation when it may be paused).
  bool quarantined = false;
  bool needs_continue = false;  // may still be paused by a failed update
};

// One pool of workers and its Router. Thread-safe. Workers are numbered in the order they are
// added, as in the Router, and never removed.
class Pool {
 public:
  Pool(std::string name, RouterOptions options);
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  const std::string& name() const { return name_; }
  Router& router() { return router_; }

  // Adds the worker at `url` ("http://HOST:PORT" or "HOST:PORT"), healthy or out of rotation
  // until the health loop admits it; an existing url is left as it is. InvalidArgument for a bad
  // url.
  Status AddWorker(const std::string& url, bool healthy);
  // Workers with a record.
  size_t size() const;
  // Keep-alive connections to `worker`; valid as long as the pool.
  ClientPool* Client(int worker);
  std::string url(int worker) const;

  // Takes `worker` out of rotation (the health loop may bring it back).
  void MarkDown(int worker, std::string_view why);
  // Takes `worker` out until the health loop admits it again after a version check;
  // `needs_continue`: it may still be paused.
  void Quarantine(int worker, std::string_view why, bool needs_continue);
  // Counts a health check; returns the consecutive failures (0 after a good one).
  int RecordHealthCheck(int worker, bool ok);
  bool quarantined(int worker) const;
  bool needs_continue(int worker) const;
  void SetNeedsContinue(int worker, bool needs_continue);
  void SetVersion(int worker, std::string version);
  // `worker` passed the version check on `version`: its quarantine ends.
  void Admitted(int worker, std::string version);
  // Last known weight version per worker.
  std::vector<std::string> Versions() const;

 private:
  const std::string name_;
  Router router_;
  mutable std::mutex mu_;
  std::deque<Worker> workers_;  // by index; guarded by mu_
};

// One worker of one pool.
struct Target {
  Pool* pool;
  int worker;
  std::string url;
};

// The three pools (prefill and decode always sticky) and the fleet's weight version: the
// version every worker in rotation must report. Thread-safe.
class Fleet {
 public:
  explicit Fleet(const RouterOptions& main);
  Fleet(const Fleet&) = delete;
  Fleet& operator=(const Fleet&) = delete;

  Pool& main() { return main_; }
  Pool& prefill() { return prefill_; }
  Pool& decode() { return decode_; }
  // main, prefill, decode.
  std::array<Pool*, 3> pools() { return {&main_, &prefill_, &decode_}; }
  // The workers in rotation now, pool by pool.
  std::vector<Target> HealthyTargets();

  std::string version() const;
  void set_version(std::string version);
  // The fleet's version; when none is known yet, `reported` becomes it.
  std::string VersionOr(const std::string& reported);

 private:
  Pool main_;
  Pool prefill_;
  Pool decode_;
  mutable std::mutex version_mu_;
  std::string version_;  // guarded by version_mu_
};

}  // namespace bragg::gateway
