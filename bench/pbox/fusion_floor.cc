// pbox-fusion-floor: the pbox work behind one pbox-fusion /run_code call of a Python program,
// without HTTP or JSON: create a sandbox in a session, write the code, run python3 on it,
// destroy the sandbox; `--callers` threads in a loop for `--seconds`. The floor that
// bench/pbox/fusion.py compares pbox-fusion with, measured in the same run.
//
//   pbox-fusion-floor --endpoint unix:///tmp/pbox.sock --callers 64 --seconds 10
//
// Prints one JSON object: {"calls", "errors", "seconds", "calls_per_s", "p50_ms", "p99_ms"}.

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "pbox/client/client.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace v1 = bragg::pbox::v1;

// One call as pbox-fusion makes it (src/fusion/runner.cc): the same spec and steps.
bool OneCall(bragg::pbox::client::Client& client, const std::string& session,
             const std::string& code) {
  v1::SandboxSpec spec;
  spec.set_image("host");
  spec.set_cpus(1);
  spec.set_memory_bytes(uint64_t{1024} << 20);
  spec.set_disk_bytes(uint64_t{256} << 20);
  spec.set_pids(256);
  spec.set_workdir("/workspace");
  (*spec.mutable_env())["PATH"] = "/usr/local/bin:/usr/bin:/bin";
  auto sb = client.Create(spec, session);
  if (!sb.ok()) {
    return false;
  }
  bool ok = client.WriteFile(sb->id(), "/workspace/__fusion_main__.py", code).ok();
  if (ok) {
    auto r = client.Run({.sandbox_id = sb->id(),
                         .argv = {"/usr/bin/python3", "__fusion_main__.py"},
                         .cwd = "/workspace",
                         .timeout_ms = 10000,
                         .max_output_bytes = 1 << 20});
    ok = r.ok() && r->result().exit_code() == 0;
  }
  return client.Destroy(sb->id()).ok() && ok;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"pbox-fusion-floor: create + write + run python3 + destroy, concurrently"};
  bragg::pbox::client::ClientOptions options;
  int callers = 64;
  double seconds = 10;
  std::string code = "print(1)\n";
  app.add_option("--endpoint", options.endpoint, "agent endpoint (default $PBOX_ENDPOINT)");
  app.add_option("--callers", callers, "concurrent callers")->check(CLI::Range(1, 4096));
  app.add_option("--seconds", seconds, "measured time")->check(CLI::PositiveNumber);
  app.add_option("--code", code, "the Python program");
  CLI11_PARSE(app, argc, argv);
  auto client = bragg::pbox::client::Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "pbox-fusion-floor: %s\n", client.status().ToString().c_str());
    return 1;
  }
  auto session = (*client)->OpenSession("pbox-fusion-floor");
  if (!session.ok()) {
    std::fprintf(stderr, "pbox-fusion-floor: %s\n", session.status().ToString().c_str());
    return 1;
  }
  std::mutex mu;
  std::vector<double> ms;
  std::atomic<uint64_t> errors{0};
  const auto t0 = Clock::now();
  const auto end = t0 + std::chrono::duration<double>(seconds);
  std::vector<std::thread> threads;
  for (int i = 0; i < callers; ++i) {
    threads.emplace_back([&] {
      while (Clock::now() < end) {
        auto c0 = Clock::now();
        bool ok = OneCall(**client, (*session)->id(), code);
        double d = std::chrono::duration<double, std::milli>(Clock::now() - c0).count();
        if (!ok) {
          errors.fetch_add(1);
          continue;
        }
        std::lock_guard<std::mutex> lock(mu);
        ms.push_back(d);
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  std::sort(ms.begin(), ms.end());
  auto pct = [&](double p) {
    return ms.empty() ? 0.0 : ms[std::min(ms.size() - 1, static_cast<size_t>(p * ms.size()))];
  };
  nlohmann::json out = {{"calls", ms.size()}, {"errors", errors.load()},
                        {"seconds", wall},    {"calls_per_s", ms.size() / wall},
                        {"p50_ms", pct(0.5)}, {"p99_ms", pct(0.99)}};
  std::printf("%s\n", out.dump().c_str());
  return errors.load() == 0 ? 0 : 1;
}
