// bragg-gateway --listen 127.0.0.1:PORT --worker http://127.0.0.1:P1 ... [--policy P]
// Also takes sgl-router's spellings (docs/gateway.md, "Drop-in for sgl-router"):
// --host H --port P, --worker-urls URL..., --pd-disaggregation --prefill URL [PORT|none]
// --decode URL, --api-key K.

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <optional>
#include <string_view>

#include "common/logging.h"
#include "gateway/gateway.h"
#include "gateway/http_util.h"

namespace {

// sgl-router's `--prefill URL [BOOTSTRAP_PORT|none]`, repeated; Bragg's `--prefill URL...` too:
// within one occurrence a port (or "none") belongs to the url before it.
bragg::Status SplitPrefill(const std::vector<std::vector<std::string>>& groups,
                           bragg::gateway::GatewayOptions* o) {
  for (const std::vector<std::string>& group : groups) {
    for (const std::string& token : group) {
      int port = -1;
      auto [end, ec] = std::from_chars(token.data(), token.data() + token.size(), port);
      bool is_port = ec == std::errc() && end == token.data() + token.size();
      if (!is_port && token != "none") {
        o->prefill_workers.push_back(token);
        o->prefill_bootstrap_ports.push_back(-1);
        continue;
      }
      if (o->prefill_workers.empty() || o->prefill_bootstrap_ports.back() != -1 ||
          (is_port && (port < 0 || port > 65535))) {
        return absl::InvalidArgumentError(fmt::format(
            "--prefill: '{}' must follow a url, as a bootstrap port (0-65535) or none", token));
      }
      o->prefill_bootstrap_ports.back() = is_port ? port : -1;
    }
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Bragg rollout gateway for SGLang workers"};
  std::string listen = "127.0.0.1:8080";
  std::string policy = "sticky";
  bragg::gateway::GatewayOptions o;
  std::string host;
  int port = -1;
  std::vector<std::vector<std::string>> prefill;
  app.add_option("--listen", listen, "HOST:PORT to serve on (port 0: any)");
  app.add_option("--host", host, "host to serve on (sgl-router's; beside --listen's port)");
  app.add_option("--port", port, "port to serve on (sgl-router's; beside --listen's host)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--worker,--worker-urls", o.workers, "worker URL http://HOST:PORT (repeat)");
  app.add_option("--policy", policy,
                 "sticky|cache_aware|sgl_cache_aware|round_robin|least_load (sgl-router's "
                 "manual: sticky, power_of_two: least_load)");
  app.add_option("--prefill", prefill,
                 "prefill worker URL [BOOTSTRAP_PORT|none] (PD disaggregation; repeat)")
      ->expected(1, 1 << 20);
  app.add_option("--decode", o.decode_workers, "decode worker URL (PD disaggregation)");
  app.add_flag("--pd-disaggregation", o.pd_disaggregation,
               "serve prefill/decode pairs, also with no worker given at start");
  app.add_option("--api-key", o.api_key,
                 "clients must send Authorization: Bearer KEY (not /health, /metrics); also "
                 "sent to the workers unless --worker-api-key is given");
  std::optional<std::string> worker_api_key;
  app.add_option("--worker-api-key", worker_api_key,
                 "sent to the workers as Authorization: Bearer KEY (\"\": none)");
  app.add_option("--bootstrap-port", o.bootstrap_port, "prefill workers' bootstrap port");
  app.add_option("--dp-size", o.dp_size, "DP-attention ranks per worker: pin rollouts to one")
      ->check(CLI::Range(1, 1024));
  app.add_option("--health-interval-ms", o.health_interval_ms, "health check period");
  app.add_option("--health-failures,--health-failure-threshold", o.health_failures,
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
  o.worker_api_key = worker_api_key.value_or(o.api_key);
  (void)bragg::InitLogging(argv[0], "info");
  if (bragg::Status st = SplitPrefill(prefill, &o); !st.ok()) {
    spdlog::error("{}", std::string(st.message()));
    return 2;
  }
  if (!host.empty() || port >= 0) {
    auto hp = bragg::gateway::ParseHostPort(listen);
    if (!hp.ok()) {
      spdlog::error("--listen: {}", std::string(hp.status().message()));
      return 2;
    }
    listen = fmt::format("{}:{}", host.empty() ? hp->host : host, port >= 0 ? port : hp->port);
  }
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
