#include "pbox/sandbox.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include "common/fs.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"

namespace bragg::pbox {
namespace {

constexpr size_t kReadChunk = 64 * 1024;
// After the command exits, output still buffered in the pipes is drained; a background
// process that keeps the pipes open gets this long before the command is reported.
constexpr std::chrono::milliseconds kDrainGrace{200};

constexpr const char* kDefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

}  // namespace

SandboxSettings FillUnset(const SandboxSettings& request, const SandboxSettings& base) {
  SandboxSettings s = request;
  if (s.image.empty()) {
    s.image = base.image;
  }
  if (s.runtime.empty()) {
    s.runtime = base.runtime;
  }
  if (s.cpus == 0) {
    s.cpus = base.cpus;
  }
  if (s.cpu_quota == 0) {
    s.cpu_quota = base.cpu_quota;
  }
  if (s.memory_bytes == 0) {
    s.memory_bytes = base.memory_bytes;
  }
  if (s.pids == 0) {
    s.pids = base.pids;
  }
  if (s.disk_bytes == 0) {
    s.disk_bytes = base.disk_bytes;
  }
  if (s.workdir.empty()) {
    s.workdir = base.workdir;
  }
  if (s.idle_ttl_seconds == 0) {
    s.idle_ttl_seconds = base.idle_ttl_seconds;
  }
  return s;
}

int64_t UnixMillisNow() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Sandbox::Sandbox(std::string id, std::string session_id, SandboxSettings settings, CpuSet cpus,
                 std::unique_ptr<Cgroup> cgroup, std::unique_ptr<RuntimeSandbox> runtime)
    : id_(std::move(id)),
      session_id_(std::move(session_id)),
      settings_(std::move(settings)),
      cpus_(std::move(cpus)),
      created_unix_ms_(UnixMillisNow()),
      last_used_unix_ms_(created_unix_ms_),
      cgroup_(std::move(cgroup)),
      runtime_(std::move(runtime)) {}

Sandbox::~Sandbox() { (void)Destroy(); }

void Sandbox::set_frozen_layer(std::shared_ptr<const FrozenLayer> layer) {
  std::shared_ptr<const FrozenLayer> old;
  {
    std::lock_guard<std::mutex> lock(layer_mu_);
    old = std::exchange(frozen_layer_, std::move(layer));
  }
  // `old` may be the last reference: its removal from disk runs here, outside the lock.
}

std::shared_ptr<const FrozenLayer> Sandbox::frozen_layer() const {
  std::lock_guard<std::mutex> lock(layer_mu_);
  return frozen_layer_;
}

Status Sandbox::Freeze() {
  std::lock_guard<std::mutex> lock(freeze_mu_);
  if (freeze_holders_ == 0) {
    BRAGG_RETURN_IF_ERROR(cgroup_->Freeze(true));
  }
  ++freeze_holders_;
  return absl::OkStatus();
}

Status Sandbox::Thaw() {
  std::lock_guard<std::mutex> lock(freeze_mu_);
  if (freeze_holders_ == 0) {
    return absl::FailedPreconditionError(fmt::format("sandbox {} is not frozen", id_));
  }
  if (--freeze_holders_ > 0) {
    return absl::OkStatus();  // another holder still needs it stopped
  }
  return cgroup_->Freeze(false);
}

void Sandbox::Touch() { last_used_unix_ms_.store(UnixMillisNow()); }

Status Sandbox::Destroy() {
  destroying_.store(true);
  std::lock_guard<std::mutex> lock(destroy_mu_);
  Status status;
  if (runtime_) {
    status.Update(runtime_->Stop());
  }
  if (cgroup_) {
    status.Update(cgroup_->Destroy());
  }
  // The overlay that used the frozen layer went with the sandbox's last process.
  set_frozen_layer(nullptr);
  // The runtime sandbox (root fd, init channel) goes once no command uses it: commands hold a
  // shared_ptr to this Sandbox, so members stay valid until the last one finishes.
  return status;
}

Result<std::unique_ptr<RunningCommand>> Sandbox::Start(const CommandSpec& spec) {
  if (spec.argv.empty() || spec.argv[0].empty()) {
    return absl::InvalidArgumentError("argv is empty: give a program to run");
  }
  if (destroying_.load()) {
    return absl::UnavailableError(fmt::format("sandbox {} is being destroyed", id_));
  }
  Touch();
  std::map<std::string, std::string> env = {
      {"PATH", kDefaultPath}, {"HOME", "/root"}, {"LANG", "C.UTF-8"}, {"PBOX_SANDBOX_ID", id_}};
  for (const auto& [k, v] : settings_.env) {
    env[k] = v;
  }
  for (const auto& [k, v] : spec.env) {
    env[k] = v;
  }
  SpawnRequest req;
  req.argv = spec.argv;
  for (const auto& [k, v] : env) {
    if (k.empty() || k.find('=') != std::string::npos || k.find('\0') != std::string::npos) {
      return absl::InvalidArgumentError(fmt::format("bad environment variable name \"{}\"", k));
    }
    req.env.push_back(k + "=" + v);
  }
  req.cwd = spec.cwd.empty() ? settings_.workdir : spec.cwd;
  if (req.cwd.empty() || req.cwd[0] != '/') {
    return absl::InvalidArgumentError(
        fmt::format("cwd \"{}\" must be an absolute path inside the sandbox", req.cwd));
  }

  std::unique_ptr<RunningCommand> cmd(new RunningCommand());
  BRAGG_ASSIGN_OR_RETURN(Pipe out, MakePipe());
  BRAGG_ASSIGN_OR_RETURN(Pipe err, MakePipe());
  Pipe in;
  if (spec.stdin) {
    BRAGG_ASSIGN_OR_RETURN(in, MakePipe());
    req.stdin_fd = in.read.get();
  }
  req.stdout_fd = out.write.get();
  req.stderr_fd = err.write.get();
  auto ooms = cgroup_->OomKills();
  cmd->oom_kills_before_ = ooms.ok() ? *ooms : 0;
  cmd->started_ = std::chrono::steady_clock::now();
  auto not_running = [&]() -> Status {
    if (ooms.ok() && *ooms > oom_kills_survived_.load()) {
      // gVisor: the kernel's OOM killer ended the sandbox's kernel (the sentry), and with it
      // every process; retrying cannot help, hence not Unavailable.
      return absl::FailedPreconditionError(fmt::format(
          "sandbox {} is dead: a command exceeded its memory limit and the OOM kill ended the "
          "whole sandbox ({} runtime); its files can still be read; destroy it and create a "
          "new one",
          id_, settings_.runtime));
    }
    return absl::UnavailableError(fmt::format("sandbox {} is not running", id_));
  };
  InitClient* init = runtime_->init();
  if (init == nullptr || !init->alive()) {
    return not_running();
  }
  auto handle = init->Spawn(req);
  if (absl::IsUnavailable(handle.status())) {
    // The channel to pbox-init closed under this call (Unavailable is only ever that): its
    // init has just exited, which the check above would have said a moment later.
    return not_running();
  }
  BRAGG_RETURN_IF_ERROR(handle.status());
  cmd->handle_ = std::move(*handle);
  cmd->sandbox_ = shared_from_this();
  cmd->stdout_ = std::move(out.read);
  cmd->stderr_ = std::move(err.read);
  cmd->stdin_ = std::move(in.write);
  cmd->timeout_ = spec.timeout;
  running_.fetch_add(1);
  return cmd;
}

RunningCommand::~RunningCommand() {
  if (handle_ && !handle_->done()) {
    (void)sandbox_->runtime_->init()->Kill(handle_->id(), SIGKILL, /*whole_tree=*/true);
  }
  if (sandbox_) {
    sandbox_->running_.fetch_sub(1);
    sandbox_->Touch();
  }
}

Status RunningCommand::WriteStdin(std::string_view data) {
  std::lock_guard<std::mutex> lock(stdin_mu_);
  if (!stdin_.valid()) {
    return absl::FailedPreconditionError("stdin is closed (or was not requested)");
  }
  // Not under the lock would let CloseStdin race the write; a full pipe blocks only this
  // command's own stdin writer.
  return WriteAll(stdin_.get(), data);
}

void RunningCommand::CloseStdin() {
  std::lock_guard<std::mutex> lock(stdin_mu_);
  stdin_.Reset();
}

Status RunningCommand::Signal(int signal) {
  if (signal <= 0 || signal >= NSIG) {
    return absl::InvalidArgumentError(fmt::format("bad signal number {}", signal));
  }
  if (signal == SIGKILL) {
    client_killed_.store(true);
  }
  return sandbox_->runtime_->init()->Kill(handle_->id(), signal, /*whole_tree=*/false);
}

CommandResult RunningCommand::Pump(OutputSink& sink, const std::function<bool()>& cancelled) {
  using Clock = std::chrono::steady_clock;
  CommandResult result;
  const bool has_deadline = timeout_.count() > 0;
  const Clock::time_point deadline = started_ + timeout_;
  std::optional<Clock::time_point> exited_at;
  bool killed = false;
  std::string buf(kReadChunk, '\0');

  auto kill_tree = [&] {
    if (!killed) {
      killed = true;
      (void)sandbox_->runtime_->init()->Kill(handle_->id(), SIGKILL, /*whole_tree=*/true);
    }
  };

  while (stdout_.valid() || stderr_.valid() || !exited_at.has_value()) {
    struct pollfd fds[3];
    int n = 0;
    int out_idx = -1, err_idx = -1, done_idx = -1;
    if (stdout_.valid()) {
      out_idx = n;
      fds[n++] = {stdout_.get(), POLLIN, 0};
    }
    if (stderr_.valid()) {
      err_idx = n;
      fds[n++] = {stderr_.get(), POLLIN, 0};
    }
    if (!exited_at.has_value()) {
      done_idx = n;
      fds[n++] = {handle_->done_fd(), POLLIN, 0};
    }
    if (cancelled && !killed && !exited_at.has_value() && cancelled()) {
      result.cancelled = true;
      kill_tree();
    }
    int wait_ms = -1;
    Clock::time_point now = Clock::now();
    if (exited_at.has_value()) {
      auto left = *exited_at + kDrainGrace - now;
      if (left <= Clock::duration::zero()) {
        break;  // a background process holds the pipes open; report the command anyway
      }
      wait_ms = static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(left).count());
    } else if (has_deadline && !killed) {
      if (now >= deadline) {
        result.timed_out = true;
        kill_tree();
        continue;
      }
      wait_ms =
          static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count());
    }
    if (cancelled && !killed) {
      wait_ms = wait_ms < 0 ? kCancelPollMs : std::min(wait_ms, kCancelPollMs);
    }
    int r = ::poll(fds, static_cast<nfds_t>(n), wait_ms);
    if (r < 0) {
      if (errno == EINTR) {
        continue;
      }
      spdlog::error("sandbox {}: poll: {}", sandbox_->id(), strerror(errno));
      kill_tree();
      break;
    }
    auto drain = [&](int idx, UniqueFd& fd, bool is_stdout) {
      if (idx < 0 || (fds[idx].revents & (POLLIN | POLLHUP | POLLERR)) == 0) {
        return;
      }
      ssize_t got = ::read(fd.get(), buf.data(), buf.size());
      if (got < 0 && (errno == EINTR || errno == EAGAIN)) {
        return;
      }
      if (got <= 0) {
        fd.Reset();
        return;
      }
      std::string_view data(buf.data(), static_cast<size_t>(got));
      if (is_stdout) {
        result.stdout_bytes += data.size();
      } else {
        result.stderr_bytes += data.size();
      }
      bool keep = is_stdout ? sink.OnStdout(data) : sink.OnStderr(data);
      if (!keep) {
        kill_tree();
        stdout_.Reset();
        stderr_.Reset();
      }
    };
    drain(out_idx, stdout_, true);
    drain(err_idx, stderr_, false);
    if (done_idx >= 0 && (fds[done_idx].revents & POLLIN) != 0) {
      exited_at = Clock::now();
    }
  }

  auto exit = handle_->Wait(std::chrono::milliseconds(5000));
  result.wall_ms = std::chrono::duration<double, std::milli>(Clock::now() - started_).count();
  if (!exit.ok()) {
    result.signal = SIGKILL;
    auto ooms = sandbox_->cgroup_->OomKills();
    if (!result.timed_out && ooms.ok() && *ooms > oom_kills_before_) {
      // The sandbox's PID 1 went with the command: on gVisor the OOM killer picks the sentry,
      // which holds all of the sandbox's memory. The command died of the OOM all the same,
      // and is reported as on the native runtime; the sandbox's next Start says it is dead.
      spdlog::warn("sandbox {}: OOM kill ended the sandbox (its init is gone)", sandbox_->id());
      result.oom_killed = true;
      return result;
    }
    result.error =
        fmt::format("lost track of the command: {}", std::string(exit.status().message()));
    return result;
  }
  result.exit_code = exit->signal == 0 ? exit->exit_code : -1;
  result.signal = exit->signal;
  result.cpu_ms = static_cast<double>(exit->user_us + exit->system_us) / 1000.0;
  result.peak_memory_bytes = static_cast<uint64_t>(exit->max_rss_kb) * 1024;
  result.error = exit->error;
  if (exit->spawn_errno != 0) {
    result.exit_code = 127;
    result.signal = 0;
  }
  // pbox-init reported this exit, so it outlived every OOM kill counted before the command
  // started, and (but for a kill in the instant since) those counted now.
  uint64_t survived = oom_kills_before_;
  if (exit->signal == SIGKILL && !result.timed_out && !result.cancelled && !client_killed_.load()) {
    auto ooms = sandbox_->cgroup_->OomKills();
    if (ooms.ok() && *ooms > oom_kills_before_) {
      result.oom_killed = true;
      survived = *ooms;
    }
  }
  uint64_t seen = sandbox_->oom_kills_survived_.load();
  while (seen < survived && !sandbox_->oom_kills_survived_.compare_exchange_weak(seen, survived)) {
  }
  return result;
}

}  // namespace bragg::pbox
