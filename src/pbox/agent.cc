#include "pbox/agent.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "common/fs.h"
#include "fmt/format.h"
#include "pbox/cgroup/cgroup.h"
#include "pbox/cgroup/cpuset.h"
#include "pbox/data_server.h"
#include "pbox/image/image_store.h"
#include "pbox/metrics.h"
#include "pbox/runtime/gvisor_runtime.h"
#include "pbox/runtime/native_runtime.h"
#include "pbox/service.h"
#include "spdlog/spdlog.h"

namespace bragg::pbox {
namespace {

constexpr const char* kVersion = "0.1.0";

std::string DefaultCgroupParent(const std::string& state_dir) {
  // The same directory however it is spelled ("/x/state", "/x//state/", "state" from /x), so
  // that `--reap` finds what an agent made. Lexical only: the directory need not exist.
  std::error_code ec;
  std::filesystem::path abs = std::filesystem::absolute(state_dir, ec);
  std::string key = (ec ? std::filesystem::path(state_dir) : abs).lexically_normal().string();
  while (key.size() > 1 && key.back() == '/') {
    key.pop_back();
  }
  uint32_t h = 2166136261u;  // FNV-1a: stable across restarts with the same state dir
  for (unsigned char c : key) {
    h = (h ^ c) * 16777619u;
  }
  return fmt::format("pbox-{:08x}", h);
}

std::string SelfDir() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) {
    return ".";
  }
  std::string path(buf, static_cast<size_t>(n));
  return path.substr(0, path.rfind('/'));
}

Result<std::string> ReadToken(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return ErrnoError("stat", path);
  }
  if ((st.st_mode & 077) != 0) {
    return absl::FailedPreconditionError(fmt::format(
        "token file {} is readable by others (mode {:o}): chmod 600 it", path, st.st_mode & 0777));
  }
  BRAGG_ASSIGN_OR_RETURN(std::string token, ReadFileToString(path));
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r' || token.back() == ' ')) {
    token.pop_back();
  }
  if (token.size() < 16) {
    return absl::InvalidArgumentError(
        fmt::format("token in {} is shorter than 16 characters", path));
  }
  return token;
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

// The state dir's agent lock, held by the returned fd: one agent (or reaper) per state dir.
Result<UniqueFd> LockStateDir(const std::string& state_dir) {
  BRAGG_ASSIGN_OR_RETURN(UniqueFd lock,
                         OpenFile(state_dir + "/agent.lock", O_RDWR | O_CREAT, 0600));
  // A child a SIGKILLed agent forked just before its death holds a copy of the lock until it
  // closes its inherited fds (microseconds, more on a loaded machine): wait a moment for it
  // before calling the state dir taken.
  const auto lock_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  while (::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) {
      return ErrnoError("flock", state_dir + "/agent.lock");
    }
    if (std::chrono::steady_clock::now() < lock_deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    return absl::FailedPreconditionError(fmt::format(
        "another pboxd is using state dir {}: stop it or pass another --state-dir", state_dir));
  }
  return lock;
}

// Creates `dir` with `mode` (0700 for a rootless agent) and, for a rootless agent, checks the
// path to it: its default run directory may be under the shared /tmp, where another user could
// have made a directory first to catch the agent's socket and state. Every directory on the
// way must be the agent user's or root's, and one others may write must be root's and sticky
// (as /tmp is), so that no one else can rename what the agent makes there.
Status MakeOwnDirs(const std::string& dir, mode_t mode, bool rootless) {
  BRAGG_RETURN_IF_ERROR(MakeDirs(dir, rootless ? 0700 : mode));
  if (!rootless) {
    return absl::OkStatus();
  }
  std::error_code ec;
  std::string path = std::filesystem::absolute(dir, ec).lexically_normal().string();
  while (path.size() > 1 && path.back() == '/') {
    path.pop_back();
  }
  for (;;) {
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) {
      return ErrnoError("lstat", path);
    }
    const bool ours = st.st_uid == ::geteuid();
    const bool shared = (st.st_mode & 002) != 0 && !(st.st_uid == 0 && (st.st_mode & S_ISVTX));
    if (!S_ISDIR(st.st_mode) || (!ours && st.st_uid != 0) || shared) {
      return absl::FailedPreconditionError(fmt::format(
          "{} (uid {}, mode {:o}) is on the path to {}: a rootless pboxd keeps its socket and "
          "state only under directories of its own user or root that no one else may rename "
          "things in; remove it or pass --state-dir and --listen elsewhere",
          path, st.st_uid, st.st_mode & 07777, dir));
    }
    if (path == "/") {
      return absl::OkStatus();
    }
    size_t slash = path.rfind('/');
    path = slash == 0 ? "/" : path.substr(0, slash);
  }
}

// Whether this process is in the host's user namespace, whose id map is the whole identity
// ("0 0 4294967295"); an unreadable map (no /proc) counts as the host's.
bool InInitialUserNamespace() {
  Result<std::string> map = ReadFileToString("/proc/self/uid_map");
  if (!map.ok()) {
    return true;
  }
  std::istringstream in(*map);
  uint64_t inside = 1, outside = 1, count = 0;
  in >> inside >> outside >> count;
  return inside == 0 && outside == 0 && count == 4294967295ull;
}

// What a rootless agent says when it may not write its cgroup.
std::string NotDelegatedHint() {
  return fmt::format(
      "pboxd runs rootless (uid {}{}), and the cgroup it started in is not delegated to "
      "that user. Start it in one that is: under systemd, `systemd-run --user --scope -p "
      "Delegate=yes pboxd ...` or Delegate=yes in its unit; under Slurm, a job cgroup the "
      "administrator hands to the job user (a prolog that chowns its cgroup.procs, "
      "cgroup.subtree_control and cgroup.threads, cgroup v2); in a container, one its "
      "runtime mounts writable for the container's user; or run pboxd as root "
      "(docs/security.md \"Rootless\")",
      ::geteuid(), ::geteuid() == 0 ? " in a user namespace" : "");
}

CgroupManagerOptions CgroupOptions(const AgentConfig& config) {
  CgroupManagerOptions cg;
  cg.mode = config.cgroup_mode;
  cg.parent_name =
      config.cgroup_parent.empty() ? DefaultCgroupParent(config.state_dir) : config.cgroup_parent;
  return cg;
}

// What a killed agent left behind, removed by every agent start and by `pboxd --reap`; the
// caller holds the state dir's lock. Its sandboxes' processes (and with them their namespaces
// and the mounts inside them) go with their cgroups; then the host-side leftovers: gVisor
// bundles with their host mounts, the native runtime's mount point, and the frozen layers of
// clones.
Status ReapLeftovers(CgroupManager& cgroups, const std::string& state_dir, ReapReport* report) {
  BRAGG_ASSIGN_OR_RETURN(report->sandboxes, cgroups.ReapAll());
  for (const char* sub : {"/gvisor", "/mnt", "/frozen"}) {
    const std::string path = state_dir + sub;
    if (!Exists(path)) {
      continue;
    }
    BRAGG_RETURN_IF_ERROR(std::string_view(sub) == "/gvisor" ? GvisorRuntime::RemoveStale(path)
                                                             : RemoveTree(path));
    report->paths.push_back(path);
  }
  return absl::OkStatus();
}

}  // namespace

Result<ReapReport> ReapAgentState(const AgentConfig& config, bool purge) {
  UniqueFd lock;
  if (purge && Exists(config.state_dir) && !Exists(config.state_dir + "/agent.lock")) {
    return absl::InvalidArgumentError(
        fmt::format("--purge: {} holds no agent.lock, so no agent has used it: not removing it",
                    config.state_dir));
  }
  if (Exists(config.state_dir)) {
    BRAGG_ASSIGN_OR_RETURN(lock, LockStateDir(config.state_dir));
  }
  CgroupManagerOptions cg = CgroupOptions(config);
  cg.create_parent = false;
  BRAGG_ASSIGN_OR_RETURN(std::unique_ptr<CgroupManager> cgroups, CgroupManager::Create(cg));
  ReapReport report;
  BRAGG_RETURN_IF_ERROR(ReapLeftovers(*cgroups, config.state_dir, &report));
  for (const std::string& p : cgroups->parent_paths()) {
    if (Exists(p)) {
      report.parents.push_back(p);
    }
  }
  BRAGG_RETURN_IF_ERROR(Annotate(cgroups->RemoveParent(), "removing the agent's parent cgroups"));
  if (purge && Exists(config.state_dir)) {
    // Still holding the lock: no agent can start there meanwhile. RemoveTree follows no
    // symlink and stops at a mount point, so a mount left inside fails the purge loudly.
    BRAGG_RETURN_IF_ERROR(Annotate(RemoveTree(config.state_dir), "--purge"));
    report.purged = true;
  }
  return report;
}

Result<std::string> ListenAddressToGrpc(const std::string& listen, bool* is_tcp) {
  if (listen.rfind("unix://", 0) == 0) {
    std::string path = listen.substr(7);
    if (path.empty() || path[0] != '/') {
      return absl::InvalidArgumentError(
          fmt::format("--listen {}: use unix:///absolute/path.sock", listen));
    }
    *is_tcp = false;
    return "unix:" + path;
  }
  if (listen.rfind("tcp://", 0) == 0) {
    std::string hostport = listen.substr(6);
    if (hostport.find(':') == std::string::npos) {
      return absl::InvalidArgumentError(fmt::format("--listen {}: use tcp://HOST:PORT", listen));
    }
    *is_tcp = true;
    return hostport;
  }
  return absl::InvalidArgumentError(
      fmt::format("--listen {}: expected unix:///path or tcp://HOST:PORT", listen));
}

Status RunAgent(const AgentConfig& config) {
  // Termination signals are taken synchronously by this thread; every thread started from
  // here on inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  // Rootless: an ordinary user's agent, or root of a user namespace (a rootless container),
  // which can no more make device nodes or trusted.* xattrs than a user can (docs/security.md
  // "Rootless"). Its sandboxes get user namespaces; its cgroups must be delegated to it.
  const bool rootless = ::geteuid() != 0 || !InInitialUserNamespace();
  if (!rootless && config.overlay == "fuse") {
    return absl::InvalidArgumentError(
        "--overlay fuse is for a rootless pboxd: as root, sandboxes' roots are the kernel's "
        "OverlayFS");
  }
  BRAGG_RETURN_IF_ERROR(MakeOwnDirs(config.state_dir, 0700, rootless));
  BRAGG_ASSIGN_OR_RETURN(UniqueFd lock, LockStateDir(config.state_dir));

  std::string token;
  if (!config.token_file.empty()) {
    BRAGG_ASSIGN_OR_RETURN(token, ReadToken(config.token_file));
  }

  BRAGG_ASSIGN_OR_RETURN(CpuSet own, CpuSet::ForThisProcess());
  CpuSet sandbox_cpus = own;
  if (!config.cpus.empty()) {
    BRAGG_ASSIGN_OR_RETURN(sandbox_cpus, CpuSet::Parse(config.cpus));
    if (sandbox_cpus.empty() || !sandbox_cpus.IsSubsetOf(own)) {
      return absl::InvalidArgumentError(fmt::format(
          "--cpus {} is not a subset of this process's CPUs {}", config.cpus, own.ToString()));
    }
  }

  CgroupManagerOptions cg = CgroupOptions(config);
  // Without --cpus the sandboxes' parent inherits the agent's CPUs: no cpuset controller is
  // needed for that (a user's systemd delegates cpu, memory and pids, not cpuset).
  if (!config.cpus.empty()) {
    cg.cpus = sandbox_cpus.ToString();
  }
  Result<std::unique_ptr<CgroupManager>> made = CgroupManager::Create(cg);
  if (!made.ok() && rootless && absl::IsPermissionDenied(made.status())) {
    return Annotate(made.status(), NotDelegatedHint());
  }
  BRAGG_ASSIGN_OR_RETURN(std::unique_ptr<CgroupManager> cgroups, std::move(made));
  ReapReport reaped;
  BRAGG_RETURN_IF_ERROR(ReapLeftovers(*cgroups, config.state_dir, &reaped));
  if (!reaped.sandboxes.empty()) {
    spdlog::warn("reaped {} sandboxes left by a previous agent", reaped.sandboxes.size());
  }
  const std::string layers_dir = config.state_dir + "/frozen";

  BRAGG_ASSIGN_OR_RETURN(
      std::unique_ptr<ImageStore> images,
      ImageStore::Create(
          config.state_dir + "/images", config.images, "/",
          ImageStoreOptions{.max_image_bytes = config.max_image_bytes, .rootless = rootless}));
  NativeRuntimeOptions rt_opts;
  rt_opts.state_dir = config.state_dir;
  rt_opts.rootless = rootless;
  rt_opts.overlay = config.overlay;
  rt_opts.fuse_overlayfs = config.fuse_overlayfs;
  rt_opts.init_path = config.init_path.empty() ? SelfDir() + "/pbox-init" : config.init_path;
  if (config.runtime != "native" && config.runtime != "gvisor") {
    return absl::InvalidArgumentError(
        fmt::format("--runtime {}: expected native or gvisor", config.runtime));
  }
  BRAGG_ASSIGN_OR_RETURN(std::unique_ptr<NativeRuntime> native, NativeRuntime::Create(rt_opts));
  // gVisor: offered when runsc is installed; required when it is the default.
  std::unique_ptr<Runtime> gvisor;
  {
    GvisorRuntimeOptions gv;
    gv.state_dir = config.state_dir;
    gv.init_path = rt_opts.init_path;
    gv.runsc = config.runsc;
    gv.platform = config.gvisor_platform;
    gv.runsc_huge_pages = config.runsc_huge_pages;
    gv.nofile_soft = native->sandbox_nofile().rlim_cur;
    gv.nofile_hard = native->sandbox_nofile().rlim_max;
    // The gVisor runtime mounts for each bundle and runs runsc as root: a rootless
    // agent does not offer it (a `runsc --rootless` variant is not built).
    Result<std::unique_ptr<GvisorRuntime>> created =
        rootless ? Result<std::unique_ptr<GvisorRuntime>>(absl::FailedPreconditionError(
                       "a rootless pboxd offers the native runtime only: run pboxd as root "
                       "of the host for gVisor sandboxes"))
                 : GvisorRuntime::Create(gv);
    if (created.ok()) {
      gvisor = std::move(*created);
    } else if (config.runtime == "gvisor" ||
               created.status().code() != absl::StatusCode::kFailedPrecondition) {
      return Annotate(created.status(), "gVisor runtime");
    } else {
      spdlog::warn("gVisor runtime unavailable: {}", std::string(created.status().message()));
      gvisor = std::make_unique<UnavailableRuntime>("gvisor", created.status());
    }
  }
  const bool gvisor_ok = dynamic_cast<UnavailableRuntime*>(gvisor.get()) == nullptr;
  CpuAllocator allocator(sandbox_cpus);

  Registry registry;
  AgentMetrics metrics = AgentMetrics::Register(&registry);

  SandboxManager manager({{"native", native.get()}, {"gvisor", gvisor.get()}}, config.runtime,
                         images.get(), cgroups.get(), &allocator, config.defaults,
                         config.max_sandboxes);
  manager.set_layers_dir(layers_dir);
  registry.AddCallbackGauge("pbox_sandboxes_live", "Sandboxes alive now.",
                            [&manager] { return static_cast<double>(manager.live()); });
  std::unique_ptr<MetricsServer> metrics_server;
  if (!config.metrics_listen.empty()) {
    BRAGG_ASSIGN_OR_RETURN(metrics_server, MetricsServer::Start(&registry, config.metrics_listen));
  }

  char hostname[256] = {};
  ::gethostname(hostname, sizeof(hostname) - 1);
  ServiceInfo info{.version = kVersion,
                   .default_runtime = config.runtime,
                   .runtimes = gvisor_ok ? std::vector<std::string>{"native", "gvisor"}
                                         : std::vector<std::string>{"native"},
                   .cpuset = sandbox_cpus.ToString(),
                   .images = images->Names(),
                   .hostname = hostname,
                   .cgroup_version = cgroups->version(),
                   .mode = rootless ? "rootless" : "root",
                   .limits = cgroups->controllers(),
                   .uid = static_cast<uint32_t>(::geteuid()),
                   .root_fs = native->root_fs_name()};
  spdlog::info("mode {} (uid {}): sandbox cgroups under {} ({}), limits: {}; roots: {}", info.mode,
               info.uid, cgroups->parent_path(), cgroups->version(), fmt::join(info.limits, ", "),
               info.root_fs);
  PboxService service(&manager, &metrics, info, token, images.get(), config.client_limits);

  // grpc.health.v1.Health, gRPC's own implementation, for Kubernetes' grpc probes and
  // grpc_health_probe: "" and "bragg.pbox.v1.Pbox" are SERVING from start until a stop signal.
  // It asks for no token (a kubelet has none) and says nothing but serving or not.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(16 << 20);
  builder.SetMaxSendMessageSize(16 << 20);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(config.keepalive_ms));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             static_cast<int>(std::max<uint32_t>(config.keepalive_ms / 2, 1000)));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  // File transfers move MiBs per call: a large initial flow-control window saves the
  // WINDOW_UPDATE round trips that HTTP/2's 64 KiB default costs.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 8 << 20);
  // gRPC reads sockets 8 KiB at a time by default: a MiB then costs 128 system calls.
  builder.AddChannelArgument(GRPC_ARG_TCP_READ_CHUNK_SIZE, 512 << 10);
  builder.AddChannelArgument(GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, 256 << 10);
  builder.AddChannelArgument(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 4 << 20);
  std::vector<std::string> unix_paths;
  std::vector<std::pair<std::string, std::unique_ptr<int>>> tcp_ports;
  for (const std::string& listen : config.listen) {
    bool is_tcp = false;
    BRAGG_ASSIGN_OR_RETURN(std::string addr, ListenAddressToGrpc(listen, &is_tcp));
    if (is_tcp) {
      if (token.empty()) {
        return absl::InvalidArgumentError(fmt::format(
            "--listen {} needs --token-file: TCP clients must present a token", listen));
      }
      tcp_ports.emplace_back(addr, std::make_unique<int>(0));
      builder.AddListeningPort(addr, grpc::InsecureServerCredentials(),
                               tcp_ports.back().second.get());
    } else {
      std::string path = addr.substr(5);
      BRAGG_RETURN_IF_ERROR(MakeOwnDirs(path.substr(0, path.rfind('/')), 0755, rootless));
      ::unlink(path.c_str());  // a stale socket of a dead agent
      unix_paths.push_back(path);
      builder.AddListeningPort(addr, grpc::InsecureServerCredentials());
    }
  }
  // Declared after the service: tickets hold slots of its limiter, and the data server's
  // connections hold tickets' grants, so both go before the service does.
  TransferTickets tickets(
      TransferTicketOptions{.ttl = std::chrono::milliseconds(config.transfer_ticket_ttl_ms)});
  std::unique_ptr<DataServer> data_server;
  if (config.data_channel) {
    std::vector<std::string> tcp_hosts;
    for (const auto& [addr, port] : tcp_ports) {
      tcp_hosts.push_back(addr.substr(0, addr.rfind(':')));
    }
    DataServerOptions data_options;
    data_options.max_connections = config.max_data_connections;
    data_options.stall_timeout = std::chrono::milliseconds(config.data_stall_timeout_ms);
    BRAGG_ASSIGN_OR_RETURN(data_server,
                           DataServer::Start(&tickets, unix_paths, tcp_hosts, config.data_port,
                                             data_options, &metrics));
    service.EnableDataChannel(&tickets, data_server->unix_endpoint(), data_server->tcp_port());
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) {
    return absl::UnavailableError(
        "cannot start the gRPC server: a listen address is in use or not permitted");
  }
  std::vector<std::string> endpoints;
  for (const std::string& path : unix_paths) {
    if (::chmod(path.c_str(), 0660) != 0) {
      return ErrnoError("chmod", path);
    }
    endpoints.push_back("unix://" + path);
  }
  for (const auto& [addr, port] : tcp_ports) {
    if (*port == 0) {
      return absl::UnavailableError(fmt::format("cannot listen on {}", addr));
    }
    endpoints.push_back(fmt::format("tcp://{}:{}", addr.substr(0, addr.rfind(':')), *port));
  }
  spdlog::info("pboxd {} serving on {} (cpus {}, cgroup {}, max {} sandboxes, state {})", kVersion,
               fmt::join(endpoints, ", "), sandbox_cpus.ToString(), cgroups->version(),
               config.max_sandboxes, config.state_dir);
  if (data_server) {
    spdlog::info("data channel on {}{}", data_server->unix_endpoint(),
                 data_server->tcp_port() != 0
                     ? fmt::format(" and TCP port {}", data_server->tcp_port())
                     : std::string());
  }
  if (!config.ready_file.empty()) {
    nlohmann::json ready = {{"pid", ::getpid()},
                            {"endpoints", endpoints},
                            {"cpuset", sandbox_cpus.ToString()},
                            {"metrics_port", metrics_server ? metrics_server->port() : 0}};
    std::string tmp = config.ready_file + ".tmp";
    BRAGG_RETURN_IF_ERROR(WriteStringToFile(tmp, ready.dump() + "\n"));
    if (::rename(tmp.c_str(), config.ready_file.c_str()) != 0) {
      return ErrnoError("rename", config.ready_file);
    }
  }

  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  if (health != nullptr) {
    health->SetServingStatus(v1::Pbox::service_full_name(), true);
  }

  int sig = 0;
  sigwait(&signals, &sig);
  spdlog::info("signal {}: destroying {} sandboxes and stopping", sig, manager.live());
  // Readiness goes first: probes and load balancers stop sending work while sandboxes go.
  if (health != nullptr) {
    health->SetServingStatus(false);
  }
  manager.DestroyAll();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  data_server.reset();
  manager.DestroyAll();
  for (const std::string& path : unix_paths) {
    ::unlink(path.c_str());
  }
  if (Status s = cgroups->RemoveParent(); !s.ok()) {
    spdlog::warn("removing the agent's cgroups: {}", std::string(s.message()));
  }
  return absl::OkStatus();
}

}  // namespace bragg::pbox
