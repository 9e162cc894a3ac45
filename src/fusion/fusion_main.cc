// pbox-fusion --listen HOST:PORT --endpoint PBOXD [--max-concurrency N] ...
// A SandboxFusion-compatible HTTP front for pbox (docs/fusion.md): each POST /run_code runs in
// a fresh pbox sandbox that is destroyed before the answer.

#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <optional>

#include "common/logging.h"
#include "common/serve.h"
#include "fusion/runner.h"
#include "fusion/server.h"
#include "pbox/client/client.h"

int main(int argc, char** argv) {
  CLI::App app{"pbox-fusion: SandboxFusion's /run_code API on pbox sandboxes"};
  std::string listen = "127.0.0.1:8080", log_level = "info";
  bragg::pbox::client::ClientOptions client_options;
  bragg::fusion::RunnerOptions ro;
  bragg::fusion::ServerOptions so;
  uint64_t max_request_mb = 64, max_output_kb = 1024, max_fetch_mb = 64;
  app.add_option("--listen", listen, "HOST:PORT to serve on (port 0: any free port)")
      ->capture_default_str();
  app.add_option("--endpoint", client_options.endpoint,
                 "pboxd address: unix:///path.sock or tcp://host:port (default: $PBOX_ENDPOINT, "
                 "else unix:///run/pbox/pbox.sock, or a user's own rootless agent's, "
                 "$XDG_RUNTIME_DIR/pbox/pbox.sock)");
  app.add_option("--max-concurrency", so.max_concurrency,
                 "/run_code calls running at once; more wait for a slot")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--max-connections", so.max_connections, "HTTP connections served at once")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  app.add_option("--max-request-mb", max_request_mb, "largest request body (413 beyond)")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--max-timeout-s", so.limits.max_timeout_s,
                 "largest compile_timeout and run_timeout a request may ask for")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-memory-mb", so.limits.max_memory_mb,
                 "largest memory_limit_MB a request may ask for")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--default-memory-mb", ro.default_memory_mb,
                 "memory limit of a sandbox whose request has memory_limit_MB <= 0")
      ->check(CLI::Range(16, 1 << 20))
      ->capture_default_str();
  app.add_option("--disk-mb", ro.disk_mb, "each sandbox's writable layer")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--pids", ro.pids, "processes and threads per sandbox")
      ->check(CLI::Range(8, 1 << 20))
      ->capture_default_str();
  app.add_option("--cpus", ro.cpus, "CPUs per sandbox")->check(CLI::Range(1, 1024));
  app.add_option("--max-output-kb", max_output_kb,
                 "stdout and stderr kept per command, each (head and tail; pbox allows 4096)")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--max-fetch-mb", max_fetch_mb, "fetch_files bytes per call, all together")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--image", ro.image, "pbox image (needs /usr/bin/python3, bash, g++)")
      ->capture_default_str();
  app.add_option("--runtime", ro.runtime, "pbox runtime (native, gvisor; default: the agent's)");
  app.add_option("--workdir", ro.workdir, "working directory of the code in the sandbox")
      ->capture_default_str();
  app.add_option("--log-level", log_level, "trace | debug | info | warn | error");
  CLI11_PARSE(app, argc, argv);
  if (bragg::Status s = bragg::InitLogging(argv[0], log_level); !s.ok()) {
    std::fprintf(stderr, "pbox-fusion: %s\n", s.ToString().c_str());
    return 2;
  }
  so.max_request_bytes = max_request_mb << 20;
  so.limits.max_memory_mb = std::min<int64_t>(so.limits.max_memory_mb, 1 << 20);
  ro.max_output_bytes = max_output_kb << 10;
  ro.max_fetch_bytes = max_fetch_mb << 20;

  std::unique_ptr<bragg::pbox::client::Client> client;
  std::unique_ptr<bragg::fusion::Runner> runner;
  std::unique_ptr<bragg::fusion::Server> server;
  return bragg::ServeUntilTerminated(
      listen,
      [&](const bragg::HostPort& hp) -> bragg::Result<std::string> {
        BRAGG_ASSIGN_OR_RETURN(client, bragg::pbox::client::Client::Connect(client_options));
        runner = std::make_unique<bragg::fusion::Runner>(client.get(), ro);
        BRAGG_RETURN_IF_ERROR(runner->Start());
        so.host = hp.host;
        so.port = hp.port;
        server = std::make_unique<bragg::fusion::Server>(runner.get(), so);
        BRAGG_RETURN_IF_ERROR(server->Start());
        return server->url();
      },
      [&] { server->Stop(); });
}
