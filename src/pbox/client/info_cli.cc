#include "pbox/client/info_cli.h"

#include <CLI/CLI.hpp>
#include <iostream>
#include <utility>
#include <vector>

#include "common/units.h"
#include "fmt/format.h"

namespace bragg::pbox::client {

void InfoCli::Register(CLI::App& app) {
  command_ = app.add_subcommand("info", "show the agent's version, CPU set and capacity");
}

Result<int> InfoCli::Run(const Agents& agents) {
  std::vector<std::pair<std::string, Client*>> clients;
  if (ClusterClient* cluster = agents.cluster(); cluster != nullptr) {
    for (const auto& n : cluster->nodes()) {
      clients.emplace_back(n, *cluster->client(n));
    }
  } else {
    clients.emplace_back("", agents.single());
  }
  int rc = 0;
  for (const auto& [n, c] : clients) {
    if (!n.empty()) {
      std::cout << fmt::format("node:           {} ({})\n", n, c->endpoint());
    }
    auto i = c->Info();
    if (!i.ok()) {
      rc = Fail(n.empty() ? i.status() : Annotate(i.status(), "node " + n));
      continue;
    }
    std::cout << fmt::format(
        "version:        {}\nhostname:       {}\nmode:           {}\nroot fs:        {}\n"
        "runtime:        {} (available: {})\n"
        "sandbox cpus:   {}\ncgroup:         {} (limits: {}, disk)\n"
        "sandboxes:      {} live, {} max\n"
        "images:         {}\ndefaults:       memory {}, disk {}, pids {}\n",
        i->version(), i->hostname(),
        i->mode() == "rootless" ? fmt::format("rootless (uid {})", i->uid()) : i->mode(),
        i->root_fs().empty() ? "overlayfs" : i->root_fs(), i->default_runtime(),
        fmt::join(i->runtimes(), ", "), i->cpuset(), i->cgroup_version(),
        fmt::join(i->limits(), ", "), i->live_sandboxes(), i->max_sandboxes(),
        fmt::join(i->images(), ", "), FormatSize(i->default_memory_bytes()),
        FormatSize(i->default_disk_bytes()), i->default_pids());
  }
  return rc;
}

}  // namespace bragg::pbox::client
