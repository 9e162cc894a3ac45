#pragma once

// bragg-engine's HTTP door: SGLang's native API (/generate, control endpoints, /metrics) and the
// token-id subset of the OpenAI API, served over cpp-httplib in front of an Engine (engine.h).
// Token ids are the contract (input_ids in, output_ids out). With a tokenizer (tokenizer.h, the
// model directory's tokenizer.json) the text endpoints are served too: /generate's `text`,
// string prompts on /v1/completions, /v1/chat/completions (ChatML), /tokenize and /detokenize,
// and answers carry the decoded "text". Without one those are refused with 400 and "text" is "".
//
// Every field name a request may carry is listed in one table (RequestFields()); a field outside
// it is refused with 400 naming it, a known SGLang field Bragg does not implement is refused
// unless it holds its no-op value. Errors are {"error": {"message": ..., "code": N}}, as the
// gateway and its simulated worker write them.

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "common/status.h"
#include "engine/engine.h"
#include "engine/tokenizer.h"

namespace bragg::engine {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port
  // When set, every endpoint but /health, /health_generate and /metrics needs
  // "Authorization: Bearer <api_key>" (401 otherwise), as SGLang's --api-key.
  std::optional<std::string> api_key;
  // The engine's options, when the caller has them: /get_server_info reports them (the Engine
  // interface does not expose its options).
  std::optional<EngineOptions> engine_options;
  // Text in and out; null: token ids only. Not owned: must outlive the server.
  const Tokenizer* tokenizer = nullptr;
  std::string tokenizer_path;  // what /get_model_info reports
  // A request that makes no progress for this long writes a keep-alive (an SSE comment in a
  // stream, a JSON whitespace byte before a plain answer) so that a client that went away is
  // noticed and its request cancelled.
  std::chrono::milliseconds heartbeat{2000};
  size_t max_threads = 4096;  // connections served at once (one thread each)
  size_t max_batch = 4096;    // prompts in one batched /generate
  size_t max_body_bytes = size_t{256} << 20;
};

// How the server treats one request field.
enum class FieldUse {
  kServed,       // implemented
  kIgnored,      // accepted with any value and without effect (documented in `note`)
  kDefaultOnly,  // accepted only with one of `accepted` (JSON texts), refused otherwise
};

struct FieldSpec {
  std::string_view scope;  // generate | sampling_params | completions | chat_completions
                           // | tokenize | detokenize | update_weights_from_disk
                           // | abort_request | pause_generation | continue_generation
  std::string_view name;   // SGLang's (or OpenAI's) field name
  FieldUse use;
  std::string_view accepted;  // kDefaultOnly: the JSON values allowed, separated by '|'
  std::string_view note;      // one line for the docs
};

// The table of every request field the server knows, in scope order. Static storage.
std::span<const FieldSpec> RequestFields();

// Owns an HTTP server on its own thread over `engine`, which must outlive it.
// Start/Stop from one thread; handlers run on the server's threads and are thread-safe.
// The process must ignore SIGPIPE: a write to a client that hung up then fails with EPIPE, which
// is how a departed client is noticed and its request cancelled.
class Server {
 public:
  Server(Engine& engine, ServerOptions options);
  ~Server();  // Stop()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds and serves in a background thread. Unavailable if the address cannot be bound;
  // FailedPrecondition if already started.
  [[nodiscard]] Status Start();
  // Stops accepting, ends open streams (their requests are cancelled) and joins the thread.
  // Idempotent.
  void Stop();
  int port() const;
  std::string url() const;  // http://host:port

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace bragg::engine
