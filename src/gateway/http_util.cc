#include "gateway/http_util.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <cerrno>
#include <charconv>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

namespace bragg::gateway {

ClientPool::ClientPool(HostPort target, std::string api_key)
    : target_(std::move(target)), api_key_(std::move(api_key)) {}

std::unique_ptr<httplib::Client> ClientPool::NewClient() const {
  auto c = std::make_unique<httplib::Client>(target_.host, target_.port);
  if (!api_key_.empty()) {
    c->set_bearer_token_auth(api_key_);
  }
  return c;
}

std::unique_ptr<httplib::Client> ClientPool::Acquire() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!idle_.empty()) {
      auto c = std::move(idle_.back());
      idle_.pop_back();
      return c;
    }
  }
  auto c = NewClient();
  c->set_keep_alive(true);
  c->set_connection_timeout(2, 0);
  c->set_read_timeout(3600, 0);
  c->set_write_timeout(60, 0);
  c->set_tcp_nodelay(true);
  return c;
}

void ClientPool::Release(std::unique_ptr<httplib::Client> client) {
  std::lock_guard<std::mutex> lock(mu_);
  if (idle_.size() < 1024) {
    idle_.push_back(std::move(client));
  }
}

void SetError(httplib::Response& res, int status, std::string_view message) {
  nlohmann::json body = {{"error", {{"message", std::string(message)}, {"code", status}}}};
  res.status = status;
  res.set_content(body.dump(), "application/json");
}

}  // namespace bragg::gateway
