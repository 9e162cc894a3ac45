#pragma once

// The gateway's Prometheus text (docs/gateway.md, "Metrics").

#include <cstdint>
#include <string>

#include "gateway/fleet.h"

namespace bragg::gateway {

// Gateway-wide counters, read by the caller from the Proxy and the WeightUpdater.
struct MetricCounters {
  uint64_t client_aborts = 0;
  uint64_t upstream_errors = 0;
  uint64_t weight_updates_ok = 0;
  uint64_t weight_updates_failed = 0;
  // Fleet versions learnt from the workers (weights changed outside the gateway).
  uint64_t weight_updates_external = 0;
};

// Per-worker gauges and counters of every pool of `fleet`, the routing decisions, the weight
// version skew and `counters`, in the Prometheus text format (label values escaped).
std::string RenderMetrics(Fleet& fleet, const MetricCounters& counters);

}  // namespace bragg::gateway
