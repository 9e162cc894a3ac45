#pragma once

// The gateway's workers: one Worker record per worker, grouped in pools (main, prefill, decode),
// each pool with the Router that picks its workers, and the fleet's weight version.
//
// One record per worker (Worker), owned by its pool's Router, in two parts with one lock each:
// - the routing part (url, healthy, stats, tree) under the Router's mutex, used by router.cc
//   alone (url is never changed once the worker is added, so anyone may read it);
// - the fleet's part (client, version, health_failures, last_answer, quarantined, needs_continue)
//   under its Pool's mutex, used through Pool's methods alone, held only while a field is read
//   or written, never across I/O.
// Lock order: a Pool's mutex may be held while the Router's is taken (Pool::AddWorker, so that
// a worker's index and its record's fleet part are set up together), never the reverse. A
// worker is in the Router a moment before its fleet part is set up, so code walking the
// Router's workers stops at Pool::size(). Records are never removed: a ClientPool* from
// Pool::Client stays valid for the pool's lifetime. The fleet's version has its own mutex, never
// held with another.

#include <array>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "gateway/http_util.h"
#include "gateway/radix_cache.h"
#include "gateway/router.h"

namespace bragg::gateway {

// Everything the gateway keeps about one worker. Locking: see the top of this file.
struct Worker {
  Worker(std::string url, size_t tree_capacity_tokens)
      : url(std::move(url)), tree(tree_capacity_tokens) {}

  // Routing part: the Router's, under its mutex.
  const std::string url;  // canonical "http://HOST:PORT"
  bool healthy = true;
  bool removed = false;  // Router::RemoveWorker; never healthy while removed
  WorkerSnapshot stats;
  RadixCache tree;  // approximate prefix tree of what the gateway sent it

  // Fleet part: under the Pool's mutex.
  std::unique_ptr<ClientPool> client;  // keep-alive connections for blocking control calls
  std::string version;                 // last known weight version, "" when unknown
  int health_failures = 0;             // consecutive failed health checks
  // When it last answered a request the gateway proxied (a whole response, status < 500):
  // evidence of life that a health probe timing out on a busy worker does not outweigh.
  std::chrono::steady_clock::time_point last_answer{};
  // Taken out by a weight update or a version check: the health loop admits it only after a
  // version check (and a continue_generation when it may be paused).
  bool quarantined = false;
  bool needs_continue = false;  // may still be paused by a failed update
  // KV bootstrap port of a prefill worker (sgl-router's `--prefill URL PORT`); -1: the gateway's
  // --bootstrap-port.
  int bootstrap_port = -1;
};

// One pool of workers and its Router. Thread-safe. Workers are numbered in the order they are
// added, as in the Router; a removed worker keeps its number and record (Router::RemoveWorker).
class Pool {
 public:
  // `worker_api_key`: see Fleet.
  Pool(std::string name, RouterOptions options, std::string worker_api_key = "");
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  const std::string& name() const { return name_; }
  Router& router() { return router_; }

  // Adds the worker at `url` ("http://HOST:PORT" or "HOST:PORT"), healthy or out of rotation
  // until the health loop admits it, with KV bootstrap port `bootstrap_port` (-1: the gateway's;
  // prefill workers); an existing member is left as it is, a removed one becomes a member again.
  // Returns whether it became a member now (false: it already was). InvalidArgument for a bad
  // url or port.
  Result<bool> AddWorker(const std::string& url, bool healthy, int bootstrap_port = -1);
  // Removes the member at `url` (canonicalized as AddWorker does); false when there is none.
  bool RemoveWorker(const std::string& url);
  // The canonical urls of the members (removed workers left out).
  std::vector<std::string> MemberUrls() const;
  int bootstrap_port(int worker) const;
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
  // `worker` answered a proxied request with `status` (< 500 counts as an answer).
  void RecordAnswer(int worker, int status);
  // Whether `worker` answered a proxied request at or after `t`.
  bool AnsweredSince(int worker, std::chrono::steady_clock::time_point t) const;
  bool quarantined(int worker) const;
  bool needs_continue(int worker) const;
  void SetNeedsContinue(int worker, bool needs_continue);
  void SetVersion(int worker, std::string version);
  // Last known weight version of `worker`, "" when unknown.
  std::string version(int worker) const;
  // `worker` passed the version check on `version`: its quarantine ends.
  void Admitted(int worker, std::string version);
  // Last known weight version per worker.
  std::vector<std::string> Versions() const;

 private:
  // The record of `worker` whose fleet part is set up; std::out_of_range otherwise (a
  // programmer error).
  Worker& Record(int worker) const;

  const std::string name_;
  const std::string worker_api_key_;
  mutable Router router_;  // owns the records; thread-safe
  mutable std::mutex mu_;
  size_t size_ = 0;  // records whose fleet part is set up; guarded by mu_
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
  // `worker_api_key`, when not empty, is sent to every worker as "Authorization: Bearer <key>"
  // by the keep-alive clients of Pool::Client.
  explicit Fleet(const RouterOptions& main, std::string worker_api_key = "");
  Fleet(const Fleet&) = delete;
  Fleet& operator=(const Fleet&) = delete;

  Pool& main() { return main_; }
  Pool& prefill() { return prefill_; }
  Pool& decode() { return decode_; }
  // main, prefill, decode.
  std::array<Pool*, 3> pools() { return {&main_, &prefill_, &decode_}; }
  // The workers in rotation now, pool by pool.
  std::vector<Target> HealthyTargets();
  // Every member (removed workers left out), healthy or not, pool by pool.
  std::vector<Target> Members();

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
