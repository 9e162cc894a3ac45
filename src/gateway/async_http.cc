#include "gateway/async_http.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <unordered_map>

namespace bragg::gateway {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using tcp = net::ip::tcp;
using boost::system::error_code;

std::string HttpRequest::Header(std::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (k.size() == name.size() && std::equal(k.begin(), k.end(), name.begin(), [](char a, char b) {
          return std::tolower(static_cast<unsigned char>(a)) ==
                 std::tolower(static_cast<unsigned char>(b));
        })) {
      return v;
    }
  }
  return "";
}

namespace {

int HexDigit(char c) {
  if (c >= '0' && c <= '9') {
    return c - '0';
  }
  c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

// application/x-www-form-urlencoded decoding: "+" is a space, "%XY" a byte; a malformed escape
// is kept as it is.
std::string UrlDecode(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '+') {
      out.push_back(' ');
    } else if (s[i] == '%' && i + 2 < s.size() && HexDigit(s[i + 1]) >= 0 &&
               HexDigit(s[i + 2]) >= 0) {
      out.push_back(static_cast<char>(HexDigit(s[i + 1]) * 16 + HexDigit(s[i + 2])));
      i += 2;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

}  // namespace

std::optional<std::string> HttpRequest::QueryParam(std::string_view name) const {
  std::string_view rest = query;
  while (!rest.empty()) {
    size_t amp = rest.find('&');
    std::string_view pair = rest.substr(0, amp);
    rest = amp == std::string_view::npos ? std::string_view() : rest.substr(amp + 1);
    size_t eq = pair.find('=');
    if (UrlDecode(pair.substr(0, eq)) == name) {
      return eq == std::string_view::npos ? std::string() : UrlDecode(pair.substr(eq + 1));
    }
  }
  return std::nullopt;
}

HttpResponse ErrorResponse(int status, std::string_view message) {
  HttpResponse r;
  r.status = status;
  r.body = nlohmann::json{{"error", {{"message", std::string(message)}, {"code", status}}}}.dump();
  return r;
}

namespace {

constexpr size_t kStreamTail = size_t{1} << 20;
constexpr size_t kChunk = 16384;
constexpr size_t kIdlePerUpstream = 4096;

// One keep-alive connection to a worker. Owned by one io thread.
struct UpstreamConn {
  explicit UpstreamConn(net::io_context& ioc) : socket(ioc) {}
  tcp::socket socket;
  beast::flat_buffer buffer;
  std::chrono::steady_clock::time_point idle_since;
};

// True if an idle pooled connection was not closed by the worker meanwhile: a worker that closed
// it (keep-alive timeout, restart, SIGKILL) leaves EOF or an error to read.
bool StillOpen(tcp::socket& s) {
  char c;
  ssize_t n = ::recv(s.native_handle(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

// Idle upstream connections of one io thread, by "host:port". Single-threaded.
class UpstreamPool {
 public:
  // The most recently used idle connection to `key` idle for at most `max_idle`; older ones are
  // closed: a worker closes idle connections after its own keep-alive timeout, and one it closes
  // just as the gateway reuses it fails the request.
  std::unique_ptr<UpstreamConn> Take(const std::string& key, std::chrono::milliseconds max_idle) {
    auto it = idle_.find(key);
    if (it == idle_.end()) {
      return nullptr;
    }
    auto now = std::chrono::steady_clock::now();
    while (!it->second.empty()) {
      std::unique_ptr<UpstreamConn> c = std::move(it->second.back());
      it->second.pop_back();
      if (now - c->idle_since > max_idle) {
        // The rest are older still (the vector is ordered by the time they were put back).
        it->second.clear();
        return nullptr;
      }
      if (c->buffer.size() == 0 && StillOpen(c->socket)) {
        return c;
      }
    }
    return nullptr;
  }
  void Put(const std::string& key, std::unique_ptr<UpstreamConn> c) {
    auto& v = idle_[key];
    if (v.size() < kIdlePerUpstream) {
      c->idle_since = std::chrono::steady_clock::now();
      v.push_back(std::move(c));
    }
  }
  // Closes the connections idle for longer than `max_idle`: Take would never reuse them, and
  // each holds a worker's connection (a thread, in a thread-per-connection server) until the
  // worker's own keep-alive timeout.
  void Sweep(std::chrono::milliseconds max_idle) {
    auto now = std::chrono::steady_clock::now();
    for (auto it = idle_.begin(); it != idle_.end();) {
      auto& v = it->second;  // ordered by the time they were put back
      auto fresh = std::find_if(v.begin(), v.end(),
                                [&](const auto& c) { return now - c->idle_since <= max_idle; });
      v.erase(v.begin(), fresh);
      it = v.empty() ? idle_.erase(it) : std::next(it);
    }
  }
  void Clear() { idle_.clear(); }

 private:
  std::unordered_map<std::string, std::vector<std::unique_ptr<UpstreamConn>>> idle_;
};

struct IoThread {
  net::io_context ioc{1};
  UpstreamPool pool;
  std::unique_ptr<net::steady_timer> sweep;                  // after ioc: destroyed before it
  std::unordered_map<std::string, tcp::endpoint> endpoints;  // resolved upstreams
  std::thread thread;
};

// Resolves "host:port" once per io thread; numeric addresses never touch the resolver.
Result<tcp::endpoint> Endpoint(IoThread& io, const HostPort& hp, const std::string& key) {
  auto it = io.endpoints.find(key);
  if (it != io.endpoints.end()) {
    return it->second;
  }
  error_code ec;
  net::ip::address addr = net::ip::make_address(hp.host, ec);
  tcp::endpoint ep;
  if (!ec) {
    ep = tcp::endpoint(addr, static_cast<uint16_t>(hp.port));
  } else {
    tcp::resolver resolver(io.ioc);
    auto results = resolver.resolve(hp.host, std::to_string(hp.port), ec);
    if (ec || results.empty()) {
      return absl::UnavailableError(fmt::format("cannot resolve {}: {}", hp.host, ec.message()));
    }
    ep = *results.begin();
  }
  io.endpoints.emplace(key, ep);
  return ep;
}

std::string Key(const HostPort& hp) { return fmt::format("{}:{}", hp.host, hp.port); }

// Sweeps `io`'s idle pool every `max_idle` (within 100 ms .. 10 s) on its own loop.
void SweepIdle(IoThread* io, std::chrono::milliseconds max_idle) {
  auto period =
      std::clamp(max_idle, std::chrono::milliseconds(100), std::chrono::milliseconds(10000));
  io->sweep->expires_after(period);
  io->sweep->async_wait([io, max_idle](error_code ec) {
    if (ec) {
      return;
    }
    io->pool.Sweep(max_idle);
    SweepIdle(io, max_idle);
  });
}

// A keep-alive POST of a JSON `body` to the worker `key` ("host:port").
// `authorization`, when not empty, is sent as the Authorization header (the workers' API key).
void PreparePost(http::request<http::string_body>& req, const std::string& key,
                 const std::string& path, std::string body, const std::string& authorization) {
  req = {};
  req.method(http::verb::post);
  req.target(path);
  req.version(11);
  req.set(http::field::host, key);
  req.set(http::field::content_type, "application/json");
  if (!authorization.empty()) {
    req.set(http::field::authorization, authorization);
  }
  req.keep_alive(true);
  req.body() = std::move(body);
  req.prepare_payload();
}

}  // namespace

struct AsyncHttpServer::Impl {
  explicit Impl(AsyncHttpOptions o) : options(std::move(o)) {}
  AsyncHttpOptions options;
  std::map<std::string, Handler> routes;  // "METHOD PATH"
  // RoutePrefix: "METHOD PREFIX" -> handler, tried (longest prefix first) when no exact route
  // matched.
  std::map<std::string, Handler, std::greater<>> prefix_routes;
  std::vector<std::unique_ptr<IoThread>> io;
  std::unique_ptr<tcp::acceptor> acceptor;
  std::unique_ptr<net::steady_timer> accept_retry;
  std::unique_ptr<ElasticTaskQueue> blocking;
  std::atomic<size_t> next_io{0};
  std::atomic<int> sessions{0};
  int max_sessions = 0;
  bool at_limit_logged = false;
  int port = 0;
  bool started = false;
  bool stopped = false;

  IoThread& NextIo() { return *io[next_io.fetch_add(1, std::memory_order_relaxed) % io.size()]; }
  void Accept();
  // The handler of `method` `path`: its exact route, else its longest route prefix that is
  // shorter than it; nullptr when none.
  const Handler* FindRoute(const std::string& method, const std::string& path) const {
    std::string key = method + " " + path;
    if (auto it = routes.find(key); it != routes.end()) {
      return &it->second;
    }
    for (const auto& [prefix, handler] : prefix_routes) {
      if (key.size() > prefix.size() && key.compare(0, prefix.size(), prefix) == 0) {
        return &handler;
      }
    }
    return nullptr;
  }
};

namespace {

// One upstream call whose response is buffered; `done` (if any) sees how it ended.
class OneShot : public std::enable_shared_from_this<OneShot> {
 public:
  OneShot(IoThread& io, const AsyncHttpOptions& options, HostPort hp, std::string path,
          std::string body, std::function<void(CallResult&)> done)
      : io_(io),
        max_idle_(options.upstream_max_idle_ms),
        limit_(options.max_upstream_response),
        hp_(std::move(hp)),
        key_(Key(hp_)),
        path_(std::move(path)),
        done_(std::move(done)) {
    PreparePost(req_, key_, path_, std::move(body), options.upstream_authorization);
    res_.body_limit(options.max_upstream_response);
  }
  void Run() {
    conn_ = io_.pool.Take(key_, max_idle_);
    if (conn_) {
      Write();
      return;
    }
    Result<tcp::endpoint> ep = Endpoint(io_, hp_, key_);
    if (!ep.ok()) {
      Fail(std::string(ep.status().message()));
      return;
    }
    conn_ = std::make_unique<UpstreamConn>(io_.ioc);
    conn_->socket.async_connect(*ep, [self = shared_from_this()](error_code ec) {
      if (ec) {
        self->Fail("connect: " + ec.message());
        return;
      }
      self->conn_->socket.set_option(tcp::no_delay(true), ec);
      self->Write();
    });
  }

 private:
  void Write() {
    http::async_write(conn_->socket, req_, [self = shared_from_this()](error_code ec, size_t) {
      if (ec) {
        self->Fail("write: " + ec.message());
        return;
      }
      // The head first, for the size limit (see Session::OnSent).
      http::async_read_header(self->conn_->socket, self->conn_->buffer, self->res_,
                              [self](error_code ec, size_t) { self->ReadBody(ec); });
    });
  }

  void ReadBody(error_code ec) {
    if (!ec && res_.content_length().value_or(0) > limit_) {
      ec = http::error::body_limit;
    }
    if (ec) {
      Fail("read: " + ec.message());
      return;
    }
    http::async_read(conn_->socket, conn_->buffer, res_,
                     [self = shared_from_this()](error_code ec, size_t) {
                       if (ec) {
                         self->Fail("read: " + ec.message());
                         return;
                       }
                       auto& msg = self->res_.get();
                       CallResult r;
                       r.ok = true;
                       r.status = msg.result_int();
                       r.body = std::move(msg.body());
                       if (msg.keep_alive()) {
                         self->io_.pool.Put(self->key_, std::move(self->conn_));
                       }
                       if (!self->done_ && r.status != 200) {
                         spdlog::warn("{} to {}: status {}", self->path_, self->key_, r.status);
                       }
                       self->Finish(r);
                     });
  }

  void Fail(std::string why) {
    CallResult r;
    r.error = std::move(why);
    if (!done_) {
      spdlog::warn("{} to {}: {}", path_, key_, r.error);
    }
    Finish(r);
  }

  void Finish(CallResult& r) {
    if (done_) {
      auto done = std::move(done_);
      done_ = nullptr;
      done(r);
    }
  }

  IoThread& io_;
  std::chrono::milliseconds max_idle_;
  size_t limit_;
  HostPort hp_;
  std::string key_;
  std::string path_;
  std::function<void(CallResult&)> done_;
  std::unique_ptr<UpstreamConn> conn_;
  http::request<http::string_body> req_;
  http::response_parser<http::string_body> res_;
};

// One client connection: reads requests one after another (keep-alive), runs the handler, and
// performs the Action. All its handlers run on its io thread.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(AsyncHttpServer::Impl& server, IoThread& io, tcp::socket socket)
      : server_(server), io_(io), sock_(std::move(socket)), idle_timer_(io.ioc) {
    server_.sessions.fetch_add(1, std::memory_order_relaxed);
  }
  ~Session() { server_.sessions.fetch_sub(1, std::memory_order_relaxed); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  void Start() { ReadRequest(); }

 private:
  using Outcome = UpstreamResult::Outcome;

  void ReadRequest() {
    parser_.emplace();
    parser_->body_limit(server_.options.max_request_body);
    parser_->header_limit(1 << 16);
    idle_timer_.expires_after(std::chrono::seconds(server_.options.keep_alive_timeout_s));
    idle_timer_.async_wait([self = shared_from_this()](error_code ec) {
      if (!ec) {
        error_code ignored;
        self->sock_.close(ignored);
      }
    });
    http::async_read_header(
        sock_, buf_, *parser_,
        [self = shared_from_this()](error_code ec, size_t) { self->OnHeader(ec); });
  }

  void OnHeader(error_code ec) {
    if (ec) {
      OnRequest(ec);
      return;
    }
    auto read_body = [this] {
      http::async_read(sock_, buf_, *parser_,
                       [self = shared_from_this()](error_code ec, size_t) { self->OnRequest(ec); });
    };
    if (!parser_->is_done() &&
        beast::iequals(parser_->get()[http::field::expect], "100-continue")) {
      // curl and others wait (about a second) for this before they send a body.
      static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      net::async_write(sock_, net::buffer(kContinue.data(), kContinue.size()),
                       [self = shared_from_this(), read_body](error_code ec, size_t) {
                         if (ec) {
                           self->OnRequest(ec);
                           return;
                         }
                         read_body();
                       });
      return;
    }
    read_body();
  }

  void OnRequest(error_code ec) {
    idle_timer_.cancel();
    if (ec) {
      if (ec == http::error::body_limit || ec == http::error::header_limit) {
        keep_alive_ = false;
        version_ = 11;
        WriteResponse(ErrorResponse(413, "request too large"));
        return;
      }
      if (ec.category() == http::make_error_code(http::error::bad_method).category() &&
          ec != http::error::end_of_stream && ec != http::error::partial_message) {
        keep_alive_ = false;
        version_ = 11;
        WriteResponse(ErrorResponse(400, "malformed HTTP request: " + ec.message()));
        return;
      }
      Close();
      return;
    }
    http::request<http::string_body> msg = parser_->release();
    parser_.reset();
    keep_alive_ = msg.keep_alive();
    version_ = msg.version();
    HttpRequest req;
    req.method = std::string(msg.method_string());
    std::string_view target(msg.target().data(), msg.target().size());
    size_t question = target.find('?');
    req.path = std::string(target.substr(0, question));
    if (question != std::string_view::npos) {
      req.query = std::string(target.substr(question + 1));
    }
    req.body = std::move(msg.body());
    req.headers.reserve(8);
    for (const auto& f : msg) {
      req.headers.emplace_back(std::string(f.name_string()), std::string(f.value()));
    }
    const Handler* handler = server_.FindRoute(req.method, req.path);
    if (handler == nullptr) {
      WriteResponse(ErrorResponse(404, fmt::format("no route {} {}", req.method, req.path)));
      return;
    }
    Action a;
    try {
      a = (*handler)(req);
    } catch (const std::exception& e) {
      // A handler bug must not take the io thread (and every connection on it) down.
      spdlog::error("handler {} {} threw: {}", req.method, req.path, e.what());
      a = Action::Respond(ErrorResponse(500, "internal error"));
    }
    Run(std::move(a));
  }

  void Run(Action a) {
    switch (a.kind) {
      case Action::Kind::kRespond:
        WriteResponse(std::move(a.response));
        return;
      case Action::Kind::kForward:
        StartForward(std::move(*a.forward));
        return;
      case Action::Kind::kBlocking:
        server_.blocking->enqueue(
            [self = shared_from_this(), fn = std::move(a.blocking)]() mutable {
              HttpResponse r = fn();
              net::post(self->io_.ioc,
                        [self, r = std::move(r)]() mutable { self->WriteResponse(std::move(r)); });
            });
        return;
      case Action::Kind::kNone:
        if (started_) {
          FinishStream();
        } else {
          WriteResponse(ErrorResponse(500, "handler gave no response"));
        }
        return;
    }
  }

  void WriteResponse(HttpResponse r) {
    if (started_) {
      // The stream head is out: the response body becomes the last chunk.
      tail_out_ = std::move(r.body);
      if (tail_out_.empty()) {
        FinishStream();
        return;
      }
      net::async_write(sock_, http::make_chunk(net::buffer(tail_out_)),
                       [self = shared_from_this()](error_code ec, size_t) {
                         if (ec) {
                           self->Close();
                           return;
                         }
                         self->FinishStream();
                       });
      return;
    }
    auto out = std::make_shared<http::response<http::string_body>>(
        static_cast<http::status>(r.status), version_);
    out->set(http::field::content_type, r.content_type);
    for (auto& [k, v] : r.headers) {
      out->set(k, v);
    }
    out->body() = std::move(r.body);
    out->keep_alive(keep_alive_);
    out->prepare_payload();
    http::async_write(sock_, *out, [self = shared_from_this(), out](error_code ec, size_t) {
      self->AfterResponse(ec);
    });
  }

  void FinishStream() {
    net::async_write(sock_, http::make_chunk_last(),
                     [self = shared_from_this()](error_code ec, size_t) {
                       self->started_ = false;
                       self->AfterResponse(ec);
                     });
  }

  void AfterResponse(error_code ec) {
    if (ec || !keep_alive_) {
      if (!ec) {
        sock_.shutdown(tcp::socket::shutdown_send, ec);
      }
      Close();
      return;
    }
    ReadRequest();
  }

  void Close() {
    error_code ignored;
    idle_timer_.cancel();
    sock_.close(ignored);
  }

  // --- forwarding ---

  void StartForward(Forward f) {
    fwd_ = std::move(f);
    result_ = UpstreamResult{};
    result_.started = started_;
    up_key_ = Key(fwd_.upstream);
    up_retried_ = false;
    Watch();
    up_ = io_.pool.Take(up_key_, std::chrono::milliseconds(server_.options.upstream_max_idle_ms));
    up_reused_ = up_ != nullptr;
    PreparePost(up_req_, up_key_, fwd_.path, std::move(fwd_.body),
                server_.options.upstream_authorization);
    if (up_) {
      WriteUpstream();
      return;
    }
    ConnectUpstream();
  }

  void ConnectUpstream() {
    Result<tcp::endpoint> ep = Endpoint(io_, fwd_.upstream, up_key_);
    if (!ep.ok()) {
      result_.error = std::string(ep.status().message());
      End(Outcome::kConnectFailed);
      return;
    }
    up_ = std::make_unique<UpstreamConn>(io_.ioc);
    up_->socket.async_connect(*ep, [self = shared_from_this()](error_code ec) {
      if (self->client_gone_) {
        self->End(Outcome::kClientGone);
        return;
      }
      if (ec) {
        self->result_.error = "connect: " + ec.message();
        self->result_.local = ec == net::error::no_descriptors || ec == net::error::no_memory ||
                              ec == net::error::no_buffer_space;
        self->End(Outcome::kConnectFailed);
        return;
      }
      self->up_->socket.set_option(tcp::no_delay(true), ec);
      self->WriteUpstream();
    });
  }

  void WriteUpstream() {
    http::async_write(up_->socket, up_req_,
                      [self = shared_from_this()](error_code ec, size_t) { self->OnSent(ec); });
  }

  // A reused keep-alive connection broke before the worker can have processed the request: the
  // write failed (the worker never got the whole request), or the worker reset the connection
  // before any byte of a response (a reset, unlike an orderly close, means it closed the socket
  // with the request unread). The request then goes once more on a fresh connection. An orderly
  // close before the response is not retried: the worker may have run the request and died.
  bool RetryOnFreshConnection(error_code ec, bool wrote, bool got_some) {
    if (!ec || !up_reused_ || up_retried_ || client_gone_ || got_some ||
        (wrote && ec != net::error::connection_reset)) {
      return false;
    }
    up_retried_ = true;
    up_reused_ = false;
    spdlog::info(
        "reused connection to {} broke before the request reached the worker ({}); "
        "sending it on a fresh one",
        up_key_, ec.message());
    up_.reset();
    up_full_.reset();
    up_stream_.reset();
    ConnectUpstream();
    return true;
  }

  // Ends the call when the client hung up or the worker `what` (read, write) failed; true then.
  bool Ended(error_code ec, const char* what) {
    if (client_gone_) {
      End(Outcome::kClientGone);
      return true;
    }
    if (ec) {
      result_.error =
          ec == http::error::body_limit
              ? fmt::format("response larger than {} bytes", server_.options.max_upstream_response)
              : std::string(what) + ": " + ec.message();
      End(Outcome::kFailed);
      return true;
    }
    return false;
  }

  void OnSent(error_code ec) {
    if (RetryOnFreshConnection(ec, false, false) || Ended(ec, "write")) {
      return;
    }
    if (fwd_.stream) {
      up_stream_.emplace();
      up_stream_->body_limit(std::numeric_limits<std::uint64_t>::max());
      http::async_read_header(
          up_->socket, up_->buffer, *up_stream_,
          [self = shared_from_this()](error_code ec, size_t) { self->OnStreamHeader(ec); });
    } else {
      up_full_.emplace();
      up_full_->body_limit(server_.options.max_upstream_response);
      // The head first: Boost 1.74's parser drops its body_limit error when body bytes arrive
      // in the same read as the head (finish_header's error is overwritten by the eager loop),
      // so a Content-Length above the limit is refused here.
      http::async_read_header(
          up_->socket, up_->buffer, *up_full_,
          [self = shared_from_this()](error_code ec, size_t) { self->OnFullHeader(ec); });
    }
  }

  void OnFullHeader(error_code ec) {
    if (!ec && up_full_->content_length().value_or(0) > server_.options.max_upstream_response) {
      ec = http::error::body_limit;
    }
    if (ec) {
      OnFull(ec);
      return;
    }
    http::async_read(up_->socket, up_->buffer, *up_full_,
                     [self = shared_from_this()](error_code ec, size_t) { self->OnFull(ec); });
  }

  void OnFull(error_code ec) {
    if (RetryOnFreshConnection(ec, true, up_full_->got_some() || up_->buffer.size() > 0) ||
        Ended(ec, "read")) {
      return;
    }
    auto& msg = up_full_->get();
    result_.status = msg.result_int();
    result_.content_type = std::string(msg[http::field::content_type]);
    result_.body = std::move(msg.body());
    if (msg.keep_alive()) {
      io_.pool.Put(up_key_, std::move(up_));
    }
    up_full_.reset();
    End(Outcome::kOk);
  }

  void OnStreamHeader(error_code ec) {
    if (RetryOnFreshConnection(ec, true, up_stream_->got_some() || up_->buffer.size() > 0) ||
        Ended(ec, "read")) {
      return;
    }
    auto& msg = up_stream_->get();
    result_.status = msg.result_int();
    result_.content_type = std::string(msg[http::field::content_type]);
    head_.emplace(static_cast<http::status>(result_.status), version_);
    head_->set(http::field::content_type,
               result_.content_type.empty() ? "text/event-stream" : result_.content_type);
    for (auto& [k, v] : fwd_.response_headers) {
      head_->set(k, v);
    }
    head_->keep_alive(keep_alive_);
    head_->chunked(true);
    head_sr_.emplace(*head_);
    started_ = true;
    result_.started = true;
    http::async_write_header(sock_, *head_sr_, [self = shared_from_this()](error_code ec, size_t) {
      if (ec) {
        self->client_gone_ = true;
      }
      self->ReadChunk();
    });
  }

  void ReadChunk() {
    if (client_gone_) {
      End(Outcome::kClientGone);
      return;
    }
    if (up_stream_->is_done()) {
      StreamDone();
      return;
    }
    up_stream_->get().body().data = chunk_;
    up_stream_->get().body().size = sizeof(chunk_);
    // read_some, not read: read returns only once chunk_ is full or the body ended, which held
    // a whole SSE stream (small events) back until its end; read_some returns with whatever
    // the worker sent, so each event goes on to the client as it arrives.
    http::async_read_some(
        up_->socket, up_->buffer, *up_stream_,
        [self = shared_from_this()](error_code ec, size_t) { self->OnChunk(ec); });
  }

  void OnChunk(error_code ec) {
    if (ec == http::error::need_buffer) {
      ec = {};
    }
    if (Ended(ec, "read")) {
      return;
    }
    size_t n = sizeof(chunk_) - up_stream_->get().body().size;
    if (n == 0) {
      ReadChunk();
      return;
    }
    result_.forwarded += n;
    result_.body.append(chunk_, n);
    if (result_.body.size() > 2 * kStreamTail) {
      result_.body.erase(0, result_.body.size() - kStreamTail);
    }
    net::async_write(sock_, http::make_chunk(net::buffer(chunk_, n)),
                     [self = shared_from_this()](error_code ec, size_t) {
                       if (ec) {
                         self->client_gone_ = true;
                       }
                       self->ReadChunk();
                     });
  }

  void StreamDone() {
    if (up_stream_->get().keep_alive()) {
      io_.pool.Put(up_key_, std::move(up_));
    }
    up_stream_.reset();
    End(Outcome::kOk);
  }

  // The exchange is over: hand the result to the handler and do what it says.
  void End(Outcome outcome) {
    Unwatch();
    if (outcome != Outcome::kOk) {
      up_.reset();  // a broken or abandoned exchange: never reuse the connection
      up_stream_.reset();
      up_full_.reset();
    }
    result_.outcome = outcome;
    Forward fwd = std::move(fwd_);
    fwd_ = Forward{};
    Action next;
    try {
      next = fwd.done ? fwd.done(result_) : Action::None();
    } catch (const std::exception& e) {
      spdlog::error("upstream completion threw: {}", e.what());
      next = Action::Respond(ErrorResponse(500, "internal error"));
    }
    if (outcome == Outcome::kClientGone) {
      Close();
      return;
    }
    if (outcome == Outcome::kOk && next.kind == Action::Kind::kNone) {
      if (started_) {
        FinishStream();
        return;
      }
      HttpResponse r;
      r.status = result_.status;
      r.content_type = result_.content_type.empty() ? "application/json" : result_.content_type;
      r.body = std::move(result_.body);
      r.headers = std::move(fwd.response_headers);
      WriteResponse(std::move(r));
      return;
    }
    Run(std::move(next));
  }

  // --- client hang-up detection while a worker works on the request ---

  void Watch() {
    if (watching_) {
      return;
    }
    watching_ = true;
    uint64_t gen = ++watch_gen_;
    sock_.async_wait(tcp::socket::wait_read, [self = shared_from_this(), gen](error_code ec) {
      self->OnReadable(ec, gen);
    });
  }

  void Unwatch() {
    if (!watching_) {
      return;
    }
    watching_ = false;
    ++watch_gen_;
    // Only the wait is pending on the client socket here: no write is in flight when an
    // exchange ends.
    error_code ignored;
    sock_.cancel(ignored);
  }

  void OnReadable(error_code ec, uint64_t gen) {
    if (gen != watch_gen_ || !watching_) {
      return;
    }
    if (ec) {
      watching_ = false;
      return;
    }
    char c;
    ssize_t n = ::recv(sock_.native_handle(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) {
      // A pipelined next request: the client is there; it is read after this response.
      watching_ = false;
      return;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      watching_ = false;
      Watch();
      return;
    }
    watching_ = false;
    ClientGone();
  }

  // Exactly one operation is pending in an exchange: an upstream connect/write/read, or a write
  // to the client. Closing the upstream socket completes the first at once; either way its
  // handler sees client_gone_ and ends the exchange.
  void ClientGone() {
    client_gone_ = true;
    error_code ignored;
    if (up_) {
      up_->socket.close(ignored);
    }
  }

  AsyncHttpServer::Impl& server_;
  IoThread& io_;
  tcp::socket sock_;
  net::steady_timer idle_timer_;
  beast::flat_buffer buf_;
  std::optional<http::request_parser<http::string_body>> parser_;
  bool keep_alive_ = true;
  unsigned version_ = 11;

  Forward fwd_;
  UpstreamResult result_;
  std::string up_key_;
  std::unique_ptr<UpstreamConn> up_;
  bool up_reused_ = false;   // up_ came from the idle pool
  bool up_retried_ = false;  // this request already went again on a fresh connection
  http::request<http::string_body> up_req_;
  std::optional<http::response_parser<http::string_body>> up_full_;
  std::optional<http::response_parser<http::buffer_body>> up_stream_;
  std::optional<http::response<http::empty_body>> head_;
  std::optional<http::response_serializer<http::empty_body>> head_sr_;
  std::string tail_out_;
  char chunk_[kChunk];
  bool started_ = false;
  bool client_gone_ = false;
  bool watching_ = false;
  uint64_t watch_gen_ = 0;
};

}  // namespace

void AsyncHttpServer::Impl::Accept() {
  if (sessions.load(std::memory_order_relaxed) >= max_sessions) {
    // Back-pressure: leave new clients in the listen backlog until a connection closes.
    if (!at_limit_logged) {
      spdlog::warn("{} client connections open, the limit: new ones wait (raise RLIMIT_NOFILE)",
                   max_sessions);
      at_limit_logged = true;
    }
    accept_retry->expires_after(std::chrono::milliseconds(5));
    accept_retry->async_wait([this](error_code e) {
      if (!e) {
        Accept();
      }
    });
    return;
  }
  IoThread& target = NextIo();
  acceptor->async_accept(target.ioc, [this, &target](error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted || !acceptor->is_open()) {
      return;
    }
    if (ec) {
      // EMFILE and friends: wait instead of spinning; the backlog keeps the clients.
      spdlog::warn("accept: {}", ec.message());
      accept_retry->expires_after(std::chrono::milliseconds(50));
      accept_retry->async_wait([this](error_code e) {
        if (!e) {
          Accept();
        }
      });
      return;
    }
    socket.set_option(tcp::no_delay(true), ec);
    auto session = std::make_shared<Session>(*this, target, std::move(socket));
    net::post(target.ioc, [session] { session->Start(); });
    Accept();
  });
}

AsyncHttpServer::AsyncHttpServer(AsyncHttpOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

AsyncHttpServer::~AsyncHttpServer() { Stop(); }

void AsyncHttpServer::Route(std::string method, std::string path, Handler handler) {
  impl_->routes[method + " " + path] = std::move(handler);
}

void AsyncHttpServer::RoutePrefix(std::string method, std::string prefix, Handler handler) {
  impl_->prefix_routes[method + " " + prefix] = std::move(handler);
}

int AsyncHttpServer::port() const { return impl_->port; }
int AsyncHttpServer::io_threads() const { return static_cast<int>(impl_->io.size()); }

Status AsyncHttpServer::Start() {
  Impl& s = *impl_;
  int n = s.options.io_threads > 0 ? s.options.io_threads
                                   : static_cast<int>(std::thread::hardware_concurrency());
  n = std::max(n, 1);
  for (int i = 0; i < n; ++i) {
    s.io.push_back(std::make_unique<IoThread>());
  }
  error_code ec;
  net::ip::address addr = net::ip::make_address(s.options.host, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        fmt::format("cannot listen on {}: not an IP address", s.options.host));
  }
  tcp::endpoint ep(addr, static_cast<uint16_t>(s.options.port));
  s.acceptor = std::make_unique<tcp::acceptor>(s.io[0]->ioc);
  s.accept_retry = std::make_unique<net::steady_timer>(s.io[0]->ioc);
  s.acceptor->open(ep.protocol(), ec);
  if (!ec) {
    s.acceptor->set_option(net::socket_base::reuse_address(true), ec);
    s.acceptor->bind(ep, ec);
  }
  if (!ec) {
    s.acceptor->listen(net::socket_base::max_listen_connections, ec);
  }
  if (ec) {
    return absl::UnavailableError(
        fmt::format("cannot bind {}:{}: {}: is the port in use? pick another with --listen",
                    s.options.host, s.options.port, ec.message()));
  }
  s.port = s.acceptor->local_endpoint().port();
  s.max_sessions = s.options.max_connections;
  if (s.max_sessions <= 0) {
    rlimit rl{};
    uint64_t soft = ::getrlimit(RLIMIT_NOFILE, &rl) == 0 ? rl.rlim_cur : 1024;
    s.max_sessions = static_cast<int>(
        std::clamp<uint64_t>(soft > 128 ? (soft - 64) / 2 : 32, 32, uint64_t{1} << 30));
  }
  s.blocking = std::make_unique<ElasticTaskQueue>(s.options.max_blocking_threads);
  s.Accept();
  for (auto& io : s.io) {
    IoThread* t = io.get();
    t->sweep = std::make_unique<net::steady_timer>(t->ioc);
    SweepIdle(t, std::chrono::milliseconds(std::max(0, s.options.upstream_max_idle_ms)));
    t->thread = std::thread([t] {
      auto guard = net::make_work_guard(t->ioc);
      t->ioc.run();
    });
  }
  s.started = true;
  return absl::OkStatus();
}

void AsyncHttpServer::Stop() {
  Impl& s = *impl_;
  if (!s.started || s.stopped) {
    return;
  }
  s.stopped = true;
  net::post(s.io[0]->ioc, [&s] {
    error_code ignored;
    s.acceptor->close(ignored);
    s.accept_retry->cancel();
  });
  for (auto& io : s.io) {
    io->ioc.stop();
  }
  for (auto& io : s.io) {
    if (io->thread.joinable()) {
      io->thread.join();
    }
  }
  // No io thread enqueues blocking work any more; running jobs finish and post their replies
  // to the stopped loops, which drop them.
  s.blocking->shutdown();
  for (auto& io : s.io) {
    io->pool.Clear();
  }
  s.acceptor.reset();
  s.accept_retry.reset();
  s.io.clear();
}

void AsyncHttpServer::Send(const HostPort& upstream, std::string path, std::string body) {
  Call(upstream, std::move(path), std::move(body), nullptr);
}

void AsyncHttpServer::Call(const HostPort& upstream, std::string path, std::string body,
                           std::function<void(CallResult&)> done) {
  Impl& s = *impl_;
  if (!s.started || s.stopped) {
    return;
  }
  IoThread& io = s.NextIo();
  auto call = std::make_shared<OneShot>(io, s.options, upstream, std::move(path), std::move(body),
                                        std::move(done));
  net::post(io.ioc, [call] { call->Run(); });
}

}  // namespace bragg::gateway
