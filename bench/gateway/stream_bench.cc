// bragg-gateway-stream-bench: many concurrent streaming /generate requests through one
// bragg-gateway process to bragg-sim-worker processes, each stream on its own client
// connection. Counts completed streams, the peak number open at once (client side and the
// gateway's in-flight gauge), and errors by cause. Exit 0 only when every stream completed
// with "data: [DONE]" and the peak reached --min-peak of --streams.
//
// The gateway and the workers run as separate processes (the real binaries), so each has its
// own RLIMIT_NOFILE: the gateway needs two descriptors per stream (client and worker side).

#include <fmt/format.h>
#include <httplib.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "bench/common/listening_child.h"
#include "common/fs.h"
#include "common/process.h"
#include "common/unique_fd.h"
#include "gateway/http_util.h"

namespace bragg::gateway {
namespace {

namespace net = boost::asio;
namespace http = boost::beast::http;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;
using boost::system::error_code;

struct Stats {
  std::atomic<int> active{0};
  std::atomic<int> peak{0};
  std::atomic<int> done{0};
  std::atomic<int> ok{0};
  std::mutex mu;
  std::map<std::string, int> errors;  // by cause
  void Error(const std::string& cause) {
    std::lock_guard<std::mutex> lock(mu);
    errors[cause]++;
  }
};

// One streaming request on its own connection ("Connection: close"). The response is read with
// Beast's parser, so the chunked framing is taken off before the events are looked at: the
// gateway forwards the worker's body as it arrives, and a read that ends mid-event puts a chunk
// boundary inside "data: [DONE]" on the wire.
class Stream : public std::enable_shared_from_this<Stream> {
 public:
  Stream(net::io_context& ioc, tcp::endpoint ep, std::string request, Stats& stats)
      : sock_(ioc), ep_(ep), request_(std::move(request)), stats_(stats) {
    parser_.body_limit(std::numeric_limits<std::uint64_t>::max());
  }

  void Run() {
    sock_.async_connect(ep_, [self = shared_from_this()](error_code ec) {
      if (ec) {
        self->Finish("connect: " + ec.message());
        return;
      }
      net::async_write(self->sock_, net::buffer(self->request_), [self](error_code ec, size_t) {
        if (ec) {
          self->Finish("write: " + ec.message());
          return;
        }
        http::async_read_header(self->sock_, self->buf_, self->parser_,
                                [self](error_code ec, size_t) { self->OnHeader(ec); });
      });
    });
  }

 private:
  void OnHeader(error_code ec) {
    if (ec) {
      Finish("read: " + ec.message());
      return;
    }
    started_ = true;
    int now = ++stats_.active;
    int peak = stats_.peak.load();
    while (now > peak && !stats_.peak.compare_exchange_weak(peak, now)) {
    }
    ReadBody();
  }

  void ReadBody() {
    if (parser_.is_done()) {
      Classify();
      return;
    }
    parser_.get().body().data = chunk_;
    parser_.get().body().size = sizeof(chunk_);
    http::async_read_some(sock_, buf_, parser_, [self = shared_from_this()](error_code ec, size_t) {
      if (ec == http::error::need_buffer) {
        ec = {};
      }
      size_t n = sizeof(self->chunk_) - self->parser_.get().body().size;
      self->tail_.append(self->chunk_, n);
      if (self->tail_.size() > 4096) {
        self->tail_.erase(0, self->tail_.size() - 2048);  // [DONE] is in the tail
      }
      if (ec) {
        self->Finish("read: " + ec.message());
        return;
      }
      self->ReadBody();
    });
  }

  void Classify() {
    int status = parser_.get().result_int();
    if (status != 200) {
      Finish(fmt::format("status: {}", status));
    } else if (tail_.find("data: [DONE]") == std::string::npos) {
      Finish(tail_.find("\"error\"") != std::string::npos ? "stream ended with an error"
                                                          : "stream ended without [DONE]");
    } else {
      Finish("");
    }
  }

  void Finish(const std::string& error) {
    if (started_) {
      --stats_.active;
    }
    if (error.empty()) {
      stats_.ok++;
    } else {
      stats_.Error(error);
    }
    stats_.done++;
  }

  tcp::socket sock_;
  tcp::endpoint ep_;
  std::string request_;
  Stats& stats_;
  boost::beast::flat_buffer buf_;
  http::response_parser<http::buffer_body> parser_;
  char chunk_[4096];
  std::string tail_;  // the decoded body's last bytes
  bool started_ = false;
};

// --- event-driven stub worker (--upstream stub) ---
// Speaks the subset of the worker API the gateway uses here: GET /health, POST /abort_request,
// and POST /generate streamed as SSE, one event every `decode_us` for `tokens` events, then the
// final event and [DONE], chunked, keep-alive. One event loop holds every stream, so it is not
// what limits how many streams a run can hold (bragg-sim-worker uses a thread per stream).
class StubConn : public std::enable_shared_from_this<StubConn> {
 public:
  StubConn(tcp::socket s, int tokens, int decode_us)
      : sock_(std::move(s)), timer_(sock_.get_executor()), tokens_(tokens), decode_us_(decode_us) {}
  void Start() { ReadHead(); }

 private:
  void ReadHead() {
    net::async_read_until(sock_, net::dynamic_buffer(in_), "\r\n\r\n",
                          [self = shared_from_this()](error_code ec, size_t n) {
                            if (ec) {
                              return;
                            }
                            self->head_ = self->in_.substr(0, n);
                            self->in_.erase(0, n);
                            size_t cl = 0;
                            size_t at = self->head_.find("Content-Length: ");
                            if (at != std::string::npos) {
                              cl = std::strtoul(self->head_.c_str() + at + 16, nullptr, 10);
                            }
                            self->ReadBody(cl);
                          });
  }
  void ReadBody(size_t cl) {
    if (in_.size() >= cl) {
      in_.erase(0, cl);
      Serve();
      return;
    }
    net::async_read(sock_, net::dynamic_buffer(in_), net::transfer_exactly(cl - in_.size()),
                    [self = shared_from_this(), cl](error_code ec, size_t) {
                      if (!ec) {
                        self->ReadBody(cl);
                      }
                    });
  }
  void Serve() {
    if (head_.rfind("POST /generate ", 0) == 0) {
      step_ = 0;
      Write(
          "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
          "Transfer-Encoding: chunked\r\n\r\n",
          [](StubConn* c) { c->Tick(); });
      return;
    }
    Write("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
          [](StubConn* c) { c->ReadHead(); });
  }
  void Tick() {
    timer_.expires_after(std::chrono::microseconds(decode_us_));
    timer_.async_wait([self = shared_from_this()](error_code ec) {
      if (ec) {
        return;
      }
      ++self->step_;
      std::string ev;
      if (self->step_ < self->tokens_) {
        ev = fmt::format(
            "data: {{\"output_ids\":[{}],\"meta_info\":{{\"completion_tokens\":{}}}}}\n\n",
            self->step_, self->step_);
      } else {
        ev = fmt::format(
            "data: {{\"meta_info\":{{\"prompt_tokens\":8,\"cached_tokens\":0,"
            "\"completion_tokens\":{}}}}}\n\ndata: [DONE]\n\n",
            self->step_);
      }
      std::string chunk = fmt::format("{:x}\r\n{}\r\n", ev.size(), ev);
      if (self->step_ >= self->tokens_) {
        chunk += "0\r\n\r\n";
        self->Write(std::move(chunk), [](StubConn* c) { c->ReadHead(); });
      } else {
        self->Write(std::move(chunk), [](StubConn* c) { c->Tick(); });
      }
    });
  }
  void Write(std::string data, void (*next)(StubConn*)) {
    out_ = std::move(data);
    net::async_write(sock_, net::buffer(out_),
                     [self = shared_from_this(), next](error_code ec, size_t) {
                       if (!ec) {
                         next(self.get());
                       }
                     });
  }

  tcp::socket sock_;
  net::steady_timer timer_;
  int tokens_;
  int decode_us_;
  int step_ = 0;
  std::string in_;
  std::string head_;
  std::string out_;
};

void StubAccept(tcp::acceptor& acc, int tokens, int decode_us) {
  acc.async_accept([&acc, tokens, decode_us](error_code ec, tcp::socket s) {
    if (!ec) {
      std::make_shared<StubConn>(std::move(s), tokens, decode_us)->Start();
    }
    StubAccept(acc, tokens, decode_us);
  });
}

int ServeStub(int tokens, int decode_us) {
  net::io_context ioc{1};
  tcp::acceptor acc(ioc, tcp::endpoint(net::ip::make_address("127.0.0.1"), 0));
  acc.listen(net::socket_base::max_listen_connections);
  std::printf("listening on http://127.0.0.1:%d\n", acc.local_endpoint().port());
  std::fflush(stdout);
  StubAccept(acc, tokens, decode_us);
  ioc.run();
  return 0;
}

// Sum of bragg_gateway_worker_in_flight over the gateway's workers, -1 if unreadable.
int GatewayInFlight(httplib::Client& c) {
  auto r = c.Get("/metrics");
  if (!r || r->status != 200) {
    return -1;
  }
  int sum = 0;
  size_t at = 0;
  const std::string key = "bragg_gateway_worker_in_flight{";
  while ((at = r->body.find(key, at)) != std::string::npos) {
    size_t sp = r->body.find(' ', r->body.find('}', at));
    sum += std::atoi(r->body.c_str() + sp + 1);
    at = sp;
  }
  return sum;
}

}  // namespace
}  // namespace bragg::gateway

int main(int argc, char** argv) {
  using namespace bragg::gateway;
  CLI::App app{"Concurrent streaming requests through bragg-gateway"};
  int streams = 10000;
  int workers = 4;
  int tokens = 40;
  int decode_us = 250000;
  int io_threads = 0;
  int client_threads = 1;
  double timeout_s = 300;
  double min_peak = 1.0;
  std::string upstream = "sim";
  bool serve_stub = false;
  std::string gateway_bin = BRAGG_GATEWAY;
  std::string worker_bin = BRAGG_SIM_WORKER;
  app.add_option("--streams", streams, "concurrent streaming requests");
  app.add_option("--workers", workers, "bragg-sim-worker processes");
  app.add_option("--tokens", tokens, "output tokens per stream");
  app.add_option("--decode-us", decode_us, "worker time per output token");
  app.add_option("--io-threads", io_threads, "gateway --io-threads (0: one per core)");
  app.add_option("--client-threads", client_threads, "client event-loop threads");
  app.add_option("--timeout-s", timeout_s, "give up after this long");
  app.add_option("--min-peak", min_peak, "fail unless this fraction of streams was open at once");
  app.add_option("--upstream", upstream, "sim: bragg-sim-worker processes; stub: event-driven stub")
      ->check(CLI::IsMember({"sim", "stub"}));
  app.add_flag("--serve-stub", serve_stub, "internal: run one stub worker");
  app.add_option("--gateway", gateway_bin, "bragg-gateway binary");
  app.add_option("--worker", worker_bin, "bragg-sim-worker binary");
  CLI11_PARSE(app, argc, argv);
  std::signal(SIGPIPE, SIG_IGN);
  auto fds = RaiseFileLimit();
  if (serve_stub) {
    return ServeStub(tokens, decode_us);
  }
  if (!fds.ok() || *fds < static_cast<uint64_t>(streams) + 64) {
    std::fprintf(stderr, "RLIMIT_NOFILE %lu is too low for %d client connections\n",
                 fds.ok() ? *fds : 0, streams);
    return 2;
  }
  auto dir = bragg::TempDir::Create("/tmp", "bragg-stream-bench-");
  if (!dir.ok()) {
    std::fprintf(stderr, "%s\n", std::string(dir.status().message()).c_str());
    return 1;
  }
  char exe[4096];
  ssize_t exe_len = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  std::string self_exe = exe_len > 0 ? std::string(exe, static_cast<size_t>(exe_len)) : argv[0];
  std::vector<bragg::bench::ListeningChild> children;
  std::vector<std::string> gw_argv = {gateway_bin,
                                      "--listen",
                                      "127.0.0.1:0",
                                      "--policy",
                                      "round_robin",
                                      "--io-threads",
                                      std::to_string(io_threads)};
  for (int w = 0; w < workers; ++w) {
    std::vector<std::string> wargv =
        upstream == "stub" ? std::vector<std::string>{"/proc/self/exe", "--serve-stub",
                                                      "--tokens",       std::to_string(tokens),
                                                      "--decode-us",    std::to_string(decode_us)}
                           : std::vector<std::string>{worker_bin,
                                                      "--listen",
                                                      "127.0.0.1:0",
                                                      "--seed",
                                                      "1",
                                                      "--decode-us",
                                                      std::to_string(decode_us)};
    auto c =
        bragg::bench::StartListeningChild(wargv, fmt::format("{}/worker-{}.log", dir->path(), w));
    if (!c.ok()) {
      std::fprintf(stderr, "%s\n", std::string(c.status().message()).c_str());
      return 1;
    }
    gw_argv.push_back("--worker");
    gw_argv.push_back(fmt::format("http://127.0.0.1:{}", c->port));
    children.push_back(std::move(*c));
  }
  auto gw = bragg::bench::StartListeningChild(gw_argv, fmt::format("{}/gateway.log", dir->path()));
  if (!gw.ok()) {
    std::fprintf(stderr, "%s\n", std::string(gw.status().message()).c_str());
    return 1;
  }

  Stats stats;
  net::io_context ioc;
  tcp::endpoint ep(net::ip::make_address("127.0.0.1"), static_cast<uint16_t>(gw->port));
  auto start = Clock::now();
  for (int i = 0; i < streams; ++i) {
    std::string body = nlohmann::json{{"input_ids", {1 + i % 1000, 2, 3, 4, 5, 6, 7, 8}},
                                      {"routing_key", fmt::format("stream-{}", i)},
                                      {"stream", true},
                                      {"sampling_params", {{"max_new_tokens", tokens}}}}
                           .dump();
    std::string req = fmt::format(
        "POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Connection: close\r\nContent-Length: {}\r\n\r\n{}",
        body.size(), body);
    std::make_shared<Stream>(ioc, ep, std::move(req), stats)->Run();
  }
  std::vector<std::thread> loop;
  for (int t = 0; t < std::max(1, client_threads); ++t) {
    loop.emplace_back([&ioc] { ioc.run(); });
  }
  httplib::Client mc("127.0.0.1", gw->port);
  mc.set_read_timeout(10, 0);
  int gw_peak = 0;
  double all_open_s = -1;
  auto deadline = start + std::chrono::duration<double>(timeout_s);
  while (stats.done.load() < streams && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    gw_peak = std::max(gw_peak, GatewayInFlight(mc));
    if (all_open_s < 0 && stats.peak.load() >= streams) {
      all_open_s = std::chrono::duration<double>(Clock::now() - start).count();
    }
  }
  double wall = std::chrono::duration<double>(Clock::now() - start).count();
  bool timed_out = stats.done.load() < streams;
  ioc.stop();
  for (auto& t : loop) {
    t.join();
  }
  if (timed_out) {
    stats.Error("timeout");
  }
  std::string gw_metrics;
  if (auto r = mc.Get("/metrics"); r) {
    gw_metrics = r->body;
  }
  auto metric = [&](const std::string& name) {
    size_t at = gw_metrics.find("\n" + name + " ");
    return at == std::string::npos
               ? std::string("?")
               : gw_metrics.substr(at + name.size() + 2,
                                   gw_metrics.find('\n', at + 1) - (at + name.size() + 2));
  };
  int errors = 0;
  std::printf(
      "## %d concurrent streams, %d %s workers, %d tokens x %d us, gateway --io-threads %d\n",
      streams, workers, upstream.c_str(), tokens, decode_us, io_threads);
  std::printf(
      "| streams | completed with [DONE] | peak open (client) | peak gateway in-flight | "
      "all open after s | wall s | errors |\n|---|---|---|---|---|---|---|\n");
  for (auto& [cause, n] : stats.errors) {
    errors += n;
  }
  std::printf("| %d | %d | %d | %d | %.1f | %.1f | %d |\n", streams, stats.ok.load(),
              stats.peak.load(), gw_peak, all_open_s, wall, errors);
  for (auto& [cause, n] : stats.errors) {
    std::printf("error: %d x %s\n", n, cause.c_str());
  }
  std::printf("gateway: client_aborts_total %s, upstream_errors_total %s\n",
              metric("bragg_gateway_client_aborts_total").c_str(),
              metric("bragg_gateway_upstream_errors_total").c_str());
  for (bragg::bench::ListeningChild& c : children) {
    (void)c.proc.Signal(SIGTERM);
  }
  (void)gw->proc.Signal(SIGTERM);
  bool pass = errors == 0 && stats.ok.load() == streams &&
              stats.peak.load() >= static_cast<int>(min_peak * streams);
  if (!pass) {
    auto log = bragg::ReadFileToString(fmt::format("{}/gateway.log", dir->path()));
    if (log.ok()) {
      std::printf("--- gateway log (tail) ---\n%s\n",
                  log->substr(log->size() > 3000 ? log->size() - 3000 : 0).c_str());
    }
  }
  std::printf("%s\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}
