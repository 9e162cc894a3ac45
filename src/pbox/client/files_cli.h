#pragma once

// The file subcommands of the pbox CLI:
//   pbox cp SRC DST    one side ID:/path, the other a local path; '-' is stdin/stdout
//   pbox ls ID:/dir

#include <string>

#include "pbox/client/cli_common.h"

namespace bragg::pbox::client {

class CpCli : public Command {
 public:
  void Register(CLI::App& app) override;
  Result<int> Run(const Agents& agents) override;

 private:
  std::string src_, dst_;
};

class LsCli : public Command {
 public:
  void Register(CLI::App& app) override;
  Result<int> Run(const Agents& agents) override;

 private:
  std::string target_;
};

}  // namespace bragg::pbox::client
