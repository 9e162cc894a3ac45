#include "gateway/metrics.h"

#include <fmt/format.h>

#include <vector>

#include "common/prometheus.h"

namespace bragg::gateway {

std::string RenderMetrics(Fleet& fleet, const MetricCounters& counters) {
  std::string out;
  std::string fleet_version = fleet.version();
  out += "# TYPE bragg_gateway_worker_healthy gauge\n";
  out += "# TYPE bragg_gateway_worker_in_flight gauge\n";
  out += "# TYPE bragg_gateway_worker_rollouts gauge\n";
  out += "# TYPE bragg_gateway_worker_requests_total counter\n";
  out += "# TYPE bragg_gateway_worker_prompt_tokens_total counter\n";
  out += "# TYPE bragg_gateway_worker_cached_tokens_total counter\n";
  out += "# TYPE bragg_gateway_worker_cache_hit_rate gauge\n";
  out += "# TYPE bragg_gateway_worker_rollouts_moved_total counter\n";
  uint64_t prompt_all = 0;
  uint64_t cached_all = 0;
  int skew = 0;
  std::string versions_block;
  for (Pool* pool : fleet.pools()) {
    std::vector<WorkerSnapshot> snap = pool->router().Snapshot();
    std::vector<std::string> versions = pool->Versions();
    for (size_t i = 0; i < snap.size(); ++i) {
      const WorkerSnapshot& s = snap[i];
      if (s.removed) {
        continue;
      }
      std::string labels =
          fmt::format("pool=\"{}\",worker=\"{}\"", pool->name(), PrometheusLabelValue(s.url));
      out += fmt::format("bragg_gateway_worker_healthy{{{}}} {}\n", labels, s.healthy ? 1 : 0);
      out += fmt::format("bragg_gateway_worker_in_flight{{{}}} {}\n", labels, s.in_flight);
      out += fmt::format("bragg_gateway_worker_rollouts{{{}}} {}\n", labels, s.rollouts);
      out += fmt::format("bragg_gateway_worker_requests_total{{{}}} {}\n", labels, s.requests);
      out += fmt::format("bragg_gateway_worker_prompt_tokens_total{{{}}} {}\n", labels,
                         s.prompt_tokens);
      out += fmt::format("bragg_gateway_worker_cached_tokens_total{{{}}} {}\n", labels,
                         s.cached_tokens);
      out += fmt::format("bragg_gateway_worker_cache_hit_rate{{{}}} {:.6f}\n", labels,
                         s.prompt_tokens == 0 ? 0.0
                                              : static_cast<double>(s.cached_tokens) /
                                                    static_cast<double>(s.prompt_tokens));
      out +=
          fmt::format("bragg_gateway_worker_rollouts_moved_total{{{}}} {}\n", labels, s.moved_out);
      std::string v = i < versions.size() ? versions[i] : "";
      versions_block += fmt::format("bragg_gateway_worker_weight_version{{{},version=\"{}\"}} 1\n",
                                    labels, PrometheusLabelValue(v));
      if (s.healthy && !fleet_version.empty() && v != fleet_version) {
        ++skew;
      }
      prompt_all += s.prompt_tokens;
      cached_all += s.cached_tokens;
    }
  }
  out += "# TYPE bragg_gateway_worker_weight_version gauge\n" + versions_block;
  out += "# TYPE bragg_gateway_cache_hit_rate gauge\n";
  out += fmt::format(
      "bragg_gateway_cache_hit_rate {:.6f}\n",
      prompt_all == 0 ? 0.0 : static_cast<double>(cached_all) / static_cast<double>(prompt_all));
  out += "# TYPE bragg_gateway_routing_decisions_total counter\n";
  for (Pool* pool : fleet.pools()) {
    for (const auto& [reason, n] : pool->router().DecisionCounts()) {
      out += fmt::format("bragg_gateway_routing_decisions_total{{pool=\"{}\",reason=\"{}\"}} {}\n",
                         pool->name(), PrometheusLabelValue(reason), n);
    }
  }
  out += "# TYPE bragg_gateway_weight_version_skew gauge\n";
  out += fmt::format("bragg_gateway_weight_version_skew {}\n", skew);
  out += "# TYPE bragg_gateway_client_aborts_total counter\n";
  out += fmt::format("bragg_gateway_client_aborts_total {}\n", counters.client_aborts);
  out += "# TYPE bragg_gateway_upstream_errors_total counter\n";
  out += fmt::format("bragg_gateway_upstream_errors_total {}\n", counters.upstream_errors);
  out += "# TYPE bragg_gateway_weight_updates_total counter\n";
  out += fmt::format("bragg_gateway_weight_updates_total{{result=\"ok\"}} {}\n",
                     counters.weight_updates_ok);
  out += fmt::format("bragg_gateway_weight_updates_total{{result=\"failed\"}} {}\n",
                     counters.weight_updates_failed);
  out += fmt::format("bragg_gateway_weight_updates_total{{result=\"external\"}} {}\n",
                     counters.weight_updates_external);
  return out;
}

}  // namespace bragg::gateway
