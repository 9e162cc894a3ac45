#pragma once

// What the gateway's integration tests share: a fixture that starts the real bragg-sim-worker and
// bragg-gateway binaries (BRAGG_SIM_WORKER, BRAGG_GATEWAY) on port 0 and reads their URLs, and
// small HTTP helpers over cpp-httplib.

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/fs.h"
#include "common/process.h"
#include "common/unique_fd.h"
#include "gateway/http_util.h"

namespace bragg::gateway {

using nlohmann::json;

struct Proc {
  ChildProcess child;
  std::string url;
  int port = 0;
};

class GatewayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::signal(SIGPIPE, SIG_IGN);
    auto dir = TempDir::Create("/tmp", "bragg-gw-test-");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = std::move(*dir);
  }

  void TearDown() override {
    if (!HasFailure()) {
      return;
    }
    // The children's logs say why.
    for (int i = 0; i < counter_; ++i) {
      auto text = ReadFileToString(fmt::format("{}/out-{}", dir_.path(), i));
      if (text.ok()) {
        std::string tail = text->size() > 3000 ? text->substr(text->size() - 3000) : *text;
        std::printf("--- child %d output (tail) ---\n%s\n", i, tail.c_str());
      }
    }
  }

  // Starts a binary that prints "listening on URL" and returns once it does.
  Proc Start(std::vector<std::string> argv) {
    std::string out = fmt::format("{}/out-{}", dir_.path(), counter_++);
    int fd = ::open(out.c_str(), O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC, 0600);
    EXPECT_GE(fd, 0);
    UniqueFd owned(fd);
    SpawnOptions so;
    so.stdout_fd = fd;
    so.stderr_fd = fd;
    auto child = Spawn(argv, so);
    EXPECT_TRUE(child.ok()) << child.status();
    Proc p;
    p.child = std::move(*child);
    for (int i = 0; i < 200; ++i) {
      auto text = ReadFileToString(out);
      size_t at = text.ok() ? text->find("listening on ") : std::string::npos;
      if (at != std::string::npos && text->find('\n', at) != std::string::npos) {
        p.url = text->substr(at + 13, text->find('\n', at) - at - 13);
        p.port = ParseHostPort(p.url)->port;
        return p;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ADD_FAILURE() << "no 'listening on' from " << argv[0];
    return p;
  }

  Proc Worker(std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {BRAGG_SIM_WORKER, "--listen", "127.0.0.1:0", "--seed", "1"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return Start(argv);
  }

  Proc Gateway(const std::vector<Proc*>& workers, const std::string& policy,
               std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {BRAGG_GATEWAY, "--listen", "127.0.0.1:0",
                                     "--policy",    policy,     "--health-interval-ms",
                                     "100"};
    for (Proc* w : workers) {
      argv.push_back("--worker");
      argv.push_back(w->url);
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    return Start(argv);
  }

  TempDir dir_;
  int counter_ = 0;
};

inline std::unique_ptr<httplib::Client> Http(const Proc& p) {
  auto c = std::make_unique<httplib::Client>("127.0.0.1", p.port);
  c->set_read_timeout(60, 0);
  c->set_keep_alive(true);
  return c;
}

// A streaming /generate request for rollout `key`.
inline httplib::Request StreamingGenerate(const json& input_ids, const std::string& key,
                                          int max_new_tokens) {
  httplib::Request req;
  req.method = "POST";
  req.path = "/generate";
  req.body = json{{"input_ids", input_ids},
                  {"routing_key", key},
                  {"stream", true},
                  {"sampling_params", {{"max_new_tokens", max_new_tokens}}}}
                 .dump();
  req.set_header("Content-Type", "application/json");
  return req;
}

inline json PostJson(httplib::Client& c, const std::string& path, const json& body, int* status,
                     std::string* worker = nullptr) {
  auto r = c.Post(path, body.dump(), "application/json");
  if (!r) {
    *status = -1;
    return json{{"transport_error", httplib::to_string(r.error())}};
  }
  *status = r->status;
  if (worker != nullptr) {
    *worker = r->get_header_value("X-Bragg-Worker");
  }
  return json::parse(r->body, nullptr, false);
}

// GET /workers' "workers" array (sgl-router's {"workers", "total", "stats"}); empty when the
// call failed.
inline json WorkerList(httplib::Client& c, const httplib::Headers& headers = {}) {
  auto r = c.Get("/workers", headers);
  json j = r ? json::parse(r->body, nullptr, false) : json();
  return j.is_object() && j["workers"].is_array() ? j["workers"] : json::array();
}

// /workers' "healthy" of the worker at `url` (false if not listed).
inline bool Healthy(httplib::Client& c, const std::string& url) {
  for (const json& x : WorkerList(c)) {
    if (x["url"] == url) {
      return x["healthy"].get<bool>();
    }
  }
  return false;
}

// Polls until `url` has health `want` (true) or `ms` passed (false).
inline bool WaitHealthy(httplib::Client& c, const std::string& url, bool want, int ms = 20000) {
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < end) {
    if (Healthy(c, url) == want) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// True if `url` never turned healthy within `ms` (health checks run every 100 ms here).
inline bool StaysOut(httplib::Client& c, const std::string& url, int ms = 1500) {
  return !WaitHealthy(c, url, true, ms);
}

// GET /sim/stats of worker `w`.
inline json SimStats(const Proc& w) {
  auto r = Http(w)->Get("/sim/stats");
  return r ? json::parse(r->body, nullptr, false) : json();
}

// Polls worker `w` (up to ~20 s) until `pred` holds for its /sim/stats.
inline bool WaitStats(const Proc& w, const std::function<bool(const json&)>& pred) {
  for (int i = 0; i < 800; ++i) {
    json s = SimStats(w);
    if (s.is_object() && pred(s)) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  return false;
}

}  // namespace bragg::gateway
