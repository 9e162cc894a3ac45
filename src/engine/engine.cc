#include "engine/engine.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <functional>
#include <future>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "common/str_cat.h"
#include "engine/kv_cache.h"
#include "engine/model/checkpoint.h"
#include "engine/model/model.h"
#include "engine/sampler.h"
#include "spdlog/spdlog.h"

namespace bragg::engine {

namespace {

using Clock = std::chrono::steady_clock;

class Stream final : public RequestStream {
 public:
  explicit Stream(std::string rid, std::function<void(const std::string&)> cancel)
      : rid_(std::move(rid)), cancel_(std::move(cancel)) {
    out_.rid = rid_;
  }
  GenerateOutput Wait(size_t seen, std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, timeout, [&] { return out_.finished() || out_.output_ids.size() > seen; });
    return out_;
  }
  void Cancel() override {
    bool was_finished;
    {
      std::lock_guard<std::mutex> lock(mu_);
      was_finished = out_.finished();
    }
    if (!was_finished) {
      cancel_(rid_);
    }
  }
  const std::string& rid() const override { return rid_; }

  void Publish(const GenerateOutput& out) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      out_ = out;
    }
    cv_.notify_all();
  }

 private:
  const std::string rid_;
  std::function<void(const std::string&)> cancel_;
  std::mutex mu_;
  std::condition_variable cv_;
  GenerateOutput out_;
};

// One request inside the engine (engine thread only, apart from construction).
struct Request {
  GenerateRequest req;
  std::shared_ptr<Stream> stream;
  uint64_t seed = 0;
  uint64_t salt = 0;
  std::vector<int32_t> tokens;  // prompt, then every sampled token
  int64_t prompt_len = 0;
  std::vector<int32_t> blocks;     // block table
  std::vector<uint64_t> keys;      // chain keys of the committed leading blocks
  int64_t computed = 0;            // positions whose KV is in the cache
  std::vector<uint32_t> versions;  // per position: version id its KV was computed under
  std::vector<int32_t> experts;    // per position [moe layers, top_k], positions [0, computed)
  bool admitted_once = false;
  bool input_logprobs_done = false;
  GenerateOutput out;
  std::vector<uint32_t> out_versions;  // per output token: version id at sampling
  Clock::time_point submitted;
};

class EngineImpl final : public Engine {
 public:
  EngineImpl(EngineOptions options, std::unique_ptr<Model> model, int64_t kv_blocks)
      : options_(std::move(options)),
        model_(std::move(model)),
        config_(model_->config()),
        experts_per_token_(static_cast<int>(config_.moe_layers().size()) *
                           config_.num_experts_per_tok),
        pool_(kv_blocks, options_.block_size, experts_per_token_) {
    version_ = options_.weight_version;
    version_id_ = VersionIdLocked(version_);
    info_.model_path = options_.model_dir;
    info_.served_model_name = options_.served_model_name.empty()
                                  ? std::filesystem::path(options_.model_dir).filename().string()
                                  : options_.served_model_name;
    if (info_.served_model_name.empty()) {
      info_.served_model_name = options_.model_dir;
    }
    info_.architecture = config_.architecture;
    info_.vocab_size = config_.vocab_size;
    info_.context_length = config_.max_position_embeddings;
    info_.num_layers = config_.num_hidden_layers;
    info_.num_experts = config_.num_experts;
    info_.experts_per_token = config_.num_experts_per_tok;
    info_.moe_layers = config_.moe_layers();
    info_.eos_token_ids = config_.eos_token_ids;
    info_.dtype = model_->dtype_name();
    info_.device = options_.device == Device::kCuda ? "cuda" : "cpu";
    thread_ = std::thread([this] { Loop(); });
  }

  ~EngineImpl() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  Result<std::shared_ptr<RequestStream>> Submit(GenerateRequest r) override {
    BRAGG_RETURN_IF_ERROR(Validate(r));
    auto req = std::make_unique<Request>();
    std::lock_guard<std::mutex> lock(mu_);
    if (r.rid.empty()) {
      r.rid = Cat("bragg-", next_rid_++);
    }
    if (by_rid_.contains(r.rid)) {
      return absl::InvalidArgumentError(Cat("rid ", r.rid, " is already running"));
    }
    req->stream =
        std::make_shared<Stream>(r.rid, [this](const std::string& rid) { (void)Abort(rid); });
    req->seed = r.sampling.sampling_seed ? *r.sampling.sampling_seed
                                         : std::hash<std::string>{}(r.rid) ^ next_rid_++;
    req->salt = BlockPool::SaltKey(r.extra_key);
    req->tokens = r.input_ids;
    req->prompt_len = static_cast<int64_t>(r.input_ids.size());
    req->out.rid = r.rid;
    req->out.prompt_tokens = req->prompt_len;
    req->submitted = Clock::now();
    req->req = std::move(r);
    auto stream = req->stream;
    by_rid_[req->req.rid] = req.get();
    queue_.push_back(std::move(req));
    stats_.requests_total++;
    wake_.notify_all();
    return std::static_pointer_cast<RequestStream>(stream);
  }

  Status Abort(std::string_view rid) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_rid_.find(std::string(rid));
    if (it == by_rid_.end()) {
      return absl::NotFoundError(Cat("no running or queued request has rid ", rid));
    }
    aborts_.insert(std::string(rid));
    wake_.notify_all();
    return absl::OkStatus();
  }

  void AbortAll() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [rid, _] : by_rid_) {
      aborts_.insert(rid);
    }
    wake_.notify_all();
  }

  Status Pause(PauseMode mode) override {
    return RunOnLoop([this, mode]() -> Status {
      if (mode == PauseMode::kAbort) {
        for (auto& [rid, _] : by_rid_) {
          aborts_.insert(rid);
        }
        ApplyAbortsLocked("generation paused (mode abort)");
      } else if (mode == PauseMode::kRetract) {
        while (!running_.empty()) {
          RetractLocked(running_.size() - 1);
        }
      }
      paused_ = true;
      return absl::OkStatus();
    });
  }

  Status Continue() override {
    std::lock_guard<std::mutex> lock(mu_);
    paused_ = false;
    wake_.notify_all();
    return absl::OkStatus();
  }

  Status UpdateWeightsFromDisk(const std::string& dir, const std::string& version,
                               bool flush_cache) override {
    // Read and check everything before the engine thread is involved: a bad directory never
    // reaches the running parameters.
    BRAGG_ASSIGN_OR_RETURN(Checkpoint ck, Checkpoint::Open(dir));
    BRAGG_RETURN_IF_ERROR(model_->CheckUpdate(ck));
    return RunOnLoop([&]() -> Status {
      auto t0 = Clock::now();
      model_->ApplyUpdate(ck);
      if (flush_cache) {
        pool_.FlushAll();
      }
      version_ = version.empty() ? Cat(version_, "+") : version;
      version_id_ = VersionIdLocked(version_);
      info_.model_path = dir;
      stats_.weight_updates_total++;
      last_update_seconds_ = std::chrono::duration<double>(Clock::now() - t0).count();
      return absl::OkStatus();
    });
  }

  Status FlushCache() override {
    return RunOnLoop([this]() -> Status {
      if (!running_.empty() || !queue_.empty()) {
        return absl::FailedPreconditionError(
            "cannot flush the cache while requests are running or queued");
      }
      pool_.FlushAll();
      return absl::OkStatus();
    });
  }

  ModelInfo model_info() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return info_;
  }

  EngineStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    EngineStats s = stats_;
    s.running = static_cast<int64_t>(running_.size());
    s.queued = static_cast<int64_t>(queue_.size());
    s.kv_tokens_capacity = pool_.num_blocks() * options_.block_size;
    s.kv_tokens_used = pool_.in_use() * options_.block_size;
    s.cached_prefix_tokens = pool_.cached_blocks() * options_.block_size;
    s.paused = paused_;
    s.weight_version = version_;
    return s;
  }

 private:
  Status Validate(const GenerateRequest& r) const {
    if (r.input_ids.empty()) {
      return absl::InvalidArgumentError("input_ids is empty");
    }
    for (size_t i = 0; i < r.input_ids.size(); ++i) {
      if (r.input_ids[i] < 0 || r.input_ids[i] >= config_.vocab_size) {
        return absl::InvalidArgumentError(Cat("input_ids[", i, "] = ", r.input_ids[i],
                                              " is outside the vocabulary [0, ", config_.vocab_size,
                                              ")"));
      }
    }
    const SamplingParams& p = r.sampling;
    int64_t n = static_cast<int64_t>(r.input_ids.size());
    int64_t ctx = config_.max_position_embeddings;
    if (p.max_new_tokens < 0) {
      return absl::InvalidArgumentError("max_new_tokens must not be negative");
    }
    if (p.max_new_tokens == 0 && !r.return_logprob) {
      return absl::InvalidArgumentError(
          "max_new_tokens 0 computes nothing; set return_logprob to score the prompt");
    }
    if (n >= ctx) {
      return absl::InvalidArgumentError(Cat("the prompt has ", n, " tokens; the context is ", ctx,
                                            " (the prompt must leave room for one)"));
    }
    if (n + p.max_new_tokens > ctx) {
      return absl::InvalidArgumentError(Cat("prompt (", n, " tokens) + max_new_tokens (",
                                            p.max_new_tokens,
                                            ") exceeds the model's context length ", ctx));
    }
    int64_t kv = pool_.num_blocks() * options_.block_size;
    if (n + p.max_new_tokens > kv) {
      return absl::InvalidArgumentError(Cat("prompt + max_new_tokens (", n + p.max_new_tokens,
                                            " tokens) exceeds the KV cache (", kv,
                                            " tokens, --kv-cache-tokens)"));
    }
    if (!(p.temperature >= 0) || !std::isfinite(p.temperature)) {
      return absl::InvalidArgumentError("temperature must be a finite number >= 0");
    }
    if (!(p.top_p > 0 && p.top_p <= 1)) {
      return absl::InvalidArgumentError("top_p must be in (0, 1]");
    }
    if (p.top_k == 0 || p.top_k < -1) {
      return absl::InvalidArgumentError("top_k must be -1 (off) or at least 1");
    }
    if (!(p.min_p >= 0 && p.min_p <= 1)) {
      return absl::InvalidArgumentError("min_p must be in [0, 1]");
    }
    for (int32_t t : p.stop_token_ids) {
      if (t < 0 || t >= config_.vocab_size) {
        return absl::InvalidArgumentError(
            Cat("stop_token_ids holds ", t, ", outside the vocabulary"));
      }
    }
    if (r.logprob_start_len < -1 || r.logprob_start_len > n) {
      return absl::InvalidArgumentError(Cat("logprob_start_len must be -1 or in [0, ", n, "]"));
    }
    if (r.routed_experts_start_len < 0 || r.routed_experts_start_len > n + p.max_new_tokens) {
      return absl::InvalidArgumentError("routed_experts_start_len is past the end of the sequence");
    }
    return absl::OkStatus();
  }

  uint32_t VersionIdLocked(const std::string& v) {
    auto it = version_ids_.find(v);
    if (it != version_ids_.end()) {
      return it->second;
    }
    uint32_t id = static_cast<uint32_t>(version_names_.size());
    version_names_.push_back(v);
    version_ids_[v] = id;
    return id;
  }

  // Runs `fn` on the engine thread between steps (under mu_), waiting for its result.
  Status RunOnLoop(std::function<Status()> fn) {
    std::packaged_task<Status()> task(std::move(fn));
    auto done = task.get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (std::this_thread::get_id() == thread_.get_id()) {
        return absl::InternalError("RunOnLoop from the engine thread");
      }
      tasks_.push_back(std::move(task));
    }
    wake_.notify_all();
    return done.get();
  }

  void Publish(Request& r) {
    GenerateOutput& o = r.out;
    o.weight_version = version_;
    o.weight_versions.clear();
    for (size_t i = 0; i < r.out_versions.size();) {
      size_t j = i;
      while (j < r.out_versions.size() && r.out_versions[j] == r.out_versions[i]) {
        ++j;
      }
      o.weight_versions.push_back(
          {version_names_[r.out_versions[i]], static_cast<int64_t>(i), static_cast<int64_t>(j)});
      i = j;
    }
    if (o.finished() && r.req.return_routed_experts && experts_per_token_ > 0) {
      int64_t end = static_cast<int64_t>(r.tokens.size()) - 1;
      int64_t begin = std::min(r.req.routed_experts_start_len, end);
      end = std::min<int64_t>(end, r.computed);
      o.routed_experts.assign(r.experts.begin() + begin * experts_per_token_,
                              r.experts.begin() + std::max(begin, end) * experts_per_token_);
    }
    r.stream->Publish(o);
  }

  // Ends a request (under mu_): publishes its last state and frees its blocks.
  void FinishLocked(std::unique_ptr<Request> r, FinishReason why, std::string message = "") {
    r->out.finish = why;
    r->out.finish_message = std::move(message);
    if (why == FinishReason::kAbort) {
      stats_.aborted_total++;
    }
    CommitFullBlocks(*r);
    pool_.Release(r->blocks);
    r->blocks.clear();
    Publish(*r);
    by_rid_.erase(r->req.rid);
  }

  // Publishes every full block of `r` not yet committed.
  void CommitFullBlocks(Request& r) {
    const int bs = options_.block_size;
    int64_t full = r.computed / bs;
    while (static_cast<int64_t>(r.keys.size()) < full) {
      int64_t i = static_cast<int64_t>(r.keys.size());
      uint64_t parent = i == 0 ? r.salt : r.keys[i - 1];
      std::span<const int32_t> toks(r.tokens.data() + i * bs, bs);
      std::span<const uint32_t> vers(r.versions.data() + i * bs, bs);
      std::span<const int32_t> exps;
      if (experts_per_token_ > 0) {
        exps = std::span<const int32_t>(r.experts.data() + i * bs * experts_per_token_,
                                        static_cast<size_t>(bs) * experts_per_token_);
      }
      r.keys.push_back(pool_.Commit(r.blocks[i], parent, toks, vers, exps));
    }
  }

  // Sends running request `i` back to the front of the queue, its blocks released (their full
  // ones stay cached, so re-admission usually finds them).
  void RetractLocked(size_t i) {
    std::unique_ptr<Request> r = std::move(running_[i]);
    running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
    CommitFullBlocks(*r);
    pool_.Release(r->blocks);
    r->blocks.clear();
    r->keys.clear();
    r->computed = 0;
    r->versions.clear();
    r->experts.clear();
    if (!r->input_logprobs_done) {
      r->out.input_logprobs.clear();  // recomputed from logprob_start_len on re-admission
    }
    stats_.retracted_total++;
    queue_.push_front(std::move(r));
  }

  void ApplyAbortsLocked(const std::string& message) {
    if (aborts_.empty()) {
      return;
    }
    for (size_t i = 0; i < running_.size();) {
      if (aborts_.erase(running_[i]->req.rid) > 0) {
        auto r = std::move(running_[i]);
        running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
        FinishLocked(std::move(r), FinishReason::kAbort, message);
      } else {
        ++i;
      }
    }
    for (size_t i = 0; i < queue_.size();) {
      if (aborts_.erase(queue_[i]->req.rid) > 0) {
        auto r = std::move(queue_[i]);
        queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(i));
        FinishLocked(std::move(r), FinishReason::kAbort, message);
      } else {
        ++i;
      }
    }
    aborts_.clear();
  }

  // Moves queued requests into the running set while blocks and slots allow (under mu_).
  void AdmitLocked() {
    const int bs = options_.block_size;
    while (!queue_.empty() && static_cast<int>(running_.size()) < options_.max_running) {
      Request& r = *queue_.front();
      int64_t n = static_cast<int64_t>(r.tokens.size());
      // At least one position is computed (its logits sample the next token); input log-probs
      // need the positions they score computed, not matched.
      int64_t limit = n - 1;
      bool want_input =
          r.req.return_logprob && r.req.logprob_start_len >= 0 && !r.input_logprobs_done;
      if (want_input) {
        limit = std::min<int64_t>(limit, std::max<int64_t>(r.req.logprob_start_len - 1, 0));
      }
      std::vector<uint64_t> keys;
      std::vector<int32_t> matched = pool_.Match(r.salt, r.tokens, limit / bs, &keys);
      int64_t need = (n + bs - 1) / bs - static_cast<int64_t>(matched.size());
      std::vector<int32_t> fresh;
      // Leave each running request a block for its next token: admitting into the last free
      // blocks would only retract someone on the next step (and a retracted request, admitted
      // straight back, would thrash).
      int64_t headroom = static_cast<int64_t>(running_.size());
      if (pool_.available() - need < headroom || !pool_.Allocate(need, &fresh)) {
        pool_.Release(matched);
        break;
      }
      std::unique_ptr<Request> owned = std::move(queue_.front());
      queue_.pop_front();
      r.blocks = matched;
      r.blocks.insert(r.blocks.end(), fresh.begin(), fresh.end());
      r.keys = std::move(keys);
      r.computed = static_cast<int64_t>(matched.size()) * bs;
      r.versions.clear();
      r.experts.clear();
      for (int32_t b : matched) {
        auto v = pool_.versions(b);
        r.versions.insert(r.versions.end(), v.begin(), v.end());
        if (experts_per_token_ > 0) {
          auto e = pool_.experts(b);
          r.experts.insert(r.experts.end(), e.begin(), e.end());
        }
      }
      if (!r.admitted_once) {
        r.admitted_once = true;
        r.out.cached_tokens = r.computed;
        stats_.cached_tokens_total += r.computed;
        stats_.prompt_tokens_total += r.prompt_len;
      }
      running_.push_back(std::move(owned));
    }
  }

  // Makes sure running request `r` has a block for position `pos`, retracting the most recently
  // admitted other requests while the cache is full. False when `r` is alone and still does not
  // fit (Submit's checks make that unreachable short of a bug).
  bool EnsureBlock(Request* r, int64_t pos) {
    const int bs = options_.block_size;
    while (static_cast<int64_t>(r->blocks.size()) * bs <= pos) {
      std::vector<int32_t> b;
      if (pool_.Allocate(1, &b)) {
        r->blocks.push_back(b[0]);
        continue;
      }
      size_t victim = running_.size();
      for (size_t j = running_.size(); j-- > 0;) {
        if (running_[j].get() != r) {
          victim = j;
          break;
        }
      }
      if (victim == running_.size()) {
        return false;
      }
      RetractLocked(victim);
    }
    return true;
  }

  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      wake_.wait(lock, [this] {
        return stopping_ || !tasks_.empty() || !aborts_.empty() ||
               (!paused_ && (!running_.empty() || !queue_.empty()));
      });
      if (stopping_) {
        for (auto& r : running_) {
          r->out.finish = FinishReason::kAbort;
          r->out.finish_message = "the engine is shutting down";
          Publish(*r);
        }
        for (auto& r : queue_) {
          r->out.finish = FinishReason::kAbort;
          r->out.finish_message = "the engine is shutting down";
          Publish(*r);
        }
        for (auto& t : tasks_) {
          t();
        }
        return;
      }
      while (!tasks_.empty()) {
        auto t = std::move(tasks_.front());
        tasks_.pop_front();
        t();
      }
      ApplyAbortsLocked("aborted by request");
      if (paused_) {
        continue;
      }
      AdmitLocked();
      if (running_.empty()) {
        continue;
      }
      Step(lock);
    }
  }

  // One forward step over the running requests: every decoding request's next token, then
  // prompt chunks up to the prefill budget.
  void Step(std::unique_lock<std::mutex>& lock) {
    struct Planned {
      Request* r;
      int64_t begin, end;  // positions forwarded
      bool sample;
      bool all_logits;
    };
    std::vector<Planned> plan;
    int64_t budget = options_.chunked_prefill;
    // Decodes first (one token each), then prefills in admission order.
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t i = 0; i < running_.size(); ++i) {
        Request* r = running_[i].get();
        int64_t n = static_cast<int64_t>(r->tokens.size());
        int64_t pending = n - r->computed;
        bool decode = pending == 1;
        if ((pass == 0) != decode || pending <= 0) {
          continue;
        }
        int64_t take = decode ? 1 : std::min(pending, budget);
        if (!decode && take <= 0) {
          continue;
        }
        size_t running_before = running_.size();
        if (!EnsureBlock(r, r->computed + take - 1)) {
          FinishLocked(
              [&] {
                auto owned = std::move(running_[i]);
                running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
                return owned;
              }(),
              FinishReason::kAbort, "the KV cache cannot hold this request");
          plan.clear();
          return;  // the running set changed; plan again on the next step
        }
        if (running_.size() != running_before) {
          // Requests were retracted to make room: drop them from this step's plan (their blocks
          // are released) and find `r` again (it may have moved down).
          std::erase_if(plan, [this](const Planned& p) {
            return std::none_of(running_.begin(), running_.end(),
                                [&](const std::unique_ptr<Request>& x) { return x.get() == p.r; });
          });
          i = static_cast<size_t>(
              std::find_if(running_.begin(), running_.end(),
                           [r](const std::unique_ptr<Request>& x) { return x.get() == r; }) -
              running_.begin());
        }
        bool want_input =
            r->req.return_logprob && r->req.logprob_start_len >= 0 && !r->input_logprobs_done;
        plan.push_back({r, r->computed, r->computed + take, r->computed + take == n, want_input});
        if (!decode) {
          budget -= take;
        }
      }
    }
    if (plan.empty()) {
      return;
    }
    std::vector<SeqChunk> chunks;
    chunks.reserve(plan.size());
    for (const Planned& p : plan) {
      SeqChunk c;
      c.tokens = std::span<const int32_t>(p.r->tokens.data() + p.begin, p.end - p.begin);
      c.start = p.begin;
      c.block_table = p.r->blocks;
      c.all_logits = p.all_logits;
      chunks.push_back(c);
    }
    uint32_t version = version_id_;
    lock.unlock();
    auto t0 = Clock::now();
    ForwardOutput& fwd = fwd_;
    Status st = model_->Forward(chunks, &fwd);
    double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    // Each sampling request's next token, drawn on the model's threads before the lock is taken
    // again: a draw at temperature > 0 passes over its whole row in double (and sorts candidates
    // where a cut needs them), and 32 of them one after another took as long as the forward.
    // Only this thread changes a running request, so they read without the lock.
    const int64_t V = config_.vocab_size;
    std::vector<Sampled> sampled(plan.size());
    std::vector<int64_t> sample_rows(plan.size(), -1);
    if (st.ok()) {
      int64_t row = 0;
      for (size_t i = 0; i < plan.size(); ++i) {
        const Planned& p = plan[i];
        const int64_t n_new = p.all_logits ? p.end - p.begin : 1;
        if (p.sample &&
            static_cast<int64_t>(p.r->out.output_ids.size()) < p.r->req.sampling.max_new_tokens) {
          sample_rows[i] = row + n_new - 1;
        }
        row += n_new;
      }
      const int64_t count = static_cast<int64_t>(plan.size());
      const int threads = model_->threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (count > 1)
      for (int64_t i = 0; i < count; ++i) {
        if (sample_rows[i] >= 0) {
          const Request& r = *plan[i].r;
          sampled[i] = Sample(std::span<const float>(fwd.logits.data() + sample_rows[i] * V, V),
                              r.req.sampling, r.seed, static_cast<int64_t>(r.out.output_ids.size()),
                              r.req.return_logprob);
        }
      }
    }
    lock.lock();
    stats_.step_seconds_total += seconds;
    if (!st.ok()) {
      spdlog::error("engine step failed: {}", st.ToString());
      for (const Planned& p : plan) {
        aborts_.insert(p.r->req.rid);
      }
      ApplyAbortsLocked(st.ToString());
      return;
    }
    size_t row = 0, tok = 0;
    std::vector<Request*> finished;
    for (size_t pi = 0; pi < plan.size(); ++pi) {
      const Planned& p = plan[pi];
      Request& r = *p.r;
      int64_t n_new = p.end - p.begin;
      r.computed = p.end;
      r.versions.insert(r.versions.end(), n_new, version);
      if (experts_per_token_ > 0) {
        r.experts.insert(r.experts.end(), fwd.experts.begin() + tok * experts_per_token_,
                         fwd.experts.begin() + (tok + n_new) * experts_per_token_);
      }
      tok += n_new;
      if (p.all_logits) {
        // Input log-probs: the logits at position i score token i + 1.
        int64_t start = r.req.logprob_start_len;
        if (r.out.input_logprobs.empty() && start == 0) {
          r.out.input_logprobs.push_back(NAN);
        }
        for (int64_t j = 0; j < n_new; ++j) {
          int64_t pos = p.begin + j;
          if (pos + 1 < r.prompt_len && pos + 1 >= std::max<int64_t>(start, 1)) {
            std::span<const float> lr(fwd.logits.data() + (row + j) * V, V);
            r.out.input_logprobs.push_back(
                LogProb(lr, r.req.sampling.temperature, r.tokens[pos + 1]));
          }
        }
        if (p.end >= r.prompt_len) {
          r.input_logprobs_done = true;
        }
        row += n_new;
      } else {
        row += 1;
      }
      CommitFullBlocks(r);
      if (!p.sample) {
        continue;
      }
      int64_t produced = static_cast<int64_t>(r.out.output_ids.size());
      if (produced >= r.req.sampling.max_new_tokens) {
        finished.push_back(&r);  // max_new_tokens 0: the prompt was scored
        continue;
      }
      const Sampled& s = sampled[pi];  // drawn above, at row sample_rows[pi]
      r.tokens.push_back(s.token);
      r.out.output_ids.push_back(s.token);
      r.out_versions.push_back(version);
      if (r.req.return_logprob) {
        r.out.output_logprobs.push_back(s.logprob);
      }
      stats_.generation_tokens_total++;
      const SamplingParams& sp = r.req.sampling;
      bool stop =
          std::find(sp.stop_token_ids.begin(), sp.stop_token_ids.end(), s.token) !=
              sp.stop_token_ids.end() ||
          (!sp.ignore_eos && std::find(config_.eos_token_ids.begin(), config_.eos_token_ids.end(),
                                       s.token) != config_.eos_token_ids.end());
      std::optional<std::string> matched;
      if (!stop && r.req.stop_check) {
        matched = r.req.stop_check(r.out.output_ids);
      }
      if (stop) {
        r.out.matched_stop = s.token;
        r.out.finish = FinishReason::kStop;
        finished.push_back(&r);
      } else if (matched) {
        r.out.matched_stop_string = std::move(matched);
        r.out.finish = FinishReason::kStop;
        finished.push_back(&r);
      } else if (produced + 1 >= sp.max_new_tokens) {
        finished.push_back(&r);
      } else {
        Publish(r);
      }
    }
    for (Request* f : finished) {
      auto it = std::find_if(running_.begin(), running_.end(),
                             [f](const std::unique_ptr<Request>& x) { return x.get() == f; });
      std::unique_ptr<Request> owned = std::move(*it);
      running_.erase(it);
      FinishReason why =
          owned->out.finish == FinishReason::kStop ? FinishReason::kStop : FinishReason::kLength;
      FinishLocked(std::move(owned), why);
    }
  }

  const EngineOptions options_;
  std::unique_ptr<Model> model_;
  ForwardOutput fwd_;  // the step's output, its memory kept from step to step (Step only)
  const ModelConfig config_;
  const int experts_per_token_;

  mutable std::mutex mu_;
  std::condition_variable wake_;
  BlockPool pool_;
  std::deque<std::unique_ptr<Request>> queue_;
  std::vector<std::unique_ptr<Request>> running_;
  std::unordered_map<std::string, Request*> by_rid_;
  std::set<std::string> aborts_;
  std::deque<std::packaged_task<Status()>> tasks_;
  bool paused_ = false;
  bool stopping_ = false;
  std::string version_;
  uint32_t version_id_ = 0;
  std::vector<std::string> version_names_;
  std::unordered_map<std::string, uint32_t> version_ids_;
  ModelInfo info_;
  EngineStats stats_;
  double last_update_seconds_ = 0;
  uint64_t next_rid_ = 0;
  std::thread thread_;
};

}  // namespace

std::string Engine::CpuRuntime() { return DescribeCpuRuntime(); }

Result<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  if (options.max_running <= 0 || options.block_size <= 0 || options.chunked_prefill <= 0) {
    return absl::InvalidArgumentError(
        "max_running, block_size and chunked_prefill must be positive");
  }
  BRAGG_ASSIGN_OR_RETURN(Checkpoint ck, Checkpoint::Open(options.model_dir));
  const ModelConfig& c = ck.config();
  ModelOptions mo;
  mo.cuda = options.device == Device::kCuda;
  DType dtype = options.dtype ? *options.dtype
                              : (c.torch_dtype == "bfloat16" ? DType::kBFloat16 : DType::kFloat32);
  mo.bf16 = dtype == DType::kBFloat16;
  mo.threads = options.threads;
  mo.block_size = options.block_size;
  mo.deterministic = options.deterministic;
  int64_t tokens = options.kv_cache_tokens > 0
                       ? options.kv_cache_tokens
                       : std::min<int64_t>(int64_t{options.max_running} * c.max_position_embeddings,
                                           int64_t{1} << 18);
  mo.kv_blocks = std::max<int64_t>(1, tokens / options.block_size);
  BRAGG_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, Model::Load(ck, mo));
  return std::unique_ptr<Engine>(new EngineImpl(options, std::move(model), mo.kv_blocks));
}

}  // namespace bragg::engine
