#include "pbox/client/sandbox_cli.h"

#include <CLI/CLI.hpp>
#include <iostream>
#include <map>

#include "common/units.h"
#include "fmt/format.h"

namespace bragg::pbox::client {

void CreateCli::Register(CLI::App& app) {
  command_ = app.add_subcommand("create", "create a detached sandbox; prints its id");
  command_->add_option("--image", image_, "image name (default host)");
  command_->add_option("--runtime", runtime_, "native or gvisor (default: the agent's)");
  command_->add_option("--cpus", cpus_, "CPUs of the agent's sandbox set");
  command_->add_option("--cpu-quota", cpu_quota_, "CPU time limit in CPUs, e.g. 0.5");
  command_->add_option("--memory", memory_, "memory limit, e.g. 512M (default: agent's)");
  command_->add_option("--disk", disk_, "writable layer size, e.g. 1G (default: agent's)");
  command_->add_option("--pids", pids_, "process limit (default: agent's)");
  command_->add_option("--env", env_, "KEY=VALUE; repeatable");
  command_->add_option("--workdir", workdir_, "default working directory");
  command_->add_option("--ttl", ttl_, "idle TTL in seconds (default: agent's)");
  command_->add_option("--label", labels_, "KEY=VALUE; repeatable");
  command_->add_option("--node", node_, "with --endpoints: the node to place it on");
}

Result<int> CreateCli::Run(const Agents& agents) {
  v1::SandboxSpec spec;
  spec.set_image(image_);
  spec.set_runtime(runtime_);
  spec.set_cpus(cpus_);
  spec.set_cpu_quota(cpu_quota_);
  BRAGG_ASSIGN_OR_RETURN(uint64_t memory, ParseSize(memory_));
  spec.set_memory_bytes(memory);
  BRAGG_ASSIGN_OR_RETURN(uint64_t disk, ParseSize(disk_));
  spec.set_disk_bytes(disk);
  spec.set_pids(pids_);
  BRAGG_ASSIGN_OR_RETURN(auto env, ParseEnv(env_));
  BRAGG_ASSIGN_OR_RETURN(auto labels, ParseEnv(labels_));
  spec.mutable_env()->insert(env.begin(), env.end());
  spec.mutable_labels()->insert(labels.begin(), labels.end());
  spec.set_workdir(workdir_);
  spec.set_idle_ttl_seconds(ttl_);
  if (agents.cluster() != nullptr) {
    BRAGG_ASSIGN_OR_RETURN(ClusterSandbox sb, agents.cluster()->Create(spec, node_));
    std::cout << sb.id() << "\n";
    return 0;
  }
  BRAGG_ASSIGN_OR_RETURN(v1::Sandbox sb, agents.single()->Create(spec));
  std::cout << sb.id() << "\n";
  return 0;
}

void CloneCli::Register(CLI::App& app) {
  command_ = app.add_subcommand(
      "clone", "start sandboxes over a frozen copy of a sandbox's files; prints their ids");
  command_->add_option("id", id_, "the sandbox to clone")->required();
  command_->add_option("-n,--count", count_, "how many clones (default 1)");
}

Result<int> CloneCli::Run(const Agents& agents) {
  BRAGG_ASSIGN_OR_RETURN(Client * client, agents.For(id_));
  BRAGG_ASSIGN_OR_RETURN(auto clones, client->Clone(id_, count_));
  for (const auto& sb : clones) {
    std::cout << sb.id() << "\n";
  }
  return 0;
}

void PsCli::Register(CLI::App& app) {
  command_ = app.add_subcommand("ps", "list sandboxes");
  command_->add_flag("--quiet,-q", quiet_, "ids only");
}

Result<int> PsCli::Run(const Agents& agents) {
  // {node: sandboxes}; one "" node without --endpoints.
  std::map<std::string, std::vector<v1::Sandbox>> by_node;
  int rc = 0;
  ClusterClient* cluster = agents.cluster();
  if (cluster != nullptr) {
    for (const auto& n : cluster->nodes()) {
      auto list = (*cluster->client(n))->List();
      if (!list.ok()) {
        rc = Fail(Annotate(list.status(), "node " + n));
        continue;
      }
      by_node[n] = std::move(*list);
    }
  } else {
    BRAGG_ASSIGN_OR_RETURN(by_node[""], agents.single()->List());
  }
  std::string node_col = cluster != nullptr ? fmt::format("{:<16} ", "NODE") : "";
  if (!quiet_) {
    std::cout << fmt::format("{}{:<16} {:<16} {:<8} {:<6} {:>10} {:>10} {:>6}\n", node_col, "ID",
                             "SESSION", "IMAGE", "CPUS", "MEMORY", "USED", "EXECS");
  }
  for (const auto& [n, list] : by_node) {
    for (const auto& sb : list) {
      if (quiet_) {
        std::cout << sb.id() << "\n";
        continue;
      }
      std::cout << fmt::format("{}{:<16} {:<16} {:<8} {:<6} {:>10} {:>10} {:>6}\n",
                               cluster != nullptr ? fmt::format("{:<16} ", n) : "", sb.id(),
                               sb.session_id().empty() ? "-" : sb.session_id(), sb.spec().image(),
                               sb.cpuset(), FormatSize(sb.spec().memory_bytes()),
                               FormatSize(sb.memory_usage_bytes()), sb.running_execs());
    }
  }
  return rc;
}

void RmCli::Register(CLI::App& app) {
  command_ = app.add_subcommand("rm", "destroy sandboxes");
  command_->add_option("ids", ids_, "sandbox ids")->required();
}

Result<int> RmCli::Run(const Agents& agents) {
  int rc = 0;
  for (const auto& id : ids_) {
    auto client = agents.For(id);
    Status s = client.ok() ? (*client)->Destroy(id) : client.status();
    if (!s.ok()) {
      rc = Fail(s);
    }
  }
  return rc;
}

}  // namespace bragg::pbox::client
