#include "train/kernels/linear_cross_entropy.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/model/linear.h"

namespace bragg::train {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::string ShapeOf(const torch::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) {
    absl::StrAppend(&s, d ? ", " : "", t.size(d));
  }
  return s + "]";
}

// The temperature as the engine's sampler sees it: SamplingParams::temperature is a float.
double SamplerTemperature(double temperature) {
  return static_cast<double>(static_cast<float>(temperature));
}

// One chunk's logits [rows, columns] as float32, contiguous: through engine::Linear in
// deterministic mode (the engine's own call, so the bits are the engine's), else one GEMM.
torch::Tensor ChunkLogits(const torch::Tensor& h, const torch::Tensor& w, bool deterministic) {
  return engine::Linear(h, w, {}, deterministic).to(torch::kFloat32).contiguous();
}

struct ForwardResult {
  torch::Tensor logprobs, entropy;  // [T] float32
  torch::Tensor lse, entropy_d;     // [T] float64, for backward
};

// Deterministic forward of one token chunk: the sampler's LogProb, row by row, in double and in
// index order; rows are independent, so parallel rows cannot change a bit.
void DeterministicChunk(const torch::Tensor& logits, const int64_t* labels, double t, float* lp,
                        float* ent, double* lse_out, double* ent_out) {
  const int64_t n = logits.size(0), V = logits.size(1);
  const float* base = logits.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = base + r * V;
      double m = -INFINITY;
      for (int64_t i = 0; i < V; ++i) {
        m = std::max(m, static_cast<double>(row[i]) / t);
      }
      double s = 0, w = 0;
      for (int64_t i = 0; i < V; ++i) {
        double d = static_cast<double>(row[i]) / t - m;
        double e = std::exp(d);
        s += e;
        w += e * d;
      }
      double lse = m + std::log(s);
      lp[r] = static_cast<float>(static_cast<double>(row[labels[r]]) / t - lse);
      double h = std::log(s) - w / s;
      ent[r] = static_cast<float>(h);
      lse_out[r] = lse;
      ent_out[r] = h;
    }
  });
}

ForwardResult Forward(const torch::Tensor& hidden, const torch::Tensor& weight,
                      const torch::Tensor& labels, const LinearCrossEntropyOptions& o) {
  const int64_t T = hidden.size(0), V = weight.size(0);
  const double t = SamplerTemperature(o.temperature);
  const float tf = static_cast<float>(t);
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  ForwardResult r{torch::empty({T}, f32), torch::empty({T}, f32), torch::empty({T}, f64),
                  torch::empty({T}, f64)};
  const int64_t* lab = labels.data_ptr<int64_t>();
  float* lp = r.logprobs.data_ptr<float>();
  float* ent = r.entropy.data_ptr<float>();
  double* lse = r.lse.data_ptr<double>();
  double* ent_d = r.entropy_d.data_ptr<double>();
  const int64_t vc = o.deterministic || o.vocab_chunk == 0 ? V : std::min(o.vocab_chunk, V);

  for (int64_t r0 = 0; r0 < T; r0 += o.token_chunk) {
    const int64_t n = std::min(o.token_chunk, T - r0);
    torch::Tensor h = hidden.narrow(0, r0, n);
    if (o.deterministic) {
      torch::Tensor logits = ChunkLogits(h, weight, true);
      DeterministicChunk(logits, lab + r0, t, lp + r0, ent + r0, lse + r0, ent_d + r0);
      continue;
    }
    // Per row, relative to the running max m: s = sum exp(z - m), w = sum exp(z - m) (z - m);
    // then lse = m + log s and entropy = lse - E[z] = log s - w / s.
    std::vector<double> m(n, -INFINITY), s(n, 0.0), w(n, 0.0), zy(n, 0.0);
    for (int64_t v0 = 0; v0 < V; v0 += vc) {
      const int64_t nv = std::min(vc, V - v0);
      torch::Tensor z = ChunkLogits(h, weight.narrow(0, v0, nv), false);
      z.div_(tf);
      const float* zp = z.data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) {
        int64_t y = lab[r0 + i];
        if (y >= v0 && y < v0 + nv) {
          zy[i] = zp[i * nv + (y - v0)];
        }
      }
      torch::Tensor mc = std::get<0>(z.max(1));
      z.sub_(mc.unsqueeze(1));
      torch::Tensor e = z.exp();
      torch::Tensor sc = e.sum(1);
      e.mul_(z);
      torch::Tensor wc = e.sum(1);
      const float* mcp = mc.data_ptr<float>();
      const float* scp = sc.data_ptr<float>();
      const float* wcp = wc.data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) {
        double mi = mcp[i], si = scp[i], wi = wcp[i];
        if (v0 == 0) {
          m[i] = mi, s[i] = si, w[i] = wi;
          continue;
        }
        double mn = std::max(m[i], mi);
        double a = std::exp(m[i] - mn), b = std::exp(mi - mn);
        w[i] = a * (w[i] + (m[i] - mn) * s[i]) + b * (wi + (mi - mn) * si);
        s[i] = a * s[i] + b * si;
        m[i] = mn;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      double l = m[i] + std::log(s[i]);
      double h_i = std::log(s[i]) - w[i] / s[i];
      lp[r0 + i] = static_cast<float>(zy[i] - l);
      ent[r0 + i] = static_cast<float>(h_i);
      lse[r0 + i] = l;
      ent_d[r0 + i] = h_i;
    }
  }
  return r;
}

// d/dz of (g_lp * logprob + g_h * entropy), z = logits / t, per row:
//   g_lp (onehot(y) - p) - g_h p (log p + H);  then / t for d/dlogits.
// grad_hidden and grad_weight accumulate G_chunk W_chunk and G_chunk^T h_chunk in float32.
std::pair<torch::Tensor, torch::Tensor> Backward(
    const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& labels,
    const torch::Tensor& lse, const torch::Tensor& entropy, const torch::Tensor& g_lp,
    const torch::Tensor& g_h, const LinearCrossEntropyOptions& o) {
  const int64_t T = hidden.size(0), H = hidden.size(1), V = weight.size(0);
  const double t = SamplerTemperature(o.temperature);
  const float tf = static_cast<float>(t);
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  torch::Tensor grad_hidden = torch::zeros({T, H}, f32);
  torch::Tensor grad_weight = torch::zeros({V, H}, f32);
  torch::Tensor weight_f = weight.to(torch::kFloat32);
  torch::Tensor lse_f = lse.to(torch::kFloat32);
  torch::Tensor ent_f = entropy.to(torch::kFloat32);
  torch::Tensor glp =
      g_lp.defined() ? g_lp.to(torch::kFloat32).contiguous() : torch::zeros({T}, f32);
  torch::Tensor gh = g_h.defined() ? g_h.to(torch::kFloat32).contiguous() : torch::zeros({T}, f32);
  const int64_t* lab = labels.data_ptr<int64_t>();
  const float* glpp = glp.data_ptr<float>();
  const int64_t vc = o.deterministic || o.vocab_chunk == 0 ? V : std::min(o.vocab_chunk, V);

  for (int64_t r0 = 0; r0 < T; r0 += o.token_chunk) {
    const int64_t n = std::min(o.token_chunk, T - r0);
    torch::Tensor h = hidden.narrow(0, r0, n);
    torch::Tensor h_f = h.to(torch::kFloat32);
    torch::Tensor neg_glp = glp.narrow(0, r0, n).neg().unsqueeze(1);
    torch::Tensor neg_gh = gh.narrow(0, r0, n).neg().unsqueeze(1);
    torch::Tensor lse_c = lse_f.narrow(0, r0, n).unsqueeze(1);
    torch::Tensor ent_c = ent_f.narrow(0, r0, n).unsqueeze(1);
    torch::Tensor gh_rows = grad_hidden.narrow(0, r0, n);
    for (int64_t v0 = 0; v0 < V; v0 += vc) {
      const int64_t nv = std::min(vc, V - v0);
      // The forward's logits, recomputed the same way (same call, same shapes, same bits).
      torch::Tensor z = ChunkLogits(h, weight.narrow(0, v0, nv), o.deterministic);
      z.div_(tf).sub_(lse_c);     // log p
      torch::Tensor p = z.exp();  // p
      z.add_(ent_c).mul_(p);      // p (log p + H)
      z.mul_(neg_gh).add_(p.mul_(neg_glp));
      p.reset();
      float* zp = z.data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) {
        int64_t y = lab[r0 + i];
        if (y >= v0 && y < v0 + nv) {
          zp[i * nv + (y - v0)] += glpp[r0 + i];
        }
      }
      z.div_(tf);
      gh_rows.addmm_(z, weight_f.narrow(0, v0, nv));
      grad_weight.narrow(0, v0, nv).addmm_(z.t(), h_f);
    }
  }
  return {grad_hidden.to(hidden.scalar_type()), grad_weight.to(weight.scalar_type())};
}

LinearCrossEntropyOptions OptionsFrom(AutogradContext* ctx) {
  LinearCrossEntropyOptions o;
  o.token_chunk = ctx->saved_data["token_chunk"].toInt();
  o.vocab_chunk = ctx->saved_data["vocab_chunk"].toInt();
  o.temperature = ctx->saved_data["temperature"].toDouble();
  o.deterministic = ctx->saved_data["deterministic"].toBool();
  return o;
}

class LceFunction : public torch::autograd::Function<LceFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, torch::Tensor hidden, torch::Tensor weight,
                               torch::Tensor labels, int64_t token_chunk, int64_t vocab_chunk,
                               double temperature, bool deterministic) {
    LinearCrossEntropyOptions o{token_chunk, vocab_chunk, temperature, deterministic};
    ForwardResult r = Forward(hidden, weight, labels, o);
    ctx->save_for_backward({hidden, weight, labels, r.lse, r.entropy_d});
    ctx->saved_data["token_chunk"] = token_chunk;
    ctx->saved_data["vocab_chunk"] = vocab_chunk;
    ctx->saved_data["temperature"] = temperature;
    ctx->saved_data["deterministic"] = deterministic;
    return {r.logprobs, r.entropy};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    torch::NoGradGuard no_grad;
    variable_list saved = ctx->get_saved_variables();
    auto [gh, gw] = Backward(saved[0], saved[1], saved[2], saved[3], saved[4], grads[0], grads[1],
                             OptionsFrom(ctx));
    return {gh, gw, {}, {}, {}, {}, {}};
  }
};

}  // namespace

Status ValidateLinearCrossEntropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                  const torch::Tensor& labels, const LinearCrossEntropyOptions& o) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("linear cross-entropy: ", parts...));
  };
  if (!hidden.defined() || !weight.defined() || !labels.defined()) {
    return bad("hidden, weight and labels must all be defined tensors");
  }
  if (hidden.dim() != 2) {
    return bad("hidden must be [T, H], got ", ShapeOf(hidden));
  }
  if (weight.dim() != 2) {
    return bad("weight must be [V, H], got ", ShapeOf(weight));
  }
  if (hidden.size(1) != weight.size(1)) {
    return bad("hidden ", ShapeOf(hidden), " and weight ", ShapeOf(weight),
               " disagree on H (hidden is [T, H], weight [V, H])");
  }
  if (weight.size(0) == 0) {
    return bad("weight has no rows: the vocabulary is empty (V = 0)");
  }
  if (labels.dim() != 1 || labels.size(0) != hidden.size(0)) {
    return bad("labels must be [T] = [", hidden.size(0), "] (one per row of hidden), got ",
               ShapeOf(labels));
  }
  if (labels.scalar_type() != torch::kInt64) {
    return bad("labels must be int64, got ", c10::toString(labels.scalar_type()));
  }
  auto st = hidden.scalar_type();
  if (st != torch::kFloat32 && st != torch::kBFloat16) {
    return bad("hidden must be float32 or bfloat16, got ", c10::toString(st));
  }
  if (weight.scalar_type() != st) {
    return bad("weight is ", c10::toString(weight.scalar_type()), " but hidden is ",
               c10::toString(st), ": give both the same dtype");
  }
  if (!hidden.device().is_cpu() || !weight.device().is_cpu() || !labels.device().is_cpu()) {
    return bad("this op runs on CPU tensors (the CUDA version is linear_cross_entropy_cuda.h)");
  }
  if (o.token_chunk <= 0) {
    return bad("token_chunk must be positive, got ", o.token_chunk);
  }
  if (o.vocab_chunk < 0) {
    return bad("vocab_chunk must be 0 (whole vocabulary) or positive, got ", o.vocab_chunk);
  }
  if (!std::isfinite(o.temperature) || !(static_cast<float>(o.temperature) > 0)) {
    return bad("temperature must be a positive float, got ", o.temperature,
               " (the engine scores greedy requests at temperature 1)");
  }
  if (o.deterministic) {
    if (o.token_chunk % engine::kDeterministicTile != 0) {
      return bad("deterministic mode needs token_chunk to be a multiple of ",
                 engine::kDeterministicTile, ", got ", o.token_chunk);
    }
    if (o.vocab_chunk != 0) {
      return bad(
          "deterministic mode computes the whole vocabulary per chunk (as the engine's "
          "sampler does): set vocab_chunk = 0, got ",
          o.vocab_chunk);
    }
  }
  if (labels.numel() > 0) {
    torch::Tensor out = (labels < 0).logical_or(labels >= weight.size(0));
    if (out.any().item<bool>()) {
      int64_t i = out.nonzero()[0][0].item<int64_t>();
      return bad("labels[", i, "] = ", labels[i].item<int64_t>(),
                 " is outside the vocabulary (V = ", weight.size(0), ")");
    }
  }
  return absl::OkStatus();
}

LinearCrossEntropyOutput LinearCrossEntropy(const torch::Tensor& hidden,
                                            const torch::Tensor& weight,
                                            const torch::Tensor& labels,
                                            const LinearCrossEntropyOptions& o) {
  Status status = ValidateLinearCrossEntropy(hidden, weight, labels, o);
  TORCH_CHECK(status.ok(), std::string(status.message()));
  variable_list out =
      LceFunction::apply(hidden.contiguous(), weight.contiguous(), labels.contiguous(),
                         o.token_chunk, o.vocab_chunk, o.temperature, o.deterministic);
  return {out[0], out[1]};
}

Result<LinearCrossEntropyOutput> TryLinearCrossEntropy(const torch::Tensor& hidden,
                                                       const torch::Tensor& weight,
                                                       const torch::Tensor& labels,
                                                       const LinearCrossEntropyOptions& o) {
  BRAGG_RETURN_IF_ERROR(ValidateLinearCrossEntropy(hidden, weight, labels, o));
  try {
    return LinearCrossEntropy(hidden, weight, labels, o);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        "linear cross-entropy: out of memory; lower token_chunk or set vocab_chunk");
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    if (msg.find("not enough memory") != std::string::npos) {
      return absl::ResourceExhaustedError(
          absl::StrCat("linear cross-entropy: ", msg, "; lower token_chunk or set vocab_chunk"));
    }
    return absl::InternalError(absl::StrCat("linear cross-entropy: ", msg));
  }
}

}  // namespace bragg::train
