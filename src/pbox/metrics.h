#pragma once

// Prometheus metrics for pboxd: counters, gauges, histograms and scrape-time callback gauges
// kept in a Registry that the agent owns (no globals), rendered in the Prometheus text
// exposition format 0.0.4 and served over HTTP by MetricsServer.
//
// Hot path (Inc/Set/Add/Observe) is lock-free: std::atomic only. Registration and rendering take
// the registry's mutex.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/status.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace bragg::pbox {

// Label name/value pairs of one series. Names must match [a-zA-Z_][a-zA-Z0-9_]* and not start
// with "__"; values are any UTF-8 text (escaped when rendered). Order does not matter: a series
// is identified by its label set, and labels are rendered sorted by name.
using MetricLabels = std::vector<std::pair<std::string, std::string>>;

// A monotonically increasing integer count. Thread-safe and lock-free.
class Counter {
 public:
  Counter() = default;
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  void Inc(uint64_t n = 1) { value_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

// A value that goes up and down. Thread-safe and lock-free (Add is a CAS loop on x86-64).
class Gauge {
 public:
  Gauge() = default;
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double delta) { value_.fetch_add(delta, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Counts observations into fixed buckets. A value v lands in the first bucket whose upper bound
// b satisfies v <= b (Prometheus "le" semantics), or in the implicit +Inf bucket. NaN lands in
// +Inf only and makes the sum NaN (as client_golang does). Thread-safe and lock-free.
class Histogram {
 public:
  // `upper_bounds` must be finite and strictly increasing (a trailing +Inf is accepted and
  // dropped); violating this is a programmer error and aborts. Use Registry::AddHistogram.
  explicit Histogram(std::vector<double> upper_bounds);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  void Observe(double v);

  // Finite upper bounds, as given (without +Inf).
  const std::vector<double>& upper_bounds() const { return bounds_; }
  // Cumulative counts, upper_bounds().size() + 1 entries: [i] counts observations <=
  // upper_bounds()[i], the last entry is +Inf (all observations). Each bucket is read once, so
  // the result is monotonic even while other threads observe.
  std::vector<uint64_t> CumulativeCounts() const;
  // Number of observations.
  uint64_t count() const { return CumulativeCounts().back(); }
  double sum() const { return sum_.load(std::memory_order_relaxed); }

 private:
  std::vector<double> bounds_;
  // Non-cumulative per-bucket counts; bounds_.size() + 1 entries, the last one is +Inf.
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;
  std::atomic<double> sum_{0.0};
};

// Bucket upper bounds for latencies in seconds: 50 µs to 60 s in roughly x2.5 steps.
std::vector<double> LatencyBucketsSeconds();

// Owns all metrics of one agent. Add* returns a pointer owned by the registry, stable for the
// registry's lifetime. Every method is thread-safe.
//
// A family is one metric name with one type and one help text; each distinct label set is one
// series of that family. Programmer errors abort (in every build type): an invalid metric or
// label name, a duplicate label name, the label "le" on a histogram, re-registering a name with
// another type or help text, a histogram series with different buckets than its family, or a
// callback gauge whose label set already exists. Adding an existing (name, labels) series of
// the same type returns the existing metric.
class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  Counter* AddCounter(const std::string& name, const std::string& help,
                      const MetricLabels& labels = {});
  Gauge* AddGauge(const std::string& name, const std::string& help,
                  const MetricLabels& labels = {});
  // `buckets`: see Histogram. Every series of a family must use the same buckets.
  Histogram* AddHistogram(const std::string& name, const std::string& help,
                          std::vector<double> buckets, const MetricLabels& labels = {});
  // A gauge whose value is `fn()` at each Render(). `fn` is called from the scraping thread with
  // the registry's mutex held: it must be thread-safe, must not throw, must not call into this
  // registry, and must stay callable for the registry's lifetime. Shares a family with plain
  // gauges of the same name.
  void AddCallbackGauge(const std::string& name, const std::string& help,
                        std::function<double()> fn, const MetricLabels& labels = {});

  // Text exposition format 0.0.4: families in registration order, each with one # HELP and
  // # TYPE line, series in registration order.
  std::string Render() const;

 private:
  struct Series;
  struct Family;
  Family* FamilyFor(const std::string& name, const std::string& help, int type);

  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Family>> families_;  // Guarded by mu_.
};

// Serves a Registry over HTTP: GET /metrics (text/plain; version=0.0.4), GET /healthz ("ok"),
// 404 for anything else. Runs its own accept thread (and httplib's worker pool); the destructor
// stops the server and joins. Not copyable or movable; use through the unique_ptr.
class MetricsServer {
 public:
  // `registry` is not owned and must outlive the server. `listen` is "HOST:PORT" ("[::1]:9100"
  // for IPv6); port 0 picks a free port, see port(). Errors: InvalidArgument for a malformed
  // `listen`; Unavailable/PermissionDenied/... when the address cannot be bound, with a message
  // like "cannot listen on 127.0.0.1:9100: Address already in use".
  [[nodiscard]] static Result<std::unique_ptr<MetricsServer>> Start(const Registry* registry,
                                                                    const std::string& listen);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // The bound TCP port (the chosen one when started with port 0).
  int port() const { return port_; }

 private:
  MetricsServer();

  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::atomic<bool> finished_{false};
  int port_ = 0;
};

}  // namespace bragg::pbox
