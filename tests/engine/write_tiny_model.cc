// write_tiny_model DIR [--dense] [--layers N] [--seed S] [--scale X] [--bf16] [--eos ID]
// A random tiny Qwen3(-MoE) checkpoint for tests that drive the real binaries
// (src/engine/testing/tiny_model.h).

#include <CLI/CLI.hpp>
#include <iostream>

#include "engine/testing/tiny_model.h"

int main(int argc, char** argv) {
  CLI::App app{"Write a random tiny Qwen3 checkpoint"};
  std::string dir;
  bool dense = false;
  float scale = 1.0f;
  bragg::engine::testing::TinyModelSpec s;
  int eos = -1;
  app.add_option("dir", dir, "output directory")->required();
  app.add_flag("--dense", dense, "Qwen3ForCausalLM instead of Qwen3MoeForCausalLM");
  app.add_option("--layers", s.layers, "decoder layers");
  app.add_option("--vocab", s.vocab, "vocabulary size");
  app.add_option("--seed", s.seed, "weights' seed");
  app.add_option("--scale", scale, "multiply every weight (another version of the same shapes)");
  app.add_flag("--bf16", s.bf16, "BF16 tensors");
  app.add_option("--eos", eos, "eos_token_id");
  CLI11_PARSE(app, argc, argv);
  s.moe = !dense;
  if (eos >= 0) s.eos = {eos};
  bragg::Status st = bragg::engine::testing::WriteTinyModel(dir, s, scale);
  if (!st.ok()) {
    std::cerr << "write_tiny_model: " << st << "\n";
    return 1;
  }
  return 0;
}
