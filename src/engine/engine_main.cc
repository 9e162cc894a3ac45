// bragg-engine --model DIR --listen HOST:PORT [--device cpu|cuda] [--dtype float32|bfloat16]
//              [--threads N] [--max-running N] [--kv-cache-tokens N] [--deterministic]
//              [--weight-version V]
// An SGLang-API inference server for Qwen3 dense and MoE models (docs/engine.md).

#include <CLI/CLI.hpp>
#include <filesystem>
#include <memory>
#include <optional>
#include <thread>

#include "common/blas_core.h"
#include "common/logging.h"
#include "common/serve.h"
#include "engine/engine.h"
#include "engine/server/server.h"
#include "engine/tokenizer.h"
#include "spdlog/spdlog.h"

int main(int argc, char** argv) {
  bragg::ReexecForKnownBlasCore(argv);  // before anything else runs
  CLI::App app{"bragg-engine: an SGLang-API inference server for Qwen3 models on libtorch"};
  bragg::engine::EngineOptions o;
  std::string listen = "127.0.0.1:30000", device = "cpu", dtype = "auto", log_level = "info";
  std::optional<std::string> api_key;
  app.add_option("--model,--model-path", o.model_dir, "Hugging Face model directory")->required();
  app.add_option("--listen", listen, "HOST:PORT to serve on (port 0: any free port)");
  app.add_option("--device", device, "cpu | cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--dtype", dtype, "float32 | bfloat16 | auto (the checkpoint's)")
      ->check(CLI::IsMember({"auto", "float32", "bfloat16"}));
  app.add_option("--threads", o.threads,
                 "compute threads (0: one per CPU this process may run on)");
  app.add_option("--max-running", o.max_running, "requests decoded together at most");
  app.add_option("--kv-cache-tokens", o.kv_cache_tokens,
                 "KV cache capacity in tokens (0: max-running x context, at most 262144)");
  app.add_option("--chunked-prefill", o.chunked_prefill, "prompt tokens computed per step at most");
  app.add_option("--block-size", o.block_size, "tokens per KV block (the prefix cache's unit)");
  app.add_flag("--deterministic", o.deterministic,
               "batch-invariant kernels: a request's tokens and log-probs do not depend on its "
               "batch");
  app.add_option("--weight-version", o.weight_version, "the initial weights' version name");
  app.add_option("--served-model-name", o.served_model_name, "the name /v1/models reports");
  app.add_option("--api-key", api_key, "require Authorization: Bearer KEY");
  app.add_option("--log-level", log_level, "trace | debug | info | warn | error");
  std::string tokenizer_path;
  bool skip_tokenizer_init = false;
  app.add_option("--tokenizer-path", tokenizer_path,
                 "a tokenizer.json, or a directory holding one (default: the model's, if any)");
  app.add_flag("--skip-tokenizer-init", skip_tokenizer_init,
               "serve token ids only, even if the model directory has a tokenizer");
  CLI11_PARSE(app, argc, argv);
  if (bragg::Status s = bragg::InitLogging(argv[0], log_level); !s.ok()) {
    std::fprintf(stderr, "bragg-engine: %s\n", s.ToString().c_str());
    return 2;
  }
  o.device = device == "cuda" ? bragg::engine::Device::kCuda : bragg::engine::Device::kCpu;
  if (dtype == "float32") o.dtype = bragg::engine::DType::kFloat32;
  if (dtype == "bfloat16") o.dtype = bragg::engine::DType::kBFloat16;
  if (o.threads <= 0) {
    cpu_set_t set;
    o.threads = sched_getaffinity(0, sizeof(set), &set) == 0
                    ? CPU_COUNT(&set)
                    : static_cast<int>(std::thread::hardware_concurrency());
  }
  // The tokenizer: --tokenizer-path (which must load), else the model directory's tokenizer.json
  // if it has one. One of the model's own that Bragg cannot read leaves the engine serving token
  // ids, the contract, with a warning: a model must not stop serving for its text side.
  std::unique_ptr<bragg::engine::Tokenizer> tokenizer;
  bool explicit_tokenizer = !tokenizer_path.empty();
  if (!skip_tokenizer_init) {
    namespace fs = std::filesystem;
    fs::path path = explicit_tokenizer ? fs::path(tokenizer_path) : fs::path(o.model_dir);
    std::error_code ec;
    if (fs::is_directory(path, ec)) {
      path /= "tokenizer.json";
    }
    if (explicit_tokenizer || fs::exists(path, ec)) {
      auto loaded = bragg::engine::Tokenizer::Load(path.string());
      if (loaded.ok()) {
        tokenizer = *std::move(loaded);
        tokenizer_path = path.string();
      } else if (explicit_tokenizer) {
        std::fprintf(stderr, "bragg-engine: tokenizer: %s\n", loaded.status().ToString().c_str());
        return 2;
      } else {
        spdlog::warn("serving token ids only: {}", std::string(loaded.status().message()));
      }
    }
  }
  std::unique_ptr<bragg::engine::Engine> engine;
  std::optional<bragg::engine::Server> server;
  return bragg::ServeUntilTerminated(
      listen,
      [&](const bragg::HostPort& hp) -> bragg::Result<std::string> {
        BRAGG_ASSIGN_OR_RETURN(engine, bragg::engine::Engine::Create(o));
        if (tokenizer && tokenizer->size() > engine->model_info().vocab_size) {
          std::string why =
              fmt::format("the tokenizer ({}) has ids up to {}, past the model's vocabulary of {}",
                          tokenizer_path, tokenizer->size() - 1, engine->model_info().vocab_size);
          if (explicit_tokenizer) {
            return absl::InvalidArgumentError(why + ": give the model's own tokenizer");
          }
          spdlog::warn("serving token ids only: {}", why);
          tokenizer.reset();
        }
        if (tokenizer) {
          spdlog::info("tokenizer: {} ({} tokens)", tokenizer_path, tokenizer->size());
        }
        if (o.device == bragg::engine::Device::kCpu) {
          spdlog::info("CPU math: {}", bragg::engine::Engine::CpuRuntime());
        }
        bragg::engine::ServerOptions so;
        so.host = hp.host;
        so.port = hp.port;
        so.api_key = api_key;
        so.engine_options = o;
        so.tokenizer = tokenizer.get();
        so.tokenizer_path = tokenizer_path;
        server.emplace(*engine, so);
        BRAGG_RETURN_IF_ERROR(server->Start());
        return server->url();
      },
      [&] {
        server->Stop();
        engine->AbortAll();
      });
}
