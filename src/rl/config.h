#pragma once

// bragg-rl's configuration: one TOML file (docs/rl.md "Configuration"). Every key is listed
// here with its default; a key not listed, a value of the wrong type or out of range is refused
// by LoadConfig with a message naming the key (InvalidArgument), before anything is started.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace bragg::rl {

// [run]
struct RunConfig {
  std::string dir = "rl-run";  // outputs: metrics.jsonl, checkpoints/, models/, plots
  uint64_t seed = 1;
  int64_t steps = 100;        // training steps (after the warm start)
  int64_t max_staleness = 2;  // no trained token older than this many versions; 0: synchronous
  double time_limit_s = 0;    // stop after this much wall-clock (0: none)
  // Stop early once the mean sampled reward of the last `target_window` steps reaches this
  // (0: never).
  double target_reward = 0;
  int64_t target_window = 3;
  int64_t checkpoint_every = 10;  // trainer checkpoints (for --resume) every N steps
  // Prometheus /metrics: "HOST:PORT" (port 0: any free one, its URL written to
  // DIR/metrics_url); "": none.
  std::string metrics_listen = "127.0.0.1:0";
};

// [model.init]: a random Qwen3 / Qwen3-MoE of this shape when [model] path is empty.
struct ModelInit {
  bool moe = true;
  int64_t hidden = 64;
  int64_t intermediate = 128;
  int layers = 2;
  int heads = 4;
  int kv_heads = 2;
  int64_t head_dim = 16;
  int experts = 4;
  int top_k = 2;
  int64_t moe_intermediate = 64;
  int64_t context = 512;
  float std = 0.02f;
  uint64_t seed = 1;
};

// [model]
struct ModelConfig {
  std::string path;  // Hugging Face directory to start from; empty: written from [model.init]
  std::optional<ModelInit> init;
};

// [tokenizer]: a character-level vocabulary (the engine takes token ids; bragg-rl turns the
// tools' text into ids with it).
struct TokenizerConfig {
  // JSON list of token strings: token i is entry i. Encoding is greedy longest match.
  std::string vocab;
};

// [task]: what a rollout is. The tool server and verifier run in the rollout's sandbox.
struct TaskConfig {
  std::string prompts;       // JSONL: {"prompt": "...", "meta": {...}} per line
  std::string eval_prompts;  // optional: held-out prompts, scored greedily every eval_every steps
  std::string files;         // optional: a directory uploaded to /task in the prepared sandbox
  std::string image;         // pbox image ("": the agent's default)
  // Long-lived tool server (docs/rl.md "Tool protocol"): reads one JSON line per model turn on
  // stdin, answers one JSON line.
  std::vector<std::string> tool_server;
  // Reads the rollout (JSON on stdin), prints its reward (a number) on stdout. Run once per
  // rollout, in its sandbox, after its last turn.
  std::vector<std::string> verifier;
  // Instead of `verifier`: the rollout's tool server scores it, answering {"verify": ROLLOUT}
  // with {"reward": X} (docs/rl.md "Tool protocol"). Saves a process per rollout (~70 ms of
  // CPU for a Python verifier).
  bool verifier_in_tool_server = false;
  // Optional: run once in the prepared sandbox, after `files` are uploaded and before any clone
  // (e.g. precomputing a table the tool server reads); must exit 0. Its files are in every
  // rollout's sandbox.
  std::vector<std::string> setup;
  int max_turns = 4;
  int64_t max_new_tokens = 32;             // per turn
  int64_t max_tokens = 512;                // whole trajectory (prompt + every turn + observations)
  std::vector<std::string> stop = {"\n"};  // tokens that end a model turn
  double tool_timeout_s = 10;
  // tool_timeout_s as a duration: what a tool call, and a verifier, may take.
  std::chrono::milliseconds tool_timeout() const {
    return std::chrono::milliseconds(static_cast<int64_t>(tool_timeout_s * 1000));
  }
  int64_t sandbox_memory_mb = 256;
  int64_t sandbox_pids = 64;
  // Prompts are drawn balanced over this meta key's values ("": uniformly over prompts).
  std::string balance_by;
  // With balance_by: a value's prompts are drawn with weight (1 - focus) + focus x (1 - its
  // recent success rate), so values the policy still fails come up more often (a group it
  // always solves teaches GRPO nothing). 0: equally.
  double focus = 0;
  int64_t eval_every = 0;  // greedy eval on eval_prompts every N steps (0: only at the end)
};

// [sampling]
struct SamplingConfig {
  double temperature = 1.0;
  double top_p = 1.0;
  int group_size = 8;  // rollouts per prompt (a GRPO group)
};

// [warm_start]: optional supervised steps before RL, on trajectories in bragg-train's JSONL.
struct WarmStartConfig {
  std::string traces;
  int64_t steps = 0;
  int64_t batch = 32;
  double lr = 1e-3;
};

// [train]
struct TrainConfig {
  double lr = 1e-4;
  int64_t groups_per_step = 8;  // GRPO groups per training step
  int minibatches = 1;
  double clip_low = 0.2, clip_high = 0.28;
  double tis_cap = 2.0;
  double kl_coef = 0;
  double entropy_coef = 0;
  double max_grad_norm = 1.0;
  // AdamW's epsilon. RL's gradients are sparse (a few decisive tokens per trajectory): with a
  // tiny epsilon, Adam moves every parameter by about lr each step, noise-only ones included,
  // which wrecks what the warm start taught; a larger one leaves those nearly still.
  double adam_eps = 1e-8;
  double weight_decay = 0;
  bool normalize_std = true;
  int threads = 1;
  int64_t max_tokens = 8192;  // tokens per packed micro-batch
  bool deterministic = true;  // the engine's batch-invariant arithmetic on both sides
  // An external trainer (docs/rl.md "An external trainer"): bragg-rl exports each step's batch
  // and, instead of training, waits for the weights of the next version to appear as
  // external_weights/vNNNNNN/ (a Hugging Face directory, renamed into place whole), then pushes
  // them to the fleet. Implies export.batches.
  bool external = false;
  std::string external_weights;      // default: run.dir/external
  double external_timeout_s = 3600;  // waiting for one version's weights at most
};

// [fleet]
struct FleetConfig {
  int engines = 2;  // local bragg-engine processes bragg-rl starts
  // Or: existing SGLang-API servers (http:// or https://). When given, engines defaults to 0;
  // engines >= 1 together with engine_urls is refused.
  std::vector<std::string> engine_urls;
  std::string gateway;  // existing bragg-gateway URL; "": bragg-rl starts one
  int engine_threads = 1;
  int64_t kv_cache_tokens = 65536;
  // One pbox endpoint, or several agents: a comma-separated list or a pbox-slurm endpoints file.
  // "": $PBOX_ENDPOINTS if set, else $PBOX_ENDPOINT, else the default socket.
  std::string pbox;
  int concurrency = 32;  // rollouts in flight at most
  std::string bin_dir;   // where bragg-engine and bragg-gateway are ("": next to bragg-rl)
};

// [export]: every step's batch written for an external trainer (Megatron-LM), as bragg_pack
// THD rows planned for its parallel layout: DIR/batches/step-NNNNNN.jsonl in
// bragg_rl.megatron's format (docs/rl.md "Scale-out").
struct ExportConfig {
  bool batches = false;
  int dp = 1;  // data-parallel ranks: each row names its rank ("dp_rank")
  int cp = 1;  // context parallelism: every sequence padded to a multiple of 2*cp*tp
  int tp = 1;
  bool sequence_parallel = false;  // with tp > 1: padded to a multiple of tp
  int64_t max_tokens = 0;          // padded tokens per row; 0: train.max_tokens
};

struct Config {
  std::string path;      // the file read, absolute ("" from ParseConfig)
  std::string base_dir;  // relative paths in the file are relative to its directory
  RunConfig run;
  ModelConfig model;
  TokenizerConfig tokenizer;
  TaskConfig task;
  SamplingConfig sampling;
  WarmStartConfig warm_start;
  TrainConfig train;
  FleetConfig fleet;
  ExportConfig export_;  // [export] (a keyword in C++)
};

// Reads and checks `path`. Relative paths in it (model.path, tokenizer.vocab, task.prompts,
// task.eval_prompts, task.files, warm_start.traces, run.dir, fleet.bin_dir) are resolved
// against its directory and made absolute and lexically normal. Files the run reads
// (tokenizer.vocab, task.prompts, and task.eval_prompts, task.files, warm_start.traces,
// model.path when set) must exist now; run.dir is created later and not checked.
// Errors: NotFound, PermissionDenied, ... naming the file when it cannot be read;
// InvalidArgument when its content is refused, one line per problem, each
// "<file>: <key path>: <what is wrong>" with " (line N)" where the key is in the file
// (a TOML syntax error: "<file>:<line>:<column>: ..."). Thread-safe (no shared state).
[[nodiscard]] Result<Config> LoadConfig(const std::string& path);
// The same from text, `name` standing for the file in messages; relative paths resolve
// against `base_dir` (itself made absolute against the working directory).
[[nodiscard]] Result<Config> ParseConfig(const std::string& text, const std::string& base_dir,
                                         const std::string& name = "config");

// "HOST:PORT" (an IPv6 host in brackets, port 0-65535) into its parts (brackets removed);
// InvalidArgument saying what is wrong.
Result<std::pair<std::string, int>> ParseHostPort(const std::string& listen);

// Every key ParseConfig accepts, as "table.key" ("model.init.layers"), in the order of the
// structs above: for the reference config's test and for documentation.
std::vector<std::string> ConfigKeys();

}  // namespace bragg::rl
