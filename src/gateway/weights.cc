#include "gateway/weights.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <future>
#include <map>

namespace bragg::gateway {

using nlohmann::json;

json WeightUpdateReport::ToJson() const {
  json workers_json = json::array();
  for (const WorkerUpdate& w : workers) {
    workers_json.push_back({{"url", w.url},
                            {"previous_version", w.previous_version},
                            {"paused", w.paused},
                            {"loaded", w.loaded},
                            {"rolled_back", w.rolled_back},
                            {"continued", w.continued},
                            {"removed", w.removed},
                            {"version_after", w.version_after},
                            {"error", w.error}});
  }
  return {{"success", success}, {"weight_version", weight_version}, {"workers", workers_json}};
}

std::optional<ModelInfo> GetModelInfo(httplib::Client& c) {
  auto r = c.Get("/get_model_info");
  if (!r || r->status != 200) {
    return std::nullopt;
  }
  json j = json::parse(r->body, nullptr, false);
  if (!j.is_object()) {
    return std::nullopt;
  }
  ModelInfo info;
  if (j.contains("model_path") && j["model_path"].is_string()) {
    info.model_path = j["model_path"].get<std::string>();
  }
  if (j.contains("weight_version") && j["weight_version"].is_string()) {
    info.weight_version = j["weight_version"].get<std::string>();
  }
  // SGLang's /get_model_info does not say; the simulator does.
  info.paused = j.contains("paused") && j["paused"].is_boolean() && j["paused"].get<bool>();
  return info;
}

WeightUpdater::WeightUpdater(Fleet* fleet) : fleet_(fleet) {}

std::unique_lock<std::mutex> WeightUpdater::TryLockUpdates() {
  return std::unique_lock<std::mutex>(update_mu_, std::try_to_lock);
}

void WeightUpdater::SetSaltVersion(const std::string& version) {
  salt_version_ = version;
  for (Pool* pool : fleet_->pools()) {
    pool->router().SetFleetVersion(version);
  }
}

WeightUpdater::Upstream WeightUpdater::Post(Pool& pool, int worker, const std::string& path,
                                            const std::string& body) {
  ClientPool* cp = pool.Client(worker);
  Upstream up;
  // A pooled keep-alive connection may have been closed by the worker; a fresh one decides.
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto client = cp->Acquire();
    auto result = client->Post(path, body, "application/json");
    if (result) {
      up.error = httplib::Error::Success;
      up.status = result->status;
      up.body = std::move(result->body);
      cp->Release(std::move(client));
      return up;
    }
    up.error = result.error();
    if (up.error != httplib::Error::Connection || attempt == 1) {
      return up;
    }
  }
  return up;
}

void WeightUpdater::ReadFleetVersion() {
  std::vector<Target> targets = fleet_->HealthyTargets();
  std::vector<std::optional<ModelInfo>> infos(targets.size());
  std::vector<std::future<void>> fs;
  for (size_t i = 0; i < targets.size(); ++i) {
    fs.push_back(std::async(std::launch::async, [&, i] {
      auto c = targets[i].pool->Client(targets[i].worker)->NewClient();
      c->set_connection_timeout(1, 0);
      c->set_read_timeout(5, 0);
      infos[i] = GetModelInfo(*c);
    }));
  }
  for (auto& f : fs) {
    f.get();
  }
  // The fleet's version is the one most workers report; a worker that does not answer yet is
  // left to the health loop.
  std::map<std::string, int> votes;
  for (const auto& info : infos) {
    if (info) {
      votes[info->weight_version]++;
    }
  }
  if (votes.empty()) {
    return;
  }
  std::string fleet =
      std::max_element(votes.begin(), votes.end(), [](const auto& a, const auto& b) {
        return a.second < b.second;
      })->first;
  fleet_->set_version(fleet);
  for (size_t i = 0; i < targets.size(); ++i) {
    if (!infos[i]) {
      continue;
    }
    Pool& pool = *targets[i].pool;
    pool.SetVersion(targets[i].worker, infos[i]->weight_version);
    if (infos[i]->weight_version != fleet) {
      pool.Quarantine(
          targets[i].worker,
          fmt::format("has weights {} while the fleet has {}", infos[i]->weight_version, fleet),
          false);
    }
  }
}

bool WeightUpdater::Admit(Pool& pool, int worker, httplib::Client& c) {
  std::string url = pool.url(worker);
  if (pool.needs_continue(worker)) {
    auto r = c.Post("/continue_generation", "{}", "application/json");
    if (!r || r->status != 200) {
      spdlog::warn("worker {} may still be paused and continue_generation failed ({}); kept out",
                   url, r ? fmt::format("status {}", r->status) : httplib::to_string(r.error()));
      return false;
    }
    pool.SetNeedsContinue(worker, false);
  }
  std::optional<ModelInfo> info = GetModelInfo(c);
  if (!info) {
    spdlog::warn("worker {} answers /health but not /get_model_info; kept out", url);
    return false;
  }
  if (info->paused) {
    // Paused by someone else or by an update whose continue was lost: continue it next round.
    pool.SetNeedsContinue(worker, true);
    spdlog::warn("worker {} is paused; kept out", url);
    return false;
  }
  std::string fleet = fleet_->VersionOr(info->weight_version);
  if (info->weight_version != fleet && !ExternalVersion(pool, worker, info->weight_version)) {
    spdlog::warn("worker {} answers but has weights {} instead of {}; kept out", url,
                 info->weight_version, fleet);
    return false;
  }
  pool.Admitted(worker, info->weight_version);
  return true;
}

bool WeightUpdater::ExternalVersion(Pool& pool, int worker, const std::string& version) {
  if (pool.quarantined(worker)) {
    // The gateway's own update left it apart: only the fleet's version brings it back.
    return false;
  }
  std::vector<Target> serving = Serving();
  if (serving.empty()) {
    // Nobody serves to compare with (every worker restarted, say on new weights): as at
    // startup, the version it reports becomes the fleet's.
    FollowVersion(version);
    return true;
  }
  for (const Target& t : serving) {
    if (t.pool->version(t.worker) == version) {
      return true;  // an outside update is under way: a worker in rotation has it too
    }
  }
  return false;
}

std::vector<Target> WeightUpdater::Serving() {
  std::vector<Target> out;
  for (Target& t : fleet_->HealthyTargets()) {
    if (!t.pool->quarantined(t.worker)) {
      out.push_back(std::move(t));
    }
  }
  return out;
}

void WeightUpdater::FollowVersion(const std::string& version) {
  std::string old = fleet_->version();
  if (version == old) {
    return;
  }
  spdlog::info("weights changed outside the gateway: the fleet's version is now {} (was {})",
               version, old.empty() ? "unknown" : old);
  fleet_->set_version(version);
  SetSaltVersion(version);
  updates_external_++;
}

void WeightUpdater::FollowWorkers() {
  std::string agreed;
  for (const Target& t : Serving()) {
    std::string v = t.pool->version(t.worker);
    if (v.empty()) {
      continue;  // not read yet
    }
    if (!agreed.empty() && v != agreed) {
      return;  // an outside update is under way, or the fleet is split: wait
    }
    agreed = v;
  }
  if (!agreed.empty()) {
    FollowVersion(agreed);
  }
}

WeightUpdateReport WeightUpdater::Update(const std::string& model_path,
                                         const std::string& version) {
  std::lock_guard<std::mutex> update_lock(update_mu_);
  WeightUpdateReport report;
  report.weight_version = version;
  std::string old_fleet = fleet_->version();
  std::vector<Target> targets = fleet_->HealthyTargets();
  std::vector<std::string> previous_paths(targets.size());
  // The load's answer was lost (transport error): the worker may hold either version.
  std::vector<bool> load_unknown(targets.size(), false);
  report.workers.resize(targets.size());
  bool ok = !targets.empty();
  if (targets.empty()) {
    spdlog::warn("weight update to {} with no healthy worker", version);
  }
  // Each phase runs on all workers at once: the pause is as short as the slowest worker.
  auto each = [&](auto fn) {
    std::vector<std::future<void>> fs;
    for (size_t i = 0; i < targets.size(); ++i) {
      fs.push_back(std::async(std::launch::async, [&, i] { fn(i); }));
    }
    for (auto& f : fs) {
      f.get();
    }
  };
  auto control_client = [&](size_t i) {
    auto c = targets[i].pool->Client(targets[i].worker)->NewClient();
    c->set_connection_timeout(2, 0);
    c->set_read_timeout(10, 0);
    return c;
  };
  each([&](size_t i) {
    WorkerUpdate& w = report.workers[i];
    w.url = targets[i].url;
    std::optional<ModelInfo> info = GetModelInfo(*control_client(i));
    if (!info) {
      w.error = "cannot read current weights from /get_model_info";
      return;
    }
    previous_paths[i] = info->model_path;
    w.previous_version = info->weight_version;
  });
  for (const WorkerUpdate& w : report.workers) {
    ok = ok && w.error.empty();
  }
  if (ok) {
    each([&](size_t i) {
      Upstream up = Post(*targets[i].pool, targets[i].worker, "/pause_generation",
                         json{{"mode", "in_place"}}.dump());
      report.workers[i].paused = up.error == httplib::Error::Success && up.status == 200;
      if (!report.workers[i].paused) {
        report.workers[i].error =
            fmt::format("pause_generation failed: {} {}", httplib::to_string(up.error), up.status);
      }
    });
    for (const WorkerUpdate& w : report.workers) {
      ok = ok && w.paused;
    }
  }
  std::string previous_salt = salt_version_;
  if (ok) {
    // Every worker is paused: nothing computes until continue_generation, after the load. A
    // rollout that starts from now on waits for the new weights, so it must not reuse KV the
    // old ones computed: salt it with the new version before the load, not after the continue.
    // (Switching before the pause would let a rollout starting in between compute KV on the old
    // weights under the new salt.)
    SetSaltVersion(version);
  }
  if (ok) {
    each([&](size_t i) {
      Upstream up =
          Post(*targets[i].pool, targets[i].worker, "/update_weights_from_disk",
               json{{"model_path", model_path}, {"weight_version", version}, {"flush_cache", false}}
                   .dump());
      json j = json::parse(up.body, nullptr, false);
      report.workers[i].loaded = up.error == httplib::Error::Success && up.status == 200 &&
                                 j.is_object() && j.value("success", false);
      load_unknown[i] = up.error != httplib::Error::Success;
      if (!report.workers[i].loaded) {
        report.workers[i].error =
            fmt::format("update_weights_from_disk failed: {} {} {}", httplib::to_string(up.error),
                        up.status, j.is_object() ? j.value("message", "") : up.body);
      }
    });
    for (const WorkerUpdate& w : report.workers) {
      ok = ok && w.loaded;
    }
    if (!ok) {
      // Fail safe: the fleet stays on one version, the old one. A worker whose answer was lost
      // may have loaded: it goes back too (loading the weights it has is harmless).
      each([&](size_t i) {
        WorkerUpdate& w = report.workers[i];
        if (!w.loaded && !load_unknown[i]) {
          return;
        }
        Upstream up = Post(*targets[i].pool, targets[i].worker, "/update_weights_from_disk",
                           json{{"model_path", previous_paths[i]},
                                {"weight_version", w.previous_version},
                                {"flush_cache", false}}
                               .dump());
        json j = json::parse(up.body, nullptr, false);
        w.rolled_back = up.error == httplib::Error::Success && up.status == 200 && j.is_object() &&
                        j.value("success", false);
        if (!w.rolled_back) {
          w.removed = true;
          w.error += (w.error.empty() ? "" : "; ") + std::string("could not roll back");
          targets[i].pool->Quarantine(targets[i].worker, "could not roll back to old weights",
                                      false);
        }
      });
    }
  }
  // The version the workers in rotation must have from now on.
  bool moved = ok;
  std::string fleet = moved ? version : old_fleet;
  bool continued_all = true;
  each([&](size_t i) {
    WorkerUpdate& w = report.workers[i];
    if (!w.paused) {
      return;
    }
    Upstream up = Post(*targets[i].pool, targets[i].worker, "/continue_generation", "{}");
    w.continued = up.error == httplib::Error::Success && up.status == 200;
    if (!w.continued) {
      w.removed = true;
      w.error +=
          (w.error.empty() ? "" : "; ") +
          fmt::format("continue_generation failed: {} {}", httplib::to_string(up.error), up.status);
      // It may still be paused: the health loop continues it before it serves again.
      targets[i].pool->Quarantine(targets[i].worker, "continue_generation failed", true);
    }
  });
  for (const WorkerUpdate& w : report.workers) {
    continued_all = continued_all && (w.continued || !w.paused);
  }
  report.success = ok && continued_all;
  if (!report.success) {
    // Whatever each call answered, ask every worker which weights it holds now; a worker not on
    // the fleet's version (or that does not say) leaves rotation until it is.
    each([&](size_t i) {
      WorkerUpdate& w = report.workers[i];
      std::optional<ModelInfo> info = GetModelInfo(*control_client(i));
      std::string expected = fleet.empty() ? w.previous_version : fleet;
      w.version_after = info ? info->weight_version : "";
      if (!info || info->weight_version != expected) {
        if (!w.removed) {
          w.removed = true;
          w.error +=
              (w.error.empty() ? "" : "; ") +
              (info ? fmt::format("holds weights {} instead of {}", info->weight_version, expected)
                    : std::string("cannot read its weights from /get_model_info"));
        }
        targets[i].pool->Quarantine(
            targets[i].worker,
            fmt::format("not on the fleet's weights {} after a failed update", expected), false);
      }
    });
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    const WorkerUpdate& w = report.workers[i];
    targets[i].pool->SetVersion(
        targets[i].worker,
        report.success ? version : (w.version_after.empty() ? "" : w.version_after));
  }
  if (!moved && salt_version_ != previous_salt) {
    // The fleet stays on the old weights: new rollouts go back to the old salt. The few that
    // started during the failed load keep the new salt on old weights; a later update should
    // use a new version name, so that none of its rollouts meets their KV.
    SetSaltVersion(previous_salt);
  }
  fleet_->set_version(fleet);
  if (report.success) {
    updates_ok_++;
  } else {
    updates_failed_++;
  }
  return report;
}

}  // namespace bragg::gateway
