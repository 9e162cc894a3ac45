#include "rl/controller.h"

#include <absl/strings/numbers.h>
#include <absl/strings/strip.h>
#include <fmt/format.h>
#include <httplib.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "common/fs.h"
#include "common/process.h"
#include "common/str_cat.h"
#include "engine/testing/tiny_model.h"
#include "gateway/client.h"
#include "pbox/client/client.h"
#include "pbox/client/cluster_client.h"
#include "rl/export.h"
#include "rl/metrics.h"
#include "rl/rollout.h"
#include "rl/tool_server.h"
#include "rl/vocab.h"
#include "train/trainer.h"

namespace bragg::rl {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// ---- prompts ----------------------------------------------------------------------------

Result<std::vector<Prompt>> LoadPrompts(const std::string& path, const std::string& balance_by) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(Cat(path, ": cannot read"));
  }
  std::vector<Prompt> out;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) {
      continue;
    }
    json j = json::parse(line, nullptr, false);
    if (!j.is_object() || !j.contains("prompt") || !j["prompt"].is_string()) {
      return absl::InvalidArgumentError(
          Cat(path, ":", n, ": expected {\"prompt\": \"...\", \"meta\": {...}}"));
    }
    Prompt p;
    p.text = j["prompt"].get<std::string>();
    if (p.text.empty()) {
      return absl::InvalidArgumentError(Cat(path, ":", n, ": the prompt is empty"));
    }
    json meta = j.value("meta", json::object());
    p.meta_json = meta.dump();
    if (!balance_by.empty()) {
      if (!meta.is_object() || !meta.contains(balance_by)) {
        return absl::InvalidArgumentError(
            Cat(path, ":", n, ": meta has no \"", balance_by, "\" (task.balance_by)"));
      }
      const json& k = meta[balance_by];
      p.balance_key = k.is_string() ? k.get<std::string>() : k.dump();
    }
    out.push_back(std::move(p));
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(Cat(path, ": no prompts"));
  }
  return out;
}

// Draws prompts uniformly over the balance key's values, then uniformly within one.
class PromptSampler {
 public:
  PromptSampler(const std::vector<Prompt>* prompts, uint64_t seed, double focus)
      : prompts_(prompts), rng_(seed), focus_(focus) {
    for (size_t i = 0; i < prompts->size(); ++i) {
      classes_[(*prompts)[i].balance_key].members.push_back(i);
    }
    for (auto& [k, v] : classes_) {
      keys_.push_back(k);
    }
  }
  const Prompt& Next() {
    std::vector<double> weights;
    for (const std::string& k : keys_) {
      weights.push_back((1 - focus_) + focus_ * (1 - classes_[k].success));
    }
    std::discrete_distribution<size_t> pick(weights.begin(), weights.end());
    const auto& members = classes_[keys_[focus_ > 0 ? pick(rng_) : rng_() % keys_.size()]].members;
    return (*prompts_)[members[rng_() % members.size()]];
  }
  // A finished group of `prompt`'s: the fraction of its rollouts that succeeded, folded into its
  // class's recent success rate (an exponential average over the class's groups).
  void Observe(const Prompt& prompt, double success) {
    Class& c = classes_[prompt.balance_key];
    c.success = c.groups == 0 ? success : 0.7 * c.success + 0.3 * success;
    ++c.groups;
  }
  // Each class's recent success rate (those with a finished group).
  json Success() const {
    json out = json::object();
    for (const auto& [k, c] : classes_) {
      if (c.groups > 0) {
        out[k.empty() ? "all" : k] = std::round(c.success * 1000) / 1000;
      }
    }
    return out;
  }

 private:
  struct Class {
    std::vector<size_t> members;
    double success = 0;
    int64_t groups = 0;
  };
  const std::vector<Prompt>* prompts_;
  std::mt19937_64 rng_;
  const double focus_;
  std::map<std::string, Class> classes_;
  std::vector<std::string> keys_;
};

Result<int64_t> ModelContext(const std::string& model_dir) {
  BRAGG_ASSIGN_OR_RETURN(std::string text, ReadFileToString(model_dir + "/config.json"));
  json j = json::parse(text, nullptr, false);
  if (!j.is_object()) {
    return absl::InvalidArgumentError(Cat(model_dir, "/config.json is not a JSON object"));
  }
  return j.value("max_position_embeddings", int64_t{1} << 30);
}

// ---- the fleet: local engines and gateway ---------------------------------------------------

struct Server {
  ChildProcess process;
  std::string url;
  std::string name;
};

// Starts a server that prints "listening on URL" first; its stderr goes to `log`. The child is
// killed when bragg-rl dies (setpriv --pdeathsig), so a killed controller leaves no engines.
Result<Server> StartServer(const std::string& name, std::vector<std::string> argv,
                           const std::string& log) {
  argv.insert(argv.begin(), {"setpriv", "--pdeathsig", "KILL", "--"});
  BRAGG_ASSIGN_OR_RETURN(Pipe out, MakePipe());
  BRAGG_ASSIGN_OR_RETURN(UniqueFd err, OpenFile(log, O_WRONLY | O_CREAT | O_APPEND, 0644));
  SpawnOptions so;
  so.stdout_fd = out.write.get();
  so.stderr_fd = err.get();
  BRAGG_ASSIGN_OR_RETURN(ChildProcess child, Spawn(argv, so));
  out.write.Reset();
  std::string line;
  auto deadline = Clock::now() + std::chrono::seconds(120);
  while (line.find('\n') == std::string::npos) {
    int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
    if (left <= 0) {
      return absl::DeadlineExceededError(Cat(name, " did not start within 120 s; see ", log));
    }
    struct pollfd p = {out.read.get(), POLLIN, 0};
    if (::poll(&p, 1, left) <= 0) {
      continue;
    }
    char buf[512];
    ssize_t n = ::read(out.read.get(), buf, sizeof buf);
    if (n <= 0) {
      return absl::UnavailableError(Cat(name, " exited before listening; see ", log));
    }
    line.append(buf, static_cast<size_t>(n));
  }
  line.resize(line.find('\n'));
  const std::string prefix = "listening on ";
  if (line.rfind(prefix, 0) != 0) {
    return absl::UnavailableError(
        Cat(name, " printed ", json(line).dump(-1, ' ', false, json::error_handler_t::replace),
            "; see ", log));
  }
  return Server{std::move(child), line.substr(prefix.size()), name};
}

// ---- the controller -------------------------------------------------------------------------

struct Group {
  int64_t index = 0;
  std::string id;
  const Prompt* prompt = nullptr;
  int64_t admitted_at = 0;  // the trainer's version when it was admitted
  size_t node = 0;          // the pbox agent its sandboxes are on (an index into nodes_)
  uint64_t epoch = 0;       // that agent's preparation they were cloned from
  std::vector<std::string> sandboxes;
  std::vector<RolloutResult> results;
  int pending = 0;
};

struct Task {
  std::shared_ptr<Group> group;
  int member = 0;
};

// Counters of one step's interval (reset when the step's line is written).
struct Interval {
  int64_t generated_tokens = 0;
  int64_t later_prompt_tokens = 0, later_cached_tokens = 0;
  std::vector<double> tool_ms;
  int64_t tool_failures = 0;
  int64_t sandbox_failures = 0;
  int64_t generate_retries = 0;
  double generate_s = 0, tools_s = 0, verify_s = 0;
  std::map<std::string, int64_t> dropped;  // reason -> rollouts
};

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) {
    return 0;
  }
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

// model.path, or the random model [model.init] describes, written to run.dir/models/init (the
// same bytes each time: its seed is in the config).
Result<std::string> FirstModel(const Config& cfg, const Vocab& vocab) {
  if (!cfg.model.path.empty()) {
    return cfg.model.path;
  }
  const ModelInit& mi = *cfg.model.init;
  engine::testing::TinyModelSpec s;
  s.moe = mi.moe;
  s.vocab = vocab.size();
  s.hidden = mi.hidden;
  s.intermediate = mi.intermediate;
  s.layers = mi.layers;
  s.heads = mi.heads;
  s.kv_heads = mi.kv_heads;
  s.head_dim = mi.head_dim;
  s.experts = mi.experts;
  s.top_k = mi.top_k;
  s.moe_intermediate = mi.moe_intermediate;
  s.context = mi.context;
  s.std = mi.std;
  s.seed = mi.seed;
  if (auto eos = vocab.Id("<eos>")) {
    s.eos = {*eos};
  }
  std::string dir = cfg.run.dir + "/models/init";
  BRAGG_RETURN_IF_ERROR(engine::testing::WriteTinyModel(dir, s));
  return dir;
}

// bragg-engine's flags for serving this run, but --listen and --weight-version.
std::vector<std::string> EngineFlags(const Config& cfg, const std::string& model_dir) {
  std::vector<std::string> argv = {
      "--model",      model_dir, "--threads",         std::to_string(cfg.fleet.engine_threads),
      "--block-size", "1",       "--kv-cache-tokens", std::to_string(cfg.fleet.kv_cache_tokens),
      "--log-level",  "warn"};
  if (cfg.train.deterministic) {
    argv.push_back("--deterministic");
  }
  return argv;
}

// Rewrites the JSON Lines file `path` (metrics.jsonl, trained.jsonl) without the step lines past
// `step`: on --resume those steps are redone. Event lines stay; a missing file is left missing.
Status DropStepsAfter(const std::string& path, int64_t step) {
  auto text = ReadFileToString(path);
  std::string kept;
  if (text.ok()) {
    std::istringstream in(*text);
    for (std::string line; std::getline(in, line);) {
      json j = json::parse(line, nullptr, false);
      if (j.is_object() && (j.contains("event") || j.value("step", int64_t{0}) <= step)) {
        kept += line + "\n";
      }
    }
  }
  return WriteStringToFile(path, kept);
}

// What the config names, read and checked once (Preflight) and then run on.
struct Inputs {
  Vocab vocab;
  std::vector<int32_t> stop_ids;
  std::vector<Prompt> prompts, eval_prompts;
};

class Controller {
 public:
  Controller(const Config& cfg, const RunOptions& opt, Inputs inputs)
      : cfg_(cfg),
        opt_(opt),
        vocab_(std::move(inputs.vocab)),
        stop_ids_(std::move(inputs.stop_ids)),
        prompts_(std::move(inputs.prompts)),
        eval_prompts_(std::move(inputs.eval_prompts)) {}
  ~Controller() {
    StopWorkers();
    StopRecoveries();
  }

  Status Run();

 private:
  Status Prepare();
  Status WarmStart(const std::string& from, const std::string& to);
  Status StartFleet(const std::string& model_dir, int64_t version);
  Status PrepareSandboxes();
  struct Prepared {
    std::unique_ptr<pbox::client::Session> session;
    std::string sandbox;
  };
  // A session on one agent and a sandbox prepared in it: the task's files and setup in it, its
  // tool server and verifier probed. Holds no lock (RPCs only).
  Result<Prepared> PrepareAgent(pbox::client::Client* pbox);
  // After agent `node` restarted (its sessions and sandboxes are gone) or its prepared sandbox
  // vanished: a thread of its own prepares it again, retrying with backoff until it succeeds or
  // the run stops, while groups start on the other agents. Rollouts in flight there lose their
  // sandboxes (dropped as sandbox_failed); the next groups there get new ones. Does nothing
  // (false) if the agent is being recovered already or has been since `epoch`, the epoch the
  // failed clone was made in. Not called with mu_ held.
  bool StartRecovery(size_t node, uint64_t epoch);
  void RecoverAgent(size_t node);
  struct Clones {
    size_t node = 0;
    uint64_t epoch = 0;
    std::vector<std::string> ids;
  };
  // `count` clones of the prepared sandbox of the agent, among those not being recovered (and,
  // for a group start, with no other group start cloning there), with the fewest live sandboxes
  // of this run. `*tried` is false when no agent was free (nothing was asked of any). A clone
  // that finds the agent or its prepared sandbox gone starts its recovery.
  Result<Clones> CloneSandboxes(uint32_t count, bool group_start, bool* tried);
  void DestroySandbox(size_t node, uint64_t epoch, const std::string& id);
  // Saves the trainer's weights as `version` and pushes them to the fleet.
  Status PushWeights(int64_t version);
  // Pushes the Hugging Face directory `dir` to the fleet as `version` (the gateway's in-place
  // update of every engine).
  Status PushModel(const std::string& dir, int64_t version);
  // train.external: writes `batch` for the next step and waits for the external trainer's
  // weights of the next version (AwaitExternal).
  Result<train::StepMetrics> ExternalStep(const std::vector<train::Trajectory>& batch);
  // Waits for ExternalDir(version) to hold a model. DeadlineExceeded after
  // train.external_timeout_s, Cancelled when run.time_limit_s runs out first.
  Status AwaitExternal(int64_t version, const std::string& batch_path);
  // --resume with train.external: the batch the killed run exported and never got weights for
  // may be in the external trainer's hands; it is kept (not exported again with other
  // rollouts), its weights awaited and pushed, and its trajectories recorded as trained.
  Status FinishExportedStep(const std::string& batch_path);
  Status SaveExternalState();
  std::string ExternalDir(int64_t version) const {
    return fmt::format("{}/v{:06d}", cfg_.train.external_weights, version);
  }
  // Optimizer steps done: the trainer's, or the external trainer's versions pushed.
  int64_t StepsDone() const { return cfg_.train.external ? external_step_ : trainer_->step(); }
  void Worker(int index);
  bool TakeTask(Task* task);
  // One rollout in `sandbox` (its tool server started there), then the sandbox destroyed and the
  // rollout's routing forgotten, whatever happened.
  RolloutResult RolloutInSandbox(size_t node, uint64_t epoch, const std::string& sandbox,
                                 const std::string& id, const std::string& group,
                                 const Prompt& prompt, gateway::RolloutClient* client,
                                 const SamplingConfig& sampling, uint64_t seed,
                                 std::function<void(int)> on_generate);
  void RunTask(const Task& task, gateway::RolloutClient* client);
  void StopWorkers();
  // Ends the agents' recoveries (their retries; an RPC in flight runs to its deadline).
  void StopRecoveries();
  // Greedy success over `prompts` (one rollout each, temperature 0), run beside anything else.
  Result<double> Evaluate(const std::vector<Prompt>& prompts, const std::string& label);
  void Metric(const json& j);
  void OnGenerate(int delta);
  // bragg-engine / bragg-gateway: in fleet.bin_dir (or RunOptions::bin_dir), else next to
  // bragg-rl or in the build tree's sibling folder, else on PATH.
  std::string Binary(const std::string& name) const {
    std::error_code ec;
    for (const std::string& dir : {bin_dir_, bin_dir_ + "/../engine", bin_dir_ + "/../gateway"}) {
      if (!bin_dir_.empty() && fs::exists(dir + "/" + name, ec)) {
        return fs::weakly_canonical(dir + "/" + name, ec).string();
      }
    }
    return name;
  }
  std::string ModelDir(int64_t version) const { return Cat(cfg_.run.dir, "/models/v", version); }

  const Config& cfg_;
  const RunOptions opt_;
  std::string bin_dir_;
  Vocab vocab_;
  std::vector<int32_t> stop_ids_;
  std::vector<Prompt> prompts_, eval_prompts_;
  std::unique_ptr<PromptSampler> sampler_;
  std::string incarnation_;

  std::vector<Server> servers_;
  std::string gateway_url_;

  // The pbox agents: one (fleet.pbox an endpoint, or the default), or several (fleet.pbox a
  // comma-separated list or a pbox-slurm endpoints file, or $PBOX_ENDPOINTS). Each group's
  // sandboxes are clones of one agent's prepared sandbox, on that agent.
  struct PboxNode {
    std::string name;
    pbox::client::Client* client = nullptr;  // owned by pbox_single_ or pbox_cluster_
    // Guarded by pbox_mu_.
    std::unique_ptr<pbox::client::Session> session;
    std::string prepared;        // the sandbox every rollout's sandbox there is cloned from
    uint64_t epoch = 0;          // counts preparations: sandboxes of an older one are gone
    int64_t live = 0;            // this run's sandboxes there, of this preparation
    int64_t cloned = 0;          // sandboxes cloned there, in all
    bool recovering = false;     // being prepared again (RecoverAgent): no clones there meanwhile
    bool group_cloning = false;  // a group start's clone in flight there
    std::thread recoverer;       // the last RecoverAgent's thread; joined before the next
  };
  std::unique_ptr<pbox::client::Client> pbox_single_;
  std::unique_ptr<pbox::client::ClusterClient> pbox_cluster_;
  std::vector<PboxNode> nodes_;  // fixed once connected; entries' fields as marked
  std::mutex pbox_mu_;
  std::condition_variable recover_cv_;  // with pbox_mu_: wakes a recovery's backoff at stop
  bool stopping_ = false;               // guarded by pbox_mu_: no new recovery, retries end
  int64_t sandbox_recoveries_ = 0;

  // With train.external it only gives the initial model (and warm start): steps are the external
  // trainer's, counted by external_step_ and kept in run.dir/external_state.json for --resume.
  std::unique_ptr<train::Trainer> trainer_;
  int64_t external_step_ = 0;
  std::ofstream metrics_, trained_;
  std::mutex rollouts_mu_;
  std::ofstream rollouts_;  // every finished rollout as text, for reading what the model does

  std::mutex mu_;
  std::condition_variable cv_;
  int64_t version_ = 0;   // the trainer's (and, after the push, the fleet's)
  int64_t admitted_ = 0;  // groups started and not dropped
  int64_t groups_started_ = 0;
  std::deque<Task> pending_;
  std::deque<std::shared_ptr<Group>> ready_;
  bool stop_ = false;
  Interval interval_;
  int64_t dropped_groups_ = 0;
  std::vector<std::thread> workers_;

  // Engine-idle accounting: time with no /generate in flight from any agent loop.
  std::mutex idle_mu_;
  int in_flight_ = 0;
  Clock::time_point idle_since_ = Clock::now();
  double idle_s_ = 0;

  Clock::time_point t0_ = Clock::now();

  std::atomic<int64_t> rollouts_running_{0};
  std::unique_ptr<RunMetrics> run_metrics_;
  // Last: destroyed first, so no scrape reads the members above once they are gone.
  std::unique_ptr<MetricsServer> metrics_server_;
};

void Controller::Metric(const json& j) {
  metrics_ << j.dump() << "\n";
  metrics_.flush();
}

void Controller::OnGenerate(int delta) {
  std::lock_guard<std::mutex> l(idle_mu_);
  if (in_flight_ == 0 && delta > 0) {
    idle_s_ += Seconds(Clock::now() - idle_since_);
  }
  in_flight_ += delta;
  if (in_flight_ == 0) {
    idle_since_ = Clock::now();
  }
}

Status Controller::Prepare() {
  bin_dir_ = !cfg_.fleet.bin_dir.empty() ? cfg_.fleet.bin_dir : opt_.bin_dir;
  return absl::OkStatus();
}

Status Controller::WarmStart(const std::string& from, const std::string& to) {
  BRAGG_ASSIGN_OR_RETURN(std::vector<train::Trajectory> traces,
                         train::ReadTrajectories(cfg_.warm_start.traces));
  train::TrainOptions o;
  o.model_dir = from;
  o.objective = train::Objective::kSft;
  o.lr = cfg_.warm_start.lr;
  o.threads = cfg_.train.threads;
  o.deterministic = cfg_.train.deterministic;
  o.max_tokens = cfg_.train.max_tokens;
  o.max_grad_norm = cfg_.train.max_grad_norm;
  BRAGG_ASSIGN_OR_RETURN(auto sft, train::Trainer::Create(o));
  std::mt19937_64 rng(cfg_.run.seed ^ 0x5f7);
  auto t0 = Clock::now();
  double loss = 0;
  for (int64_t s = 0; s < cfg_.warm_start.steps; ++s) {
    std::vector<train::Trajectory> batch;
    for (int64_t i = 0; i < cfg_.warm_start.batch; ++i) {
      batch.push_back(traces[rng() % traces.size()]);
      batch.back().id = Cat("w", i);
    }
    BRAGG_ASSIGN_OR_RETURN(train::StepMetrics m, sft->Step(batch));
    loss = m.loss;
    if ((s + 1) % std::max<int64_t>(1, cfg_.warm_start.steps / 10) == 0 ||
        s + 1 == cfg_.warm_start.steps) {
      spdlog::info("warm start: step {}/{} loss {:.4f} ({:.1f} s)", s + 1, cfg_.warm_start.steps,
                   m.loss, Seconds(Clock::now() - t0));
    }
  }
  BRAGG_RETURN_IF_ERROR(sft->SaveModel(to));
  Metric({{"event", "warm_start"},
          {"steps", cfg_.warm_start.steps},
          {"loss", loss},
          {"seconds", Seconds(Clock::now() - t0)}});
  return absl::OkStatus();
}

Status Controller::StartFleet(const std::string& model_dir, int64_t version) {
  std::vector<std::string> workers = cfg_.fleet.engine_urls;
  std::string logs = cfg_.run.dir + "/logs";
  BRAGG_RETURN_IF_ERROR(MakeDirs(logs));
  std::vector<Server> engines;
  // Started one after the other: each loads in well under a second for the models bragg-rl
  // makes, and their startup lines are read in order.
  for (int i = 0; i < cfg_.fleet.engines; ++i) {
    std::vector<std::string> argv = {Binary("bragg-engine"), "--listen", "127.0.0.1:0",
                                     "--weight-version", std::to_string(version)};
    for (std::string& flag : EngineFlags(cfg_, model_dir)) {
      argv.push_back(std::move(flag));
    }
    BRAGG_ASSIGN_OR_RETURN(Server s,
                           StartServer(Cat("engine ", i), argv, Cat(logs, "/engine-", i, ".log")));
    workers.push_back(s.url);
    servers_.push_back(std::move(s));
  }
  if (!cfg_.fleet.gateway.empty()) {
    gateway_url_ = cfg_.fleet.gateway;
    return absl::OkStatus();
  }
  std::vector<std::string> argv = {
      Binary("bragg-gateway"), "--listen", "127.0.0.1:0", "--policy", "sticky",
      "--health-interval-ms",  "500"};
  for (const std::string& w : workers) {
    argv.push_back("--worker");
    argv.push_back(w);
  }
  BRAGG_ASSIGN_OR_RETURN(Server g, StartServer("gateway", argv, logs + "/gateway.log"));
  gateway_url_ = g.url;
  servers_.push_back(std::move(g));
  // Who is who, for operators and tests: the processes bragg-rl started.
  json fleet = {{"controller_pid", ::getpid()},
                {"gateway", gateway_url_},
                {"workers", workers},
                {"servers", json::array()}};
  for (const Server& s : servers_) {
    fleet["servers"].push_back({{"name", s.name}, {"url", s.url}, {"pid", s.process.pid()}});
  }
  BRAGG_RETURN_IF_ERROR(WriteStringToFile(cfg_.run.dir + "/fleet.json", fleet.dump(2) + "\n"));
  spdlog::info("fleet: {} engine(s) behind the gateway at {}", workers.size(), gateway_url_);
  return absl::OkStatus();
}

bool Controller::StartRecovery(size_t node, uint64_t epoch) {
  std::lock_guard<std::mutex> l(pbox_mu_);
  PboxNode& n = nodes_[node];
  if (n.recovering || n.epoch != epoch || stopping_) {
    return false;
  }
  n.recovering = true;
  ++n.epoch;
  n.live = 0;
  ++sandbox_recoveries_;
  if (n.recoverer.joinable()) {
    n.recoverer.join();  // the last recovery's thread, which has finished (recovering was false)
  }
  n.recoverer = std::thread([this, node] { RecoverAgent(node); });
  return true;
}

void Controller::RecoverAgent(size_t node) {
  PboxNode& n = nodes_[node];
  std::unique_ptr<pbox::client::Session> old;
  {
    std::lock_guard<std::mutex> l(pbox_mu_);
    old = std::move(n.session);
  }
  old.reset();  // its sandboxes go with it, where the agent still has them
  auto backoff = std::chrono::milliseconds(500);
  for (;;) {
    auto start = Clock::now();
    auto prepared = PrepareAgent(n.client);
    std::unique_lock<std::mutex> l(pbox_mu_);
    if (prepared.ok() && !stopping_) {
      n.session = std::move(prepared->session);
      n.prepared = std::move(prepared->sandbox);
      n.recovering = false;
      spdlog::info("pbox agent {} prepared again in {:.1f} s", n.name,
                   Seconds(Clock::now() - start));
      break;
    }
    if (stopping_) {
      break;  // a session made meanwhile closes as `prepared` goes
    }
    spdlog::warn("preparing pbox agent {} again: {}; retrying in {} ms", n.name,
                 prepared.status().message(), backoff.count());
    if (recover_cv_.wait_for(l, backoff, [this] { return stopping_; })) {
      break;
    }
    backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::seconds(8));
  }
  { std::lock_guard<std::mutex> l(mu_); }  // a TakeTask between its check and its wait sees it
  cv_.notify_all();
}

Status Controller::PrepareSandboxes() {
  const std::string& where = cfg_.fleet.pbox;
  std::error_code ec;
  const char* env = std::getenv("PBOX_ENDPOINTS");
  bool several = where.find(',') != std::string::npos || fs::is_regular_file(where, ec) ||
                 (where.empty() && env != nullptr && *env != '\0');
  if (several) {
    pbox::client::ClusterOptions co;
    co.endpoints = where;  // "": $PBOX_ENDPOINTS
    BRAGG_ASSIGN_OR_RETURN(pbox_cluster_, pbox::client::ClusterClient::Connect(co));
    BRAGG_RETURN_IF_ERROR(pbox_cluster_->WaitHealthy(std::chrono::seconds(60)));
    for (const std::string& name : pbox_cluster_->nodes()) {
      BRAGG_ASSIGN_OR_RETURN(pbox::client::Client * client, pbox_cluster_->client(name));
      nodes_.push_back(PboxNode{name, client});
    }
  } else {
    pbox::client::ClientOptions po;
    po.endpoint = where;
    BRAGG_ASSIGN_OR_RETURN(pbox_single_, pbox::client::Client::Connect(po));
    nodes_.push_back(PboxNode{where.empty() ? "pbox" : where, pbox_single_.get()});
  }
  for (PboxNode& n : nodes_) {
    auto prepared = PrepareAgent(n.client);
    if (!prepared.ok()) {
      return Annotate(prepared.status(), Cat("pbox agent ", n.name));
    }
    n.session = std::move(prepared->session);
    n.prepared = std::move(prepared->sandbox);
  }
  if (nodes_.size() > 1) {
    spdlog::info("sandboxes on {} pbox agents", nodes_.size());
  }
  return absl::OkStatus();
}

Result<Controller::Prepared> Controller::PrepareAgent(pbox::client::Client* pbox) {
  Prepared out;
  BRAGG_ASSIGN_OR_RETURN(out.session, pbox->OpenSession("bragg-rl"));
  pbox::client::v1::SandboxSpec spec;
  spec.set_image(cfg_.task.image);
  spec.set_memory_bytes(static_cast<uint64_t>(cfg_.task.sandbox_memory_mb) << 20);
  spec.set_pids(static_cast<uint32_t>(cfg_.task.sandbox_pids));
  (*spec.mutable_labels())["bragg-rl"] = "prepared";
  BRAGG_ASSIGN_OR_RETURN(pbox::client::v1::Sandbox sb, pbox->Create(spec, out.session->id()));
  out.sandbox = sb.id();
  const std::string& prepared = out.sandbox;
  if (!cfg_.task.files.empty()) {
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(cfg_.task.files, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (!it->is_regular_file()) {
        continue;
      }
      std::string rel = fs::relative(it->path(), cfg_.task.files).string();
      BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(it->path().string(), O_RDONLY));
      auto st = pbox->WriteFileFromFd(prepared, "/task/" + rel, fd.get(), 0755, true);
      if (!st.ok()) {
        return Annotate(st.status(), Cat("uploading ", it->path().string()));
      }
    }
    if (ec) {
      return absl::InvalidArgumentError(Cat("task.files: ", cfg_.task.files, ": ", ec.message()));
    }
  }
  if (!cfg_.task.setup.empty()) {
    auto setup = pbox->Run({.sandbox_id = prepared,
                            .argv = cfg_.task.setup,
                            .timeout_ms = 600000,
                            .stdin = "",
                            .max_output_bytes = 4096});
    if (!setup.ok()) {
      return Annotate(setup.status(), "task.setup");
    }
    if (!setup->result().error().empty() || setup->result().exit_code() != 0 ||
        setup->result().signal() != 0) {
      return absl::FailedPreconditionError(
          Cat("task.setup ", json(cfg_.task.setup).dump(), " failed in the sandbox: exit ",
              setup->result().exit_code(), " ", setup->result().error(), " ",
              setup->stderr().substr(0, 300)));
    }
  }
  // The task must start: its tool server exits 0 at end of input, its verifier prints a number
  // for a rollout without turns (with verifier_in_tool_server: the tool server answers that
  // rollout's {"verify"} line with a numeric reward, then exits 0). Refused here, before any
  // rollout.
  json empty_rollout = {{"prompt", prompts_[0].text},
                        {"meta", json::parse(prompts_[0].meta_json)},
                        {"turns", json::array()},
                        {"observations", json::array()},
                        {"done", false}};
  const bool in_server = cfg_.task.verifier_in_tool_server;
  auto probe =
      pbox->Run({.sandbox_id = prepared,
                 .argv = cfg_.task.tool_server,
                 .timeout_ms = 30000,
                 .stdin = in_server ? json{{"verify", empty_rollout}}.dump() + "\n" : std::string(),
                 .max_output_bytes = 4096});
  if (!probe.ok()) {
    return Annotate(probe.status(), "task.tool_server");
  }
  if (!probe->result().error().empty() || probe->result().exit_code() != 0 ||
      probe->result().signal() != 0) {
    return absl::FailedPreconditionError(
        Cat("task.tool_server ", json(cfg_.task.tool_server).dump(),
            " does not run in the sandbox (it must exit 0 at end of input): exit ",
            probe->result().exit_code(), " ", probe->result().error(), " ",
            probe->stderr().substr(0, 300)));
  }
  if (in_server) {
    std::string line = probe->stdout().substr(0, probe->stdout().find('\n'));
    json reply = json::parse(line, nullptr, false);
    if (!reply.is_object() || !reply.contains("reward") || !reply["reward"].is_number()) {
      return absl::FailedPreconditionError(
          Cat("task.tool_server ", json(cfg_.task.tool_server).dump(),
              " must answer {\"verify\": ROLLOUT} with {\"reward\": NUMBER} "
              "(task.verifier_in_tool_server); for a rollout without turns it answered ",
              json(line.substr(0, 120)).dump(-1, ' ', false, json::error_handler_t::replace), " ",
              probe->stderr().substr(0, 300)));
    }
    return out;
  }
  auto v = pbox->Run({.sandbox_id = prepared,
                      .argv = cfg_.task.verifier,
                      .timeout_ms = 30000,
                      .stdin = empty_rollout.dump(),
                      .max_output_bytes = 4096});
  if (!v.ok()) {
    return Annotate(v.status(), "task.verifier");
  }
  double x = 0;
  absl::string_view printed = absl::StripAsciiWhitespace(v->stdout());
  if (v->result().exit_code() != 0 || !absl::SimpleAtod(printed, &x)) {
    return absl::FailedPreconditionError(Cat(
        "task.verifier ", json(cfg_.task.verifier).dump(),
        " must print a reward (a number) for a rollout; for a rollout without turns it printed ",
        json(std::string(printed.substr(0, 80)))
            .dump(-1, ' ', false, json::error_handler_t::replace),
        " and exited ", v->result().exit_code(), " ", v->result().error(), " ",
        v->stderr().substr(0, 300)));
  }
  return out;
}

Result<Controller::Clones> Controller::CloneSandboxes(uint32_t count, bool group_start,
                                                      bool* tried) {
  Clones out;
  pbox::client::Client* pbox = nullptr;
  std::string source;
  {
    std::lock_guard<std::mutex> l(pbox_mu_);
    bool found = false;
    for (size_t i = 0; i < nodes_.size(); ++i) {
      const PboxNode& n = nodes_[i];
      if (n.recovering || (group_start && n.group_cloning)) {
        continue;
      }
      if (!found || n.live < nodes_[out.node].live) {
        out.node = i;
        found = true;
      }
    }
    *tried = found;
    if (!found) {
      return absl::UnavailableError("every pbox agent is being prepared again or cloning");
    }
    PboxNode& n = nodes_[out.node];
    out.epoch = n.epoch;
    source = n.prepared;
    pbox = n.client;
    // Counted before the clone returns, so that concurrent groups spread over the agents.
    n.live += count;
    n.group_cloning = n.group_cloning || group_start;
  }
  auto clones = pbox->Clone(source, count);
  bool gone = false;
  {
    std::lock_guard<std::mutex> l(pbox_mu_);
    PboxNode& n = nodes_[out.node];
    if (group_start) {
      n.group_cloning = false;
    }
    if (clones.ok()) {
      n.cloned += count;
    } else if (n.epoch == out.epoch) {
      n.live = std::max<int64_t>(0, n.live - count);
    }
  }
  if (!clones.ok()) {
    // The agent full (ResourceExhausted): wait for sandboxes to be destroyed. The agent or the
    // prepared sandbox gone (after an agent restart): prepare it again.
    absl::StatusCode code = clones.status().code();
    gone = code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kNotFound ||
           code == absl::StatusCode::kFailedPrecondition ||
           code == absl::StatusCode::kDeadlineExceeded;
    if (!gone) {
      spdlog::warn("cloning {} sandbox(es) on pbox agent {}: {}", count, nodes_[out.node].name,
                   clones.status().message());
    } else if (StartRecovery(out.node, out.epoch)) {
      spdlog::warn("cloning {} sandbox(es) on pbox agent {}: {}; preparing the agent again", count,
                   nodes_[out.node].name, clones.status().message());
    } else {
      // A clone that was in flight beside the one that found the agent gone: that one has
      // reported it and started the recovery (or the agent is prepared again already).
      spdlog::debug("cloning {} sandbox(es) on pbox agent {}: {} (already being prepared again)",
                    count, nodes_[out.node].name, clones.status().message());
    }
    return clones.status();
  }
  for (const auto& c : *clones) {
    out.ids.push_back(c.id());
  }
  return out;
}

void Controller::DestroySandbox(size_t node, uint64_t epoch, const std::string& id) {
  (void)nodes_[node].client->Destroy(id);
  std::lock_guard<std::mutex> l(pbox_mu_);
  if (nodes_[node].epoch == epoch) {  // else counted out when the agent was prepared again
    nodes_[node].live = std::max<int64_t>(0, nodes_[node].live - 1);
  }
}

Status Controller::PushWeights(int64_t version) {
  std::string dir = ModelDir(version);
  BRAGG_RETURN_IF_ERROR(trainer_->SaveModel(dir));
  BRAGG_RETURN_IF_ERROR(PushModel(dir, version));
  // The previous model's files: every engine has the new one now. Keep the last two.
  std::error_code ec;
  fs::remove_all(ModelDir(version - 2), ec);
  return absl::OkStatus();
}

Status Controller::PushModel(const std::string& dir, int64_t version) {
  httplib::Client http(gateway_url_);
  http.set_read_timeout(600, 0);
  json body = {{"model_path", fs::absolute(dir).string()},
               {"weight_version", std::to_string(version)}};
  auto r = http.Post("/weights/update", body.dump(), "application/json");
  if (!r) {
    return absl::UnavailableError(
        Cat("POST ", gateway_url_, "/weights/update: ", httplib::to_string(r.error())));
  }
  if (r->status != 200) {
    return absl::InternalError(
        Cat("POST /weights/update: HTTP ", r->status, ": ", r->body.substr(0, 500)));
  }
  return absl::OkStatus();
}

Status Controller::AwaitExternal(int64_t version, const std::string& batch_path) {
  // The trainer renames a whole directory into place: once config.json is there, so is the rest.
  const std::string dir = ExternalDir(version);
  auto start = Clock::now();
  auto next_note = start + std::chrono::seconds(30);
  spdlog::info("waiting for the external trainer's weights for {} in {}", batch_path, dir);
  for (;;) {
    std::error_code ec;
    if (fs::exists(dir + "/config.json", ec)) {
      return absl::OkStatus();
    }
    auto now = Clock::now();
    if (cfg_.run.time_limit_s > 0 && Seconds(now - t0_) > cfg_.run.time_limit_s) {
      return absl::CancelledError("the time limit ran out waiting for the external trainer");
    }
    if (Seconds(now - start) > cfg_.train.external_timeout_s) {
      return absl::DeadlineExceededError(Cat(
          "no weights for version ", version, " in ", dir, " after ", cfg_.train.external_timeout_s,
          " s (train.external_timeout_s): the external trainer should train on ", batch_path,
          " and rename a Hugging Face directory (config.json and safetensors) to ", dir));
    }
    if (now >= next_note) {
      spdlog::info("still waiting for {} ({:.0f} s)", dir, Seconds(now - start));
      next_note = now + std::chrono::seconds(30);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

Status Controller::SaveExternalState() {
  return WriteStringToFile(
      cfg_.run.dir + "/external_state.json",
      json{{"step", external_step_}, {"version", version_}, {"model", ExternalDir(version_)}}
              .dump() +
          "\n");
}

Status Controller::FinishExportedStep(const std::string& batch_path) {
  BRAGG_ASSIGN_OR_RETURN(std::string text, ReadFileToString(batch_path));
  std::istringstream in(text);
  json ids = json::array();
  int64_t version = -1;
  for (std::string line; std::getline(in, line);) {
    json row = json::parse(line, nullptr, false);
    if (!row.is_object() || !row.contains("version") || !row.contains("trajectory_ids")) {
      return absl::DataLossError(Cat(batch_path, ": a row without version and trajectory_ids"));
    }
    version = row["version"].get<int64_t>();
    for (const json& id : row["trajectory_ids"]) {
      ids.push_back(id);
    }
  }
  if (version != version_ + 1) {
    return absl::DataLossError(Cat(batch_path, " names version ", version, ", not ", version_ + 1,
                                   " (the version after the last one pushed)"));
  }
  BRAGG_RETURN_IF_ERROR(AwaitExternal(version, batch_path));
  BRAGG_RETURN_IF_ERROR(PushModel(ExternalDir(version), version));
  external_step_ += 1;
  version_ = version;
  trainer_->set_version(version);
  BRAGG_RETURN_IF_ERROR(SaveExternalState());
  trained_ << json{{"step", external_step_}, {"version", version}, {"ids", ids}}.dump() << "\n";
  trained_.flush();
  Metric({{"event", "resumed_step"},
          {"step", external_step_},
          {"version", version},
          {"samples", ids.size()}});
  spdlog::info("step {} v{}: the killed run's exported batch, trained externally", external_step_,
               version);
  return absl::OkStatus();
}

Result<train::StepMetrics> Controller::ExternalStep(const std::vector<train::Trajectory>& batch) {
  train::StepMetrics m;
  m.step = external_step_ + 1;
  m.version = version_ + 1;
  const std::string batch_path = fmt::format("{}/batches/step-{:06d}.jsonl", cfg_.run.dir, m.step);
  std::vector<double> adv = train::GroupAdvantages(batch, cfg_.train.normalize_std);
  BRAGG_RETURN_IF_ERROR(
      Annotate(WritePackedBatch(
                   batch, adv, cfg_.export_,
                   cfg_.export_.max_tokens > 0 ? cfg_.export_.max_tokens : cfg_.train.max_tokens,
                   m.step, m.version, batch_path),
               Cat("exporting the batch of step ", m.step)));
  auto start = Clock::now();
  BRAGG_RETURN_IF_ERROR(AwaitExternal(m.version, batch_path));
  m.seconds = Seconds(Clock::now() - start);
  m.trajectories = static_cast<int64_t>(batch.size());
  for (const train::Trajectory& t : batch) {
    m.tokens += static_cast<int64_t>(t.tokens.size());
    for (size_t k = 0; k < t.tokens.size(); ++k) {
      m.loss_tokens += t.loss_mask[k] ? 1 : 0;
      if (k < t.versions.size() && t.versions[k] >= 0) {
        m.min_version = m.min_version < 0 ? t.versions[k] : std::min(m.min_version, t.versions[k]);
        m.max_version = std::max(m.max_version, t.versions[k]);
      }
    }
  }
  m.tokens_per_second = m.seconds > 0 ? static_cast<double>(m.tokens) / m.seconds : 0;
  // What only the trainer knows: null in metrics.jsonl.
  const double unknown = std::numeric_limits<double>::quiet_NaN();
  m.loss = m.policy_loss = m.entropy = m.kl = m.clip_fraction = unknown;
  m.logprob_diff_max = m.grad_norm = unknown;
  return m;
}

bool Controller::TakeTask(Task* task) {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    if (stop_) {
      return false;
    }
    if (!pending_.empty()) {
      *task = std::move(pending_.front());
      pending_.pop_front();
      return true;
    }
    int64_t limit = (version_ + cfg_.run.max_staleness + 1) * cfg_.train.groups_per_step;
    if (admitted_ < limit) {
      // Several groups may start at once, one per agent: an agent that hangs holds up its own
      // start only.
      auto g = std::make_shared<Group>();
      g->index = groups_started_++;
      g->id = Cat(incarnation_, "-g", g->index);
      g->prompt = &sampler_->Next();
      g->admitted_at = version_;
      ++admitted_;
      l.unlock();
      bool tried = false;
      auto clones = CloneSandboxes(static_cast<uint32_t>(cfg_.sampling.group_size), true, &tried);
      l.lock();
      if (!clones.ok()) {
        --admitted_;  // its index stays used: another start may have taken the next one
        if (tried) {
          interval_.sandbox_failures += cfg_.sampling.group_size;
        }
        // Until an agent is free, prepared again or has room: woken by a finished clone or
        // recovery, or a destroyed sandbox's rollout ending.
        cv_.wait_for(l, std::chrono::milliseconds(tried ? 1000 : 200));
        continue;
      }
      g->node = clones->node;
      g->epoch = clones->epoch;
      g->sandboxes = std::move(clones->ids);
      g->results.resize(g->sandboxes.size());
      g->pending = static_cast<int>(g->sandboxes.size());
      for (int i = 0; i < g->pending; ++i) {
        pending_.push_back({g, i});
      }
      cv_.notify_all();
      continue;
    }
    cv_.wait(l);
  }
}

RolloutResult Controller::RolloutInSandbox(size_t node, uint64_t epoch, const std::string& sandbox,
                                           const std::string& id, const std::string& group,
                                           const Prompt& prompt, gateway::RolloutClient* client,
                                           const SamplingConfig& sampling, uint64_t seed,
                                           std::function<void(int)> on_generate) {
  RolloutResult result;
  pbox::client::Client* pbox = nodes_[node].client;
  auto tools = ToolServer::Start(pbox, sandbox, cfg_.task.tool_server);
  if (!tools.ok()) {
    result.dropped = "sandbox_failed";
    result.detail = std::string(tools.status().message());
  } else {
    RolloutEnv env{&vocab_,
                   &cfg_.task,
                   stop_ids_,
                   client,
                   tools->get(),
                   cfg_.task.verifier_in_tool_server
                       ? Verifier([tool = tools->get(), timeout = cfg_.task.tool_timeout()](
                                      const std::string& in) -> Result<VerifierOutput> {
                           return tool->Verify(in, timeout);
                         })
                       : PboxVerifier(pbox, sandbox, &cfg_.task),
                   std::move(on_generate)};
    auto r = RunRollout(env, id, group, prompt, sampling, seed);
    if (r.ok()) {
      result = std::move(*r);
    } else {
      result.dropped = "bad_prompt";
      result.detail = std::string(r.status().message());
    }
    tools->reset();
  }
  (void)client->Forget(id);
  DestroySandbox(node, epoch, sandbox);
  return result;
}

void Controller::RunTask(const Task& task, gateway::RolloutClient* client) {
  Group& g = *task.group;
  std::string id = Cat(g.id, "-", task.member);
  int64_t start_version;
  {
    // Read before the first request: the gateway's cache salt for this rollout is then this
    // version or a later one (it switches salts before it loads, PushWeights returns after).
    std::lock_guard<std::mutex> l(mu_);
    start_version = version_;
  }
  RolloutResult result =
      RolloutInSandbox(g.node, g.epoch, g.sandboxes[static_cast<size_t>(task.member)], id, g.id,
                       *g.prompt, client, cfg_.sampling,
                       cfg_.run.seed * 1000003 + static_cast<uint64_t>(g.index) * 1009 +
                           static_cast<uint64_t>(task.member),
                       [this](int d) { OnGenerate(d); });
  result.start_version = start_version;
  {
    json line = {{"id", id},
                 {"prompt", g.prompt->text},
                 {"turns", result.turns},
                 {"reward", result.reward},
                 {"done", result.done},
                 {"dropped", result.dropped}};
    if (!result.trajectory.versions.empty()) {
      int64_t lo = -1, hi = -1;
      for (int64_t v : result.trajectory.versions) {
        if (v < 0) continue;
        lo = lo < 0 ? v : std::min(lo, v);
        hi = std::max(hi, v);
      }
      line["versions"] = {lo, hi};
    }
    if (!result.detail.empty()) line["detail"] = result.detail;
    std::lock_guard<std::mutex> l(rollouts_mu_);
    rollouts_ << line.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
  }

  std::lock_guard<std::mutex> l(mu_);
  Interval& iv = interval_;
  iv.generated_tokens += result.generated_tokens;
  iv.generate_retries += result.generate_retries;
  iv.later_prompt_tokens += result.later_prompt_tokens;
  iv.later_cached_tokens += result.later_cached_tokens;
  iv.generate_s += result.generate_s;
  iv.tools_s += result.tools_s;
  iv.verify_s += result.verify_s;
  for (const ToolCallRecord& c : result.tool_calls) {
    run_metrics_->ObserveToolCall(c.ms);
    iv.tool_ms.push_back(c.ms);
    iv.tool_failures += c.failure.empty() ? 0 : 1;
  }
  if (result.dropped == "sandbox_failed") {
    ++iv.sandbox_failures;
  }
  if (!result.dropped.empty()) {
    ++iv.dropped[result.dropped];
    spdlog::debug("rollout {} dropped ({}): {}", id, result.dropped, result.detail);
  }
  g.results[static_cast<size_t>(task.member)] = std::move(result);
  if (--g.pending == 0) {
    int kept = 0, succeeded = 0;
    for (const RolloutResult& r : g.results) {
      kept += r.dropped.empty() ? 1 : 0;
      succeeded += r.dropped.empty() && r.reward >= 1.0 ? 1 : 0;
    }
    if (kept > 0) {
      sampler_->Observe(*g.prompt, static_cast<double>(succeeded) / kept);
    }
    if (kept >= 2) {
      ready_.push_back(task.group);
    } else {
      --admitted_;  // a group with nothing to compare: another is admitted in its place
      ++dropped_groups_;
    }
    cv_.notify_all();
  }
}

void Controller::Worker(int index) {
  gateway::ClientOptions co;
  co.return_logprob = true;
  co.return_routed_experts = true;
  auto client = gateway::RolloutClient::Create(gateway_url_, co);
  if (!client.ok()) {
    spdlog::error("agent loop {}: {}", index, client.status().message());
    return;
  }
  Task task;
  while (TakeTask(&task)) {
    rollouts_running_.fetch_add(1);
    RunTask(task, client->get());
    rollouts_running_.fetch_sub(1);
  }
}

void Controller::StopWorkers() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : workers_) {
    t.join();
  }
  workers_.clear();
  // Sandboxes of groups never started.
  for (const Task& t : pending_) {
    DestroySandbox(t.group->node, t.group->epoch,
                   t.group->sandboxes[static_cast<size_t>(t.member)]);
  }
  pending_.clear();
}

void Controller::StopRecoveries() {
  {
    std::lock_guard<std::mutex> l(pbox_mu_);
    stopping_ = true;
  }
  recover_cv_.notify_all();
  for (PboxNode& n : nodes_) {
    if (n.recoverer.joinable()) {
      n.recoverer.join();
    }
  }
}

Result<double> Controller::Evaluate(const std::vector<Prompt>& prompts, const std::string& label) {
  if (prompts.empty()) {
    return 0.0;
  }
  auto t0 = Clock::now();
  std::atomic<size_t> next{0};
  std::atomic<int64_t> success{0}, scored{0};
  // One record per prompt, in the prompts' order: what the model said and what it scored, so a
  // held-out miss can be read, not only counted (run.dir/eval/LABEL.jsonl).
  std::vector<json> records(prompts.size());
  std::vector<std::thread> threads;
  int n = std::min<int>(cfg_.fleet.concurrency, static_cast<int>(prompts.size()));
  for (int w = 0; w < n; ++w) {
    threads.emplace_back([&] {
      gateway::ClientOptions co;
      co.return_logprob = true;
      auto client = gateway::RolloutClient::Create(gateway_url_, co);
      if (!client.ok()) {
        spdlog::warn("eval: {}", client.status().message());
        return;
      }
      for (size_t i; (i = next++) < prompts.size();) {
        bool tried = false;
        auto sb = CloneSandboxes(1, false, &tried);
        // Every agent being prepared again: wait for one (a minute at most), as group starts do.
        for (int waits = 0; !sb.ok() && !tried && waits < 300; ++waits) {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          sb = CloneSandboxes(1, false, &tried);
        }
        if (!sb.ok()) {
          spdlog::warn("eval: cloning a sandbox: {}", sb.status().message());
          records[i] = {{"prompt", prompts[i].text}, {"dropped", "no_sandbox"}};
          continue;
        }
        std::string id = Cat(incarnation_, "-eval-", label, "-", i);
        SamplingConfig greedy = cfg_.sampling;
        greedy.temperature = 0;
        RolloutResult r = RolloutInSandbox(sb->node, sb->epoch, sb->ids[0], id, id, prompts[i],
                                           client->get(), greedy, 0, nullptr);
        if (r.dropped.empty()) {
          ++scored;
          success += r.reward >= 1.0 ? 1 : 0;
        } else {
          spdlog::warn("eval: rollout {}: {}: {}", id, r.dropped, r.detail);
        }
        records[i] = {{"prompt", prompts[i].text},
                      {"meta", json::parse(prompts[i].meta_json, nullptr, false)},
                      {"turns", r.turns},
                      {"done", r.done},
                      {"reward", r.reward},
                      {"dropped", r.dropped}};
      }
    });
  }
  for (std::thread& t : threads) {
    t.join();
  }
  std::string lines;
  for (const json& j : records) {
    if (!j.is_null()) {  // null: no thread reached it (every gateway client failed)
      lines += j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
    }
  }
  if (Status s = MakeDirs(cfg_.run.dir + "/eval"); s.ok()) {
    s = WriteStringToFile(Cat(cfg_.run.dir, "/eval/", label, ".jsonl"), lines);
    if (!s.ok()) {
      spdlog::warn("eval: {}", s.message());
    }
  }
  double rate = static_cast<double>(success) / static_cast<double>(prompts.size());
  spdlog::info("eval ({}): greedy success {:.3f} on {} held-out prompts ({} scored, {:.1f} s)",
               label, rate, prompts.size(), scored.load(), Seconds(Clock::now() - t0));
  return rate;
}

Status Controller::Run() {
  BRAGG_RETURN_IF_ERROR(Prepare());
  BRAGG_RETURN_IF_ERROR(MakeDirs(cfg_.run.dir + "/models"));
  if (cfg_.export_.batches) {
    BRAGG_RETURN_IF_ERROR(MakeDirs(cfg_.run.dir + "/batches"));
  }
  run_metrics_ = std::make_unique<RunMetrics>([this] {
    LiveState s;
    {
      std::lock_guard<std::mutex> l(mu_);
      s.version = version_;
      s.groups_admitted = admitted_;
    }
    {
      std::lock_guard<std::mutex> l(idle_mu_);
      s.generate_in_flight = in_flight_;
    }
    s.rollouts_in_flight = rollouts_running_.load();
    return s;
  });
  if (!cfg_.run.metrics_listen.empty()) {
    BRAGG_ASSIGN_OR_RETURN(metrics_server_,
                           MetricsServer::Start(cfg_.run.metrics_listen, run_metrics_.get()));
    BRAGG_RETURN_IF_ERROR(
        WriteStringToFile(cfg_.run.dir + "/metrics_url", metrics_server_->url() + "\n"));
    spdlog::info("metrics: {}", metrics_server_->url());
  }
  // The task's sandbox first: a tool server that does not start or a verifier that prints no
  // number is refused before a minute of warm start and before any engine.
  BRAGG_RETURN_IF_ERROR(PrepareSandboxes());
  incarnation_ = Cat("r", std::chrono::duration_cast<std::chrono::milliseconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                                  .count() %
                              100000000);
  const std::string ckpt = cfg_.run.dir + "/checkpoints";
  const std::string metrics_path = cfg_.run.dir + "/metrics.jsonl";
  const std::string trained_path = cfg_.run.dir + "/trained.jsonl";

  train::TrainOptions o;
  o.objective = train::Objective::kGrpo;
  o.lr = cfg_.train.lr;
  o.threads = cfg_.train.threads;
  o.deterministic = cfg_.train.deterministic;
  o.temperature = cfg_.sampling.temperature;
  o.minibatches = cfg_.train.minibatches;
  o.clip_low = cfg_.train.clip_low;
  o.clip_high = cfg_.train.clip_high;
  o.tis_cap = cfg_.train.tis_cap;
  o.kl_coef = cfg_.train.kl_coef;
  o.entropy_coef = cfg_.train.entropy_coef;
  o.max_grad_norm = cfg_.train.max_grad_norm;
  o.eps = cfg_.train.adam_eps;
  o.weight_decay = cfg_.train.weight_decay;
  o.normalize_std = cfg_.train.normalize_std;
  o.max_tokens = cfg_.train.max_tokens;

  const std::string external_state = cfg_.run.dir + "/external_state.json";
  if (opt_.resume && cfg_.train.external) {
    // The external trainer's last version pushed, and the initial model to start a trainer
    // object from (it only serves the initial weights in this mode).
    int64_t version = 0;
    if (auto text = ReadFileToString(external_state); text.ok()) {
      json st = json::parse(*text, nullptr, false);
      if (!st.is_object() || !st.contains("step") || !st.contains("version")) {
        return absl::DataLossError(Cat(external_state, " is not {\"step\", \"version\"}"));
      }
      external_step_ = st["step"].get<int64_t>();
      version = st["version"].get<int64_t>();
    }
    if (!fs::exists(ModelDir(0) + "/config.json")) {
      return absl::FailedPreconditionError(
          Cat("cannot resume: ", ModelDir(0), " (the initial model) is missing"));
    }
    o.model_dir = ModelDir(0);
    BRAGG_ASSIGN_OR_RETURN(trainer_, train::Trainer::Create(o));
    trainer_->set_version(version);
    for (const std::string& path : {metrics_path, trained_path}) {
      BRAGG_RETURN_IF_ERROR(DropStepsAfter(path, external_step_));
    }
    spdlog::info("resumed at step {} (version {}, the external trainer's)", external_step_,
                 version);
  } else if (opt_.resume) {
    if (cfg_.train.kl_coef > 0) {
      o.reference_dir = cfg_.run.dir + "/models/reference";
    }
    BRAGG_ASSIGN_OR_RETURN(trainer_, train::Trainer::Resume(ckpt, o));
    // What the killed run wrote after its last checkpoint is redone: its lines go.
    for (const std::string& path : {metrics_path, trained_path}) {
      BRAGG_RETURN_IF_ERROR(DropStepsAfter(path, trainer_->step()));
    }
    spdlog::info("resumed at step {} (version {})", trainer_->step(), trainer_->version());
  } else {
    BRAGG_ASSIGN_OR_RETURN(std::string start, FirstModel(cfg_, vocab_));
    BRAGG_RETURN_IF_ERROR(WriteStringToFile(metrics_path, ""));
    BRAGG_RETURN_IF_ERROR(WriteStringToFile(trained_path, ""));
    metrics_.open(metrics_path, std::ios::app);
    if (cfg_.warm_start.steps > 0) {
      std::string warm = cfg_.run.dir + "/models/warm";
      BRAGG_RETURN_IF_ERROR(WarmStart(start, warm));
      start = warm;
    }
    o.model_dir = start;
    if (cfg_.train.kl_coef > 0) {
      // KL towards the model RL starts from; kept for --resume.
      o.reference_dir = cfg_.run.dir + "/models/reference";
      std::error_code ec;
      fs::remove_all(o.reference_dir, ec);
      fs::copy(start, o.reference_dir, fs::copy_options::recursive, ec);
      if (ec) {
        return absl::InternalError(
            Cat("copying ", start, " to ", o.reference_dir, ": ", ec.message()));
      }
    }
    BRAGG_ASSIGN_OR_RETURN(trainer_, train::Trainer::Create(o));
    trainer_->set_version(0);
  }
  if (!metrics_.is_open()) {
    metrics_.open(metrics_path, std::ios::app);
  }
  trained_.open(trained_path, std::ios::app);
  rollouts_.open(cfg_.run.dir + "/rollouts.jsonl", std::ios::app);
  version_ = trainer_->version();
  std::string serving = ModelDir(version_);
  if (cfg_.train.external && version_ > 0) {
    serving = ExternalDir(version_);
  } else {
    BRAGG_RETURN_IF_ERROR(trainer_->SaveModel(serving));
  }
  if (cfg_.train.external) {
    BRAGG_RETURN_IF_ERROR(MakeDirs(cfg_.train.external_weights));
  }
  BRAGG_RETURN_IF_ERROR(StartFleet(serving, version_));
  if (!cfg_.fleet.engine_urls.empty()) {
    // Servers bragg-rl did not start serve whatever they were started with (a Slurm job starts
    // them from the first model, before the warm start): from now on, the run's weights.
    BRAGG_RETURN_IF_ERROR(
        Annotate(PushModel(serving, version_), "loading the run's weights into fleet.engine_urls"));
  }
  if (opt_.resume && cfg_.train.external) {
    std::string exported =
        fmt::format("{}/batches/step-{:06d}.jsonl", cfg_.run.dir, external_step_ + 1);
    if (fs::exists(exported)) {
      t0_ = Clock::now();  // the time limit counts from here
      BRAGG_RETURN_IF_ERROR(FinishExportedStep(exported));
    }
  }
  sampler_ = std::make_unique<PromptSampler>(
      &prompts_, cfg_.run.seed * 7919 + static_cast<uint64_t>(StepsDone()), cfg_.task.focus);

  std::optional<double> eval_before;
  if (!eval_prompts_.empty()) {
    BRAGG_ASSIGN_OR_RETURN(double e, Evaluate(eval_prompts_, "before"));
    eval_before = e;
    run_metrics_->ObserveEval(e);
    Metric({{"event", "eval"}, {"step", StepsDone()}, {"eval_success", e}});
  }

  t0_ = Clock::now();
  {
    std::lock_guard<std::mutex> l(idle_mu_);
    idle_since_ = t0_;
    idle_s_ = 0;
  }
  for (int i = 0; i < cfg_.fleet.concurrency; ++i) {
    workers_.emplace_back([this, i] { Worker(i); });
  }
  Metric({{"event", "start"},
          {"step", StepsDone()},
          {"trainer", cfg_.train.external ? "external" : "bragg"},
          {"max_staleness", cfg_.run.max_staleness},
          {"resume", opt_.resume}});

  const int64_t S = cfg_.run.max_staleness;
  const int64_t B = cfg_.train.groups_per_step;
  std::deque<double> recent;
  std::optional<double> target_time;
  auto last = t0_;
  double last_idle = 0;
  Status failure;
  while (StepsDone() < cfg_.run.steps) {
    // Wait for B groups whose trajectories are all within the bound.
    auto wait0 = Clock::now();
    std::vector<train::Trajectory> batch;
    std::vector<int64_t> staleness, starts;
    int64_t dropped_stale = 0, groups = 0;
    double rewards = 0, successes = 0;
    bool timed_out = false;
    {
      std::unique_lock<std::mutex> l(mu_);
      while (groups < B) {
        if (cfg_.run.time_limit_s > 0 && Seconds(Clock::now() - t0_) > cfg_.run.time_limit_s) {
          timed_out = true;
          break;
        }
        if (ready_.empty()) {
          cv_.wait_for(l, std::chrono::milliseconds(200));
          continue;
        }
        std::shared_ptr<Group> g = ready_.front();
        ready_.pop_front();
        std::vector<train::Trajectory> kept;
        std::vector<int64_t> ages, kept_starts;
        for (RolloutResult& r : g->results) {
          if (!r.dropped.empty()) {
            continue;
          }
          int64_t oldest = version_;
          for (int64_t v : r.trajectory.versions) {
            if (v >= 0) oldest = std::min(oldest, v);
          }
          if (version_ - oldest > S) {
            ++dropped_stale;
            continue;
          }
          ages.push_back(version_ - oldest);
          kept_starts.push_back(r.start_version);
          kept.push_back(std::move(r.trajectory));
        }
        if (kept.size() < 2) {
          --admitted_;
          ++dropped_groups_;
          cv_.notify_all();
          continue;
        }
        for (size_t i = 0; i < kept.size(); ++i) {
          rewards += kept[i].reward;
          successes += kept[i].reward >= 1.0 ? 1 : 0;
          staleness.push_back(ages[i]);
          starts.push_back(kept_starts[i]);
          batch.push_back(std::move(kept[i]));
        }
        ++groups;
      }
    }
    if (timed_out) {
      spdlog::info("time limit of {} s reached", cfg_.run.time_limit_s);
      break;
    }
    double wait_s = Seconds(Clock::now() - wait0);
    // Log-prob agreement: the trainer's log-probs of trajectories computed wholly by the
    // current weights equal the engine's (exactly, with deterministic kernels on both sides).
    // Wholly: every sampled token carries this version, and the rollout began under it (one
    // that began earlier may reuse prompt KV of older weights; see start_version).
    std::vector<train::Trajectory> fresh;
    // (Not with an external trainer: the trainer here does not hold its weights.)
    for (size_t i = 0; i < batch.size() && fresh.size() < 4 && !cfg_.train.external; ++i) {
      if (staleness[i] == 0 && starts[i] == version_ &&
          std::all_of(batch[i].versions.begin(), batch[i].versions.end(),
                      [&](int64_t v) { return v < 0 || v == version_; })) {
        fresh.push_back(batch[i]);
      }
    }
    double agreement = -1;
    if (!fresh.empty()) {
      auto lps = trainer_->LogProbs(fresh);
      if (lps.ok()) {
        agreement = 0;
        for (size_t i = 0; i < fresh.size(); ++i) {
          for (size_t k = 0; k < fresh[i].tokens.size(); ++k) {
            if (fresh[i].loss_mask[k]) {
              agreement = std::max(
                  agreement, std::abs(static_cast<double>((*lps)[i][k] - fresh[i].logprobs[k])));
            }
          }
        }
      }
    }
    int64_t over_stale = 0;
    std::map<int64_t, int64_t> hist;
    for (int64_t a : staleness) {
      over_stale += a > S ? 1 : 0;
      ++hist[a];
    }
    auto train0 = Clock::now();
    auto m = cfg_.train.external ? ExternalStep(batch) : trainer_->Step(batch);
    if (absl::IsCancelled(m.status())) {
      spdlog::info("time limit of {} s reached", cfg_.run.time_limit_s);
      break;
    }
    if (!m.ok()) {
      failure = Annotate(m.status(), Cat("training step ", StepsDone() + 1));
      break;
    }
    double train_s = Seconds(Clock::now() - train0);
    if (cfg_.export_.batches && !cfg_.train.external) {
      // What the step trained on, for an external trainer: before the weights move on.
      std::vector<double> adv = train::GroupAdvantages(batch, cfg_.train.normalize_std);
      Status ex = WritePackedBatch(
          batch, adv, cfg_.export_,
          cfg_.export_.max_tokens > 0 ? cfg_.export_.max_tokens : cfg_.train.max_tokens, m->step,
          m->version, fmt::format("{}/batches/step-{:06d}.jsonl", cfg_.run.dir, m->step));
      if (!ex.ok()) {
        failure = Annotate(ex, Cat("exporting the batch of step ", m->step));
        break;
      }
    }
    auto sync0 = Clock::now();
    Status pushed = cfg_.train.external ? PushModel(ExternalDir(m->version), m->version)
                                        : PushWeights(trainer_->version());
    if (!pushed.ok()) {
      failure = pushed;
      break;
    }
    double sync_s = Seconds(Clock::now() - sync0);
    {
      std::lock_guard<std::mutex> l(mu_);
      version_ = m->version;
    }
    if (cfg_.train.external) {
      external_step_ = m->step;
      trainer_->set_version(m->version);
      if (Status st = SaveExternalState(); !st.ok()) {
        failure = st;
        break;
      }
    }
    cv_.notify_all();
    json ids = json::array();
    for (const train::Trajectory& t : batch) {
      ids.push_back(t.id);
    }
    trained_ << json{{"step", m->step}, {"version", m->version}, {"ids", ids}}.dump() << "\n";
    trained_.flush();
    if (!cfg_.train.external && cfg_.run.checkpoint_every > 0 &&
        m->step % cfg_.run.checkpoint_every == 0) {
      Status c = trainer_->SaveCheckpoint(ckpt);
      if (!c.ok()) {
        failure = c;
        break;
      }
    }

    auto now = Clock::now();
    double span = Seconds(now - last);
    double idle;
    {
      std::lock_guard<std::mutex> l(idle_mu_);
      idle = idle_s_ + (in_flight_ == 0 ? Seconds(now - idle_since_) : 0.0);
    }
    Interval iv;
    int64_t dropped_groups;
    int64_t sandbox_recoveries;
    json by_agent = json::object();  // sandboxes cloned on each pbox agent, in all
    {
      std::lock_guard<std::mutex> l(pbox_mu_);
      sandbox_recoveries = sandbox_recoveries_;
      for (const PboxNode& n : nodes_) {
        by_agent[n.name] = n.cloned;
      }
    }
    json class_success;  // the prompt sampler's recent success rate per balance_by value
    {
      std::lock_guard<std::mutex> l(mu_);
      iv = std::move(interval_);
      interval_ = Interval{};
      dropped_groups = dropped_groups_;
      class_success = sampler_->Success();
    }
    double n = static_cast<double>(batch.size());
    double reward = rewards / n, success = successes / n;
    json hist_json = json::object();
    for (auto [k, v] : hist) {
      hist_json[std::to_string(k)] = v;
    }
    json dropped_json = json(iv.dropped);
    json line = {
        {"step", m->step},
        {"version", m->version},
        {"time_s", Seconds(now - t0_)},
        {"reward_mean", reward},
        {"success_rate", success},
        {"samples", batch.size()},
        {"groups", groups},
        {"over_stale", over_stale},
        {"dropped_stale", dropped_stale},
        {"dropped", dropped_json},
        {"dropped_groups", dropped_groups},
        {"staleness", hist_json},
        {"gen_tokens_per_s", static_cast<double>(iv.generated_tokens) / span},
        {"train_tokens_per_s", m->tokens_per_second},
        {"cache_hit_rate", iv.later_prompt_tokens > 0
                               ? static_cast<double>(iv.later_cached_tokens) /
                                     static_cast<double>(iv.later_prompt_tokens)
                               : 0.0},
        {"tool_ms_p50", Percentile(iv.tool_ms, 0.5)},
        {"tool_ms_p99", Percentile(iv.tool_ms, 0.99)},
        {"tool_calls", iv.tool_ms.size()},
        {"tool_failures", iv.tool_failures},
        {"sandbox_failures", iv.sandbox_failures},
        {"generate_retries", iv.generate_retries},
        {"sandbox_recoveries", sandbox_recoveries},
        {"sandboxes_by_agent", by_agent},
        {"class_success", class_success},
        {"time_split",
         {{"generate_s", iv.generate_s},
          {"tools_s", iv.tools_s},
          {"verify_s", iv.verify_s},
          {"train_s", train_s},
          {"sync_s", sync_s},
          {"wait_s", wait_s}}},
        {"engine_idle_fraction", span > 0 ? std::clamp((idle - last_idle) / span, 0.0, 1.0) : 0},
        {"loss", m->loss},
        {"kl", m->kl},
        {"entropy", m->entropy},
        {"clip_fraction", m->clip_fraction},
        {"grad_norm", m->grad_norm},
        {"logprob_diff_max", m->logprob_diff_max},
        {"logprob_agreement_max", agreement},
        {"agreement_samples", fresh.size()},
        {"min_version", m->min_version},
    };
    last = now;
    last_idle = idle;
    recent.push_back(reward);
    if (static_cast<int64_t>(recent.size()) > cfg_.run.target_window) {
      recent.pop_front();
    }
    double window = 0;
    for (double r : recent) window += r;
    window /= static_cast<double>(recent.size());
    if (cfg_.task.eval_every > 0 && m->step % cfg_.task.eval_every == 0 && !eval_prompts_.empty()) {
      auto e = Evaluate(eval_prompts_, Cat("step-", m->step));
      if (e.ok()) line["eval_success"] = *e;
    }
    Metric(line);
    run_metrics_->ObserveStep(line);
    std::string stale_text;
    for (auto [k, v] : hist) {
      stale_text += Cat(stale_text.empty() ? "" : ",", k, ":", v);
    }
    spdlog::info(
        "step {} v{} reward {:.3f} success {:.3f} samples {} stale {{{}}} over-stale {} gen {:.0f} "
        "tok/s train {:.0f} tok/s cache {:.2f} tool p50 {:.1f} ms p99 {:.1f} ms sandbox "
        "failures {} | {:.1f} s",
        m->step, m->version, reward, success, batch.size(), stale_text, over_stale,
        line["gen_tokens_per_s"].get<double>(), m->tokens_per_second,
        line["cache_hit_rate"].get<double>(), line["tool_ms_p50"].get<double>(),
        line["tool_ms_p99"].get<double>(), iv.sandbox_failures, Seconds(now - t0_));
    if (cfg_.run.target_reward > 0 && !target_time &&
        static_cast<int64_t>(recent.size()) >= cfg_.run.target_window &&
        window >= cfg_.run.target_reward) {
      target_time = Seconds(now - t0_);
      spdlog::info("target reward {} reached (mean of the last {} steps {:.3f}) at {:.1f} s",
                   cfg_.run.target_reward, cfg_.run.target_window, window, *target_time);
      Metric({{"event", "target_reached"},
              {"step", m->step},
              {"time_s", *target_time},
              {"reward_window", window}});
      break;
    }
  }
  StopWorkers();
  if (!failure.ok()) {
    return failure;
  }
  if (!cfg_.train.external) {
    BRAGG_RETURN_IF_ERROR(trainer_->SaveCheckpoint(ckpt));
  }
  json summary = {{"steps", StepsDone()},
                  {"version", version_},
                  {"trainer", cfg_.train.external ? "external" : "bragg"},
                  {"seconds", Seconds(Clock::now() - t0_)},
                  {"target_time_s", target_time ? json(*target_time) : json(nullptr)},
                  {"max_staleness", cfg_.run.max_staleness}};
  if (eval_before) summary["eval_before"] = *eval_before;
  if (!eval_prompts_.empty()) {
    BRAGG_ASSIGN_OR_RETURN(double e, Evaluate(eval_prompts_, "after"));
    summary["eval_after"] = e;
    run_metrics_->ObserveEval(e);
  }
  summary["event"] = "end";
  Metric(summary);
  BRAGG_RETURN_IF_ERROR(WriteStringToFile(cfg_.run.dir + "/summary.json", summary.dump(2) + "\n"));
  return absl::OkStatus();
}

Result<Inputs> LoadInputs(const Config& config) {
  Inputs in;
  BRAGG_ASSIGN_OR_RETURN(in.vocab, Vocab::Load(config.tokenizer.vocab));
  const Vocab& vocab = in.vocab;
  for (const std::string& s : config.task.stop) {
    auto id = vocab.Id(s);
    if (!id) {
      return absl::InvalidArgumentError(
          Cat("task.stop: ", json(s).dump(), " is not a token of ", config.tokenizer.vocab));
    }
    in.stop_ids.push_back(*id);
  }
  int64_t context = config.model.init ? config.model.init->context : 0;
  if (!config.model.path.empty()) {
    BRAGG_ASSIGN_OR_RETURN(context, ModelContext(config.model.path));
  }
  if (config.task.max_tokens > context) {
    return absl::InvalidArgumentError(Cat("task.max_tokens (", config.task.max_tokens,
                                          ") is longer than the model's context (", context, ")"));
  }
  for (const std::string& file : {config.task.prompts, config.task.eval_prompts}) {
    if (file.empty()) {
      continue;
    }
    const bool train = file == config.task.prompts;
    std::vector<Prompt>& prompts = train ? in.prompts : in.eval_prompts;
    BRAGG_ASSIGN_OR_RETURN(prompts, LoadPrompts(file, train ? config.task.balance_by : ""));
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto ids = vocab.Encode(prompts[i].text);
      if (!ids.ok()) {
        return absl::InvalidArgumentError(
            Cat(file, ": prompt ", i + 1, ": ", ids.status().message()));
      }
      if (static_cast<int64_t>(ids->size()) + config.task.max_new_tokens > config.task.max_tokens) {
        return absl::InvalidArgumentError(
            Cat(file, ": prompt ", i + 1, " is ", ids->size(),
                " tokens: with task.max_new_tokens it does not fit task.max_tokens (",
                config.task.max_tokens, ")"));
      }
    }
  }
  if (!config.warm_start.traces.empty()) {
    BRAGG_ASSIGN_OR_RETURN(std::vector<train::Trajectory> traces,
                           train::ReadTrajectories(config.warm_start.traces));
    for (const train::Trajectory& t : traces) {
      for (int32_t id : t.tokens) {
        if (id < 0 || id >= vocab.size()) {
          return absl::InvalidArgumentError(Cat(config.warm_start.traces, ": trajectory ", t.id,
                                                " holds token ", id, ", outside the vocabulary"));
        }
      }
    }
  }
  return in;
}

}  // namespace

Status Preflight(const Config& config) { return LoadInputs(config).status(); }

Result<std::vector<std::string>> EngineArgs(const Config& config) {
  BRAGG_ASSIGN_OR_RETURN(Inputs inputs, LoadInputs(config));
  BRAGG_RETURN_IF_ERROR(MakeDirs(config.run.dir + "/models"));
  BRAGG_ASSIGN_OR_RETURN(std::string model, FirstModel(config, inputs.vocab));
  return EngineFlags(config, model);
}

Status Run(const Config& config, const RunOptions& options) {
  BRAGG_ASSIGN_OR_RETURN(Inputs inputs, LoadInputs(config));
  Controller c(config, options, std::move(inputs));
  return c.Run();
}

}  // namespace bragg::rl
