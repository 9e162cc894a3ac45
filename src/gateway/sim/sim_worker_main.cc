// bragg-sim-worker --listen 127.0.0.1:PORT [--cache-tokens N] [--seed S]

#include <CLI/CLI.hpp>
#include <optional>

#include "common/logging.h"
#include "gateway/http_util.h"
#include "gateway/sim/sim_worker.h"

int main(int argc, char** argv) {
  CLI::App app{"Simulated SGLang worker for the Bragg gateway"};
  std::string listen = "127.0.0.1:30000";
  bragg::gateway::SimWorkerOptions o;
  app.add_option("--listen", listen, "HOST:PORT to serve on (port 0: any)");
  app.add_option("--cache-tokens", o.cache_tokens, "prefix cache capacity in tokens");
  app.add_option("--seed", o.seed, "seed of the output tokens");
  app.add_option("--vocab", o.vocab, "output token ids are below this")->check(CLI::PositiveNumber);
  app.add_option("--prefill-us", o.prefill_us_per_token, "microseconds per uncached prompt token");
  app.add_option("--decode-us", o.decode_us_per_token, "microseconds per output token");
  app.add_option("--moe-layers", o.moe.layers, "MoE layers in routed_experts");
  app.add_option("--moe-topk", o.moe.top_k, "experts per token per layer");
  app.add_option("--num-experts", o.moe.num_experts, "experts per layer");
  app.add_option("--weight-version", o.weight_version, "initial weight version");
  app.add_option("--model-path", o.model_path, "initial model path");
  app.add_flag("--noop", o.noop, "answer /generate at once with a fixed body");
  app.add_option("--api-key", o.api_key,
                 "calls but /health and /sim/ need Authorization: Bearer KEY (SGLang's)");
  CLI11_PARSE(app, argc, argv);
  (void)bragg::InitLogging(argv[0], "info");
  std::optional<bragg::gateway::SimWorker> worker;
  return bragg::gateway::ServeUntilTerminated(
      listen,
      [&](const bragg::gateway::HostPort& hp) -> bragg::Result<std::string> {
        o.host = hp.host;
        o.port = hp.port;
        worker.emplace(o);
        BRAGG_RETURN_IF_ERROR(worker->Start());
        return worker->url();
      },
      [&] { worker->Stop(); });
}
