#include "agent_fixture.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <thread>

#include "fmt/format.h"

namespace bragg::pbox::testing {

bool OnGvisor() {
  const char* r = ::getenv("PBOX_TEST_RUNTIME");
  return r != nullptr && std::string(r) == "gvisor";
}

std::string AgentTestSkipReason() {
  if (geteuid() != 0) {
    return "pboxd needs root (namespaces, mounts, cgroups)";
  }
  if (OnGvisor() && ::access("/usr/bin/runsc", X_OK) != 0 &&
      ::access("/usr/sbin/runsc", X_OK) != 0) {
    return "runsc is not installed (Debian package runsc): no gVisor runtime here";
  }
  return "";
}

Result<std::unique_ptr<TestAgent>> TestAgent::Start(const AgentOptions& options) {
  std::unique_ptr<TestAgent> a(new TestAgent());
  BRAGG_ASSIGN_OR_RETURN(a->dir_, TempDir::Create("/tmp", "pbox-test-"));
  a->state_dir_ = a->dir_.path() + "/state";
  a->ready_file_ = a->dir_.path() + "/ready.json";
  a->unix_endpoint_ = "unix://" + a->dir_.path() + "/pbox.sock";
  a->cgroup_parent_ = "pbox-test-" + a->dir_.path().substr(a->dir_.path().rfind('-') + 1);
  a->flags_ = {"--listen",         a->unix_endpoint_, "--state-dir",     a->state_dir_,
               "--ready-file",     a->ready_file_,    "--log-level",     "warn",
               "--metrics-listen", "127.0.0.1:0",     "--cgroup-parent", a->cgroup_parent_};
  if (options.tcp) {
    a->token_ = "test-token-0123456789abcdef";
    std::string token_file = a->dir_.path() + "/token";
    BRAGG_RETURN_IF_ERROR(WriteStringToFile(token_file, a->token_ + "\n"));
    ::chmod(token_file.c_str(), 0600);
    a->flags_.insert(a->flags_.end(),
                     {"--listen", "tcp://127.0.0.1:0", "--token-file", token_file});
  }
  // PBOX_TEST_RUNTIME=gvisor runs the same tests on the gVisor runtime (the agent's default).
  if (const char* runtime = ::getenv("PBOX_TEST_RUNTIME"); runtime != nullptr && *runtime) {
    a->flags_.insert(a->flags_.end(), {"--runtime", runtime});
  }
  a->flags_.insert(a->flags_.end(), options.extra_flags.begin(), options.extra_flags.end());
  BRAGG_RETURN_IF_ERROR(a->Launch());
  return a;
}

Status TestAgent::Launch() {
  ::unlink(ready_file_.c_str());
  last_exit_.reset();
  std::vector<std::string> argv = {PBOXD_PATH};
  argv.insert(argv.end(), flags_.begin(), flags_.end());
  BRAGG_ASSIGN_OR_RETURN(process_, Spawn(argv));
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    auto ready = ReadFileToString(ready_file_);
    if (ready.ok()) {
      auto j = nlohmann::json::parse(*ready);
      metrics_port_ = j["metrics_port"].get<int>();
      for (const auto& e : j["endpoints"]) {
        std::string ep = e.get<std::string>();
        if (ep.rfind("tcp://", 0) == 0) {
          tcp_endpoint_ = ep;
        }
      }
      return absl::OkStatus();
    }
    auto exited = process_.Wait(std::chrono::milliseconds(20));
    if (exited.ok()) {
      last_exit_ = *exited;
      return absl::InternalError(
          fmt::format("pboxd exited before it was ready: {}", DescribeExit(*exited)));
    }
  }
  return absl::DeadlineExceededError("pboxd did not become ready in 20 s");
}

TestAgent::~TestAgent() {
  if (process_.running()) {
    (void)Stop(SIGTERM);
  }
  if (last_exit_.has_value() && (last_exit_->signal != 0 || last_exit_->exit_code != 0)) {
    auto reaped = Reap();
    if (!reaped.ok()) {
      std::fprintf(stderr, "pboxd --reap %s: %s\n", state_dir_.c_str(),
                   std::string(reaped.status().message()).c_str());
    }
  }
}

Result<std::string> TestAgent::Reap() {
  std::vector<std::string> argv = {PBOXD_PATH, "--reap", "--state-dir", state_dir_};
  for (size_t i = 0; i + 1 < flags_.size(); ++i) {
    if (flags_[i] == "--cgroup" || flags_[i] == "--cgroup-parent") {
      argv.insert(argv.end(), {flags_[i], flags_[i + 1]});
    }
  }
  const std::string out_path = dir_.path() + "/reap.out";
  const std::string err_path = dir_.path() + "/reap.err";
  BRAGG_ASSIGN_OR_RETURN(UniqueFd out, OpenFile(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600));
  BRAGG_ASSIGN_OR_RETURN(UniqueFd err, OpenFile(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0600));
  BRAGG_ASSIGN_OR_RETURN(ChildProcess reaper,
                         Spawn(argv, {.stdout_fd = out.get(), .stderr_fd = err.get()}));
  BRAGG_ASSIGN_OR_RETURN(ExitInfo exit, reaper.Wait(std::chrono::milliseconds(60000)));
  BRAGG_ASSIGN_OR_RETURN(std::string printed, ReadFileToString(out_path));
  if (exit.signal != 0 || exit.exit_code != 0) {
    auto errors = ReadFileToString(err_path);
    return absl::FailedPreconditionError(fmt::format("pboxd --reap: {}: {}", DescribeExit(exit),
                                                     errors.ok() ? *errors : std::string()));
  }
  return printed;
}

std::unique_ptr<client::Client> TestAgent::NewClient() const {
  auto c = client::Client::Connect({.endpoint = unix_endpoint_});
  return c.ok() ? std::move(*c) : nullptr;
}

Result<ExitInfo> TestAgent::Stop(int sig) {
  BRAGG_RETURN_IF_ERROR(process_.Signal(sig));
  BRAGG_ASSIGN_OR_RETURN(ExitInfo exit, process_.Wait(std::chrono::milliseconds(30000)));
  last_exit_ = exit;
  return exit;
}

Status TestAgent::Restart() { return Launch(); }

}  // namespace bragg::pbox::testing
