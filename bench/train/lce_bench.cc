// train_lce_bench: peak extra memory and time of the fused linear cross-entropy (forward +
// backward) against the naive path (full logits, log_softmax, autograd), on CPU.
//
// Each case runs in a fresh process (this binary re-executed with --child), so one case's heap
// cannot hide another's: the child makes its inputs, warms torch up on a tiny case, resets its
// peak RSS (/proc/self/clear_refs, "5"), runs forward + backward, and reports VmHWM - VmRSS at
// the reset. That delta is every byte the step touched: the op's buffers, torch's temporaries
// and the gradients it returns (grad_hidden [T, H] and grad_weight [V, H] float32, listed apart).
// JSON on stdout, a table on stderr. The naive path at T x V too big for this machine is not
// run: its logits' bytes are computed and its measured per-token peak is scaled, both labelled.

#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "common/process.h"
#include "common/unique_fd.h"
#include "nlohmann/json.hpp"
#include "train/kernels/linear_cross_entropy.h"

namespace {

using bragg::train::LinearCrossEntropy;
using bragg::train::LinearCrossEntropyOutput;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

// A field of /proc/self/status in bytes ("VmHWM", "VmRSS"); -1 if absent.
int64_t ProcStatusBytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      return std::stoll(line.substr(field.size() + 1)) * 1024;
    }
  }
  return -1;
}

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

LinearCrossEntropyOutput Naive(const torch::Tensor& h, const torch::Tensor& w,
                               const torch::Tensor& labels) {
  torch::Tensor logp = torch::log_softmax(torch::nn::functional::linear(h, w), 1);
  return {logp.gather(1, labels.unsqueeze(1)).squeeze(1), -(logp.exp() * logp).sum(1)};
}

// One case in this process; returns its record.
json RunCase(const std::string& impl, int64_t T, int64_t H, int64_t V, int64_t chunk,
             int64_t vocab_chunk) {
  auto step = [&](const torch::Tensor& h, const torch::Tensor& w, const torch::Tensor& labels,
                  const torch::Tensor& a, const torch::Tensor& b, double* fwd_s) {
    auto t0 = Clock::now();
    LinearCrossEntropyOutput out =
        impl == "fused" ? LinearCrossEntropy(h, w, labels, {chunk, vocab_chunk, 1.0, false})
                        : Naive(h, w, labels);
    torch::Tensor loss = (a * out.logprobs).sum() + (b * out.entropy).sum();
    auto t1 = Clock::now();
    loss.backward();
    if (fwd_s != nullptr) {
      *fwd_s = Seconds(t0, t1);
    }
  };
  {  // warm-up: torch's thread pool, BLAS buffers, allocator paths
    torch::Tensor h = torch::randn({64, H}, torch::requires_grad());
    torch::Tensor w = torch::randn({256, H}, torch::requires_grad());
    step(h, w, torch::randint(0, 256, {64}, torch::kInt64), torch::randn({64}), torch::randn({64}),
         nullptr);
  }
  torch::manual_seed(1);
  torch::Tensor h = (torch::randn({T, H}) * 2.0).requires_grad_(true);
  torch::Tensor w = (torch::randn({V, H}) / std::sqrt(static_cast<double>(H))).requires_grad_(true);
  torch::Tensor labels = torch::randint(0, V, {T}, torch::kInt64);
  torch::Tensor a = torch::randn({T}), b = torch::randn({T});

  bool reset = false;
  {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";
    clear.flush();
    reset = clear.good();
  }
  const int64_t base = ProcStatusBytes("VmRSS");
  double fwd_s = 0;
  auto t0 = Clock::now();
  step(h, w, labels, a, b, &fwd_s);
  const double total_s = Seconds(t0, Clock::now());
  const int64_t peak = ProcStatusBytes("VmHWM");
  const int64_t grads = (T * H + V * H) * 4;
  return json{
      {"impl", impl},
      {"T", T},
      {"H", H},
      {"V", V},
      {"token_chunk", impl == "fused" ? chunk : T},
      {"vocab_chunk", vocab_chunk},
      {"measured", true},
      {"peak_reset", reset},
      {"peak_extra_bytes", peak - base},
      {"grad_bytes", grads},
      {"peak_extra_beyond_grads_bytes", peak - base - grads},
      {"bound_2xchunkxVx4_bytes", 2 * std::min(chunk, T) * (vocab_chunk ? vocab_chunk : V) * 4},
      {"logits_TxVx4_bytes", T * V * 4},
      {"forward_s", fwd_s},
      {"forward_backward_s", total_s}};
}

// Runs one case in a child (this binary, --child) and returns its record.
bragg::Result<json> RunChild(const std::string& self, const std::string& impl, int64_t T, int64_t H,
                             int64_t V, int64_t chunk, int64_t vocab_chunk) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    return bragg::ErrnoError("pipe2", "");
  }
  bragg::UniqueFd rd(fds[0]), wr(fds[1]);
  bragg::SpawnOptions so;
  so.stdout_fd = wr.get();
  BRAGG_ASSIGN_OR_RETURN(
      bragg::ChildProcess child,
      bragg::Spawn({self, "--child", impl, "--child-tokens", std::to_string(T), "--hidden",
                    std::to_string(H), "--vocab", std::to_string(V), "--token-chunk",
                    std::to_string(chunk), "--vocab-chunk", std::to_string(vocab_chunk)},
                   so));
  wr.Reset();
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = read(rd.get(), buf, sizeof(buf))) > 0;) {
    out.append(buf, n);
  }
  BRAGG_ASSIGN_OR_RETURN(bragg::ExitInfo exit, child.Wait());
  if (out.empty()) {
    return absl::InternalError(
        absl::StrCat(impl, " T=", T, " V=", V, " child failed: ", bragg::DescribeExit(exit)));
  }
  return json::parse(out);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"train_lce_bench: fused linear cross-entropy vs naive, memory and time (CPU)"};
  std::string child;
  // Defaults sized to run in about three minutes on 2 shared cores; --tokens 16384,16384 is the
  // full case (about 15 minutes there).
  int64_t T = 0, H = 256, chunk = 1024, vocab_chunk = 0, one_vocab = 0;
  std::vector<int64_t> vocabs{32768, 151936};
  std::vector<int64_t> tokens{8192, 2048};
  std::vector<int64_t> naive_tokens{2048, 1024};
  app.add_option("--child", child, "internal: run one case (fused|naive) and print its record");
  app.add_option("--tokens", tokens, "T for the fused op, one per vocabulary")->delimiter(',');
  app.add_option("--child-tokens", T, "internal: T of the --child case");
  app.add_option("--hidden", H, "H");
  app.add_option("--vocabs", vocabs, "vocabulary sizes")->delimiter(',');
  app.add_option("--naive-tokens", naive_tokens,
                 "T for the naive path (and a like-for-like fused run), one per vocabulary")
      ->delimiter(',');
  app.add_option("--token-chunk", chunk, "rows per chunk of the fused op");
  app.add_option("--vocab-chunk", vocab_chunk, "columns per chunk (0: whole vocabulary)");
  app.add_option("--vocab", one_vocab, "internal: V of the --child case");
  CLI11_PARSE(app, argc, argv);
  if (!child.empty()) {
    std::cout << RunCase(child, T, H, one_vocab, chunk, vocab_chunk).dump() << std::endl;
    return 0;
  }
  if (naive_tokens.size() != vocabs.size() || tokens.size() != vocabs.size()) {
    std::cerr << "--tokens and --naive-tokens need one T per vocabulary (" << vocabs.size()
              << ")\n";
    return 2;
  }
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) {
    perror("readlink /proc/self/exe");
    return 1;
  }
  self[n] = 0;

  json records = json::array();
  auto run = [&](const std::string& impl, int64_t t, int64_t v) {
    bragg::Result<json> r = RunChild(self, impl, t, H, v, chunk, vocab_chunk);
    if (!r.ok()) {
      std::cerr << r.status() << "\n";
      return false;
    }
    records.push_back(*r);
    return true;
  };
  for (size_t i = 0; i < vocabs.size(); ++i) {
    int64_t v = vocabs[i], tn = naive_tokens[i];
    T = tokens[i];
    if (!run("fused", T, v) || (tn != T && !run("fused", tn, v)) || !run("naive", tn, v)) {
      return 1;
    }
    if (tn == T) {
      continue;
    }
    // The naive path at the fused op's T, not run: scaled from its measured per-token peak.
    const json& naive = records.back();
    int64_t per_token = naive["peak_extra_beyond_grads_bytes"].get<int64_t>() / tn;
    records.push_back(json{{"impl", "naive"},
                           {"T", T},
                           {"H", H},
                           {"V", v},
                           {"measured", false},
                           {"note", "computed, not run: naive peak beyond grads per token at T=" +
                                        std::to_string(tn) + " x T, plus the grads"},
                           {"grad_bytes", (T * H + v * H) * 4},
                           {"peak_extra_bytes", per_token * T + (T * H + v * H) * 4},
                           {"peak_extra_beyond_grads_bytes", per_token * T},
                           {"logits_TxVx4_bytes", T * v * 4}});
  }
  std::cout << json{{"bench", "train_lce"}, {"cases", records}}.dump(2) << std::endl;

  auto mib = [](const json& r, const char* k) {
    return r.contains(k) ? r[k].get<int64_t>() / 1048576.0 : -1.0;
  };
  std::fprintf(stderr, "%-6s %6s %4s %7s %9s %11s %11s %11s %11s %8s %8s\n", "impl", "T", "H", "V",
               "measured", "extra MiB", "-grads MiB", "2cV4 MiB", "TV4 MiB", "fwd s", "f+b s");
  for (const json& r : records) {
    std::fprintf(stderr, "%-6s %6lld %4lld %7lld %9s %11.1f %11.1f %11.1f %11.1f %8.2f %8.2f\n",
                 r["impl"].get<std::string>().c_str(), (long long)r["T"].get<int64_t>(),
                 (long long)r["H"].get<int64_t>(), (long long)r["V"].get<int64_t>(),
                 r["measured"].get<bool>() ? "yes" : "computed", mib(r, "peak_extra_bytes"),
                 mib(r, "peak_extra_beyond_grads_bytes"), mib(r, "bound_2xchunkxVx4_bytes"),
                 mib(r, "logits_TxVx4_bytes"), r.value("forward_s", 0.0),
                 r.value("forward_backward_s", 0.0));
  }
  return 0;
}
