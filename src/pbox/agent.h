#pragma once

// pboxd's top-level object: builds every part from an AgentConfig, serves until SIGTERM or
// SIGINT, then destroys every sandbox.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "pbox/client_limiter.h"
#include "pbox/sandbox_manager.h"

namespace bragg::pbox {

struct AgentConfig {
  // "unix:///run/pbox/pbox.sock" (mode 0660) and/or "tcp://HOST:PORT" (token required).
  std::vector<std::string> listen = {"unix:///run/pbox/pbox.sock"};
  std::string token_file;
  std::string state_dir = "/run/pbox/state";
  std::string cpus;  // sandbox CPU set; empty: every CPU this process may use
  uint32_t max_sandboxes = 256;
  SandboxDefaults defaults;
  std::string metrics_listen;              // "HOST:PORT"; empty: no metrics endpoint
  std::string runtime = "native";          // default runtime: native or gvisor
  std::string gvisor_platform = "ptrace";  // runsc --platform: ptrace, systrap or kvm
  std::string runsc = "runsc";             // runsc binary (path or name in PATH)
  // Rootless: sandboxes' roots as the kernel's OverlayFS ("kernel", Linux 5.11), as
  // fuse-overlayfs mounts ("fuse"), or the first of those the host allows ("auto").
  std::string overlay = "auto";
  std::string fuse_overlayfs = "fuse-overlayfs";  // its binary (path or name in PATH)
  bool runsc_huge_pages = true;  // run runsc from a copy on a huge-page tmpfs (gvisor_runtime.h)
  std::map<std::string, std::string> images;  // name -> directory
  std::string init_path;                      // empty: pbox-init beside the pboxd binary
  std::string cgroup_mode = "auto";           // auto, v1, v2
  std::string cgroup_parent;                  // empty: "pbox-<hash of state_dir>"
  std::string ready_file;  // written (JSON: pid, endpoints, metrics port) once serving
  uint32_t keepalive_ms = 10000;
  uint64_t max_image_bytes = 4ull << 30;  // largest image import (archive, and unpacked)
  ClientLimits client_limits;             // per-client caps and refusal pacing
  // Data channel (docs/pbox.md "Data channel"): a socket beside each listener for file bytes.
  bool data_channel = true;
  uint16_t data_port = 0;                   // TCP port of the data channel; 0: a free one
  uint32_t transfer_ticket_ttl_ms = 10000;  // an unused transfer ticket lapses after this
  uint32_t max_data_connections = 1024;
  uint32_t data_stall_timeout_ms = 30000;  // a data transfer (or a request header) stalled
};

// What ReapAgentState found and removed.
struct ReapReport {
  std::vector<std::string> sandboxes;  // sandbox cgroups killed and removed
  std::vector<std::string> paths;      // state paths removed (mounts, frozen layers, bundles)
  std::vector<std::string> parents;    // parent cgroup directories removed
  bool purged = false;                 // the state dir itself removed (`purge`)
};

// `pboxd --reap`: removes everything an agent on config.state_dir left when it was SIGKILLed
// or crashed and is not restarted there (per-job state dirs): kills and removes every sandbox
// cgroup under the parent (config.cgroup_parent, default derived from the state_dir string
// exactly as the agent derives it, so pass the same string), removes leftover mounts and
// frozen layers as an agent start does, then the parent cgroups themselves. Uses
// config.state_dir, cgroup_mode and cgroup_parent only. Locates the parent from its own
// /proc/self/cgroup as the agent does: run it in the cgroup the agent was started in. Takes the
// state dir's agent lock first: FailedPrecondition, with nothing touched, while a live agent
// holds it. A state dir that does not exist is fine (only the cgroup parent is reaped).
// Idempotent: a second call finds nothing.
// `purge`: then removes the state dir itself (images, lock and all; `pboxd --reap --purge`),
// for a per-job state dir whose owner cannot (an agent run as root for an ordinary user's job:
// pbox-slurm --as-root). Refused, removing nothing, for a directory no agent has used (no
// agent.lock in it): the flag must not empty a mistyped --state-dir.
Result<ReapReport> ReapAgentState(const AgentConfig& config, bool purge = false);

// Runs the agent until a termination signal. Returns the error that stopped it from starting
// or from shutting down cleanly.
Status RunAgent(const AgentConfig& config);

// "unix:///p" -> grpc "unix:/p"; "tcp://h:p" -> "h:p". InvalidArgument otherwise.
Result<std::string> ListenAddressToGrpc(const std::string& listen, bool* is_tcp);

}  // namespace bragg::pbox
