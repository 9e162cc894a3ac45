#include "gateway/gateway.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "common/logging.h"
#include "gateway/metrics.h"
#include "gateway/request.h"

namespace bragg::gateway {

using nlohmann::json;

namespace {

HttpResponse JsonResponse(const json& body, int status = 200) {
  HttpResponse r;
  r.status = status;
  r.body = body.dump();
  return r;
}

AsyncHttpOptions ServerOptions(const GatewayOptions& options) {
  AsyncHttpOptions ho;
  ho.host = options.host;
  ho.port = options.port;
  ho.io_threads = options.io_threads;
  ho.max_blocking_threads = options.max_threads;
  ho.max_request_body = options.max_body_bytes;
  ho.max_upstream_response = options.max_upstream_response_bytes;
  ho.upstream_max_idle_ms = options.upstream_idle_ms;
  return ho;
}

ProxyOptions PairOptions(const GatewayOptions& options) {
  ProxyOptions po;
  po.disaggregated = !options.prefill_workers.empty();
  po.bootstrap_port = options.bootstrap_port;
  return po;
}

}  // namespace

Gateway::Gateway(GatewayOptions options)
    : options_(std::move(options)),
      server_(std::make_unique<AsyncHttpServer>(ServerOptions(options_))),
      fleet_(options_.router),
      weights_(&fleet_),
      proxy_(PairOptions(options_), &fleet_, server_.get()),
      health_(HealthOptions{options_.health_interval_ms, options_.health_failures}, &fleet_,
              &weights_) {
  Register();
}

Gateway::~Gateway() { Stop(); }

int Gateway::io_threads() const { return server_->io_threads(); }

Status Gateway::Start() {
  for (const std::string& w : options_.workers) {
    BRAGG_RETURN_IF_ERROR(Annotate(fleet_.main().AddWorker(w, true), "--worker"));
  }
  for (const std::string& w : options_.prefill_workers) {
    BRAGG_RETURN_IF_ERROR(Annotate(fleet_.prefill().AddWorker(w, true), "--prefill"));
  }
  for (const std::string& w : options_.decode_workers) {
    BRAGG_RETURN_IF_ERROR(Annotate(fleet_.decode().AddWorker(w, true), "--decode"));
  }
  if (options_.prefill_workers.empty() != options_.decode_workers.empty()) {
    return absl::InvalidArgumentError(
        "prefill/decode disaggregation needs both --prefill and --decode workers");
  }
  weights_.ReadFleetVersion();
  BRAGG_RETURN_IF_ERROR(server_->Start());
  port_ = server_->port();
  health_.Start();
  return absl::OkStatus();
}

void Gateway::Stop() {
  health_.Stop();
  server_->Stop();
}

Action Gateway::Handle(Endpoint endpoint, HttpRequest& req) {
  Result<Request> r =
      ParseRequest(endpoint, req, options_.dp_size, [this] { return proxy_.NewRid(); });
  if (!r.ok()) {
    return Action::Respond(ErrorResponse(400, std::string(r.status().message())));
  }
  return proxy_.Serve(std::move(*r));
}

WeightUpdateReport Gateway::UpdateWeights(const std::string& model_path,
                                          const std::string& version) {
  return weights_.Update(model_path, version);
}

void Gateway::Register() {
  AsyncHttpServer& s = *server_;
  s.Route("POST", "/generate",
          [this](HttpRequest& req) { return Handle(Endpoint::kGenerate, req); });
  for (const char* path : {"/v1/chat/completions", "/v1/completions"}) {
    s.Route("POST", path, [this](HttpRequest& req) { return Handle(Endpoint::kOpenAi, req); });
  }
  s.Route("GET", "/health", [](HttpRequest&) {
    HttpResponse r;
    r.content_type = "text/plain";
    return Action::Respond(std::move(r));
  });
  s.Route("GET", "/metrics", [this](HttpRequest&) {
    HttpResponse r;
    r.content_type = "text/plain; version=0.0.4";
    r.body = RenderMetrics(fleet_, {proxy_.client_aborts(), proxy_.upstream_errors(),
                                    weights_.updates_ok(), weights_.updates_failed()});
    return Action::Respond(std::move(r));
  });
  s.Route("GET", "/workers", [this](HttpRequest&) {
    json out = json::array();
    for (Pool* pool : fleet_.pools()) {
      for (const WorkerSnapshot& w : pool->router().Snapshot()) {
        out.push_back({{"pool", pool->name()},
                       {"url", w.url},
                       {"healthy", w.healthy},
                       {"in_flight", w.in_flight},
                       {"rollouts", w.rollouts},
                       {"requests", w.requests}});
      }
    }
    return Action::Respond(JsonResponse(out));
  });
  s.Route("POST", "/workers", [this](HttpRequest& req) {
    json body = json::parse(req.body, nullptr, false);
    if (!body.is_object() || !body.contains("url") || !body["url"].is_string()) {
      return Action::Respond(ErrorResponse(400, "body must be {\"url\": \"http://HOST:PORT\"}"));
    }
    // Out of rotation until the health loop checked its weight version.
    Status st = fleet_.main().AddWorker(body["url"].get<std::string>(), false);
    if (!st.ok()) {
      return Action::Respond(ErrorResponse(400, std::string(st.message())));
    }
    return Action::Respond(JsonResponse({{"success", true}}));
  });
  s.Route("POST", "/weights/update", [this](HttpRequest& req) {
    json body = json::parse(req.body, nullptr, false);
    if (!body.is_object() || !body.contains("model_path") || !body["model_path"].is_string() ||
        !body.contains("weight_version") || !body["weight_version"].is_string() ||
        body["weight_version"].get<std::string>().empty()) {
      return Action::Respond(ErrorResponse(
          400, "body must be {\"model_path\": \"...\", \"weight_version\": \"<non-empty>\"}"));
    }
    // Pauses, loads and continues the fleet with blocking calls: off the io threads.
    return Action::Blocking([this, path = body["model_path"].get<std::string>(),
                             version = body["weight_version"].get<std::string>()] {
      WeightUpdateReport report = UpdateWeights(path, version);
      return JsonResponse(report.ToJson(), report.success ? 200 : 500);
    });
  });
  s.Route("POST", "/rollouts/forget", [this](HttpRequest& req) {
    json body = json::parse(req.body, nullptr, false);
    if (!body.is_object() || !body.contains("routing_key") || !body["routing_key"].is_string()) {
      return Action::Respond(ErrorResponse(400, "body must be {\"routing_key\": \"...\"}"));
    }
    std::string key = body["routing_key"].get<std::string>();
    for (Pool* pool : fleet_.pools()) {
      pool->router().Forget(key);
    }
    return Action::Respond(JsonResponse({{"success", true}}));
  });
}

}  // namespace bragg::gateway
