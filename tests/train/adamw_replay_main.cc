// train_adamw_replay DIR: runs OffloadAdamW over a recorded sequence of grads, for checks against
// torch itself (adamw_torch_test.py). DIR holds
//   config.json  {"shapes": [[...], ...], "steps": N, "lr", "beta1", "beta2", "eps",
//                 "weight_decay", "max_grad_norm", "chunk_elements"}
//   params.bin   the initial parameters, FP32 little-endian, concatenated in order
//   grads.bin    N steps of grads, each laid out like params.bin
// and receives
//   state.bin    the final parameters, exp_avg and exp_avg_sq, each laid out like params.bin
//   norms.json   {"grad_norms": [...]} (one per step; 0 without clipping)
// Exit code 0, or 1 with the error on stderr.

#include <cstdio>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "train/optim/offload_adamw.h"

namespace bragg::train {
namespace {

Result<std::vector<float>> ReadFloats(const std::string& path, int64_t count) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return ErrnoError("open", path);
  }
  std::vector<float> out(static_cast<size_t>(count));
  in.read(reinterpret_cast<char*>(out.data()), count * 4);
  if (in.gcount() != count * 4) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected ", count * 4, " bytes, got ", in.gcount()));
  }
  return out;
}

Status Run(const std::string& dir) {
  std::ifstream config_file(dir + "/config.json");
  if (!config_file) {
    return ErrnoError("open", dir + "/config.json");
  }
  const nlohmann::json config = nlohmann::json::parse(config_file, nullptr, false);
  if (config.is_discarded()) {
    return absl::InvalidArgumentError(dir + "/config.json is not JSON");
  }
  AdamWOptions o;
  o.lr = config.at("lr");
  o.beta1 = config.at("beta1");
  o.beta2 = config.at("beta2");
  o.eps = config.at("eps");
  o.weight_decay = config.at("weight_decay");
  o.max_grad_norm = config.at("max_grad_norm");
  o.chunk_elements = config.at("chunk_elements");
  const int steps = config.at("steps");
  std::vector<std::vector<int64_t>> shapes = config.at("shapes");
  int64_t total = 0;
  for (const auto& s : shapes) {
    total += c10::multiply_integers(s);
  }
  BRAGG_ASSIGN_OR_RETURN(std::vector<float> init, ReadFloats(dir + "/params.bin", total));
  BRAGG_ASSIGN_OR_RETURN(std::vector<float> grads, ReadFloats(dir + "/grads.bin", total * steps));
  torch::Tensor init_t = torch::from_blob(init.data(), {total}, torch::kFloat);
  torch::Tensor grads_t = torch::from_blob(grads.data(), {steps, total}, torch::kFloat);

  std::vector<std::pair<std::string, torch::Tensor>> params;
  int64_t offset = 0;
  std::vector<int64_t> offsets;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const int64_t n = c10::multiply_integers(shapes[i]);
    offsets.push_back(offset);
    params.emplace_back(
        "p" + std::to_string(i),
        init_t.narrow(0, offset, n).view(shapes[i]).clone().set_requires_grad(true));
    offset += n;
  }
  BRAGG_ASSIGN_OR_RETURN(auto opt, OffloadAdamW::Create(params, o));
  nlohmann::json norms = nlohmann::json::array();
  for (int step = 0; step < steps; ++step) {
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].second.mutable_grad() =
          grads_t[step].narrow(0, offsets[i], params[i].second.numel()).view(shapes[i]).clone();
    }
    BRAGG_ASSIGN_OR_RETURN(StepStats stats, opt->Step());
    norms.push_back(stats.grad_norm);
  }
  std::ofstream out(dir + "/state.bin", std::ios::binary);
  auto state = opt->StateTensors();
  auto write = [&](const std::string& suffix) {
    for (size_t i = 0; i < params.size(); ++i) {
      for (const auto& [name, t] : state) {
        if (name == params[i].first + suffix) {
          torch::Tensor c = t.contiguous();
          out.write(reinterpret_cast<const char*>(c.data_ptr<float>()), c.numel() * 4);
        }
      }
    }
  };
  write(".master");
  write(".exp_avg");
  write(".exp_avg_sq");
  std::ofstream(dir + "/norms.json") << nlohmann::json{{"grad_norms", norms}}.dump();
  if (!out) {
    return ErrnoError("write", dir + "/state.bin");
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace bragg::train

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR (see the top of adamw_replay_main.cc)\n", argv[0]);
    return 2;
  }
  bragg::Status s = bragg::train::Run(argv[1]);
  if (!s.ok()) {
    std::fprintf(stderr, "train_adamw_replay: %s\n", std::string(s.ToString()).c_str());
    return 1;
  }
  return 0;
}
