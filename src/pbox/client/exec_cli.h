#pragma once

// `pbox exec ID [--timeout S] [-e K=V] [-w DIR] [-i] -- CMD ...`: runs a command in a sandbox,
// streaming its output; exits with the command's exit code (124: timed out, 137: OOM-killed,
// 128+N: killed by signal N).

#include <string>
#include <vector>

#include "pbox/client/cli_common.h"

namespace bragg::pbox::client {

class ExecCli : public Command {
 public:
  void Register(CLI::App& app) override;
  Result<int> Run(const Agents& agents) override;

 private:
  std::string id_, cwd_;
  double timeout_s_ = 0;
  bool interactive_ = false;
  std::vector<std::string> env_, command_line_;
};

}  // namespace bragg::pbox::client
