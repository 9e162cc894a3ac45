#include "pbox/client/cluster_client.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <thread>

#include "common/process.h"
#include "fmt/format.h"

namespace bragg::pbox::client {
namespace {

// Codes that say "this node is not answering" rather than "this request is wrong".
bool IsDown(const Status& s) {
  return s.code() == absl::StatusCode::kUnavailable ||
         s.code() == absl::StatusCode::kDeadlineExceeded;
}

// Runs fn(0..n-1) on up to 32 threads; returns when all are done.
void ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) {
    return;
  }
  if (n == 1) {
    fn(0);
    return;
  }
  std::atomic<size_t> next{0};
  std::vector<std::thread> workers;
  size_t threads = std::min<size_t>(n, 32);
  workers.reserve(threads);
  for (size_t t = 0; t < threads; ++t) {
    workers.emplace_back([&] {
      for (size_t i = next++; i < n; i = next++) {
        fn(i);
      }
    });
  }
  for (auto& w : workers) {
    w.join();
  }
}

// A node's error message without the single-agent hint (the endpoints come from a list or
// file here, not --endpoint).
std::string Reason(const Status& s) {
  std::string m(s.message());
  if (size_t at = m.find(kConnectHint); at != std::string::npos) {
    m.erase(at, kConnectHint.size());
  }
  return m;
}

// Prefixes the node's name, keeping the code.
Status OnNode(const std::string& node, const Status& s) {
  return s.ok() ? s : Status(s.code(), fmt::format("node {}: {}", node, Reason(s)));
}

}  // namespace

// ---- ClusterSandbox ----

Result<v1::RunResponse> ClusterSandbox::Run(RunArgs args) const {
  args.sandbox_id = id();
  return client_->Run(args);
}

Result<v1::ExecResult> ClusterSandbox::Exec(v1::ExecStart start, int stdin_fd,
                                            const OutputFn& on_output) const {
  start.set_sandbox_id(id());
  return client_->Exec(start, stdin_fd, on_output);
}

Result<v1::FileInfo> ClusterSandbox::WriteFile(const std::string& path, std::string_view data,
                                               uint32_t mode, bool make_parents) const {
  return client_->WriteFile(id(), path, data, mode, make_parents);
}

Result<std::string> ClusterSandbox::ReadFile(const std::string& path, uint64_t offset,
                                             uint64_t length) const {
  return client_->ReadFile(id(), path, offset, length);
}

Result<v1::FileInfo> ClusterSandbox::WriteFileFromFd(const std::string& path, int fd, uint32_t mode,
                                                     bool make_parents) const {
  return client_->WriteFileFromFd(id(), path, fd, mode, make_parents);
}

Result<uint64_t> ClusterSandbox::ReadFileToFd(const std::string& path, int fd) const {
  return client_->ReadFileToFd(id(), path, fd);
}

Result<v1::Sandbox> ClusterSandbox::Get() const { return client_->Get(id()); }

Status ClusterSandbox::Destroy() const { return client_->Destroy(id()); }

// ---- ClusterClient ----

Result<std::unique_ptr<ClusterClient>> ClusterClient::Connect(const ClusterOptions& options) {
  int given = int(!options.nodes.empty()) + int(!options.endpoints.empty()) +
              int(!options.endpoints_file.empty());
  if (given > 1) {
    return absl::InvalidArgumentError(
        "pass one of nodes, endpoints and endpoints_file, not several");
  }
  std::vector<Endpoint> eps;
  if (!options.nodes.empty()) {
    eps = options.nodes;
    for (auto& e : eps) {
      BRAGG_ASSIGN_OR_RETURN(e.endpoint, CanonicalEndpoint(e.endpoint));
      if (e.node.empty()) {
        e.node = e.endpoint;
      }
    }
  } else if (!options.endpoints_file.empty()) {
    BRAGG_ASSIGN_OR_RETURN(eps, LoadEndpointsFile(options.endpoints_file));
  } else {
    BRAGG_ASSIGN_OR_RETURN(eps, LoadEndpoints(options.endpoints));
  }
  std::unique_ptr<ClusterClient> c(new ClusterClient());
  c->health_timeout_ms_ = options.health_timeout_ms;
  c->session_open_timeout_ms_ = options.session_open_timeout_ms;
  c->refresh_ = std::chrono::milliseconds(options.refresh_ms);
  std::map<std::string, std::string> tokens;  // token file -> token: nodes usually share one
  for (auto& ep : eps) {
    if (std::find(c->names_.begin(), c->names_.end(), ep.node) != c->names_.end()) {
      return absl::InvalidArgumentError(fmt::format("duplicate node name \"{}\"", ep.node));
    }
    auto node = std::make_unique<Node>();
    std::string token = options.token;
    if (token.empty() && !ep.token_file.empty()) {
      auto it = tokens.find(ep.token_file);
      if (it == tokens.end()) {
        BRAGG_ASSIGN_OR_RETURN(std::string read, ReadTokenFile(ep.token_file));
        it = tokens.emplace(ep.token_file, std::move(read)).first;
      }
      token = it->second;
    }
    if (!ep.cpuset.empty()) {
      BRAGG_ASSIGN_OR_RETURN(node->weight, CountCpuList(ep.cpuset));
    }
    // The Python client strips a tcp endpoint's trailing '/' before dialing; gRPC would not.
    std::string dial = ep.endpoint;
    if (dial.rfind("tcp://", 0) == 0) {
      while (dial.back() == '/') {
        dial.pop_back();
      }
    }
    BRAGG_ASSIGN_OR_RETURN(
        node->client,
        Client::Connect(
            {.endpoint = dial, .token = token, .call_timeout_ms = options.call_timeout_ms}));
    node->ep = std::move(ep);
    c->names_.push_back(node->ep.node);
    c->nodes_.push_back(std::move(node));
  }
  return c;
}

ClusterClient::~ClusterClient() = default;

Result<size_t> ClusterClient::Index(const std::string& node) const {
  auto it = std::find(names_.begin(), names_.end(), node);
  if (it == names_.end()) {
    return absl::InvalidArgumentError(
        fmt::format("unknown node \"{}\"; nodes: {}", node, fmt::join(names_, ", ")));
  }
  return static_cast<size_t>(it - names_.begin());
}

Result<Endpoint> ClusterClient::endpoint(const std::string& node) const {
  BRAGG_ASSIGN_OR_RETURN(size_t i, Index(node));
  return nodes_[i]->ep;
}

Result<Client*> ClusterClient::client(const std::string& node) const {
  BRAGG_ASSIGN_OR_RETURN(size_t i, Index(node));
  return nodes_[i]->client.get();
}

std::vector<Result<v1::HealthResponse>> ClusterClient::Refresh(const std::vector<size_t>& which) {
  std::vector<Result<v1::HealthResponse>> res(which.size());
  ParallelFor(which.size(),
              [&](size_t k) { res[k] = nodes_[which[k]]->client->Health(health_timeout_ms_); });
  auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t k = 0; k < which.size(); ++k) {
    Node& n = *nodes_[which[k]];
    if (res[k].ok() && res[k]->serving()) {
      n.live = res[k]->live_sandboxes();
      n.added = 0;
      n.refreshed = now;
      n.down_until = {};
      n.down_reason.clear();
    } else {
      n.down_until = now + refresh_;
      n.down_reason = res[k].ok() ? "Health says it is not serving" : Reason(res[k].status());
    }
    if (!res[k].ok()) {
      res[k] = OnNode(names_[which[k]], res[k].status());
    }
  }
  return res;
}

std::map<std::string, Result<v1::HealthResponse>> ClusterClient::Health() {
  std::vector<size_t> all(nodes_.size());
  for (size_t i = 0; i < all.size(); ++i) {
    all[i] = i;
  }
  auto res = Refresh(all);
  std::map<std::string, Result<v1::HealthResponse>> out;
  for (size_t i = 0; i < all.size(); ++i) {
    out.emplace(names_[i], std::move(res[i]));
  }
  return out;
}

Status ClusterClient::WaitHealthy(std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  for (;;) {
    std::vector<std::string> bad;
    for (auto& [node, h] : Health()) {
      if (!h.ok()) {
        bad.push_back(std::string(h.status().message()));
      } else if (!h->serving()) {
        bad.push_back(fmt::format("node {}: not serving", node));
      }
    }
    if (bad.empty()) {
      return absl::OkStatus();
    }
    if (Clock::now() >= deadline) {
      return absl::UnavailableError(
          fmt::format("nodes not healthy after {} ms: {}", timeout.count(), fmt::join(bad, "; ")));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

std::vector<NodeLoad> ClusterClient::Loads() const {
  auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<NodeLoad> out;
  for (const auto& n : nodes_) {
    out.push_back({.node = n->ep.node,
                   .live = n->live,
                   .added = n->added,
                   .inflight = n->inflight,
                   .weight = n->weight,
                   .down = n->down_until > now,
                   .down_reason = n->down_until > now ? n->down_reason : ""});
  }
  return out;
}

Status ClusterClient::RefreshStale(const std::vector<size_t>& which) {
  auto now = Clock::now();
  std::vector<size_t> stale;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < nodes_.size(); ++i) {
      if (!which.empty() && std::find(which.begin(), which.end(), i) == which.end()) {
        continue;
      }
      const Node& n = *nodes_[i];
      bool never = n.refreshed == Clock::time_point{};
      if ((never || now - n.refreshed > refresh_) && n.down_until <= now) {
        stale.push_back(i);
      }
    }
  }
  if (stale.empty()) {
    return absl::OkStatus();
  }
  for (const auto& h : Refresh(stale)) {
    if (!h.ok() && !IsDown(h.status())) {
      return h.status();  // misconfigured (e.g. a wrong token): say so, do not skip
    }
  }
  return absl::OkStatus();
}

double ClusterClient::LoadLocked(size_t i) const {
  const Node& n = *nodes_[i];
  int64_t count = std::max<int64_t>(0, static_cast<int64_t>(n.live) + n.added) + n.inflight;
  return static_cast<double>(count) / static_cast<double>(n.weight);
}

ClusterSandbox ClusterClient::Handle(size_t i, v1::Sandbox info) const {
  return ClusterSandbox(names_[i], nodes_[i]->client.get(), std::move(info));
}

Result<ClusterSandbox> ClusterClient::Place(const CreateFn& create, const std::string& node,
                                            const std::function<bool(size_t)>& usable) {
  // Records the end of a create on node i that reserved a slot.
  auto finish = [this](size_t i, const Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    Node& n = *nodes_[i];
    n.inflight--;
    if (s.ok()) {
      n.added++;
    } else if (IsDown(s)) {
      n.down_until = Clock::now() + refresh_;
      n.down_reason = Reason(s);
    }
  };

  if (!node.empty()) {
    BRAGG_ASSIGN_OR_RETURN(size_t i, Index(node));
    BRAGG_RETURN_IF_ERROR(RefreshStale({i}));
    {
      std::lock_guard<std::mutex> lock(mu_);
      Node& n = *nodes_[i];
      if (n.down_until > Clock::now()) {
        return absl::UnavailableError(fmt::format("node {} is down: {}", node, n.down_reason));
      }
      n.inflight++;
    }
    auto sb = create(i);
    finish(i, sb.status());
    if (!sb.ok()) {
      return OnNode(node, sb.status());
    }
    return Handle(i, std::move(*sb));
  }

  BRAGG_RETURN_IF_ERROR(RefreshStale());
  std::vector<bool> tried(nodes_.size(), false);
  for (size_t i = 0; i < nodes_.size(); ++i) {
    tried[i] = !usable(i);
  }
  std::vector<std::string> errors;
  bool all_down = true;
  for (;;) {
    // Pick and reserve under one lock, so that concurrent creates spread.
    size_t pick = nodes_.size();
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto now = Clock::now();
      for (size_t i = 0; i < nodes_.size(); ++i) {
        if (tried[i] || nodes_[i]->down_until > now) {
          continue;
        }
        if (pick == nodes_.size() || LoadLocked(i) < LoadLocked(pick)) {
          pick = i;
        }
      }
      if (pick == nodes_.size()) {
        break;
      }
      tried[pick] = true;
      nodes_[pick]->inflight++;
    }
    auto sb = create(pick);
    finish(pick, sb.status());
    if (sb.ok()) {
      return Handle(pick, std::move(*sb));
    }
    const Status& s = sb.status();
    bool passable = IsDown(s) || s.code() == absl::StatusCode::kResourceExhausted ||
                    s.code() == absl::StatusCode::kFailedPrecondition;
    if (!passable) {
      return OnNode(names_[pick], s);
    }
    all_down = all_down && IsDown(s);
    errors.push_back(fmt::format("{}: {}", names_[pick], Reason(s)));
  }
  // Name the nodes passed over as down too, so the caller sees the whole picture.
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < nodes_.size(); ++i) {
      if (!tried[i] && nodes_[i]->down_until > Clock::now()) {
        errors.push_back(fmt::format("{}: {}", names_[i], nodes_[i]->down_reason));
      }
    }
  }
  if (errors.empty()) {
    return absl::UnavailableError("no node of the cluster can take sandboxes");
  }
  if (all_down) {
    return absl::UnavailableError(
        fmt::format("no node of the cluster answers: {} (are the job's agents running, and is the "
                    "endpoints file current?)",
                    fmt::join(errors, "; ")));
  }
  return absl::ResourceExhaustedError(
      fmt::format("no node could take the sandbox: {}", fmt::join(errors, "; ")));
}

Result<ClusterSandbox> ClusterClient::Create(const v1::SandboxSpec& spec, const std::string& node) {
  return Place([&](size_t i) { return nodes_[i]->client->Create(spec); }, node,
               [](size_t) { return true; });
}

Result<ClusterSandbox> ClusterClient::Find(const std::string& sandbox_id) {
  std::vector<Result<v1::Sandbox>> res(nodes_.size());
  ParallelFor(nodes_.size(), [&](size_t i) { res[i] = nodes_[i]->client->Get(sandbox_id); });
  std::vector<std::string> errors;
  for (size_t i = 0; i < res.size(); ++i) {
    if (res[i].ok()) {
      return Handle(i, std::move(*res[i]));
    }
    if (res[i].status().code() != absl::StatusCode::kNotFound) {
      errors.push_back(fmt::format("{}: {}", names_[i], Reason(res[i].status())));
    }
  }
  if (!errors.empty()) {
    return absl::UnavailableError(fmt::format("sandbox {} is on no node that answered; {}",
                                              sandbox_id, fmt::join(errors, "; ")));
  }
  return absl::NotFoundError(fmt::format("sandbox {} is on no node of the cluster ({})", sandbox_id,
                                         fmt::join(names_, ", ")));
}

Result<std::map<std::string, std::vector<v1::Sandbox>>> ClusterClient::List(
    const std::string& session_id) {
  std::vector<Result<std::vector<v1::Sandbox>>> res(nodes_.size());
  ParallelFor(nodes_.size(), [&](size_t i) { res[i] = nodes_[i]->client->List(session_id); });
  std::map<std::string, std::vector<v1::Sandbox>> out;
  for (size_t i = 0; i < res.size(); ++i) {
    if (!res[i].ok()) {
      return OnNode(names_[i], res[i].status());
    }
    out.emplace(names_[i], std::move(*res[i]));
  }
  return out;
}

Result<std::unique_ptr<ClusterSession>> ClusterClient::OpenSession(const std::string& client_name,
                                                                   const std::string& job_id) {
  std::string job = job_id.empty() ? bragg::GetEnv("SLURM_JOB_ID") : job_id;
  std::string name = client_name.empty() ? fmt::format("cpp:{}", ::getpid()) : client_name;
  std::vector<Result<std::unique_ptr<Session>>> res(nodes_.size());
  ParallelFor(nodes_.size(), [&](size_t i) {
    res[i] = nodes_[i]->client->OpenSession(name, job, session_open_timeout_ms_);
  });
  std::unique_ptr<ClusterSession> s(new ClusterSession(this));
  Status first;
  for (size_t i = 0; i < res.size(); ++i) {
    if (res[i].ok()) {
      s->ids_.emplace(names_[i], (*res[i])->id());
      s->sessions_.push_back(std::move(*res[i]));
    } else {
      s->sessions_.push_back(nullptr);
      if (first.ok()) {
        first = OnNode(names_[i], res[i].status());
      }
    }
  }
  s->lost_.assign(nodes_.size(), false);
  if (!first.ok()) {
    (void)s->Close();  // all or nothing
    return first;
  }
  return s;
}

// ---- ClusterSession ----

ClusterSession::~ClusterSession() { (void)Close(); }

Result<ClusterSandbox> ClusterSession::Create(const v1::SandboxSpec& spec,
                                              const std::string& node) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      return absl::FailedPreconditionError("the cluster session is closed");
    }
  }
  auto create = [&](size_t i) -> Result<v1::Sandbox> {
    auto sb = cluster_->nodes_[i]->client->Create(spec, sessions_[i]->id());
    if (!sb.ok() && sb.status().code() == absl::StatusCode::kFailedPrecondition) {
      std::lock_guard<std::mutex> lock(mu_);
      lost_[i] = true;
    }
    return sb;
  };
  auto usable = [&](size_t i) {
    std::lock_guard<std::mutex> lock(mu_);
    return !lost_[i];
  };
  return cluster_->Place(create, node, usable);
}

Result<std::map<std::string, std::vector<v1::Sandbox>>> ClusterSession::List() {
  std::map<std::string, std::vector<v1::Sandbox>> out;
  std::vector<Result<std::vector<v1::Sandbox>>> res(sessions_.size());
  ParallelFor(sessions_.size(),
              [&](size_t i) { res[i] = cluster_->nodes_[i]->client->List(sessions_[i]->id()); });
  for (size_t i = 0; i < res.size(); ++i) {
    if (!res[i].ok()) {
      return OnNode(cluster_->names_[i], res[i].status());
    }
    out.emplace(cluster_->names_[i], std::move(*res[i]));
  }
  return out;
}

Status ClusterSession::Close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      return absl::OkStatus();
    }
    closed_ = true;
  }
  std::vector<Status> res(sessions_.size());
  ParallelFor(sessions_.size(), [&](size_t i) {
    if (sessions_[i] != nullptr) {
      res[i] = sessions_[i]->Close();
    }
  });
  std::vector<std::string> errors;
  for (size_t i = 0; i < res.size(); ++i) {
    if (!res[i].ok()) {
      errors.push_back(fmt::format("{}: {}", cluster_->names_[i], Reason(res[i])));
    }
  }
  if (errors.empty()) {
    return absl::OkStatus();
  }
  return absl::UnavailableError(
      fmt::format("closing the cluster session: {}", fmt::join(errors, "; ")));
}

}  // namespace bragg::pbox::client
