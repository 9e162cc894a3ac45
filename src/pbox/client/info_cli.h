#pragma once

// `pbox info`: the agent's version, runtimes, CPU set, cgroup, capacity and defaults; with
// --endpoints, each node's in turn.

#include "pbox/client/cli_common.h"

namespace bragg::pbox::client {

class InfoCli : public Command {
 public:
  void Register(CLI::App& app) override;
  // A node that does not answer is reported and the others are described (exit code 1).
  Result<int> Run(const Agents& agents) override;
};

}  // namespace bragg::pbox::client
