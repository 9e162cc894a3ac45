#include "fusion/server.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <nlohmann/json.hpp>

#include "common/http_server.h"

namespace bragg::fusion {
namespace {

using json = nlohmann::json;

constexpr char kJson[] = "application/json";

// FastAPI's shape for errors that are not a request's validation: {"detail": "..."}.
void SetDetail(httplib::Response& res, int status, const std::string& detail) {
  res.status = status;
  res.set_content(json{{"detail", detail}}.dump(-1, ' ', false, json::error_handler_t::replace),
                  kJson);
}

}  // namespace

Server::Server(Runner* runner, ServerOptions options)
    : runner_(runner),
      options_(std::move(options)),
      watch_([runner](const std::string& sandbox_id) { runner->Destroy(sandbox_id); }) {
  http_.new_task_queue = [n = options_.max_connections] { return new ElasticTaskQueue(n); };
  http_.set_tcp_nodelay(true);
  http_.set_keep_alive_max_count(1 << 30);
  // Uvicorn's (SandboxFusion's server) default; also how long an idle keep-alive connection can
  // hold up Stop(), which httplib does not interrupt.
  http_.set_keep_alive_timeout(5);
  http_.set_payload_max_length(options_.max_request_bytes);
  // A call runs for as long as its timeouts allow; the client, not httplib, decides how long
  // to wait for the answer. These bound reading the request and writing the answer only.
  http_.set_read_timeout(60);
  http_.set_write_timeout(60);

  http_.Get("/v1/ping", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("\"pong\"", kJson);
  });
  http_.Post("/run_code",
             [this](const httplib::Request& req, httplib::Response& res) { RunCode(req, res); });
  http_.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) {
      return;
    }
    if (res.status == 413) {
      SetDetail(res, 413,
                fmt::format("request body larger than {} bytes (pbox-fusion's --max-request-mb)",
                            options_.max_request_bytes));
    } else if (res.status == 404) {
      SetDetail(res, 404, "Not Found");
    }
  });
  http_.set_exception_handler(
      [](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown error";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        spdlog::error("{} {} failed: {}", req.method, req.path, what);
        SetDetail(res, 500, fmt::format("internal error: {}", what));
      });
}

Server::~Server() { Stop(); }

Status Server::Start() {
  BRAGG_ASSIGN_OR_RETURN(port_, BindServer(http_, options_.host, options_.port));
  BRAGG_ASSIGN_OR_RETURN(thread_, ServeInBackground(http_));
  return absl::OkStatus();
}

void Server::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      return;
    }
    stopping_ = true;
  }
  slot_free_.notify_all();
  // Ends the calls in flight: their sandboxes go with the session, their Run calls fail.
  runner_->Shutdown();
  http_.stop();
  if (thread_.joinable()) {
    thread_.join();
  }
  ServerStats s = stats();
  spdlog::info("served {} calls, refused {}, {} abandoned by their clients", s.calls, s.refused,
               s.abandoned);
}

std::string Server::url() const {
  const std::string& h = options_.host;
  return h.find(':') != std::string::npos ? fmt::format("http://[{}]:{}", h, port_)
                                          : fmt::format("http://{}:{}", h, port_);
}

ServerStats Server::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

bool Server::AcquireSlot(const WatchedCall& call) {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_ && running_ >= options_.max_concurrency) {
    // The watch marks a hung-up client without waking this wait: look again now and then.
    slot_free_.wait_for(lock, std::chrono::milliseconds(100));
    if (running_ >= options_.max_concurrency) {
      lock.unlock();
      bool gone = call.cancelled();
      lock.lock();
      if (gone) {
        return false;
      }
    }
  }
  if (stopping_) {
    return false;
  }
  ++running_;
  return true;
}

void Server::ReleaseSlot() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    --running_;
  }
  slot_free_.notify_one();
}

void Server::RunCode(const httplib::Request& req, httplib::Response& res) {
  RequestError error;
  Result<RunCodeRequest> request = ParseRunCodeRequest(req.body, options_.limits, &error);
  if (!request.ok()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.refused;
    }
    res.status = 422;
    res.set_content(RequestErrorJson(error), kJson);
    return;
  }
  Result<int> fd = FindConnectionFd(req.remote_addr, req.remote_port, req.local_port);
  if (!fd.ok()) {
    spdlog::warn("not watching a /run_code call for its client hanging up: {}",
                 fd.status().ToString());
  }
  std::unique_ptr<WatchedCall> call = watch_.Register(fd.ok() ? *fd : -1);
  RunCodeResponse response;
  if (AcquireSlot(*call)) {
    response = runner_->Run(*request, call.get());
    ReleaseSlot();
  } else {
    response = SandboxErrorResponse(call->cancelled() ? "the client went away"
                                                      : "pbox-fusion is shutting down");
  }
  bool gone = call->cancelled();
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++(gone ? stats_.abandoned : stats_.calls);
  }
  res.status = 200;
  res.set_content(ToJson(response), kJson);
}

}  // namespace bragg::fusion
