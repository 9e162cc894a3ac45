#pragma once

// What the pbox CLI's subcommands share: the agents they talk to (one, or every agent of a job),
// the exit code of an error, and the parsers of KEY=VALUE and ID:/path arguments.

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "pbox/client/client.h"
#include "pbox/client/cluster_client.h"

namespace CLI {
class App;
}  // namespace CLI

namespace bragg::pbox::client {

// Prints "pbox: MESSAGE" to stderr; returns the exit code of `s`: 2 for InvalidArgument (a
// usage error), else 1.
int Fail(const Status& s);

// "ID:/path" -> (ID, /path); a plain path, "./x" or "/x" -> ("", path).
std::pair<std::string, std::string> SplitRemote(const std::string& arg);

// KEY=VALUE items -> {KEY: VALUE}; InvalidArgument naming `--env` on an item without a key.
Result<std::map<std::string, std::string>> ParseEnv(const std::vector<std::string>& items);

// The agents a command talks to: one agent (single()), or every agent of a job (cluster()).
// Exactly one of the two is set. Not thread-safe.
class Agents {
 public:
  struct Flags {
    ClientOptions options;  // --endpoint, --token
    std::string endpoints;  // --endpoints
  };
  // Adds --endpoint, --token and --endpoints to `app`; `*flags` must outlive `app`'s parse.
  static void Register(CLI::App& app, Flags* flags);

  // Connects to $PBOX_ENDPOINTS's or --endpoints' agents when given (and neither --endpoint
  // nor $PBOX_ENDPOINT is), else to the one agent. InvalidArgument when both --endpoint and
  // --endpoints are given, when `one_agent_only` (a command that talks to one agent) meets
  // endpoints, or when `node` (create --node) is given without endpoints.
  static Result<Agents> Connect(Flags flags, bool one_agent_only, const std::string& node);

  Client* single() const { return single_.get(); }
  ClusterClient* cluster() const { return cluster_.get(); }

  // The client of the agent that holds sandbox `id` (NotFound from the cluster when no agent
  // does). The pointer lives as long as this object.
  Result<Client*> For(const std::string& id) const;

 private:
  std::unique_ptr<Client> single_;
  std::unique_ptr<ClusterClient> cluster_;
};

// One subcommand of the CLI: its flags, whether it was chosen, and what it does.
class Command {
 public:
  virtual ~Command() = default;
  // Adds the subcommand to `app`, which must outlive this object.
  virtual void Register(CLI::App& app) = 0;
  // Whether the user chose this subcommand (after parsing).
  bool selected() const;
  // Runs it: the process exit code, having printed any error on the way (partial failures of a
  // command over several sandboxes or nodes), or the error that stopped it (the caller prints
  // it with Fail).
  virtual Result<int> Run(const Agents& agents) = 0;

 protected:
  CLI::App* command_ = nullptr;
};

}  // namespace bragg::pbox::client
