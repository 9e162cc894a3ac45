// pboxd: the pbox agent. Parses flags -> AgentConfig (agent_config.h) -> runs the agent (or
// --reap) -> maps the outcome to an exit code.

#include <CLI/CLI.hpp>
#include <iostream>

#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/memory.h"
#include "pbox/agent.h"
#include "pbox/agent_config.h"
#include "spdlog/spdlog.h"

namespace {

using bragg::Status;

// `pboxd --reap`: reaps what an agent on config.state_dir left and prints what it removed.
Status Reap(const bragg::pbox::AgentConfig& config, bool purge) {
  BRAGG_ASSIGN_OR_RETURN(bragg::pbox::ReapReport report,
                         bragg::pbox::ReapAgentState(config, purge));
  for (const std::string& name : report.sandboxes) {
    std::cout << "reaped sandbox " << name << "\n";
  }
  for (const std::string& path : report.paths) {
    std::cout << "removed " << path << "\n";
  }
  for (const std::string& path : report.parents) {
    std::cout << "removed cgroup " << path << "\n";
  }
  if (report.sandboxes.empty() && report.paths.empty() && report.parents.empty()) {
    std::cout << "nothing to reap for state dir " << config.state_dir << "\n";
  }
  if (report.purged) {
    std::cout << "removed state dir " << config.state_dir << "\n";
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  // Debian's Abseil runs Mutex deadlock detection (a cycle graph on every lock) unless told
  // not to; gRPC locks on every call.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  bragg::TuneAllocatorForBulkData();
  bragg::pbox::AgentFlags flags;
  bragg::pbox::AgentConfig& config = flags.config;
  std::string log_level = "info";
  CLI::App app{"pboxd: the pbox sandbox agent (one per node)"};
  app.add_option("--listen", flags.listen,
                 "unix:///path.sock (default unix://RUN/pbox.sock, RUN: /run/pbox as root, "
                 "else $XDG_RUNTIME_DIR/pbox or /tmp/pbox-UID) and/or tcp://HOST:PORT (needs "
                 "--token-file); repeatable");
  app.add_option("--token-file", config.token_file, "file holding the bearer token for TCP");
  app.add_option("--state-dir", config.state_dir,
                 "agent state; reaped on start (default RUN/state)");
  app.add_option("--cpus", config.cpus, "sandbox CPU set, e.g. 8-15 (default: all)");
  app.add_option("--max-sandboxes", config.max_sandboxes, "admission limit")->capture_default_str();
  bragg::pbox::ClientLimits& cl = config.client_limits;
  app.add_option("--client-max-creates", cl.max_creates,
                 "sandbox creations (and clones) one client may have in flight (0: no cap)")
      ->capture_default_str();
  app.add_option("--client-max-execs", cl.max_execs,
                 "commands one client may have running (0: no cap)")
      ->capture_default_str();
  app.add_option("--client-max-transfers", cl.max_transfers,
                 "data-channel file transfers one client may have open (0: no cap)")
      ->capture_default_str();
  app.add_option("--client-refusals-per-second", cl.refusals_per_second,
                 "refusals one client gets at once per second; beyond, each is held (0: never)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e9));
  app.add_option("--client-refusal-hold-ms", cl.refusal_hold_ms,
                 "longest a client's refusal is held when it is over its refusal budget")
      ->capture_default_str()
      ->check(CLI::Range(0u, 60000u));
  app.add_option("--default-memory", flags.default_memory, "memory per sandbox unless asked")
      ->capture_default_str();
  app.add_option("--max-memory", flags.max_memory, "largest memory a sandbox may ask for (0: any)")
      ->capture_default_str();
  app.add_option("--default-disk", flags.default_disk, "writable layer size unless asked")
      ->capture_default_str();
  app.add_option("--default-pids", config.defaults.pids, "pids limit unless asked")
      ->capture_default_str();
  app.add_option("--detached-ttl", config.defaults.detached_ttl_seconds,
                 "idle TTL in seconds of sandboxes created outside a session")
      ->capture_default_str();
  app.add_option("--metrics-listen", config.metrics_listen, "HOST:PORT for /metrics");
  app.add_option("--runtime", config.runtime, "default runtime: native or gvisor")
      ->capture_default_str();
  app.add_option("--gvisor-platform", config.gvisor_platform,
                 "runsc platform for gVisor sandboxes: ptrace, systrap or kvm")
      ->capture_default_str();
  app.add_option("--runsc", config.runsc, "runsc binary for the gVisor runtime")
      ->capture_default_str();
  app.add_option("--overlay", config.overlay,
                 "rootless: sandboxes' roots as the kernel's OverlayFS (kernel, Linux 5.11), "
                 "fuse-overlayfs mounts (fuse), or the first the host allows (auto)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "kernel", "fuse"}));
  app.add_option("--fuse-overlayfs", config.fuse_overlayfs,
                 "fuse-overlayfs binary for --overlay fuse (or auto where the kernel's is refused)")
      ->capture_default_str();
  app.add_flag("--runsc-huge-pages,!--no-runsc-huge-pages", config.runsc_huge_pages,
               "run runsc from a copy on a tmpfs of huge pages (24 MB of memory the agent holds; "
               "nothing stays mounted), so that each gVisor sandbox's runsc processes start "
               "with fewer page faults; without huge pages for tmpfs, runsc runs where it is")
      ->capture_default_str();
  app.add_option("--image", flags.images, "NAME=DIR: a directory image; repeatable");
  app.add_option("--max-image-bytes", flags.max_image_bytes,
                 "largest image `pbox image import` accepts (the archive, and its unpacked files)")
      ->capture_default_str();
  app.add_option("--init-path", config.init_path, "pbox-init binary (default: beside pboxd)");
  app.add_option("--cgroup", config.cgroup_mode,
                 "auto, v1 or v2; without root, the cgroup pboxd starts in must be delegated "
                 "to its user (docs/security.md)")
      ->capture_default_str();
  app.add_option("--cgroup-parent", config.cgroup_parent,
                 "name of the cgroup holding the sandboxes (default derived from --state-dir)");
  app.add_option("--ready-file", config.ready_file,
                 "write {pid, endpoints, metrics_port} as JSON here once serving");
  app.add_option("--keepalive-ms", config.keepalive_ms, "HTTP/2 keepalive ping interval")
      ->capture_default_str();
  app.add_option("--data-channel", config.data_channel,
                 "offer the data channel for file transfers (a socket beside each listener)")
      ->capture_default_str();
  app.add_option("--data-port", config.data_port,
                 "TCP port of the data channel for TCP listeners (0: a free port)")
      ->capture_default_str();
  app.add_option("--transfer-ticket-ttl-ms", config.transfer_ticket_ttl_ms,
                 "how long an unused data-channel transfer ticket stays valid")
      ->capture_default_str()
      ->check(CLI::Range(1u, 600000u));
  app.add_option("--max-data-connections", config.max_data_connections,
                 "data-channel connections open at once")
      ->capture_default_str()
      ->check(CLI::Range(1u, 65536u));
  app.add_option("--data-stall-timeout-ms", config.data_stall_timeout_ms,
                 "a data-channel transfer that moves no byte for this long fails; a request "
                 "header must arrive whole within it")
      ->capture_default_str()
      ->check(CLI::Range(100u, 3600000u));
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error")
      ->capture_default_str();
  bool reap = false;
  CLI::Option* reap_flag =
      app.add_flag("--reap", reap,
                   "do not serve: kill and remove what a SIGKILLed agent on --state-dir left "
                   "(sandboxes, mounts, frozen layers, its cgroup parent), print it and exit; "
                   "refused while an agent runs there. For epilogs and ExecStopPost");
  bool purge = false;
  app.add_flag("--purge", purge,
               "with --reap: then remove the state dir itself (images and all), which must be "
               "an agent's; for per-job state dirs, as pbox-slurm --as-root does")
      ->needs(reap_flag);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  auto built = bragg::pbox::MakeAgentConfig(std::move(flags));
  if (!built.ok()) {
    std::cerr << "pboxd: " << built.status().message() << "\n";
    return 2;
  }
  if (auto s = bragg::InitLogging("pboxd", log_level); !s.ok()) {
    std::cerr << "pboxd: " << s.message() << "\n";
    return 2;
  }
  Status s = reap ? Reap(*built, purge) : bragg::pbox::RunAgent(*built);
  if (!s.ok()) {
    // RunAgent logs its error; Reap's is the command's answer.
    if (reap) {
      std::cerr << "pboxd --reap: " << s.message() << "\n";
    } else {
      spdlog::critical("{}", std::string(s.message()));
    }
    return 1;
  }
  return 0;
}
