#pragma once

// The sandbox lifecycle subcommands of the pbox CLI:
//   pbox create [--memory 1G] [--cpus 1] ... [--node N]   prints the new sandbox id
//   pbox clone ID [-n COUNT]                             prints the clones' ids
//   pbox ps [-q]                                         every node's with --endpoints
//   pbox rm ID...

#include <cstdint>
#include <string>
#include <vector>

#include "pbox/client/cli_common.h"

namespace bragg::pbox::client {

class CreateCli : public Command {
 public:
  void Register(CLI::App& app) override;
  Result<int> Run(const Agents& agents) override;
  // --node: the node to place the sandbox on ("" when not given).
  const std::string& node() const { return node_; }

 private:
  std::string image_, runtime_, memory_ = "0", disk_ = "0", workdir_, node_;
  uint32_t cpus_ = 0, pids_ = 0, ttl_ = 0;
  double cpu_quota_ = 0;
  std::vector<std::string> env_, labels_;
};

class CloneCli : public Command {
 public:
  void Register(CLI::App& app) override;
  Result<int> Run(const Agents& agents) override;

 private:
  std::string id_;
  uint32_t count_ = 1;
};

class PsCli : public Command {
 public:
  void Register(CLI::App& app) override;
  // A node that does not answer is reported and the others are listed (exit code 1).
  Result<int> Run(const Agents& agents) override;

 private:
  bool quiet_ = false;
};

class RmCli : public Command {
 public:
  void Register(CLI::App& app) override;
  // Every id is tried; each failure is reported and sets the exit code.
  Result<int> Run(const Agents& agents) override;

 private:
  std::vector<std::string> ids_;
};

}  // namespace bragg::pbox::client
