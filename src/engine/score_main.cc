// bragg-engine-score: the engine's forward and greedy decoding from the command line, for checks
// against other implementations (tests/engine/test_transformers_parity.py).
//
//   bragg-engine-score --model DIR --ids IDS.json --logits OUT.f32 [--dtype float32|bfloat16]
//     writes float32 [len(ids), vocab] (little-endian) of one prefill of IDS, and prints
//     {"tokens": n, "vocab": v}
//   bragg-engine-score --model DIR --ids IDS.json --greedy N
//     prints {"output_ids": [...]}: N greedy tokens through the engine's scheduler

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/blas_core.h"
#include "engine/engine.h"
#include "engine/model/checkpoint.h"
#include "engine/model/model.h"

namespace {

using bragg::Status;
using json = nlohmann::json;

int Fail(const Status& s) {
  std::fprintf(stderr, "bragg-engine-score: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  bragg::ReexecForKnownBlasCore(argv);  // before anything else runs
  CLI::App app{"Score token ids with bragg-engine's model (logits or greedy tokens)"};
  std::string model_dir, ids_path, logits_path, dtype = "auto";
  int64_t greedy = -1;
  int threads = 0;
  app.add_option("--model", model_dir, "Hugging Face model directory")->required();
  app.add_option("--ids", ids_path, "JSON list of token ids")->required();
  app.add_option("--logits", logits_path, "write float32 [tokens, vocab] here");
  app.add_option("--greedy", greedy, "generate this many greedy tokens instead");
  app.add_option("--dtype", dtype, "float32 | bfloat16 | auto (the checkpoint's)");
  app.add_option("--threads", threads, "torch threads (0: default)");
  CLI11_PARSE(app, argc, argv);
  if ((greedy >= 0) == !logits_path.empty()) {
    std::fprintf(stderr, "bragg-engine-score: give exactly one of --logits and --greedy\n");
    return 2;
  }
  std::ifstream in(ids_path);
  json ids_json = json::parse(in, nullptr, false);
  if (ids_json.is_discarded() || !ids_json.is_array()) {
    std::fprintf(stderr, "bragg-engine-score: %s is not a JSON list\n", ids_path.c_str());
    return 2;
  }
  std::vector<int32_t> ids = ids_json.get<std::vector<int32_t>>();
  std::optional<bragg::engine::DType> want;
  if (dtype == "float32") want = bragg::engine::DType::kFloat32;
  if (dtype == "bfloat16") want = bragg::engine::DType::kBFloat16;

  if (greedy >= 0) {
    bragg::engine::EngineOptions o;
    o.model_dir = model_dir;
    o.dtype = want;
    o.threads = threads;
    o.max_running = 1;
    o.kv_cache_tokens = static_cast<int64_t>(ids.size()) + greedy + 64;
    auto engine = bragg::engine::Engine::Create(o);
    if (!engine.ok()) return Fail(engine.status());
    bragg::engine::GenerateRequest r;
    r.input_ids = ids;
    r.sampling.temperature = 0;
    r.sampling.max_new_tokens = greedy;
    r.sampling.ignore_eos = true;
    auto stream = (*engine)->Submit(r);
    if (!stream.ok()) return Fail(stream.status());
    bragg::engine::GenerateOutput out;
    do {
      out = (*stream)->Wait(out.output_ids.size(), std::chrono::seconds(60));
    } while (!out.finished());
    if (out.finish == bragg::engine::FinishReason::kAbort) {
      std::fprintf(stderr, "bragg-engine-score: aborted: %s\n", out.finish_message.c_str());
      return 1;
    }
    std::cout << json{{"output_ids", out.output_ids}}.dump() << std::endl;
    return 0;
  }

  auto ck = bragg::engine::Checkpoint::Open(model_dir);
  if (!ck.ok()) return Fail(ck.status());
  bragg::engine::ModelOptions mo;
  bool bf16 =
      want ? *want == bragg::engine::DType::kBFloat16 : ck->config().torch_dtype == "bfloat16";
  mo.bf16 = bf16;
  mo.threads = threads;
  mo.block_size = 16;
  mo.kv_blocks = (static_cast<int64_t>(ids.size()) + 15) / 16;
  auto model = bragg::engine::Model::Load(*ck, mo);
  if (!model.ok()) return Fail(model.status());
  std::vector<int32_t> table(mo.kv_blocks);
  for (int64_t i = 0; i < mo.kv_blocks; ++i) table[i] = static_cast<int32_t>(i);
  bragg::engine::SeqChunk chunk;
  chunk.tokens = ids;
  chunk.start = 0;
  chunk.block_table = table;
  chunk.all_logits = true;
  bragg::engine::ForwardOutput out;
  Status s = (*model)->Forward(std::span<const bragg::engine::SeqChunk>(&chunk, 1), &out);
  if (!s.ok()) return Fail(s);
  std::ofstream f(logits_path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(out.logits.data()),
          static_cast<std::streamsize>(out.logits.size() * sizeof(float)));
  if (!f) {
    std::fprintf(stderr, "bragg-engine-score: cannot write %s\n", logits_path.c_str());
    return 1;
  }
  std::cout << json{{"tokens", ids.size()}, {"vocab", ck->config().vocab_size}}.dump() << std::endl;
  return 0;
}
