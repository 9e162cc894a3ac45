#pragma once

// bragg-rl's Prometheus /metrics (docs/rl.md "Outputs"): every step line of metrics.jsonl
// as counters (summed over the run) and gauges (the last step's value), each tool call into a
// latency histogram, and the controller's live state read at scrape time.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "common/status.h"

namespace bragg::rl {

// What the controller is doing now (read when /metrics is scraped).
struct LiveState {
  int64_t version = 0;             // the fleet's weight version
  int64_t rollouts_in_flight = 0;  // agent loops running
  int64_t generate_in_flight = 0;  // /generate calls in flight
  int64_t groups_admitted = 0;     // started and not yet trained or dropped
};

// Thread-safe.
class RunMetrics {
 public:
  explicit RunMetrics(std::function<LiveState()> live = nullptr);

  // A step line of metrics.jsonl (the keys docs/rl.md lists; a missing key is left as it was).
  void ObserveStep(const nlohmann::json& line);
  // Greedy success on the held-out prompts.
  void ObserveEval(double success);
  void ObserveToolCall(double ms);

  // The text exposition format, 0.0.4.
  std::string Render() const;

 private:
  std::function<LiveState()> live_;
  mutable std::mutex mu_;
  std::map<std::string, double> gauges_;    // name -> last value
  std::map<std::string, double> counters_;  // name -> sum over the run
  std::map<std::string, double> dropped_;   // reason -> trajectories
  std::map<int64_t, double> staleness_;     // versions behind -> trajectories trained
  std::map<std::string, double> phases_;    // generate, tools, train, sync, wait -> seconds
  std::vector<double> tool_buckets_;        // per bound of kToolBounds, cumulative at render
  double tool_sum_s_ = 0;
  int64_t tool_count_ = 0;
};

// GET /metrics on `listen` ("HOST:PORT"; port 0: any free one) until destroyed.
class MetricsServer {
 public:
  static Result<std::unique_ptr<MetricsServer>> Start(const std::string& listen,
                                                      const RunMetrics* metrics);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // http://HOST:PORT/metrics with the port bound.
  const std::string& url() const { return url_; }

 private:
  struct Impl;
  explicit MetricsServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::string url_;
};

}  // namespace bragg::rl
