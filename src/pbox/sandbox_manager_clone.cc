// SandboxManager::Clone: N sandboxes over a frozen copy of one sandbox's writable layer.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "fmt/format.h"
#include "pbox/sandbox_manager.h"
#include "spdlog/spdlog.h"

namespace bragg::pbox {
namespace {

// The source's settings with the request's set fields over them (FillUnset), env and labels
// merged key by key.
Result<SandboxSettings> MergeOverrides(const SandboxSettings& source, const SandboxSettings& o) {
  if (!o.image.empty() && o.image != source.image) {
    return absl::InvalidArgumentError(fmt::format(
        "a clone has its source's image \"{}\"; it cannot be \"{}\"", source.image, o.image));
  }
  if (!o.runtime.empty() && o.runtime != source.runtime) {
    return absl::InvalidArgumentError(fmt::format(
        "a clone has its source's runtime \"{}\"; it cannot be \"{}\"", source.runtime, o.runtime));
  }
  SandboxSettings s = FillUnset(o, source);
  s.env = source.env;
  s.labels = source.labels;
  for (const auto& [k, v] : o.env) {
    s.env[k] = v;
  }
  for (const auto& [k, v] : o.labels) {
    s.labels[k] = v;
  }
  return s;
}

// Clones started at once: one per CPU of the agent (at most 8). More than the CPUs only
// queue on the kernel's namespace and mount locks (measured in docs/benchmarks.md).
size_t CloneWorkers() { return std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 8); }

// Longest wait for the source's runtime to flush its writes before the copy.
constexpr auto kCloneFlushTimeout = std::chrono::seconds(10);

}  // namespace

Result<std::vector<std::shared_ptr<Sandbox>>> SandboxManager::Clone(
    const std::string& session_id, const std::string& source_id, uint32_t count,
    const SandboxSettings& overrides, const CallerGone& caller_gone) {
  auto t0 = std::chrono::steady_clock::now();
  if (count == 0) {
    return absl::InvalidArgumentError("clone count must be at least 1");
  }
  if (layers_dir_.empty()) {
    return absl::FailedPreconditionError("this agent has no directory for frozen layers");
  }
  BRAGG_ASSIGN_OR_RETURN(std::shared_ptr<Sandbox> source, Get(source_id));
  if (source->destroying()) {
    return absl::FailedPreconditionError(fmt::format("sandbox {} is being destroyed", source_id));
  }
  // Clones share their source's lease: another session's sandbox is not the caller's to copy.
  std::string target_session = session_id.empty() ? source->session_id() : session_id;
  if (!source->session_id().empty() && source->session_id() != target_session) {
    return absl::PermissionDeniedError(fmt::format(
        "sandbox {} belongs to another session; clone it from that session", source_id));
  }
  source->Touch();
  BRAGG_ASSIGN_OR_RETURN(SandboxSettings settings, MergeOverrides(source->settings(), overrides));
  BRAGG_RETURN_IF_ERROR(Validate(settings));

  // Admission for all of them at once, before any work.
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      return absl::UnavailableError("the agent is shutting down");
    }
    if (!target_session.empty() && sessions_.count(target_session) == 0) {
      return absl::FailedPreconditionError(fmt::format(
          "session {} is not open (it ended, or belongs to another agent)", target_session));
    }
    size_t used = sandboxes_.size() + creating_;
    if (used + count > max_sandboxes_) {
      if (hooks_.on_reject) {
        hooks_.on_reject();
      }
      return absl::ResourceExhaustedError(fmt::format(
          "{} clones do not fit: the agent is at {} of its {} sandboxes; no clone was made", count,
          used, max_sandboxes_));
    }
    creating_ += count;
  }
  absl::Cleanup creating_done = [this, count] { EndCreating(count); };

  // The snapshot: the source stops (cgroup freezer) so that no process writes while its
  // layer is copied, and resumes right after. File calls of the agent itself on the source
  // (WriteFile ...) are not stopped by the freezer and may or may not be in the copy.
  BRAGG_ASSIGN_OR_RETURN(UniqueFd upper, source->OpenWritableLayer());
  // Where the runtime keeps written data of its own (gVisor's sentry), it goes to the layer
  // first. Best effort: a sandbox that cannot run one more process (at its limits) is still
  // cloned, from what reached its layer.
  auto t_flush = std::chrono::steady_clock::now();
  if (Status flushed = source->FlushWrites(kCloneFlushTimeout); !flushed.ok()) {
    spdlog::warn("clone of {}: {}; copying what reached its layer", source_id,
                 std::string(flushed.message()));
  }
  auto t_freeze = std::chrono::steady_clock::now();
  Status frozen = source->Freeze();
  auto t_frozen = std::chrono::steady_clock::now();
  if (!frozen.ok()) {
    spdlog::warn("clone of {}: cannot freeze it ({}); copying it while it runs", source_id,
                 std::string(frozen.message()));
  }
  auto layer = FrozenLayer::Create(layers_dir_, NewId("fl-"), upper.get(), source->frozen_layer());
  auto t_copied = std::chrono::steady_clock::now();
  if (frozen.ok()) {
    if (Status thawed = source->Thaw(); !thawed.ok() && !source->destroying()) {
      spdlog::error("clone of {}: cannot thaw it: {}", source_id, std::string(thawed.message()));
    }
  }
  upper.Reset();
  if (!layer.ok()) {
    return Annotate(layer.status(), fmt::format("cloning sandbox {}", source_id));
  }
  auto t_copy = std::chrono::steady_clock::now();

  CreateOptions options;
  options.frozen = *layer;
  options.admitted = true;
  options.publish = false;
  std::vector<std::shared_ptr<Sandbox>> clones(count);
  std::vector<Status> errors(count);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
      auto sb = CreateImpl(target_session, settings, options);
      if (sb.ok()) {
        clones[i] = std::move(*sb);
      } else {
        errors[i] = sb.status();
        next.store(count);  // one failed: the rest are moot
      }
    }
  };
  size_t workers = std::min<size_t>(count, CloneWorkers());
  std::vector<std::thread> threads;
  for (size_t w = 1; w < workers; ++w) {
    threads.emplace_back(work);
  }
  work();
  for (auto& t : threads) {
    t.join();
  }
  options.frozen.reset();
  layer->reset();

  Status failed;
  for (const Status& e : errors) {
    if (!e.ok()) {
      failed = e;
      break;
    }
  }
  std::vector<std::shared_ptr<Sandbox>> made;
  for (auto& sb : clones) {
    if (sb != nullptr) {
      made.push_back(sb);
    }
  }
  if (failed.ok() && made.size() != count) {
    failed = absl::InternalError("clone ended without a sandbox");
  }
  if (failed.ok() && caller_gone && caller_gone()) {
    failed = absl::CancelledError("the caller went away while the clones were being created");
  }
  if (failed.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || (!target_session.empty() && sessions_.count(target_session) == 0)) {
      failed = absl::FailedPreconditionError(
          fmt::format("session {} ended while the clones were being created", target_session));
    } else {
      for (const auto& sb : made) {
        sandboxes_[sb->id()] = sb;
        if (!target_session.empty()) {
          sessions_[target_session].insert(sb->id());
        }
      }
    }
  }
  if (!failed.ok()) {
    spdlog::warn("clone of {}: {}; destroying the {} clones made", source_id,
                 std::string(failed.message()), made.size());
    DestroyMany(std::move(made));
    return Annotate(failed,
                    fmt::format("cloning sandbox {} ({} clones, none kept)", source_id, count));
  }
  auto t_end = std::chrono::steady_clock::now();
  auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  spdlog::info(
      "sandbox {} cloned {} times in {:.1f} ms (flush {:.1f} ms, freeze {:.1f} ms, layer copy "
      "{:.1f} ms, thaw {:.1f} ms, starting the clones {:.1f} ms)",
      source_id, count, ms(t0, t_end), ms(t_flush, t_freeze), ms(t_freeze, t_frozen),
      ms(t_frozen, t_copied), ms(t_copied, t_copy), ms(t_copy, t_end));
  return made;
}

}  // namespace bragg::pbox
