#pragma once

// bragg-engine's core: a Qwen3 (dense or MoE) model on libtorch behind a continuous-batching
// scheduler with a block KV cache and a radix prefix cache. The HTTP server (server.h) is the
// part's door for users; this header is the door for the server and for in-process callers
// (tests, benchmarks, a trainer's parity check). No torch type appears here: including this
// header costs a normal translation unit, not libtorch's.
//
// Threading: every method is thread-safe. One engine thread runs the model; requests are
// submitted from any thread and their progress is read from their RequestStream.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace bragg::engine {

enum class Device { kCpu, kCuda };
enum class DType { kFloat32, kBFloat16 };

struct EngineOptions {
  std::string model_dir;  // a Hugging Face directory: config.json + *.safetensors
  Device device = Device::kCpu;
  std::optional<DType> dtype;     // default: the checkpoint's torch_dtype (bf16 or fp32)
  int threads = 0;                // intra-op threads; 0: one per CPU the process may run on
  int max_running = 64;           // requests decoded together at most
  int64_t kv_cache_tokens = 0;    // KV capacity in tokens; 0: enough for max_running x context
  int block_size = 1;             // tokens per KV block (1: the prefix cache is exact to the
                                  // token, as SGLang's default page size)
  int64_t chunked_prefill = 512;  // prompt tokens computed per step at most (all requests)
  bool deterministic = false;     // batch-invariant kernels (docs/engine.md)
  std::string weight_version = "0";
  std::string served_model_name;  // default: the model directory's name
};

// SGLang's sampling_params (the subset Bragg serves). Defaults are SGLang's.
struct SamplingParams {
  int64_t max_new_tokens = 128;
  float temperature = 1.0f;  // 0: greedy
  float top_p = 1.0f;
  int64_t top_k = -1;  // -1: off
  float min_p = 0.0f;
  std::vector<int32_t> stop_token_ids;
  std::optional<uint64_t> sampling_seed;  // same seed, same prompt, same weights: same tokens
  bool ignore_eos = false;
};

struct GenerateRequest {
  std::string rid;  // empty: the engine names it
  std::vector<int32_t> input_ids;
  SamplingParams sampling;
  bool return_logprob = false;
  int64_t logprob_start_len = -1;  // -1: no input log-probs; k: input tokens [k, n) get theirs
  bool return_routed_experts = false;
  int64_t routed_experts_start_len = 0;  // experts of positions [this, tokens - 1) are returned
  std::string extra_key;                 // cache salt: prefixes match only under the same key
  // Stop strings and regexes (SGLang's sampling_params.stop and stop_regex), matched by the
  // caller, who has the tokenizer:
  // called on the engine thread after each sampled token that did not already end the request,
  // with the output so far. A returned string ends the request there (finish stop,
  // matched_stop_string). Must be quick and must not call into the engine.
  std::function<std::optional<std::string>(std::span<const int32_t> output_ids)> stop_check;
};

// Output tokens [start, end) were sampled under weight version `version`.
struct VersionSpan {
  std::string version;
  int64_t start = 0;
  int64_t end = 0;
};

enum class FinishReason { kNone, kStop, kLength, kAbort };

// The state of one request, cumulative: each update carries everything so far.
struct GenerateOutput {
  std::string rid;
  std::vector<int32_t> output_ids;
  std::vector<float> output_logprobs;  // one per output id when return_logprob
  std::vector<float> input_logprobs;   // input tokens [logprob_start_len, n); the first is NaN at 0
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;  // prompt tokens served from the prefix cache
  FinishReason finish = FinishReason::kNone;
  std::optional<int32_t> matched_stop;             // the stop token that ended it, if one did
  std::optional<std::string> matched_stop_string;  // or the stop string (stop_check)
  std::string finish_message;                      // why an abort happened
  std::string weight_version;                      // the version when the last token was sampled
  std::vector<VersionSpan> weight_versions;
  // int32 [positions, layers, top_k] for positions [routed_experts_start_len, tokens - 1) where
  // tokens = prompt + output; empty for a dense model or when not asked for.
  std::vector<int32_t> routed_experts;
  bool finished() const { return finish != FinishReason::kNone; }
};

// A submitted request's progress. Thread-safe; the engine keeps it alive while it runs.
class RequestStream {
 public:
  virtual ~RequestStream() = default;
  // Waits until the output has more tokens than `seen_tokens`, or finished, or `timeout`.
  // Returns the current state (finished() tells the end).
  virtual GenerateOutput Wait(size_t seen_tokens, std::chrono::milliseconds timeout) = 0;
  // The client went away: abort the request and free its KV blocks.
  virtual void Cancel() = 0;
  virtual const std::string& rid() const = 0;
};

struct ModelInfo {
  std::string model_path;
  std::string served_model_name;
  std::string architecture;  // Qwen3ForCausalLM | Qwen3MoeForCausalLM
  int64_t vocab_size = 0;
  int64_t context_length = 0;
  int num_layers = 0;
  int num_experts = 0;  // 0: dense
  int experts_per_token = 0;
  std::vector<int> moe_layers;  // layer indices that route (routed_experts' layer axis)
  std::vector<int32_t> eos_token_ids;
  std::string dtype;   // float32 | bfloat16
  std::string device;  // cpu | cuda
};

struct EngineStats {
  int64_t running = 0;
  int64_t queued = 0;
  int64_t kv_tokens_used = 0;
  int64_t kv_tokens_capacity = 0;
  int64_t cached_prefix_tokens = 0;  // tokens held by the radix cache
  int64_t prompt_tokens_total = 0;
  int64_t cached_tokens_total = 0;
  int64_t generation_tokens_total = 0;
  int64_t requests_total = 0;
  int64_t aborted_total = 0;
  int64_t retracted_total = 0;
  int64_t weight_updates_total = 0;
  double step_seconds_total = 0;
  bool paused = false;
  std::string weight_version;
};

enum class PauseMode {
  kAbort,    // abort every running and queued request
  kInPlace,  // stop stepping; running requests keep their KV and resume on continue
  kRetract,  // running requests go back to the queue, their KV kept in the prefix cache
};

class Engine {
 public:
  // Loads the model and starts the engine thread. InvalidArgument/NotFound on a bad directory.
  static Result<std::unique_ptr<Engine>> Create(const EngineOptions& options);
  virtual ~Engine() = default;

  // The CPU math of this process once an engine is created: torch's threads and the BLAS
  // library (its file, and how it is threaded). Logged at start; for benchmarks.
  static std::string CpuRuntime();

  // Validates (InvalidArgument naming the problem: ids out of vocabulary, a prompt that does not
  // fit the context, max_new_tokens past it, a duplicate rid) and enqueues.
  virtual Result<std::shared_ptr<RequestStream>> Submit(GenerateRequest request) = 0;
  // NotFound if no running or queued request has this rid.
  virtual Status Abort(std::string_view rid) = 0;
  virtual void AbortAll() = 0;

  virtual Status Pause(PauseMode mode) = 0;
  virtual Status Continue() = 0;
  // Loads `model_dir` into the running parameters in place: every tensor is read and checked
  // (names, shapes, dtypes) before any parameter is touched, so a bad directory leaves the
  // running weights as they were (InvalidArgument/NotFound). Pauses stepping while it copies;
  // requests in flight continue on the new weights. The KV cache is kept unless flush_cache.
  virtual Status UpdateWeightsFromDisk(const std::string& model_dir,
                                       const std::string& weight_version, bool flush_cache) = 0;
  // Drops every cached prefix not in use. FailedPrecondition while requests run (as SGLang).
  virtual Status FlushCache() = 0;

  virtual ModelInfo model_info() const = 0;
  virtual EngineStats stats() const = 0;
};

// Names for the wire: "stop" | "length" | "abort" | "" (not finished).
inline std::string_view FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kAbort:
      return "abort";
    case FinishReason::kNone:
      break;
  }
  return "";
}

}  // namespace bragg::engine
