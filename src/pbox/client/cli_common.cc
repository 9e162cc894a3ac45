#include "pbox/client/cli_common.h"

#include <CLI/CLI.hpp>
#include <iostream>

#include "common/process.h"
#include "fmt/format.h"
#include "pbox/client/endpoints.h"

namespace bragg::pbox::client {

int Fail(const Status& s) {
  std::cerr << "pbox: " << s.message() << "\n";
  return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

std::pair<std::string, std::string> SplitRemote(const std::string& arg) {
  size_t colon = arg.find(':');
  if (colon == std::string::npos || colon == 0 || arg.rfind("./", 0) == 0 || arg[0] == '/') {
    return {"", arg};
  }
  return {arg.substr(0, colon), arg.substr(colon + 1)};
}

Result<std::map<std::string, std::string>> ParseEnv(const std::vector<std::string>& items) {
  std::map<std::string, std::string> env;
  for (const auto& kv : items) {
    size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      return absl::InvalidArgumentError(fmt::format("--env {}: expected KEY=VALUE", kv));
    }
    env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

void Agents::Register(CLI::App& app, Flags* flags) {
  app.add_option("--endpoint", flags->options.endpoint,
                 "agent address: unix:///path.sock or tcp://host:port (default $PBOX_ENDPOINT, "
                 "else unix:///run/pbox/pbox.sock, or a user's own rootless agent's, "
                 "$XDG_RUNTIME_DIR/pbox/pbox.sock)");
  app.add_option("--token", flags->options.token, "bearer token for TCP (default $PBOX_TOKEN)");
  app.add_option("--endpoints", flags->endpoints,
                 "every agent of a job: an endpoints file or tcp://a:1,tcp://b:2 (default "
                 "$PBOX_ENDPOINTS when neither --endpoint nor $PBOX_ENDPOINT is set)");
}

Result<Agents> Agents::Connect(Flags flags, bool one_agent_only, const std::string& node) {
  Agents agents;
  if (flags.endpoints.empty() && flags.options.endpoint.empty() &&
      GetEnv("PBOX_ENDPOINT").empty()) {
    flags.endpoints = GetEnv(kEndpointsEnv);
  }
  if (!flags.endpoints.empty()) {
    if (!flags.options.endpoint.empty()) {
      return absl::InvalidArgumentError("pass --endpoint or --endpoints, not both");
    }
    if (one_agent_only) {
      return absl::InvalidArgumentError(
          "pbox image talks to one agent: pass --endpoint (each node imports its own images)");
    }
    BRAGG_ASSIGN_OR_RETURN(agents.cluster_, ClusterClient::Connect({.endpoints = flags.endpoints,
                                                                    .token = flags.options.token}));
    return agents;
  }
  if (!node.empty()) {
    return absl::InvalidArgumentError("--node needs --endpoints (or $PBOX_ENDPOINTS)");
  }
  BRAGG_ASSIGN_OR_RETURN(agents.single_, Client::Connect(flags.options));
  return agents;
}

Result<Client*> Agents::For(const std::string& id) const {
  if (!cluster_) {
    return single_.get();
  }
  BRAGG_ASSIGN_OR_RETURN(ClusterSandbox sb, cluster_->Find(id));
  return &sb.client();
}

bool Command::selected() const { return command_ != nullptr && *command_; }

}  // namespace bragg::pbox::client
