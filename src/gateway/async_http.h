#pragma once

// Event-driven HTTP/1.1 front and reverse-proxy engine of the gateway (Boost.Asio + Beast,
// hidden in async_http.cc). A fixed pool of io threads, each with its own event loop; a client
// connection lives on one io thread for its whole life, and so does every upstream exchange it
// starts, so per-connection state needs no locks. Each io thread keeps its own pool of keep-alive
// upstream connections per worker, reused across requests. Handlers decide what to do with a
// request by returning an Action: answer now, run a blocking function off the io threads, or
// forward it to a worker (streamed through chunk by chunk, or buffered).

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "gateway/http_util.h"

namespace bragg::gateway {

using HeaderList = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string path;    // request target without the query string
  std::string query;   // what followed the first '?' of the target, "" when none
  std::string body;
  HeaderList headers;
  // Value of header `name` (case-insensitive), "" when absent.
  std::string Header(std::string_view name) const;
  // The first value of query parameter `name`, URL-decoded ("+" and "%XY"); "" for a name
  // without "="; nullopt when absent.
  std::optional<std::string> QueryParam(std::string_view name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  HeaderList headers;
};

// A JSON error body {"error": {"message", "code"}} with `status`.
HttpResponse ErrorResponse(int status, std::string_view message);

// How one upstream exchange ended.
struct UpstreamResult {
  enum class Outcome {
    kOk,             // the whole response arrived (and, when streaming, reached the client)
    kConnectFailed,  // no connection to the worker: nothing reached it, safe to route elsewhere
    kFailed,         // the exchange broke after the request was (maybe) sent: never retried
                     // (a reused keep-alive connection that broke before the worker could have
                     // read the whole request is replaced by a fresh one once, transparently)
    kClientGone,     // the client hung up before the response was complete
  };
  Outcome outcome = Outcome::kFailed;
  int status = 0;
  std::string content_type;
  // Buffered: the whole body. Streamed: the last bytes (up to 1 MiB), e.g. the final SSE event.
  std::string body;
  size_t forwarded = 0;  // streamed body bytes written to the client
  bool started = false;  // the response head went to the client (streamed only)
  // kConnectFailed because of the gateway itself (out of file descriptors or memory), not the
  // worker: the worker must not be marked down for it.
  bool local = false;
  std::string error;
};

// How a Call ended.
struct CallResult {
  bool ok = false;  // a whole response arrived (any status)
  int status = 0;
  std::string body;
  std::string error;  // why not ok: connect, write or read error
};

struct Action;

// Forward the client's request to one worker.
struct Forward {
  HostPort upstream;
  std::string path;
  std::string body;  // sent with Content-Type: application/json
  // Pass the response body through chunk by chunk as it arrives (SSE), instead of buffering it.
  bool stream = false;
  HeaderList response_headers;  // added to the response sent to the client
  // Runs on the io thread once the exchange ended. kOk and kNone: the worker's response goes to
  // the client as it is (buffered: status, content type and body of the result; streamed: the
  // stream is closed). Otherwise the returned Action runs: another Forward (after
  // kConnectFailed), or a response (after a stream started, its body is written as the last
  // chunk). After kClientGone the returned Action is ignored and the connection closed.
  std::function<Action(UpstreamResult&)> done;
};

struct Action {
  enum class Kind { kNone, kRespond, kForward, kBlocking };
  Kind kind = Kind::kNone;
  HttpResponse response;
  std::unique_ptr<Forward> forward;
  std::function<HttpResponse()> blocking;

  static Action None() { return Action{}; }
  static Action Respond(HttpResponse r) {
    Action a;
    a.kind = Kind::kRespond;
    a.response = std::move(r);
    return a;
  }
  static Action Proxy(Forward f) {
    Action a;
    a.kind = Kind::kForward;
    a.forward = std::make_unique<Forward>(std::move(f));
    return a;
  }
  // `fn` runs on a thread of its own (threads are reused), never on an io thread: for handlers
  // that block (fleet weight updates, blocking upstream calls).
  static Action Blocking(std::function<HttpResponse()> fn) {
    Action a;
    a.kind = Kind::kBlocking;
    a.blocking = std::move(fn);
    return a;
  }
};

// Runs on an io thread; must not block. May modify the request (its body is moved from).
using Handler = std::function<Action(HttpRequest&)>;

struct AsyncHttpOptions {
  std::string host = "127.0.0.1";
  int port = 0;        // 0: any free port
  int io_threads = 0;  // 0: one per core
  size_t max_blocking_threads = 1024;
  // Larger request bodies get 413 before they are read: a body is held (and parsed) in memory.
  size_t max_request_body = size_t{64} << 20;
  // Larger buffered worker responses fail the exchange (kFailed); streamed bodies are passed
  // through chunk by chunk and not limited.
  size_t max_upstream_response = size_t{1} << 30;
  // Pooled keep-alive worker connections idle longer than this are closed instead of reused;
  // a sweep closes them within about this long (at least 100 ms, at most 10 s) even when no
  // request comes for that worker.
  int upstream_max_idle_ms = 2000;
  int keep_alive_timeout_s = 60;  // idle client connections are closed after this
  // Sent as the Authorization header of every upstream request ("Bearer <key>"), "" for none.
  std::string upstream_authorization;
  // Client connections served at once; beyond it new ones wait in the listen backlog. 0: what
  // RLIMIT_NOFILE allows, (soft limit - 64) / 2, since each proxied request also holds a
  // worker connection: running out of descriptors would fail requests and health checks.
  int max_connections = 0;
};

// Thread-safety: Route before Start; Start/Stop from one thread; Send from any thread.
class AsyncHttpServer {
 public:
  explicit AsyncHttpServer(AsyncHttpOptions options);
  ~AsyncHttpServer();
  AsyncHttpServer(const AsyncHttpServer&) = delete;
  AsyncHttpServer& operator=(const AsyncHttpServer&) = delete;

  // Serves `method` `path` (exact match) with `handler`. Unknown paths get 404.
  void Route(std::string method, std::string path, Handler handler);
  // Serves `method` on every path that starts with `prefix` and is longer than it (e.g.
  // "/workers/" for "/workers/{id}"), unless an exact Route matches; the longest prefix wins.
  // The handler finds the rest in HttpRequest::path, still percent-encoded.
  void RoutePrefix(std::string method, std::string prefix, Handler handler);
  // Binds and starts the io threads. Unavailable if the address cannot be bound.
  Status Start();
  // Stops accepting, waits for blocking handlers, stops the io threads. Idempotent.
  void Stop();
  int port() const;
  int io_threads() const;

  // Fire-and-forget POST of a JSON body to a worker, on an io thread (e.g. /abort_request).
  // Failures are logged.
  void Send(const HostPort& upstream, std::string path, std::string body);
  // POST of a JSON body to a worker on an io thread, whole response buffered; `done` runs on
  // that io thread once it ended (must not block). Dropped without running if the server stops
  // first.
  void Call(const HostPort& upstream, std::string path, std::string body,
            std::function<void(CallResult&)> done);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace bragg::gateway
