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
//
// Each subcommand lives in its own file (sandbox_cli, exec_cli, files_cli, info_cli, image_cli);
// this file parses the flags, connects, dispatches and maps the outcome to an exit code.

#include <signal.h>

#include <CLI/CLI.hpp>

#include "absl/synchronization/mutex.h"
#include "common/memory.h"
#include "pbox/client/cli_common.h"
#include "pbox/client/exec_cli.h"
#include "pbox/client/files_cli.h"
#include "pbox/client/image_cli.h"
#include "pbox/client/info_cli.h"
#include "pbox/client/sandbox_cli.h"

int main(int argc, char** argv) {
  namespace client = bragg::pbox::client;
  // Debian's Abseil runs Mutex deadlock detection (a cycle graph on every lock) unless told
  // not to; gRPC locks on every call.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  bragg::TuneAllocatorForBulkData();
  ::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"pbox: run commands in sandboxes on this node's pbox agent"};
  app.require_subcommand(1);
  client::Agents::Flags agent_flags;
  client::Agents::Register(app, &agent_flags);

  // Registered in this order, the order of `pbox --help`.
  client::CreateCli create;
  client::ExecCli exec;
  client::CpCli cp;
  client::PsCli ps;
  client::LsCli ls;
  client::RmCli rm;
  client::InfoCli info;
  client::ImageCli image;
  client::CloneCli clone;
  for (client::Command* c :
       std::initializer_list<client::Command*>{&create, &exec, &cp, &ps, &ls, &rm, &info}) {
    c->Register(app);
  }
  image.Register(app);
  clone.Register(app);

  CLI11_PARSE(app, argc, argv);

  auto agents = client::Agents::Connect(agent_flags, image.selected(), create.node());
  if (!agents.ok()) {
    return client::Fail(agents.status());
  }
  if (image.selected()) {
    return image.Run(*agents->single());
  }
  for (client::Command* c :
       std::initializer_list<client::Command*>{&create, &clone, &exec, &cp, &ps, &ls, &rm, &info}) {
    if (c->selected()) {
      bragg::Result<int> rc = c->Run(*agents);
      return rc.ok() ? *rc : client::Fail(rc.status());
    }
  }
  return 0;
}
