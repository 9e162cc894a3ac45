#pragma once

// C++ client of several pbox agents (one per node of a job) behind one object: places each new
// sandbox on the least-loaded node or a named one, and opens one session spanning every node.
// The Python counterpart is pbox.ClusterClient (python/pbox/cluster.py); both read the same
// endpoints file and $PBOX_ENDPOINTS (see endpoints.h) and place sandboxes by the same rule.
//
//   auto cluster = ClusterClient::Connect({});            // $PBOX_ENDPOINTS: a file or a list
//   auto session = (*cluster)->OpenSession("rollouts");   // one lease on every node
//   auto sb = (*session)->Create(spec);                   // least-loaded node
//   auto near = (*session)->Create(spec, "gpu-node-3");   // beside one rollout worker
//   auto r = sb->Run({.argv = {"nproc"}});                // goes to sb->node()'s agent
//
// Placement: a named node, else the node with the fewest sandboxes per sandbox CPU (its
// "cpuset" in the endpoints file; 1 CPU when not given), counting the agents' Health reports
// (trusted for `refresh_ms`) plus this client's own creations since; ties go to the earlier
// node. A node that does not answer (UNAVAILABLE, DEADLINE_EXCEEDED) is skipped for `refresh_ms`,
// one that is full (RESOURCE_EXHAUSTED) is passed over for the next; any other error (e.g.
// UNAUTHENTICATED: a wrong token) is returned. A named node is never substituted.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pbox/client/client.h"
#include "pbox/client/endpoints.h"

namespace bragg::pbox::client {

struct ClusterOptions {
  // The agents; set at most one of the three. `nodes`: as parsed (e.g. by LoadEndpoints); a
  // node without a name is named by its endpoint.
  // `endpoints`: a comma-separated list of endpoints, or the path of an endpoints file (the
  // forms of $PBOX_ENDPOINTS). `endpoints_file`: the launcher's endpoints file. None:
  // $PBOX_ENDPOINTS.
  std::vector<Endpoint> nodes;
  std::string endpoints;
  std::string endpoints_file;
  // Bearer token for every node. Empty: each node's token_file from the endpoints file, else
  // $PBOX_TOKEN, else the contents of $PBOX_TOKEN_FILE (as Client).
  std::string token;
  // Deadline of unary calls other than Run/Create (ms), as ClientOptions. 0: none.
  uint32_t call_timeout_ms = 60000;
  // Deadline of the Health calls placement makes (ms): a node that does not answer in time is
  // skipped as down.
  uint32_t health_timeout_ms = 5000;
  // How long OpenSession waits for each agent to open its part (ms).
  uint32_t session_open_timeout_ms = 30000;
  // How long a node's Health (its live sandbox count), or its being down, is trusted (ms).
  uint32_t refresh_ms = 1000;
};

// A sandbox on one node: its description, its node and that node's Client. A non-owning
// handle (copyable): destroying it leaves the sandbox; Destroy() or its session's end removes
// it. Valid while the ClusterClient that made it lives. Thread-safe as Client.
class ClusterSandbox {
 public:
  const std::string& node() const { return node_; }
  const std::string& id() const { return info_.id(); }
  // The agent's description when it was created (or found).
  const v1::Sandbox& info() const { return info_; }
  // The node's client, for any call not forwarded below (owned by the ClusterClient).
  Client& client() const { return *client_; }

  // As the Client calls of the same name, with this sandbox's id filled in and sent to its
  // node's agent.
  Result<v1::RunResponse> Run(RunArgs args) const;
  Result<v1::ExecResult> Exec(v1::ExecStart start, int stdin_fd, const OutputFn& on_output) const;
  Result<v1::FileInfo> WriteFile(const std::string& path, std::string_view data,
                                 uint32_t mode = 0644, bool make_parents = true) const;
  Result<std::string> ReadFile(const std::string& path, uint64_t offset = 0,
                               uint64_t length = 0) const;
  Result<v1::FileInfo> WriteFileFromFd(const std::string& path, int fd, uint32_t mode = 0644,
                                       bool make_parents = true) const;
  Result<uint64_t> ReadFileToFd(const std::string& path, int fd) const;
  Result<v1::Sandbox> Get() const;
  Status Destroy() const;

 private:
  friend class ClusterClient;
  ClusterSandbox(std::string node, Client* client, v1::Sandbox info)
      : node_(std::move(node)), client_(client), info_(std::move(info)) {}
  std::string node_;
  Client* client_;
  v1::Sandbox info_;
};

// One node's placement state, as Loads() reports it.
struct NodeLoad {
  std::string node;
  uint32_t live = 0;     // live sandboxes at its last Health
  int64_t added = 0;     // created through this client since
  int64_t inflight = 0;  // creates under way through this client
  size_t weight = 1;     // sandbox CPUs
  bool down = false;     // skipped for placement until its next refresh
  std::string down_reason;
};

class ClusterSession;

// Thread-safe. Owns one Client per node.
class ClusterClient {
 public:
  // Resolves the endpoints and reads the token files; does not contact the agents.
  // InvalidArgument for conflicting options, a bad endpoint list, endpoints file or token file.
  static Result<std::unique_ptr<ClusterClient>> Connect(const ClusterOptions& options);
  ~ClusterClient();
  ClusterClient(const ClusterClient&) = delete;
  ClusterClient& operator=(const ClusterClient&) = delete;

  // Node names, in endpoint order.
  const std::vector<std::string>& nodes() const { return names_; }
  // InvalidArgument for an unknown node (the message lists the known ones).
  Result<Endpoint> endpoint(const std::string& node) const;
  // The node's client (owned by this object). InvalidArgument for an unknown node.
  Result<Client*> client(const std::string& node) const;

  // Each node's Health, or the error asking it returned. Refreshes the placement state.
  std::map<std::string, Result<v1::HealthResponse>> Health();
  // Returns once every node serves; UNAVAILABLE naming the others after `timeout`.
  Status WaitHealthy(std::chrono::milliseconds timeout);
  // The placement state of every node, in endpoint order.
  std::vector<NodeLoad> Loads() const;

  // A detached sandbox (see Client::Create) on `node`, or ("") placed as described above.
  // InvalidArgument for an unknown node; UNAVAILABLE if the named node, or every node, does not
  // answer; RESOURCE_EXHAUSTED if no node could take it (the message has each node's reason).
  Result<ClusterSandbox> Create(const v1::SandboxSpec& spec, const std::string& node = "");
  // The sandbox of that id on whichever node holds it (GetSandbox on each). NOT_FOUND if none
  // does; UNAVAILABLE if it is on no node that answered and some node did not.
  Result<ClusterSandbox> Find(const std::string& sandbox_id);
  // Every node's sandboxes (of one session id, if given): {node: sandboxes}. The first node's
  // error, if any node fails.
  Result<std::map<std::string, std::vector<v1::Sandbox>>> List(const std::string& session_id = "");

  // Opens a session on every node at once (all or nothing: if one fails, those already open
  // are closed and that node's error is returned). Empty `job_id`: $SLURM_JOB_ID. The session
  // must not outlive this object.
  Result<std::unique_ptr<ClusterSession>> OpenSession(const std::string& client_name,
                                                      const std::string& job_id = "");

 private:
  friend class ClusterSession;
  using Clock = std::chrono::steady_clock;
  struct Node {
    Endpoint ep;
    std::unique_ptr<Client> client;
    size_t weight = 1;
    // Guarded by mu_.
    uint32_t live = 0;
    int64_t added = 0;
    int64_t inflight = 0;           // reserved by creates under way; a refresh keeps them
    Clock::time_point refreshed{};  // epoch: never
    Clock::time_point down_until{};
    std::string down_reason;
  };
  // Creates a sandbox on node `i` (an index into nodes_).
  using CreateFn = std::function<Result<v1::Sandbox>(size_t i)>;

  ClusterClient() = default;
  Result<size_t> Index(const std::string& node) const;
  // Asks Health of the nodes whose last answer is older than refresh_ (all if `which` is
  // empty, else those listed); an error other than "down" is returned.
  Status RefreshStale(const std::vector<size_t>& which = {});
  // Sandboxes per sandbox CPU, counting reservations. Caller holds mu_.
  double LoadLocked(size_t i) const;
  // Runs Health on the nodes `which` in parallel and records the answers.
  std::vector<Result<v1::HealthResponse>> Refresh(const std::vector<size_t>& which);
  Result<ClusterSandbox> Place(const CreateFn& create, const std::string& node,
                               const std::function<bool(size_t)>& usable);
  ClusterSandbox Handle(size_t i, v1::Sandbox info) const;

  uint32_t health_timeout_ms_ = 0;
  uint32_t session_open_timeout_ms_ = 0;
  std::chrono::milliseconds refresh_{0};
  std::vector<std::unique_ptr<Node>> nodes_;
  std::vector<std::string> names_;
  mutable std::mutex mu_;
};

// A session on every node of a ClusterClient: its sandboxes on every node are destroyed when it
// is closed or destroyed, or when this process dies (each agent sees its stream end). Create
// and List may be called from many threads; Close and destruction must not race them.
class ClusterSession {
 public:
  ~ClusterSession();  // Close()
  ClusterSession(const ClusterSession&) = delete;
  ClusterSession& operator=(const ClusterSession&) = delete;

  // {node: session id}.
  const std::map<std::string, std::string>& ids() const { return ids_; }

  // A sandbox owned by this session, on `node` or ("") placed as ClusterClient::Create. A node
  // whose part of the session has ended (its agent restarted: FAILED_PRECONDITION) is passed
  // over like a full one. Errors as ClusterClient::Create.
  Result<ClusterSandbox> Create(const v1::SandboxSpec& spec, const std::string& node = "");
  // {node: this session's live sandboxes there}; the first node's error if any fails.
  Result<std::map<std::string, std::vector<v1::Sandbox>>> List();
  // Ends the session on every node at once; returns once each agent that answers has destroyed
  // its sandboxes. The errors of nodes that did not answer, named, if any (the session is ended
  // regardless).
  Status Close();

 private:
  friend class ClusterClient;
  explicit ClusterSession(ClusterClient* cluster) : cluster_(cluster) {}

  ClusterClient* cluster_;
  std::vector<std::unique_ptr<Session>> sessions_;  // by node index
  std::map<std::string, std::string> ids_;
  mutable std::mutex mu_;
  std::vector<bool> lost_;  // guarded by mu_: that node's session ended (FAILED_PRECONDITION)
  bool closed_ = false;
};

}  // namespace bragg::pbox::client
