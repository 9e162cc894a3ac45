// bragg-gateway --listen 127.0.0.1:PORT --worker http://127.0.0.1:P1 ... [--policy P]

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <optional>

#include "common/logging.h"
#include "gateway/gateway.h"
#include "gateway/http_util.h"

int main(int argc, char** argv) {
  CLI::App app{"Bragg rollout gateway for SGLang workers"};
  std::string listen = "127.0.0.1:8080";
  std::string policy = "sticky";
  bragg::gateway::GatewayOptions o;
  app.add_option("--listen", listen, "HOST:PORT to serve on (port 0: any)");
  app.add_option("--worker", o.workers, "worker URL http://HOST:PORT (repeat)");
  app.add_option("--policy", policy, "sticky|cache_aware|round_robin|least_load");
  app.add_option("--prefill", o.prefill_workers, "prefill worker URL (PD disaggregation)");
  app.add_option("--decode", o.decode_workers, "decode worker URL (PD disaggregation)");
  app.add_option("--bootstrap-port", o.bootstrap_port, "prefill workers' bootstrap port");
  app.add_option("--dp-size", o.dp_size, "DP-attention ranks per worker: pin rollouts to one")
      ->check(CLI::Range(1, 1024));
  app.add_option("--health-interval-ms", o.health_interval_ms, "health check period");
  app.add_option("--health-failures", o.health_failures,
                 "consecutive failed health checks before a worker is taken out")
      ->check(CLI::Range(1, 1000));
  app.add_option("--io-threads", o.io_threads, "event-loop threads (0: one per core)")
      ->check(CLI::Range(0, 1024));
  app.add_option("--cache-threshold", o.router.cache_threshold, "sgl_cache_aware match rate");
  app.add_option("--balance-abs-threshold", o.router.balance_abs_threshold, "load gap");
  app.add_option("--balance-rel-threshold", o.router.balance_rel_threshold, "load ratio");
  app.add_option("--bounded-load", o.router.bounded_load_factor,
                 "new rollouts go to workers under this multiple of the mean load");
  size_t max_body_mb = o.max_body_bytes >> 20;
  size_t max_response_mb = o.max_upstream_response_bytes >> 20;
  app.add_option("--max-body-mb", max_body_mb, "largest request body in MiB (413 beyond)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--max-upstream-response-mb", max_response_mb,
                 "largest buffered worker response in MiB (502 beyond)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--upstream-idle-ms", o.upstream_idle_ms,
                 "close pooled worker connections idle longer than this (below the workers' "
                 "keep-alive timeout)")
      ->check(CLI::Range(1, 3600 * 1000));
  CLI11_PARSE(app, argc, argv);
  o.max_body_bytes = max_body_mb << 20;
  o.max_upstream_response_bytes = max_response_mb << 20;
  (void)bragg::InitLogging(argv[0], "info");
  auto p = bragg::gateway::ParsePolicy(policy);
  if (!p.ok()) {
    spdlog::error("--policy: {}", std::string(p.status().message()));
    return 2;
  }
  o.router.policy = *p;
  std::optional<bragg::gateway::Gateway> gateway;
  return bragg::gateway::ServeUntilTerminated(
      listen,
      [&](const bragg::gateway::HostPort& hp) -> bragg::Result<std::string> {
        o.host = hp.host;
        o.port = hp.port;
        gateway.emplace(o);
        BRAGG_RETURN_IF_ERROR(gateway->Start());
        return fmt::format("http://{}:{}", o.host, gateway->port());
      },
      [&] { gateway->Stop(); });
}
