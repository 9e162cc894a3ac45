// pbox-bench: latency and throughput of a pbox agent with N live sandboxes, and the wall time
// of sampled scientific tool executions, beside the floor (the host without isolation, and
// loopback TCP for the same bytes) measured in the same run.
//
//   pbox-bench --endpoint unix:///tmp/pbox.sock --sandboxes 100 --rounds 3 --json out.json
//
// Output contract (scripts depend on it; bench/peers/*_peer.py write the same shape): one JSON
// object with "runtime", "sandboxes", "metrics" {create_ms, exec_true_ms, exec_python_ms,
// rtt_1mib_ms, rtt_1mib_concurrent_ms: {"p50", "p99", "n"}}, "throughput_gbps", and "tools"
// {NAME: {"p50", "p99", "n", "ms": [wall ms of execution k, run with seed k]}}. The rtt and
// throughput metrics are those of the client's default transfer path, named by "transfer"
// ("data": the agent's data channel, "grpc": the WriteFile/ReadFile streams);
// "transfer_paths" {PATH: {rtt_1mib_ms, rtt_1mib_concurrent_ms, throughput_gbps}} holds both,
// measured interleaved in the same run (--transfer-ab). "floor" holds
// the same shape with "runtime": "floor" (no create_ms: the host creates nothing).
// Exit status 3: the agent does not offer the runtime asked for.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/fs.h"
#include "common/memory.h"
#include "common/process.h"
#include "fmt/format.h"
#include "pbox/client/client.h"

namespace {

using Clock = std::chrono::steady_clock;
// Where tool scripts are uploaded inside each sandbox.
constexpr const char* kToolsDir = "/opt/bragg-tools";
using bragg::pbox::client::Client;
namespace v1 = bragg::pbox::v1;

double Ms(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

struct Stats {
  std::vector<double> v;
  double Pct(double p) {
    if (v.empty()) {
      return 0;
    }
    std::sort(v.begin(), v.end());
    size_t idx = static_cast<size_t>(p / 100.0 * static_cast<double>(v.size() - 1) + 0.5);
    return v[std::min(idx, v.size() - 1)];
  }
  nlohmann::json Json() { return {{"p50", Pct(50)}, {"p99", Pct(99)}, {"n", v.size()}}; }
};

// Tool executions: wall ms per execution, in seed order, per tool.
struct ToolTimes {
  std::vector<std::string> names;
  std::vector<std::vector<double>> ms;  // [tool][seed]
  nlohmann::json Json() const {
    nlohmann::json out = nlohmann::json::object();
    for (size_t t = 0; t < names.size(); ++t) {
      Stats st{ms[t]};
      nlohmann::json j = st.Json();
      j["ms"] = ms[t];
      out[names[t]] = j;
    }
    return out;
  }
};

[[noreturn]] void Die(const bragg::Status& s, const char* what) {
  std::cerr << "pbox-bench: " << what << ": " << s.message() << "\n";
  std::exit(1);
}

// Runs `fn(i)` for i in [0, n) on `threads` threads.
template <typename Fn>
void ParallelFor(size_t n, size_t threads, Fn fn) {
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  for (size_t t = 0; t < std::min(n, threads); ++t) {
    pool.emplace_back([&] {
      for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
        fn(i);
      }
    });
  }
  for (auto& t : pool) {
    t.join();
  }
}

// --clone N: CloneSandbox(source, N) of a source holding `setup_mib` MiB of uploaded files
// (a prompt's environment), `rounds` times, beside the same setup done the slow way (create N
// sandboxes and upload the files into each). Per clone = the call's wall time / N. Output:
// {"clone": {"count", "setup_mib", "rounds", "per_clone_ms", "call_ms", "first_exec_ms",
// "create_per_sandbox_ms", "create_and_upload_per_sandbox_ms": {"p50", "p99", "n"}}}.
int CloneBench(Client& client, const std::string& sid, uint32_t n, int rounds, size_t setup_mib,
               const std::string& json_out) {
  auto make = [&] {
    v1::SandboxSpec spec;
    spec.set_memory_bytes(256 << 20);
    spec.set_disk_bytes(256 << 20);
    auto sb = client.Create(spec, sid);
    if (!sb.ok()) {
      Die(sb.status(), "CreateSandbox");
    }
    return sb->id();
  };
  std::string mib(1 << 20, '\0');
  std::mt19937_64 rng(7);
  for (size_t i = 0; i < mib.size(); i += 8) {
    uint64_t x = rng();
    std::memcpy(mib.data() + i, &x, 8);
  }
  auto setup = [&](const std::string& id) {
    for (size_t f = 0; f < setup_mib; ++f) {
      auto w = client.WriteFile(id, fmt::format("/task/input-{}.bin", f), mib);
      if (!w.ok()) {
        Die(w.status(), "WriteFile");
      }
    }
  };
  std::string source = make();
  setup(source);
  Stats per_clone, call, first_exec, baseline, create_only;
  for (int r = 0; r < rounds; ++r) {
    auto t0 = Clock::now();
    auto clones = client.Clone(source, n, sid);
    double ms = Ms(t0);
    if (!clones.ok()) {
      Die(clones.status(), "CloneSandbox");
    }
    call.v.push_back(ms);
    per_clone.v.push_back(ms / n);
    for (const auto& c : *clones) {
      auto t1 = Clock::now();
      auto res = client.Run({.sandbox_id = c.id(), .argv = {"true"}});
      if (!res.ok() || res->result().exit_code() != 0) {
        Die(res.ok() ? absl::InternalError(res->stderr()) : res.status(), "Run in a clone");
      }
      first_exec.v.push_back(Ms(t1));
    }
    std::cerr << fmt::format("  round {}: {} clones in {:.1f} ms, {:.2f} ms per clone\n", r + 1, n,
                             ms, ms / n);
    for (const auto& c : *clones) {
      (void)client.Destroy(c.id());
    }
  }
  // The same environment without cloning: create, then upload the setup, N times.
  for (int r = 0; r < rounds; ++r) {
    std::vector<std::string> made;
    for (uint32_t i = 0; i < n; ++i) {
      auto t0 = Clock::now();
      made.push_back(make());
      create_only.v.push_back(Ms(t0));
      setup(made.back());
      baseline.v.push_back(Ms(t0));
    }
    for (const auto& id : made) {
      (void)client.Destroy(id);
    }
  }
  std::cerr << fmt::format(
      "  clone p50 {:.2f} ms per clone (call p50 {:.1f} ms); create p50 {:.1f} ms, create + "
      "upload {} MiB p50 {:.1f} ms per sandbox\n",
      per_clone.Pct(50), call.Pct(50), create_only.Pct(50), setup_mib, baseline.Pct(50));
  (void)client.Destroy(source);
  nlohmann::json out = {{"clone",
                         {{"count", n},
                          {"setup_mib", setup_mib},
                          {"rounds", rounds},
                          {"per_clone_ms", per_clone.Json()},
                          {"call_ms", call.Json()},
                          {"first_exec_ms", first_exec.Json()},
                          {"create_per_sandbox_ms", create_only.Json()},
                          {"create_and_upload_per_sandbox_ms", baseline.Json()}}}};
  std::cout << out.dump(2) << "\n";
  if (!json_out.empty()) {
    auto s = bragg::WriteStringToFile(json_out, out.dump(2) + "\n");
    if (!s.ok()) {
      Die(s, "writing --json");
    }
  }
  return 0;
}

// The floor for exec: the same command started directly on the host, without isolation
// (posix_spawn + wait), what any sandbox must at least pay.
Stats HostExec(const std::vector<std::string>& argv, int rounds) {
  Stats st;
  auto devnull = bragg::OpenFile("/dev/null", O_WRONLY | O_CLOEXEC);
  if (!devnull.ok()) {
    Die(devnull.status(), "host exec");
  }
  for (int r = 0; r < rounds; ++r) {
    auto t0 = Clock::now();
    bragg::SpawnOptions opts;
    opts.stdout_fd = devnull->get();
    auto child = bragg::Spawn(argv, opts);
    if (!child.ok()) {
      Die(child.status(), "host exec");
    }
    auto exit = child->Wait();
    if (!exit.ok() || exit->exit_code != 0) {
      Die(absl::InternalError(fmt::format("host command failed: {}", fmt::join(argv, " "))),
          "host exec");
    }
    st.v.push_back(Ms(t0));
  }
  return st;
}

// The floor: the same bytes (`payload`, the sandboxes' round trip's) up and back down over one
// loopback TCP connection to an echo thread (what any network service must at least pay),
// checked after each round as the sandboxes' are.
Stats LoopbackFloor(const std::string& payload, int rounds) {
  const size_t bytes = payload.size();
  bragg::UniqueFd ls(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (!ls.valid() || ::bind(ls.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(ls.get(), 1) != 0 ||
      ::getsockname(ls.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    Die(bragg::ErrnoError("bind/listen", "127.0.0.1"), "loopback floor");
  }
  int one = 1;
  std::thread echo([&ls, bytes, rounds, one] {
    bragg::UniqueFd c(::accept4(ls.get(), nullptr, nullptr, SOCK_CLOEXEC));
    ::setsockopt(c.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    std::string buf(bytes, '\0');
    for (int r = 0; r < rounds; ++r) {
      size_t got = 0;
      while (got < bytes) {
        ssize_t n = ::read(c.get(), buf.data() + got, bytes - got);
        if (n <= 0) {
          return;
        }
        got += static_cast<size_t>(n);
      }
      (void)bragg::WriteAll(c.get(), buf);
    }
  });
  bragg::UniqueFd c(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ::setsockopt(c.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (::connect(c.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    Die(bragg::ErrnoError("connect", "127.0.0.1"), "loopback floor");
  }
  std::string back(bytes, '\0');
  Stats st;
  for (int r = 0; r < rounds; ++r) {
    auto t0 = Clock::now();
    std::thread sender([&] { (void)bragg::WriteAll(c.get(), payload); });
    size_t got = 0;
    while (got < bytes) {
      ssize_t n = ::read(c.get(), back.data() + got, bytes - got);
      if (n <= 0) {
        break;
      }
      got += static_cast<size_t>(n);
    }
    sender.join();
    double ms = Ms(t0);
    if (got != bytes || back != payload) {
      Die(absl::DataLossError("the echoed bytes differ from the sent ones"), "loopback floor");
    }
    st.v.push_back(ms);
  }
  c.Reset();
  echo.join();
  return st;
}

// The floor for the concurrent phase: `conns` loopback TCP connections, each moving the same
// bytes up and back at once, `rounds` times. Returns per-connection round trips; `gbps` gets
// the aggregate rate (bytes both ways over the wall time of all rounds).
Stats LoopbackFloorConcurrent(const std::string& payload, size_t conns, int rounds, double* gbps) {
  const size_t bytes = payload.size();
  bragg::UniqueFd ls(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (!ls.valid() || ::bind(ls.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(ls.get(), static_cast<int>(conns)) != 0 ||
      ::getsockname(ls.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    Die(bragg::ErrnoError("bind/listen", "127.0.0.1"), "concurrent loopback floor");
  }
  auto read_full = [](int fd, std::string* buf) {
    size_t got = 0;
    while (got < buf->size()) {
      ssize_t n = ::read(fd, buf->data() + got, buf->size() - got);
      if (n <= 0) {
        return false;
      }
      got += static_cast<size_t>(n);
    }
    return true;
  };
  // Echo side: one thread per accepted connection reads the whole message, then sends it back
  // (so a client may write everything before it reads).
  std::vector<std::thread> echoes;
  std::thread acceptor([&] {
    for (size_t i = 0; i < conns; ++i) {
      bragg::UniqueFd c(::accept4(ls.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!c.valid()) {
        return;
      }
      int nodelay = 1;
      ::setsockopt(c.get(), IPPROTO_TCP, TCP_NODELAY, &nodelay, sizeof(nodelay));
      echoes.emplace_back([c = std::move(c), bytes, rounds, &read_full]() mutable {
        std::string buf(bytes, '\0');
        for (int r = 0; r < rounds && read_full(c.get(), &buf); ++r) {
          (void)bragg::WriteAll(c.get(), buf);
        }
      });
    }
  });
  std::vector<bragg::UniqueFd> clients;
  int one = 1;
  for (size_t i = 0; i < conns; ++i) {
    bragg::UniqueFd c(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    ::setsockopt(c.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (::connect(c.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      Die(bragg::ErrnoError("connect", "127.0.0.1"), "concurrent loopback floor");
    }
    clients.push_back(std::move(c));
  }
  acceptor.join();
  Stats st;
  std::mutex mu;
  auto t_all = Clock::now();
  for (int r = 0; r < rounds; ++r) {
    ParallelFor(conns, conns, [&](size_t i) {
      std::string back(bytes, '\0');
      auto t0 = Clock::now();
      if (!bragg::WriteAll(clients[i].get(), payload).ok() || !read_full(clients[i].get(), &back)) {
        Die(absl::InternalError("short transfer"), "concurrent loopback floor");
      }
      double ms = Ms(t0);
      if (back != payload) {
        Die(absl::DataLossError("the echoed bytes differ from the sent ones"),
            "concurrent loopback floor");
      }
      std::lock_guard<std::mutex> lock(mu);
      st.v.push_back(ms);
    });
  }
  double secs = Ms(t_all) / 1000.0;
  *gbps = 2.0 * static_cast<double>(bytes) * static_cast<double>(conns) * rounds / secs / 1e9;
  clients.clear();
  for (auto& t : echoes) {
    t.join();
  }
  return st;
}

// The tool scripts (NAME.py) in `dir`, sorted by name, with their contents.
std::vector<std::pair<std::string, std::string>> LoadTools(const std::string& dir) {
  std::vector<std::pair<std::string, std::string>> tools;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.is_regular_file() && entry.path().extension() == ".py") {
      auto text = bragg::ReadFileToString(entry.path().string());
      if (!text.ok()) {
        Die(text.status(), "reading a tool script");
      }
      tools.emplace_back(entry.path().stem().string(), *text);
    }
  }
  if (ec) {
    Die(absl::NotFoundError(fmt::format("{}: {}", dir, ec.message())), "--tools");
  }
  std::sort(tools.begin(), tools.end());
  return tools;
}

// Seed-order wall times of `samples` executions of each tool on the host, without isolation.
ToolTimes HostTools(const std::string& dir,
                    const std::vector<std::pair<std::string, std::string>>& tools, int samples) {
  ToolTimes out;
  out.ms.resize(tools.size());
  for (const auto& [name, text] : tools) {
    out.names.push_back(name);
  }
  for (int k = 0; k < samples; ++k) {
    for (size_t t = 0; t < tools.size(); ++t) {
      Stats one = HostExec(
          {"/usr/bin/python3", fmt::format("{}/{}.py", dir, tools[t].first), std::to_string(k)}, 1);
      out.ms[t].push_back(one.v[0]);
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  // Debian's Abseil runs Mutex deadlock detection (a cycle graph on every lock) unless told
  // not to; gRPC locks on every call.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  bragg::TuneAllocatorForBulkData();
  CLI::App app{"pbox-bench: pbox latency and throughput with N live sandboxes"};
  bragg::pbox::client::ClientOptions options;
  size_t sandboxes = 100;
  int rounds = 3;
  std::string runtime, json_out;
  size_t threads = 8;
  app.add_option("--endpoint", options.endpoint, "agent endpoint (default $PBOX_ENDPOINT)");
  app.add_option("--sandboxes", sandboxes, "live sandboxes")->capture_default_str();
  app.add_option("--rounds", rounds, "measurements per sandbox and metric")->capture_default_str();
  app.add_option("--runtime", runtime, "runtime to ask for (default: the agent's)");
  app.add_option("--threads", threads, "client threads for creation and concurrent phases")
      ->capture_default_str();
  app.add_option("--json", json_out, "write results here");
  uint32_t cpus = 0;
  app.add_option("--cpus", cpus, "CPUs per sandbox (default: the agent's, 1)");
  std::string tools_dir = PBOX_BENCH_TOOLS_DIR;
  int tool_samples = 5;
  app.add_option("--tools", tools_dir, "directory of tool scripts (NAME.py SEED)")
      ->capture_default_str();
  app.add_option("--tool-samples", tool_samples,
                 "executions of each tool (seeds 0..K-1), spread over the sandboxes; 0: none")
      ->capture_default_str();
  bool transfer_ab = true;
  app.add_option("--transfer-ab", transfer_ab,
                 "also measure the gRPC file streams beside the data channel, interleaved")
      ->capture_default_str();
  uint32_t clone_count = 0;
  size_t clone_setup_mib = 8;
  app.add_option("--clone", clone_count,
                 "instead: measure CloneSandbox with this many clones per call (--rounds calls)");
  app.add_option("--clone-setup-mib", clone_setup_mib,
                 "MiB of files uploaded to the clone source first")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (sandboxes == 0 || rounds <= 0 || tool_samples < 0) {
    std::cerr << "pbox-bench: --sandboxes and --rounds must be positive\n";
    return 2;
  }
  auto tools =
      tool_samples > 0 ? LoadTools(tools_dir) : std::vector<std::pair<std::string, std::string>>{};

  auto client_or = Client::Connect(options);
  if (!client_or.ok()) {
    Die(client_or.status(), "connect");
  }
  Client& client = **client_or;
  auto info = client.Info();
  if (!info.ok()) {
    Die(info.status(), "Info");
  }
  auto session = client.OpenSession("pbox-bench");
  if (!session.ok()) {
    Die(session.status(), "OpenSession");
  }
  std::string sid = (*session)->id();
  if (clone_count > 0) {
    std::cerr << fmt::format("pbox-bench: {} clones per call, {} MiB setup, {} rounds\n",
                             clone_count, clone_setup_mib, rounds);
    int rc = CloneBench(client, sid, clone_count, rounds, clone_setup_mib, json_out);
    (void)(*session)->Close();
    return rc;
  }
  std::string rt = runtime.empty() ? info->default_runtime() : runtime;
  if (std::find(info->runtimes().begin(), info->runtimes().end(), rt) == info->runtimes().end()) {
    std::cerr << fmt::format("pbox-bench: the agent does not offer runtime {} (it offers: {})\n",
                             rt, fmt::join(info->runtimes(), ", "));
    return 3;
  }
  std::cerr << fmt::format("pbox-bench: {} sandboxes, runtime {}, {} rounds, agent cpus {}\n",
                           sandboxes, rt, rounds, info->cpuset());

  // create -> first exec ready; and create, then the first `true` run to its exit (the time
  // until a first command has run, whatever a runtime counts as ready).
  std::vector<std::string> ids(sandboxes);
  Stats create, create_exec;
  std::mutex mu;
  auto t_create = Clock::now();
  // One at a time: the latency a rollout sees, with up to N-1 sandboxes already live.
  ParallelFor(sandboxes, 1, [&](size_t i) {
    v1::SandboxSpec spec;
    spec.set_runtime(runtime);
    spec.set_cpus(cpus);
    spec.set_memory_bytes(256 << 20);
    spec.set_disk_bytes(256 << 20);
    auto t0 = Clock::now();
    auto sb = client.Create(spec, sid);
    if (!sb.ok()) {
      Die(sb.status(), "CreateSandbox");
    }
    double ms = Ms(t0);
    auto first = client.Run(bragg::pbox::client::RunArgs{.sandbox_id = sb->id(), .argv = {"true"}});
    double ms_exec = Ms(t0);
    if (!first.ok() || first->result().exit_code() != 0) {
      Die(first.ok() ? absl::InternalError(first->stderr()) : first.status(), "first Run");
    }
    ids[i] = sb->id();
    std::lock_guard<std::mutex> lock(mu);
    create.v.push_back(ms);
    create_exec.v.push_back(ms_exec);
    if (create.v.size() % 25 == 0) {
      std::cerr << fmt::format("  created {}/{}\n", create.v.size(), sandboxes);
    }
  });
  std::cerr << fmt::format("  all {} created in {:.0f} ms\n", sandboxes, Ms(t_create));

  auto exec_round = [&](const std::vector<std::string>& argv, Stats* out) {
    for (int r = 0; r < rounds; ++r) {
      for (size_t i = 0; i < sandboxes; ++i) {
        bragg::pbox::client::RunArgs args{.sandbox_id = ids[i], .argv = argv};
        auto t0 = Clock::now();
        auto res = client.Run(args);
        double ms = Ms(t0);
        if (!res.ok() || res->result().exit_code() != 0) {
          Die(res.ok() ? absl::InternalError(res->stderr()) : res.status(), "Run");
        }
        out->v.push_back(ms);
      }
    }
  };
  Stats exec_true, exec_python;
  exec_round({"true"}, &exec_true);
  std::cerr << fmt::format("  exec true p50 {:.3f} ms\n", exec_true.Pct(50));
  exec_round({"python3", "-c", "pass"}, &exec_python);
  std::cerr << fmt::format("  exec python3 -c pass p50 {:.3f} ms\n", exec_python.Pct(50));

  // 1 MiB upload then download of the same bytes, checked.
  constexpr size_t kMiB = 1 << 20;
  std::string payload(kMiB, '\0');
  std::mt19937_64 rng(42);
  for (size_t i = 0; i < kMiB; i += 8) {
    uint64_t x = rng();
    std::memcpy(payload.data() + i, &x, 8);
  }
  // The client's default transfer path (the data channel when the agent offers it) and the
  // gRPC streams, measured interleaved (A B A B ...) so both see the same machine load.
  options.data_channel = false;
  auto grpc_client_or = Client::Connect(options);
  if (!grpc_client_or.ok()) {
    Die(grpc_client_or.status(), "connect");
  }
  Client& grpc_client = **grpc_client_or;
  auto round_trip = [&](Client& c, const std::string& id) {
    auto t0 = Clock::now();
    auto w = c.WriteFile(id, "/tmp/bench.bin", payload);
    if (!w.ok()) {
      Die(w.status(), "WriteFile");
    }
    auto r = c.ReadFile(id, "/tmp/bench.bin");
    if (!r.ok()) {
      Die(r.status(), "ReadFile");
    }
    double ms = Ms(t0);
    if (*r != payload) {
      Die(absl::DataLossError("downloaded bytes differ from uploaded ones"), "round trip");
    }
    return ms;
  };
  // One warm-up round trip each: the first learns whether the agent offers the data channel.
  (void)round_trip(client, ids[0]);
  (void)round_trip(grpc_client, ids[0]);
  struct Path {
    const char* name;
    Client* client;
    Stats rtt, rtt_conc;
    double bytes = 0, seconds = 0;
  };
  std::vector<Path> paths = {{client.uses_data_channel() ? "data" : "grpc", &client}};
  if (transfer_ab && client.uses_data_channel()) {
    paths.push_back({"grpc", &grpc_client});
  }
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < sandboxes; ++i) {
      for (Path& p : paths) {
        p.rtt.v.push_back(round_trip(*p.client, ids[i]));
      }
    }
  }
  for (Path& p : paths) {
    std::cerr << fmt::format("  1 MiB round trip ({}) p50 {:.3f} ms\n", p.name, p.rtt.Pct(50));
  }
  for (int r = 0; r < rounds; ++r) {
    for (Path& p : paths) {
      auto t_conc = Clock::now();
      ParallelFor(sandboxes, sandboxes, [&](size_t i) {
        double ms = round_trip(*p.client, ids[i]);
        std::lock_guard<std::mutex> lock(mu);
        p.rtt_conc.v.push_back(ms);
        p.bytes += 2.0 * kMiB;
      });
      p.seconds += Ms(t_conc) / 1000.0;
    }
  }
  for (Path& p : paths) {
    std::cerr << fmt::format("  concurrent 1 MiB round trips ({}) p50 {:.3f} ms, {:.2f} GB/s\n",
                             p.name, p.rtt_conc.Pct(50), p.bytes / p.seconds / 1e9);
  }
  Stats rtt = paths[0].rtt;
  Stats rtt_conc = paths[0].rtt_conc;
  double gbps = paths[0].bytes / paths[0].seconds / 1e9;
  nlohmann::json transfer_paths = nlohmann::json::object();
  for (Path& p : paths) {
    transfer_paths[p.name] = {{"rtt_1mib_ms", p.rtt.Json()},
                              {"rtt_1mib_concurrent_ms", p.rtt_conc.Json()},
                              {"throughput_gbps", p.bytes / p.seconds / 1e9}};
  }

  // Tool executions: each script uploaded once to every sandbox; execution k of tool t runs
  // with seed k in sandbox (k * tools + t) mod N, timed from the call to its result.
  ToolTimes tool_times;
  tool_times.ms.resize(tools.size());
  for (const auto& [name, text] : tools) {
    tool_times.names.push_back(name);
  }
  if (!tools.empty()) {
    ParallelFor(sandboxes, threads, [&](size_t i) {
      for (const auto& [name, text] : tools) {
        auto w = client.WriteFile(ids[i], fmt::format("{}/{}.py", kToolsDir, name), text);
        if (!w.ok()) {
          Die(w.status(), "uploading a tool script");
        }
      }
    });
    for (int k = 0; k < tool_samples; ++k) {
      for (size_t t = 0; t < tools.size(); ++t) {
        bragg::pbox::client::RunArgs args{
            .sandbox_id = ids[(static_cast<size_t>(k) * tools.size() + t) % sandboxes],
            .argv = {"python3", fmt::format("{}/{}.py", kToolsDir, tools[t].first),
                     std::to_string(k)}};
        auto t0 = Clock::now();
        auto res = client.Run(args);
        double ms = Ms(t0);
        if (!res.ok() || res->result().exit_code() != 0) {
          Die(res.ok() ? absl::InternalError(res->stderr()) : res.status(), tools[t].first.c_str());
        }
        tool_times.ms[t].push_back(ms);
      }
    }
    for (size_t t = 0; t < tools.size(); ++t) {
      std::cerr << fmt::format("  tool {} p50 {:.1f} ms\n", tools[t].first,
                               Stats{tool_times.ms[t]}.Pct(50));
    }
  }

  Stats floor = LoopbackFloor(payload, std::max(rounds * 20, 50));
  std::cerr << fmt::format("  loopback TCP floor, 1 MiB up and back: p50 {:.3f} ms\n",
                           floor.Pct(50));

  double floor_gbps = 0;
  Stats floor_conc = LoopbackFloorConcurrent(payload, sandboxes, rounds, &floor_gbps);
  std::cerr << fmt::format("  loopback TCP floor, {} at once: p50 {:.3f} ms, {:.2f} GB/s\n",
                           sandboxes, floor_conc.Pct(50), floor_gbps);

  // As many host spawns as sandbox execs, from 20 (for a stable p50) to 100 (enough for it).
  int host_rounds = static_cast<int>(std::clamp<size_t>(sandboxes * rounds, 20, 100));
  Stats host_true = HostExec({"/usr/bin/true"}, host_rounds);
  Stats host_python = HostExec({"/usr/bin/python3", "-c", "pass"}, host_rounds);
  std::cerr << fmt::format("  host floor: true p50 {:.3f} ms, python3 -c pass p50 {:.3f} ms\n",
                           host_true.Pct(50), host_python.Pct(50));
  ToolTimes host_tools = HostTools(tools_dir, tools, tool_samples);

  (void)(*session)->Close();
  nlohmann::json out = {
      {"runtime", rt},
      {"sandboxes", sandboxes},
      {"rounds", rounds},
      {"metrics",
       {{"create_ms", create.Json()},
        {"create_exec_ms", create_exec.Json()},
        {"exec_true_ms", exec_true.Json()},
        {"exec_python_ms", exec_python.Json()},
        {"rtt_1mib_ms", rtt.Json()},
        {"rtt_1mib_concurrent_ms", rtt_conc.Json()}}},
      {"throughput_gbps", gbps},
      {"transfer", paths[0].name},
      {"transfer_paths", transfer_paths},
      {"tools", tool_times.Json()},
      {"floor",
       {{"runtime", "floor"},
        {"sandboxes", sandboxes},
        {"metrics",
         {{"exec_true_ms", host_true.Json()},
          {"exec_python_ms", host_python.Json()},
          {"rtt_1mib_ms", floor.Json()},
          {"rtt_1mib_concurrent_ms", floor_conc.Json()}}},
        {"throughput_gbps", floor_gbps},
        {"tools", host_tools.Json()}}},
  };
  std::cout << out.dump(2) << "\n";
  if (!json_out.empty()) {
    auto s = bragg::WriteStringToFile(json_out, out.dump(2) + "\n");
    if (!s.ok()) {
      Die(s, "writing --json");
    }
  }
  return 0;
}
