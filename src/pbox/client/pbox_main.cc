// pbox: command-line client of the pbox agent.
//
//   pbox create [--memory 1G] [--cpus 1] ...      prints the new sandbox id
//   pbox exec ID [--timeout S] [-i] -- CMD ...    exits with CMD's exit code (124: timeout,
//                                                 137: OOM-killed or killed)
//   pbox cp SRC DST                               one side ID:/path; '-' is stdin/stdout
//   pbox ps | ls ID:/dir | rm ID... | info
//   pbox image import NAME FILE | image ls | image rm NAME... | image prune
//
// With --endpoints FILE|LIST (or $PBOX_ENDPOINTS when no --endpoint/$PBOX_ENDPOINT is given) the
// CLI speaks to every agent of a job: create places the sandbox on the least-loaded node (or
// --node), ps lists every node, info describes each, and the commands that name a sandbox find
// the node that holds it.

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "absl/synchronization/mutex.h"
#include "common/fs.h"
#include "common/memory.h"
#include "common/process.h"
#include "common/units.h"
#include "fmt/format.h"
#include "pbox/client/client.h"
#include "pbox/client/cluster_client.h"
#include "pbox/client/image_cli.h"

namespace {

using bragg::Result;
using bragg::Status;
namespace v1 = bragg::pbox::v1;
using bragg::pbox::client::Client;
using bragg::pbox::client::ClusterClient;

int Fail(const Status& s) {
  std::cerr << "pbox: " << s.message() << "\n";
  return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

// "ID:/path" -> (ID, /path); a plain path -> ("", path).
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

const char* TypeName(v1::FileType t) {
  switch (t) {
    case v1::FILE_TYPE_REGULAR:
      return "-";
    case v1::FILE_TYPE_DIRECTORY:
      return "d";
    case v1::FILE_TYPE_SYMLINK:
      return "l";
    default:
      return "?";
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Debian's Abseil runs Mutex deadlock detection (a cycle graph on every lock) unless told
  // not to; gRPC locks on every call.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  bragg::TuneAllocatorForBulkData();
  ::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"pbox: run commands in sandboxes on this node's pbox agent"};
  app.require_subcommand(1);
  bragg::pbox::client::ClientOptions options;
  app.add_option("--endpoint", options.endpoint,
                 "agent address: unix:///path.sock or tcp://host:port (default $PBOX_ENDPOINT, "
                 "else unix:///run/pbox/pbox.sock)");
  app.add_option("--token", options.token, "bearer token for TCP (default $PBOX_TOKEN)");
  std::string endpoints;
  app.add_option("--endpoints", endpoints,
                 "every agent of a job: an endpoints file or tcp://a:1,tcp://b:2 (default "
                 "$PBOX_ENDPOINTS when neither --endpoint nor $PBOX_ENDPOINT is set)");

  // create
  auto* create = app.add_subcommand("create", "create a detached sandbox; prints its id");
  std::string image, runtime, memory = "0", disk = "0", workdir;
  uint32_t cpus = 0, pids = 0, ttl = 0;
  double cpu_quota = 0;
  std::vector<std::string> create_env, labels;
  create->add_option("--image", image, "image name (default host)");
  create->add_option("--runtime", runtime, "native or gvisor (default: the agent's)");
  create->add_option("--cpus", cpus, "CPUs of the agent's sandbox set");
  create->add_option("--cpu-quota", cpu_quota, "CPU time limit in CPUs, e.g. 0.5");
  create->add_option("--memory", memory, "memory limit, e.g. 512M (default: agent's)");
  create->add_option("--disk", disk, "writable layer size, e.g. 1G (default: agent's)");
  create->add_option("--pids", pids, "process limit (default: agent's)");
  create->add_option("--env", create_env, "KEY=VALUE; repeatable");
  create->add_option("--workdir", workdir, "default working directory");
  create->add_option("--ttl", ttl, "idle TTL in seconds (default: agent's)");
  create->add_option("--label", labels, "KEY=VALUE; repeatable");
  std::string node;
  create->add_option("--node", node, "with --endpoints: the node to place it on");

  // exec
  auto* exec = app.add_subcommand("exec", "run a command in a sandbox, streaming its output");
  std::string exec_id, cwd;
  double timeout_s = 0;
  bool interactive = false;
  std::vector<std::string> exec_env, command;
  exec->add_option("id", exec_id, "sandbox id")->required();
  exec->add_option("--timeout", timeout_s, "seconds; the command's whole tree is killed then");
  exec->add_option("--env,-e", exec_env, "KEY=VALUE; repeatable");
  exec->add_option("--cwd,-w", cwd, "working directory inside the sandbox");
  exec->add_flag("--interactive,-i", interactive, "forward stdin to the command");
  exec->add_option("command", command, "command and arguments (after --)")->required();

  // cp
  auto* cp = app.add_subcommand("cp", "copy a file into or out of a sandbox");
  std::string cp_src, cp_dst;
  cp->add_option("src", cp_src, "local path, '-' for stdin, or ID:/path")->required();
  cp->add_option("dst", cp_dst, "local path, '-' for stdout, or ID:/path")->required();

  auto* ps = app.add_subcommand("ps", "list sandboxes");
  bool quiet = false;
  ps->add_flag("--quiet,-q", quiet, "ids only");

  auto* ls = app.add_subcommand("ls", "list a directory in a sandbox");
  std::string ls_target;
  ls->add_option("target", ls_target, "ID:/path")->required();

  auto* rm = app.add_subcommand("rm", "destroy sandboxes");
  std::vector<std::string> rm_ids;
  rm->add_option("ids", rm_ids, "sandbox ids")->required();

  auto* info = app.add_subcommand("info", "show the agent's version, CPU set and capacity");

  bragg::pbox::client::ImageCli image_cli;
  image_cli.Register(app);
  // clone
  auto* clone = app.add_subcommand(
      "clone", "start sandboxes over a frozen copy of a sandbox's files; prints their ids");
  std::string clone_id;
  uint32_t clone_count = 1;
  clone->add_option("id", clone_id, "the sandbox to clone")->required();
  clone->add_option("-n,--count", clone_count, "how many clones (default 1)");

  CLI11_PARSE(app, argc, argv);

  // One agent, or every agent of a job.
  std::unique_ptr<Client> single;
  std::unique_ptr<ClusterClient> cluster;
  if (endpoints.empty() && options.endpoint.empty() && bragg::GetEnv("PBOX_ENDPOINT").empty()) {
    endpoints = bragg::GetEnv(bragg::pbox::client::kEndpointsEnv);
  }
  if (!endpoints.empty()) {
    if (!options.endpoint.empty()) {
      return Fail(absl::InvalidArgumentError("pass --endpoint or --endpoints, not both"));
    }
    if (image_cli.selected()) {
      return Fail(absl::InvalidArgumentError(
          "pbox image talks to one agent: pass --endpoint (each node imports its own images)"));
    }
    auto c = ClusterClient::Connect({.endpoints = endpoints, .token = options.token});
    if (!c.ok()) {
      return Fail(c.status());
    }
    cluster = std::move(*c);
  } else {
    if (!node.empty()) {
      return Fail(absl::InvalidArgumentError("--node needs --endpoints (or $PBOX_ENDPOINTS)"));
    }
    auto c = Client::Connect(options);
    if (!c.ok()) {
      return Fail(c.status());
    }
    single = std::move(*c);
  }
  // The client of the agent that holds `id`.
  auto client_for = [&](const std::string& id) -> Result<Client*> {
    if (!cluster) {
      return single.get();
    }
    auto sb = cluster->Find(id);
    if (!sb.ok()) {
      return sb.status();
    }
    return &sb->client();
  };

  if (*create) {
    v1::SandboxSpec spec;
    spec.set_image(image);
    spec.set_runtime(runtime);
    spec.set_cpus(cpus);
    spec.set_cpu_quota(cpu_quota);
    for (auto [text, setter] : {std::pair<std::string*, void (v1::SandboxSpec::*)(uint64_t)>{
                                    &memory, &v1::SandboxSpec::set_memory_bytes},
                                {&disk, &v1::SandboxSpec::set_disk_bytes}}) {
      auto size = bragg::ParseSize(*text);
      if (!size.ok()) {
        return Fail(size.status());
      }
      (spec.*setter)(*size);
    }
    spec.set_pids(pids);
    auto env = ParseEnv(create_env);
    auto lbl = ParseEnv(labels);
    if (!env.ok()) {
      return Fail(env.status());
    }
    if (!lbl.ok()) {
      return Fail(lbl.status());
    }
    spec.mutable_env()->insert(env->begin(), env->end());
    spec.mutable_labels()->insert(lbl->begin(), lbl->end());
    spec.set_workdir(workdir);
    spec.set_idle_ttl_seconds(ttl);
    if (cluster) {
      auto sb = cluster->Create(spec, node);
      if (!sb.ok()) {
        return Fail(sb.status());
      }
      std::cout << sb->id() << "\n";
      return 0;
    }
    auto sb = single->Create(spec);
    if (!sb.ok()) {
      return Fail(sb.status());
    }
    std::cout << sb->id() << "\n";
    return 0;
  }

  if (*clone) {
    auto c = client_for(clone_id);
    if (!c.ok()) {
      return Fail(c.status());
    }
    auto clones = (*c)->Clone(clone_id, clone_count);
    if (!clones.ok()) {
      return Fail(clones.status());
    }
    for (const auto& sb : *clones) {
      std::cout << sb.id() << "\n";
    }
    return 0;
  }

  if (*exec) {
    v1::ExecStart start;
    start.set_sandbox_id(exec_id);
    for (const auto& a : command) {
      start.add_argv(a);
    }
    auto env = ParseEnv(exec_env);
    if (!env.ok()) {
      return Fail(env.status());
    }
    start.mutable_env()->insert(env->begin(), env->end());
    start.set_cwd(cwd);
    start.set_timeout_ms(static_cast<uint64_t>(timeout_s * 1000));
    auto c = client_for(exec_id);
    if (!c.ok()) {
      return Fail(c.status());
    }
    auto result = (*c)->Exec(
        start, interactive ? STDIN_FILENO : -1, [](bool is_stderr, std::string_view data) {
          (void)bragg::WriteAll(is_stderr ? STDERR_FILENO : STDOUT_FILENO, data);
        });
    if (!result.ok()) {
      return Fail(result.status());
    }
    if (!result->error().empty()) {
      std::cerr << "pbox: " << result->error() << "\n";
    }
    if (result->timed_out()) {
      std::cerr << fmt::format("pbox: timed out after {:g} s; the command was killed\n", timeout_s);
      return 124;
    }
    if (result->oom_killed()) {
      std::cerr << "pbox: the command was killed: its sandbox ran out of memory\n";
      return 137;
    }
    if (result->signal() != 0) {
      return 128 + result->signal();
    }
    return result->exit_code();
  }

  if (*cp) {
    auto [src_id, src_path] = SplitRemote(cp_src);
    auto [dst_id, dst_path] = SplitRemote(cp_dst);
    if (src_id.empty() == dst_id.empty()) {
      return Fail(absl::InvalidArgumentError(
          "pbox cp: exactly one of SRC and DST must be in a sandbox (ID:/path)"));
    }
    auto c = client_for(dst_id.empty() ? src_id : dst_id);
    if (!c.ok()) {
      return Fail(c.status());
    }
    Client& client = **c;
    if (!dst_id.empty()) {
      bragg::UniqueFd in;
      if (src_path != "-") {
        auto fd = bragg::OpenFile(src_path, O_RDONLY);
        if (!fd.ok()) {
          return Fail(fd.status());
        }
        in = std::move(*fd);
      }
      auto r = client.WriteFileFromFd(dst_id, dst_path, in.valid() ? in.get() : STDIN_FILENO);
      return r.ok() ? 0 : Fail(r.status());
    }
    bragg::UniqueFd out;
    if (dst_path != "-") {
      auto fd = bragg::OpenFile(dst_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (!fd.ok()) {
        return Fail(fd.status());
      }
      out = std::move(*fd);
    }
    auto r = client.ReadFileToFd(src_id, src_path, out.valid() ? out.get() : STDOUT_FILENO);
    return r.ok() ? 0 : Fail(r.status());
  }

  if (*ps) {
    // {node: sandboxes}; one "" node without --endpoints.
    std::map<std::string, std::vector<v1::Sandbox>> by_node;
    int rc = 0;
    if (cluster) {
      for (const auto& n : cluster->nodes()) {
        auto list = (*cluster->client(n))->List();
        if (!list.ok()) {
          rc = Fail(bragg::Annotate(list.status(), "node " + n));
          continue;
        }
        by_node[n] = std::move(*list);
      }
    } else {
      auto list = single->List();
      if (!list.ok()) {
        return Fail(list.status());
      }
      by_node[""] = std::move(*list);
    }
    std::string node_col = cluster ? fmt::format("{:<16} ", "NODE") : "";
    if (!quiet) {
      std::cout << fmt::format("{}{:<16} {:<16} {:<8} {:<6} {:>10} {:>10} {:>6}\n", node_col, "ID",
                               "SESSION", "IMAGE", "CPUS", "MEMORY", "USED", "EXECS");
    }
    for (const auto& [n, list] : by_node) {
      for (const auto& sb : list) {
        if (quiet) {
          std::cout << sb.id() << "\n";
          continue;
        }
        std::cout << fmt::format("{}{:<16} {:<16} {:<8} {:<6} {:>10} {:>10} {:>6}\n",
                                 cluster ? fmt::format("{:<16} ", n) : "", sb.id(),
                                 sb.session_id().empty() ? "-" : sb.session_id(), sb.spec().image(),
                                 sb.cpuset(), bragg::FormatSize(sb.spec().memory_bytes()),
                                 bragg::FormatSize(sb.memory_usage_bytes()), sb.running_execs());
      }
    }
    return rc;
  }

  if (*ls) {
    auto [id, path] = SplitRemote(ls_target);
    if (id.empty()) {
      return Fail(absl::InvalidArgumentError("pbox ls: expected ID:/path"));
    }
    auto c = client_for(id);
    if (!c.ok()) {
      return Fail(c.status());
    }
    auto entries = (*c)->ListDir(id, path.empty() ? "/" : path);
    if (!entries.ok()) {
      return Fail(entries.status());
    }
    for (const auto& e : *entries) {
      std::cout << fmt::format("{}{:04o} {:>10} {}{}\n", TypeName(e.type()), e.mode(), e.size(),
                               e.path(),
                               e.symlink_target().empty() ? "" : " -> " + e.symlink_target());
    }
    return 0;
  }

  if (*rm) {
    int rc = 0;
    for (const auto& id : rm_ids) {
      auto c = client_for(id);
      Status s = c.ok() ? (*c)->Destroy(id) : c.status();
      if (!s.ok()) {
        rc = Fail(s);
      }
    }
    return rc;
  }

  if (image_cli.selected()) {
    return image_cli.Run(*single);
  }

  if (*info) {
    std::vector<std::pair<std::string, Client*>> agents;
    if (cluster) {
      for (const auto& n : cluster->nodes()) {
        agents.emplace_back(n, *cluster->client(n));
      }
    } else {
      agents.emplace_back("", single.get());
    }
    int rc = 0;
    for (const auto& [n, c] : agents) {
      if (!n.empty()) {
        std::cout << fmt::format("node:           {} ({})\n", n, c->endpoint());
      }
      auto i = c->Info();
      if (!i.ok()) {
        rc = Fail(n.empty() ? i.status() : bragg::Annotate(i.status(), "node " + n));
        continue;
      }
      std::cout << fmt::format(
          "version:        {}\nhostname:       {}\nruntime:        {} (available: {})\n"
          "sandbox cpus:   {}\ncgroup:         {}\nsandboxes:      {} live, {} max\n"
          "images:         {}\ndefaults:       memory {}, disk {}, pids {}\n",
          i->version(), i->hostname(), i->default_runtime(), fmt::join(i->runtimes(), ", "),
          i->cpuset(), i->cgroup_version(), i->live_sandboxes(), i->max_sandboxes(),
          fmt::join(i->images(), ", "), bragg::FormatSize(i->default_memory_bytes()),
          bragg::FormatSize(i->default_disk_bytes()), i->default_pids());
    }
    return rc;
  }
  return 0;
}
