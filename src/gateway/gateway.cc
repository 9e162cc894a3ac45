#include "gateway/gateway.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <charconv>
#include <future>
#include <optional>

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
  if (!options.worker_api_key.empty()) {
    ho.upstream_authorization = "Bearer " + options.worker_api_key;
  }
  return ho;
}

ProxyOptions PairOptions(const GatewayOptions& options) {
  ProxyOptions po;
  po.disaggregated = options.pd_disaggregation || !options.prefill_workers.empty() ||
                     !options.decode_workers.empty();
  po.bootstrap_port = options.bootstrap_port;
  return po;
}

// Compares without an early exit, so that the time taken does not tell how much of a guessed
// key was right.
bool SameKey(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

// sgl-router's bootstrap port spellings: a port number, "none" or nothing (-1: the default).
Result<int> ParseBootstrapPort(std::string_view text) {
  if (text.empty() || text == "none") {
    return -1;
  }
  int port = -1;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), port);
  if (ec != std::errc() || end != text.data() + text.size() || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        fmt::format("bootstrap_port {:.40} is not a port (0-65535) or none", text));
  }
  return port;
}

// One blocking GET or POST to a worker of the fleet, for the fan-out calls.
struct WorkerAnswer {
  bool ok = false;  // a whole response arrived (any status)
  int status = 0;
  std::string body;
  std::string content_type;
  std::string error;
};

WorkerAnswer AskWorker(const Target& t, const std::string& method, const std::string& path) {
  auto c = t.pool->Client(t.worker)->NewClient();
  c->set_connection_timeout(2, 0);
  c->set_read_timeout(60, 0);
  auto r = method == "GET" ? c->Get(path) : c->Post(path, "", "application/json");
  WorkerAnswer a;
  if (!r) {
    a.error = httplib::to_string(r.error());
    return a;
  }
  a.ok = true;
  a.status = r->status;
  a.body = std::move(r->body);
  a.content_type = r->get_header_value("Content-Type");
  return a;
}

// `method` `path` on every target at once; answers in the targets' order.
std::vector<WorkerAnswer> FanOut(const std::vector<Target>& targets, const std::string& method,
                                 const std::string& path) {
  std::vector<std::future<WorkerAnswer>> fs;
  fs.reserve(targets.size());
  for (const Target& t : targets) {
    fs.push_back(std::async(std::launch::async,
                            [&t, &method, &path] { return AskWorker(t, method, path); }));
  }
  std::vector<WorkerAnswer> out;
  out.reserve(fs.size());
  for (auto& f : fs) {
    out.push_back(f.get());
  }
  return out;
}

// sgl-router's error body on its /workers routes (protocols/worker_spec.rs WorkerErrorResponse).
HttpResponse WorkerError(int status, std::string message, std::string_view code) {
  return JsonResponse({{"error", std::move(message)}, {"code", code}}, status);
}

// A path segment's percent-decoding ("+" stays "+"). InvalidArgument for a malformed escape or
// a NUL byte.
Result<std::string> DecodePathSegment(std::string_view s) {
  auto hex = [](char c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
  };
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out.push_back(s[i]);
      continue;
    }
    if (i + 2 >= s.size() || hex(s[i + 1]) < 0 || hex(s[i + 2]) < 0) {
      return absl::InvalidArgumentError("malformed %-escape in the worker id or url");
    }
    out.push_back(static_cast<char>(hex(s[i + 1]) * 16 + hex(s[i + 2])));
    i += 2;
  }
  if (out.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError("NUL byte in the worker id or url");
  }
  return out;
}

// The id GET /workers gives a worker: UUID-shaped, as sgl-router's, but derived from its
// canonical url (two FNV-1a hashes), so that it is the same after a restart or a re-add.
std::string WorkerId(std::string_view url) {
  auto fnv = [url](uint64_t h) {
    for (char c : url) {
      h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ULL;
    }
    return h;
  };
  uint64_t hi = fnv(0xcbf29ce484222325ULL);
  uint64_t lo = fnv(0x84222325cbf29ce4ULL);
  hi = (hi & ~uint64_t{0xf000}) | 0x8000;                  // version 8: custom
  lo = (lo & ~(uint64_t{3} << 62)) | (uint64_t{2} << 62);  // RFC 4122 variant
  return fmt::format("{:08x}-{:04x}-{:04x}-{:04x}-{:012x}", hi >> 32, (hi >> 16) & 0xffff,
                     hi & 0xffff, lo >> 48, lo & 0xffffffffffffULL);
}

HttpResponse TextResponse(std::string text, int status = 200) {
  HttpResponse r;
  r.status = status;
  r.content_type = "text/plain; charset=utf-8";
  r.body = std::move(text);
  return r;
}

}  // namespace

Gateway::Gateway(GatewayOptions options)
    : options_(std::move(options)),
      server_(std::make_unique<AsyncHttpServer>(ServerOptions(options_))),
      fleet_(options_.router, options_.worker_api_key),
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
    BRAGG_RETURN_IF_ERROR(Annotate(fleet_.main().AddWorker(w, true).status(), "--worker"));
  }
  for (size_t i = 0; i < options_.prefill_workers.size(); ++i) {
    int port =
        i < options_.prefill_bootstrap_ports.size() ? options_.prefill_bootstrap_ports[i] : -1;
    BRAGG_RETURN_IF_ERROR(Annotate(
        fleet_.prefill().AddWorker(options_.prefill_workers[i], true, port).status(), "--prefill"));
  }
  for (const std::string& w : options_.decode_workers) {
    BRAGG_RETURN_IF_ERROR(Annotate(fleet_.decode().AddWorker(w, true).status(), "--decode"));
  }
  if (!options_.pd_disaggregation &&
      options_.prefill_workers.empty() != options_.decode_workers.empty()) {
    return absl::InvalidArgumentError(
        "prefill/decode disaggregation needs both --prefill and --decode workers (or "
        "--pd-disaggregation, to register the others later with POST /add_worker)");
  }
  if (disaggregated() && !options_.workers.empty()) {
    return absl::InvalidArgumentError(
        "--worker/--worker-urls and prefill/decode workers cannot be mixed: a gateway serves "
        "either one pool or prefill/decode pairs");
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
  Route("POST", "/generate", [this](HttpRequest& req) { return Handle(Endpoint::kGenerate, req); });
  for (const char* path : {"/v1/chat/completions", "/v1/completions"}) {
    Route("POST", path, [this](HttpRequest& req) { return Handle(Endpoint::kOpenAi, req); });
  }
  auto health = [](HttpRequest&) {
    HttpResponse r;
    r.content_type = "text/plain";
    return Action::Respond(std::move(r));
  };
  for (const char* path : {"/health", "/liveness", "/readiness"}) {
    Route("GET", path, health, /*open=*/true);
  }
  Route(
      "GET", "/metrics",
      [this](HttpRequest&) {
        HttpResponse r;
        r.content_type = "text/plain; version=0.0.4";
        r.body = RenderMetrics(
            fleet_, {proxy_.client_aborts(), proxy_.upstream_errors(), weights_.updates_ok(),
                     weights_.updates_failed(), weights_.updates_external()});
        return Action::Respond(std::move(r));
      },
      /*open=*/true);
  // sgl-router's worker API (its server.rs, protocols/worker_spec.rs): GET /workers,
  // POST /workers, GET and DELETE /workers/{id or url-encoded url}.
  Route("GET", "/workers", [this](HttpRequest&) {
    json workers = WorkerInfos();
    size_t counts[3] = {0, 0, 0};  // regular, prefill, decode
    for (const json& w : workers) {
      const std::string& type = w["worker_type"].get_ref<const std::string&>();
      ++counts[type == "prefill" ? 1 : type == "decode" ? 2 : 0];
    }
    size_t total = workers.size();
    return Action::Respond(JsonResponse({{"workers", std::move(workers)},
                                         {"total", total},
                                         {"stats",
                                          {{"prefill_count", counts[1]},
                                           {"decode_count", counts[2]},
                                           {"regular_count", counts[0]}}}}));
  });
  Route("POST", "/workers", [this](HttpRequest& req) {
    json body = json::parse(req.body, nullptr, false);
    auto string_or_null = [&body](const char* key) {
      return !body.contains(key) || body[key].is_string() || body[key].is_null();
    };
    if (!body.is_object() || !body.contains("url") || !body["url"].is_string() ||
        !string_or_null("worker_type") || !string_or_null("api_key")) {
      return Action::Respond(
          ErrorResponse(400,
                        "body must be {\"url\": \"http://HOST:PORT\"[, \"worker_type\": "
                        "\"regular|prefill|decode\", \"bootstrap_port\": PORT]}"));
    }
    int port = -1;
    if (body.contains("bootstrap_port") && !body["bootstrap_port"].is_null()) {
      const json& p = body["bootstrap_port"];
      if (!p.is_number_integer() || p.get<int64_t>() < 0 || p.get<int64_t>() > 65535) {
        return Action::Respond(ErrorResponse(400, "bootstrap_port must be a port (0-65535)"));
      }
      port = p.get<int>();
    }
    // sgl-router keeps a key per worker; the gateway sends one key (--worker-api-key) to all.
    if (body.contains("api_key") && body["api_key"].is_string() &&
        body["api_key"].get<std::string>() != options_.worker_api_key) {
      return Action::Respond(
          ErrorResponse(400,
                        "a per-worker api_key is not supported: every worker gets the gateway's "
                        "--worker-api-key; leave api_key out or give that key"));
    }
    std::string type =
        body["worker_type"].is_string() ? body["worker_type"].get<std::string>() : std::string();
    // Out of rotation until the health loop checked its weight version.
    Result<bool> added = AddWorker(body["url"].get<std::string>(), type, port);
    if (!added.ok()) {
      return Action::Respond(ErrorResponse(400, std::string(added.status().message())));
    }
    Result<HostPort> hp = ParseHostPort(body["url"].get<std::string>());  // AddWorker parsed it
    std::string url = fmt::format("http://{}:{}", hp->host, hp->port);
    std::string id = WorkerId(url);
    // sgl-router's fields (it answers 202: its job queue adds the worker later; here it is a
    // member already) and Bragg's.
    return Action::Respond(
        JsonResponse({{"status", "accepted"},
                      {"worker_id", id},
                      {"url", url},
                      {"location", "/workers/" + id},
                      {"message", *added ? "Worker added" : "Worker is already registered"},
                      {"success", true},
                      {"added", *added}}));
  });
  for (const char* method : {"GET", "DELETE"}) {
    RoutePrefix(method, "/workers/",
                [this, delete_it = std::string(method) == "DELETE"](HttpRequest& req) {
                  Result<std::string> key = DecodePathSegment(
                      std::string_view(req.path).substr(std::string_view("/workers/").size()));
                  if (!key.ok()) {
                    return Action::Respond(
                        WorkerError(400, std::string(key.status().message()), "BAD_REQUEST"));
                  }
                  std::optional<json> info = FindWorker(*key);
                  bool removed = false;
                  if (info && delete_it) {
                    for (Pool* pool : fleet_.pools()) {
                      removed = pool->RemoveWorker((*info)["url"].get<std::string>()) || removed;
                    }
                  }
                  if (!info || (delete_it && !removed)) {
                    return Action::Respond(WorkerError(
                        404, fmt::format("Worker {:.200} not found", *key), "WORKER_NOT_FOUND"));
                  }
                  if (!delete_it) {
                    return Action::Respond(JsonResponse(*info));
                  }
                  return Action::Respond(JsonResponse({{"status", "accepted"},
                                                       {"success", true},
                                                       {"worker_id", (*info)["id"]},
                                                       {"url", (*info)["url"]},
                                                       {"message", "Worker removed"}}));
                });
  }
  Route("POST", "/weights/update", [this](HttpRequest& req) {
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
  Route("POST", "/rollouts/forget", [this](HttpRequest& req) {
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
  RegisterSglRouter();
}

bool Gateway::disaggregated() const {
  return options_.pd_disaggregation || !options_.prefill_workers.empty() ||
         !options_.decode_workers.empty();
}

void Gateway::Route(const std::string& method, const std::string& path, Handler handler,
                    bool open) {
  server_->Route(method, path, Guard(std::move(handler), open));
}

void Gateway::RoutePrefix(const std::string& method, const std::string& prefix, Handler handler) {
  server_->RoutePrefix(method, prefix, Guard(std::move(handler), /*open=*/false));
}

Handler Gateway::Guard(Handler handler, bool open) {
  if (open || options_.api_key.empty()) {
    return handler;
  }
  return [this, handler = std::move(handler)](HttpRequest& req) {
    std::string auth = req.Header("Authorization");
    constexpr std::string_view kBearer = "Bearer ";
    if (auth.size() < kBearer.size() || auth.compare(0, kBearer.size(), kBearer) != 0 ||
        !SameKey(std::string_view(auth).substr(kBearer.size()), options_.api_key)) {
      HttpResponse r = ErrorResponse(401,
                                     "missing or wrong API key: send the gateway's --api-key as "
                                     "\"Authorization: Bearer <key>\"");
      r.headers.emplace_back("WWW-Authenticate", "Bearer");
      return Action::Respond(std::move(r));
    }
    return handler(req);
  };
}

Result<bool> Gateway::AddWorker(const std::string& url, const std::string& worker_type,
                                int bootstrap_port) {
  Pool* pool = nullptr;
  if (worker_type.empty() || worker_type == "regular") {
    if (disaggregated()) {
      return absl::InvalidArgumentError(
          "this gateway serves prefill/decode pairs: give worker_type=prefill or decode");
    }
    pool = &fleet_.main();
  } else if (worker_type == "prefill" || worker_type == "decode") {
    if (!disaggregated()) {
      return absl::InvalidArgumentError(fmt::format(
          "worker_type {} needs a gateway started with --pd-disaggregation", worker_type));
    }
    pool = worker_type == "prefill" ? &fleet_.prefill() : &fleet_.decode();
  } else {
    return absl::InvalidArgumentError(
        fmt::format("worker_type must be regular, prefill or decode, not {:.40}", worker_type));
  }
  if (bootstrap_port >= 0 && pool != &fleet_.prefill()) {
    return absl::InvalidArgumentError("bootstrap_port is for prefill workers only");
  }
  Result<HostPort> hp = ParseHostPort(url);
  if (!hp.ok()) {
    return absl::InvalidArgumentError(
        fmt::format("url {:.200}: {}", url, std::string(hp.status().message())));
  }
  if (hp->port == 0) {
    return absl::InvalidArgumentError(fmt::format("url {:.200}: port 0 is no worker", url));
  }
  // A url belongs to one pool: registering it in another would route to it twice.
  std::string canonical = fmt::format("http://{}:{}", hp->host, hp->port);
  for (Pool* other : fleet_.pools()) {
    if (other == pool) {
      continue;
    }
    for (const std::string& member : other->MemberUrls()) {
      if (member == canonical) {
        return absl::InvalidArgumentError(
            fmt::format("{} is already a {} worker; remove it first", canonical, other->name()));
      }
    }
  }
  BRAGG_ASSIGN_OR_RETURN(bool added, pool->AddWorker(canonical, false, bootstrap_port));
  if (added) {
    spdlog::info("worker {} registered in pool {}", canonical, pool->name());
  }
  return added;
}

void Gateway::RegisterSglRouter() {
  // sgl-router's legacy worker calls (slime, miles): POST /add_worker?url=U[&worker_type=T]
  // [&bootstrap_port=P], POST /remove_worker?url=U, GET /list_workers. Answers as sgl-router
  // does: plain text on success.
  Route("POST", "/add_worker", [this](HttpRequest& req) {
    std::optional<std::string> url = req.QueryParam("url");
    if (!url || url->empty()) {
      return Action::Respond(
          ErrorResponse(400, "missing url: POST /add_worker?url=http://HOST:PORT"));
    }
    Result<int> port = ParseBootstrapPort(req.QueryParam("bootstrap_port").value_or(""));
    if (!port.ok()) {
      return Action::Respond(ErrorResponse(400, std::string(port.status().message())));
    }
    Result<bool> added = AddWorker(*url, req.QueryParam("worker_type").value_or(""), *port);
    if (!added.ok()) {
      return Action::Respond(ErrorResponse(400, std::string(added.status().message())));
    }
    return Action::Respond(
        TextResponse(*added ? fmt::format("Successfully added worker: {}", *url)
                            : fmt::format("Worker {} is already registered", *url)));
  });
  Route("POST", "/remove_worker", [this](HttpRequest& req) {
    std::optional<std::string> url = req.QueryParam("url");
    if (!url || url->empty()) {
      return Action::Respond(
          ErrorResponse(400, "missing url: POST /remove_worker?url=http://HOST:PORT"));
    }
    bool removed = false;
    for (Pool* pool : fleet_.pools()) {
      removed = pool->RemoveWorker(*url) || removed;
    }
    if (!removed) {
      return Action::Respond(
          ErrorResponse(404, fmt::format("no worker {:.200} is registered", *url)));
    }
    return Action::Respond(TextResponse(fmt::format("Successfully removed worker: {}", *url)));
  });
  Route("GET", "/list_workers", [this](HttpRequest&) {
    json urls = json::array();
    for (Pool* pool : fleet_.pools()) {
      for (std::string& u : pool->MemberUrls()) {
        urls.push_back(std::move(u));
      }
    }
    return Action::Respond(JsonResponse({{"urls", urls}}));
  });
  // Read-only queries answered by the first worker in rotation, as sgl-router does.
  for (const char* path : {"/v1/models", "/get_model_info"}) {
    Route(
        "GET", path,
        [this, path = std::string(path)](HttpRequest&) {
          return Action::Blocking([this, path] {
            std::vector<Target> healthy = fleet_.HealthyTargets();
            if (healthy.empty()) {
              return ErrorResponse(503, "no healthy worker");
            }
            WorkerAnswer a = AskWorker(healthy.front(), "GET", path);
            if (!a.ok) {
              return ErrorResponse(502, fmt::format("{}: {}", healthy.front().url, a.error));
            }
            HttpResponse r;
            r.status = a.status;
            r.content_type = a.content_type.empty() ? "application/json" : a.content_type;
            r.body = std::move(a.body);
            return r;
          });
        },
        /*open=*/true);
  }
  // Every worker's /get_server_info: the first healthy worker's answer (sgl-router's shape),
  // with each worker's under "bragg_workers".
  Route(
      "GET", "/get_server_info",
      [this](HttpRequest&) {
        return Action::Blocking([this] {
          std::vector<Target> members = fleet_.Members();
          if (members.empty()) {
            return ErrorResponse(503, "no worker is registered");
          }
          std::vector<WorkerAnswer> answers = FanOut(members, "GET", "/get_server_info");
          json first;
          json workers = json::array();
          for (size_t i = 0; i < members.size(); ++i) {
            json info = answers[i].ok ? json::parse(answers[i].body, nullptr, false) : json();
            bool good = answers[i].ok && answers[i].status == 200 && info.is_object();
            bool healthy = members[i].pool->router().Snapshot()[members[i].worker].healthy;
            if (good && healthy && first.is_null()) {
              first = info;
            }
            json w = {{"url", members[i].url},
                      {"pool", members[i].pool->name()},
                      {"healthy", healthy},
                      {"status", answers[i].status}};
            if (good) {
              w["info"] = std::move(info);
            } else {
              w["error"] = answers[i].ok ? answers[i].body.substr(0, 500) : answers[i].error;
            }
            workers.push_back(std::move(w));
          }
          if (first.is_null()) {
            return JsonResponse(
                {{"error", {{"message", "no healthy worker answered"}, {"code", 503}}},
                 {"bragg_workers", workers}},
                503);
          }
          first["bragg_workers"] = std::move(workers);
          return JsonResponse(first);
        });
      },
      /*open=*/true);
  // Every worker's /flush_cache at once; sgl-router's answer: 200 when all flushed, 206 when
  // some did, with the failures listed.
  Route("POST", "/flush_cache", [this](HttpRequest&) {
    return Action::Blocking([this] {
      std::vector<Target> members = fleet_.Members();
      if (members.empty()) {
        return ErrorResponse(503, "no worker is registered");
      }
      std::vector<WorkerAnswer> answers = FanOut(members, "POST", "/flush_cache");
      json successful = json::array();
      json failed = json::array();
      for (size_t i = 0; i < members.size(); ++i) {
        const WorkerAnswer& a = answers[i];
        if (a.ok && a.status >= 200 && a.status < 300) {
          successful.push_back(members[i].url);
        } else {
          failed.push_back({{"worker", members[i].url},
                            {"error", a.ok ? fmt::format("HTTP {}", a.status) : a.error}});
        }
      }
      size_t n = successful.size();
      json out = {
          {"status", failed.empty() ? "success" : "partial_success"},
          {"message", failed.empty()
                          ? fmt::format("Successfully flushed cache on all {} HTTP workers", n)
                          : fmt::format("Cache flush: {} succeeded, {} failed", n, failed.size())},
          {"workers_flushed", n},
          {"total_http_workers", members.size()},
          {"total_workers", members.size()}};
      if (!failed.empty()) {
        out["successful"] = successful;
        out["failed"] = failed;
      }
      return JsonResponse(out, failed.empty() ? 200 : (n > 0 ? 206 : 502));
    });
  });
  // sgl-router's shape ({"workers": [{"worker", "load"}]}); the load is what the gateway knows:
  // requests in flight on the worker (sgl-router asks each worker's /get_load for its tokens).
  Route("GET", "/get_loads", [this](HttpRequest&) {
    json loads = json::array();
    for (json& w : WorkerInfos()) {
      json l = {{"worker", w["url"]}, {"load", w["load"]}, {"rollouts", w["rollouts"]}};
      if (w["worker_type"] != "regular") {
        l["worker_type"] = w["worker_type"];
      }
      loads.push_back(std::move(l));
    }
    return Action::Respond(JsonResponse({{"workers", std::move(loads)}}));
  });
}

json Gateway::WorkerInfos() {
  json out = json::array();
  for (Pool* pool : fleet_.pools()) {
    std::vector<std::string> versions = pool->Versions();
    std::vector<WorkerSnapshot> snap = pool->router().Snapshot();
    std::string type = pool == &fleet_.main() ? "regular" : pool->name();
    for (size_t i = 0; i < snap.size() && i < versions.size(); ++i) {
      const WorkerSnapshot& w = snap[i];
      if (w.removed) {
        continue;
      }
      // sgl-router's WorkerInfo (model, priority and cost are its defaults: the gateway has
      // none), then Bragg's fields.
      json j = {{"id", WorkerId(w.url)},
                {"url", w.url},
                {"model_id", "unknown"},
                {"priority", 50},
                {"cost", 1.0},
                {"worker_type", type},
                {"is_healthy", w.healthy},
                {"load", w.in_flight},
                {"connection_mode", "Http"},
                {"pool", pool->name()},
                {"healthy", w.healthy},
                {"in_flight", w.in_flight},
                {"rollouts", w.rollouts},
                {"requests", w.requests},
                {"weight_version", versions[i]}};
      if (pool == &fleet_.prefill()) {
        int port = pool->bootstrap_port(static_cast<int>(i));
        j["bootstrap_port"] = port >= 0 ? port : options_.bootstrap_port;
      }
      out.push_back(std::move(j));
    }
  }
  return out;
}

std::optional<json> Gateway::FindWorker(const std::string& id_or_url) {
  Result<HostPort> hp = ParseHostPort(id_or_url);
  std::string url = hp.ok() ? fmt::format("http://{}:{}", hp->host, hp->port) : std::string();
  for (json& w : WorkerInfos()) {
    if (w["id"] == id_or_url || (hp.ok() && w["url"] == url)) {
      return std::move(w);
    }
  }
  return std::nullopt;
}

}  // namespace bragg::gateway
