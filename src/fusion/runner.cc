#include "fusion/runner.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cmath>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"

namespace bragg::fusion {
namespace {

namespace v1 = pbox::v1;

constexpr char kClientName[] = "pbox-fusion";

uint64_t TimeoutMs(double seconds) {
  return std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(seconds * 1000.0)));
}

}  // namespace

Runner::Runner(pbox::client::Client* client, RunnerOptions options)
    : client_(client), options_(std::move(options)) {}

Runner::~Runner() = default;

Status Runner::Start() {
  std::lock_guard<std::mutex> lock(session_mu_);
  BRAGG_ASSIGN_OR_RETURN(session_, client_->OpenSession(kClientName));
  spdlog::info("pbox session {} open at {}", session_->id(), client_->endpoint());
  return absl::OkStatus();
}

bool Runner::stopping() {
  std::lock_guard<std::mutex> lock(session_mu_);
  return stopping_;
}

void Runner::Shutdown() {
  std::unique_ptr<pbox::client::Session> session;
  {
    std::lock_guard<std::mutex> lock(session_mu_);
    stopping_ = true;
    session = std::move(session_);
  }
  if (session) {
    (void)session->Close();
  }
}

void Runner::Destroy(const std::string& sandbox_id) {
  Status s = client_->Destroy(sandbox_id);
  if (!s.ok() && !absl::IsNotFound(s)) {
    // The session still owns it: the agent destroys it when pbox-fusion ends at the latest.
    spdlog::warn("cannot destroy sandbox {}: {}", sandbox_id, s.ToString());
  }
}

Result<std::string> Runner::CreateSandbox(const RunCodeRequest& request) {
  v1::SandboxSpec spec;
  spec.set_image(options_.image);
  spec.set_runtime(options_.runtime);
  spec.set_cpus(options_.cpus);
  uint64_t memory_mb = request.memory_limit_mb > 0 ? static_cast<uint64_t>(request.memory_limit_mb)
                                                   : options_.default_memory_mb;
  spec.set_memory_bytes(memory_mb << 20);
  spec.set_disk_bytes(options_.disk_mb << 20);
  spec.set_pids(options_.pids);
  spec.set_workdir(options_.workdir);
  (*spec.mutable_env())["PATH"] = "/usr/local/bin:/usr/bin:/bin";
  (*spec.mutable_env())["HOME"] = options_.workdir;
  (*spec.mutable_labels())["owner"] = kClientName;

  for (int attempt = 0;; ++attempt) {
    std::string session_id;
    {
      std::lock_guard<std::mutex> lock(session_mu_);
      if (stopping_ || !session_) {
        return absl::UnavailableError("pbox-fusion is shutting down");
      }
      session_id = session_->id();
    }
    Result<v1::Sandbox> sandbox = client_->Create(spec, session_id);
    if (sandbox.ok()) {
      return sandbox->id();
    }
    // The agent restarted (or dropped the session): open a new one, once per call.
    bool session_gone = absl::IsFailedPrecondition(sandbox.status()) &&
                        absl::StrContains(sandbox.status().message(), "is not open");
    if (!session_gone || attempt > 0) {
      return Annotate(sandbox.status(), "creating a pbox sandbox");
    }
    std::lock_guard<std::mutex> lock(session_mu_);
    if (!stopping_ && session_ && session_->id() == session_id) {
      spdlog::warn("pbox session {} is gone ({}): opening a new one", session_id,
                   std::string(sandbox.status().message()));
      session_.reset();
      BRAGG_ASSIGN_OR_RETURN(session_, client_->OpenSession(kClientName));
    }
  }
}

Result<CommandResult> Runner::RunCommand(const std::string& sandbox_id,
                                         const std::vector<std::string>& argv, double timeout_s,
                                         const std::string& stdin_data) {
  pbox::client::RunArgs args{.sandbox_id = sandbox_id,
                             .argv = argv,
                             .cwd = options_.workdir,
                             .timeout_ms = TimeoutMs(timeout_s),
                             .stdin = stdin_data,
                             .max_output_bytes = options_.max_output_bytes};
  BRAGG_ASSIGN_OR_RETURN(v1::RunResponse resp, client_->Run(args));
  const v1::ExecResult& r = resp.result();
  CommandResult c;
  c.execution_time = r.wall_time_ms() / 1000.0;
  c.out = std::move(*resp.mutable_stdout());
  c.err = std::move(*resp.mutable_stderr());
  if (r.timed_out()) {
    // SandboxFusion reports no return code for a command it killed at its timeout.
    c.status = CommandStatus::kTimeLimitExceeded;
    return c;
  }
  c.status = CommandStatus::kFinished;
  // Python's Popen.returncode, which SandboxFusion reports: -N for a death by signal N.
  c.return_code = r.signal() != 0 ? -r.signal() : r.exit_code();
  if (!r.error().empty()) {
    c.err += r.error();
  }
  return c;
}

RunCodeResponse Runner::Run(const RunCodeRequest& request, WatchedCall* call) {
  auto cancelled = [call] { return call != nullptr && call->cancelled(); };
  Result<std::string> created = CreateSandbox(request);
  if (!created.ok()) {
    return SandboxErrorResponse(std::string(created.status().message()));
  }
  const std::string& id = *created;
  absl::Cleanup destroy = [this, &id, call] {
    if (call != nullptr) {
      (void)call->SetSandbox("");
    }
    Destroy(id);
  };
  if (call != nullptr && !call->SetSandbox(id)) {
    return SandboxErrorResponse("the client went away");
  }

  const std::string dir = options_.workdir + "/";
  const Language& lang = *request.language;
  if (Result<v1::FileInfo> w = client_->WriteFile(id, dir + std::string(lang.source), request.code);
      !w.ok()) {
    return SandboxErrorResponse(fmt::format("cannot write the code into the sandbox: {}",
                                            std::string(w.status().message())));
  }
  for (const auto& [path, bytes] : request.files) {
    if (Result<v1::FileInfo> w = client_->WriteFile(id, dir + path, bytes); !w.ok()) {
      return SandboxErrorResponse(fmt::format("cannot write file '{}' into the sandbox: {}", path,
                                              std::string(w.status().message())));
    }
  }

  RunCodeResponse response;
  bool compiled = true;
  if (!lang.compile.empty()) {
    Result<CommandResult> c = RunCommand(id, lang.compile, request.compile_timeout_s, "");
    if (!c.ok()) {
      return SandboxErrorResponse(
          cancelled() ? "the client went away"
                      : fmt::format("compiling: {}", std::string(c.status().message())));
    }
    compiled = c->status == CommandStatus::kFinished && c->return_code == 0;
    response.compile_result = std::move(*c);
  }
  if (compiled) {
    Result<CommandResult> r = RunCommand(id, lang.run, request.run_timeout_s, request.stdin_data);
    if (!r.ok()) {
      return SandboxErrorResponse(
          cancelled() ? "the client went away"
                      : fmt::format("running: {}", std::string(r.status().message())));
    }
    response.run_result = std::move(*r);
  }

  // SandboxFusion returns the fetched files that exist as regular files and skips the others.
  uint64_t budget = options_.max_fetch_bytes;
  for (const auto& [name, path] : request.fetch_files) {
    if (cancelled()) {
      return SandboxErrorResponse("the client went away");
    }
    Result<v1::FileInfo> info = client_->Stat(id, dir + path);
    if (!info.ok() || info->type() != v1::FILE_TYPE_REGULAR) {
      continue;
    }
    if (info->size() > budget) {
      return SandboxErrorResponse(fmt::format(
          "fetched files exceed {} bytes (pbox-fusion's --max-fetch-mb) at '{}' ({} bytes)",
          options_.max_fetch_bytes, name, info->size()));
    }
    Result<std::string> bytes = client_->ReadFile(id, dir + path, 0, budget);
    if (!bytes.ok()) {
      continue;
    }
    budget -= bytes->size();
    response.files.emplace_back(name, std::move(*bytes));
  }
  if (stopping()) {
    // The session's end killed the commands: their results say nothing about the code.
    return SandboxErrorResponse("pbox-fusion is shutting down");
  }
  SetRunStatus(&response);
  return response;
}

}  // namespace bragg::fusion
