#include "engine/model/qwen3.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <malloc.h>
#include <strings.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "common/blas_core.h"
#include "common/str_cat.h"
#include "engine/model/cpu_isa.h"
#include "engine/model/linear.h"
#include "engine/model/moe_cpu.h"

namespace bragg::engine::qwen3 {
namespace {

using torch::indexing::Slice;

// Replaces *gate and *up ([I, H] each) by views of one [2I, H] tensor holding both.
void Fuse(torch::Tensor* gate, torch::Tensor* up, torch::Tensor* fused) {
  int64_t I = gate->size(0);
  *fused = torch::cat({*gate, *up}, 0).contiguous();
  *gate = fused->narrow(0, 0, I);
  *up = fused->narrow(0, I, I);
}

class Loader {
 public:
  Loader(const Checkpoint& ck, Weights* w) : ck_(ck), w_(w) {}

  Status Param(const std::string& name, std::vector<int64_t> shape, torch::Tensor* dst,
               bool leaf = true) {
    BRAGG_ASSIGN_OR_RETURN(const TensorView* v, ck_.Find(name));
    if (v->shape != shape) {
      return absl::InvalidArgumentError(Cat(
          v->file, ": tensor ", name, " has shape [", fmt::format("{}", fmt::join(v->shape, ", ")),
          "], the config says [", fmt::format("{}", fmt::join(shape, ", ")), "]"));
    }
    *dst = Borrow(*v).to(w_->device, w_->dtype, /*non_blocking=*/false, /*copy=*/true).contiguous();
    w_->params[name] = dst;
    w_->file_dtypes[name] = v->dtype;
    if (leaf) {
      w_->leaves.emplace_back(name, dst);
    }
    return absl::OkStatus();
  }

 private:
  const Checkpoint& ck_;
  Weights* w_;
};

}  // namespace

torch::Dtype TorchDType(TensorDType t) {
  switch (t) {
    case TensorDType::kF32:
      return torch::kFloat32;
    case TensorDType::kBF16:
      return torch::kBFloat16;
    case TensorDType::kF16:
      return torch::kFloat16;
  }
  return torch::kFloat32;
}

torch::Tensor Borrow(const TensorView& v) {
  return torch::from_blob(const_cast<uint8_t*>(v.data), v.shape,
                          torch::TensorOptions().dtype(TorchDType(v.dtype)));
}

Status Weights::Load(const Checkpoint& ck, torch::Device dev, torch::Dtype dt) {
  config = ck.config();
  device = dev;
  dtype = dt;
  const ModelConfig& c = config;
  Loader load(ck, this);
  int64_t H = c.hidden_size, hd = c.head_dim;
  int64_t q_out = c.num_attention_heads * hd, kv_out = c.num_key_value_heads * hd;
  BRAGG_RETURN_IF_ERROR(load.Param("model.embed_tokens.weight", {c.vocab_size, H}, &embed));
  layers.resize(c.num_hidden_layers);
  int moe_seen = 0;
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    Layer& L = layers[i];
    std::string p = Cat("model.layers.", i, ".");
    BRAGG_RETURN_IF_ERROR(load.Param(p + "input_layernorm.weight", {H}, &L.ln1));
    BRAGG_RETURN_IF_ERROR(load.Param(p + "post_attention_layernorm.weight", {H}, &L.ln2));
    BRAGG_RETURN_IF_ERROR(load.Param(p + "self_attn.q_proj.weight", {q_out, H}, &L.wq));
    BRAGG_RETURN_IF_ERROR(load.Param(p + "self_attn.k_proj.weight", {kv_out, H}, &L.wk));
    BRAGG_RETURN_IF_ERROR(load.Param(p + "self_attn.v_proj.weight", {kv_out, H}, &L.wv));
    BRAGG_RETURN_IF_ERROR(load.Param(p + "self_attn.o_proj.weight", {H, q_out}, &L.wo));
    if (c.attention_bias) {
      BRAGG_RETURN_IF_ERROR(load.Param(p + "self_attn.q_proj.bias", {q_out}, &L.bq));
      BRAGG_RETURN_IF_ERROR(load.Param(p + "self_attn.k_proj.bias", {kv_out}, &L.bk));
      BRAGG_RETURN_IF_ERROR(load.Param(p + "self_attn.v_proj.bias", {kv_out}, &L.bv));
      BRAGG_RETURN_IF_ERROR(load.Param(p + "self_attn.o_proj.bias", {H}, &L.bo));
    }
    BRAGG_RETURN_IF_ERROR(load.Param(p + "self_attn.q_norm.weight", {hd}, &L.q_norm));
    BRAGG_RETURN_IF_ERROR(load.Param(p + "self_attn.k_norm.weight", {hd}, &L.k_norm));
    L.moe = c.is_moe_layer(i);
    moe_layer_index.push_back(L.moe ? moe_seen++ : -1);
    if (L.moe) {
      int64_t I = c.moe_intermediate_size;
      BRAGG_RETURN_IF_ERROR(load.Param(p + "mlp.gate.weight", {c.num_experts, H}, &L.router));
      L.e_gate.resize(c.num_experts);
      L.e_up.resize(c.num_experts);
      L.e_down.resize(c.num_experts);
      L.e_gate_up.resize(c.num_experts);
      for (int e = 0; e < c.num_experts; ++e) {
        std::string q = Cat(p, "mlp.experts.", e, ".");
        BRAGG_RETURN_IF_ERROR(load.Param(q + "gate_proj.weight", {I, H}, &L.e_gate[e], false));
        BRAGG_RETURN_IF_ERROR(load.Param(q + "up_proj.weight", {I, H}, &L.e_up[e], false));
        BRAGG_RETURN_IF_ERROR(load.Param(q + "down_proj.weight", {H, I}, &L.e_down[e]));
        Fuse(&L.e_gate[e], &L.e_up[e], &L.e_gate_up[e]);
        leaves.emplace_back(q + "gate_up_proj.weight", &L.e_gate_up[e]);
      }
    } else {
      int64_t I = c.intermediate_size;
      BRAGG_RETURN_IF_ERROR(load.Param(p + "mlp.gate_proj.weight", {I, H}, &L.w_gate, false));
      BRAGG_RETURN_IF_ERROR(load.Param(p + "mlp.up_proj.weight", {I, H}, &L.w_up, false));
      BRAGG_RETURN_IF_ERROR(load.Param(p + "mlp.down_proj.weight", {H, I}, &L.w_down));
      Fuse(&L.w_gate, &L.w_up, &L.w_gate_up);
      leaves.emplace_back(p + "mlp.gate_up_proj.weight", &L.w_gate_up);
    }
  }
  BRAGG_RETURN_IF_ERROR(load.Param("model.norm.weight", {H}, &final_norm));
  if (c.tie_word_embeddings) {
    lm_head = embed;
  } else {
    BRAGG_RETURN_IF_ERROR(load.Param("lm_head.weight", {c.vocab_size, H}, &lm_head));
  }
  // As transformers computes it: 1 / theta^(arange(0, hd, 2) / hd), in float32.
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  torch::Tensor exponent =
      torch::arange(0, hd, 2, torch::TensorOptions().dtype(torch::kInt64)).to(torch::kFloat32) /
      static_cast<float>(hd);
  inv_freq = (1.0 / torch::pow(torch::tensor(static_cast<float>(c.rope_theta), f32), exponent))
                 .to(torch::kFloat32)
                 .to(device);
  return absl::OkStatus();
}

namespace {

template <typename F>
F OpenBlasFunction(const char* name) {
  return reinterpret_cast<F>(::dlsym(RTLD_DEFAULT, name));
}

// openblas_get_parallel(): 0 sequential, 1 pthreads, 2 OpenMP; -1 when torch's BLAS is not
// OpenBLAS.
int OpenBlasParallel() {
  auto get = OpenBlasFunction<int (*)()>("openblas_get_parallel");
  return get != nullptr ? get() : -1;
}

}  // namespace

void ConfigureCpuRuntime(int threads) {
  if (threads > 0) {
    torch::set_num_threads(threads);
  }
  // A process that could not start again with the right kernels (a Python interpreter with the
  // trainer's module, say) says how to get them.
  static const bool warned = [] {
    const std::string core = BlasFallbackCore();
    const char* forced = std::getenv("OPENBLAS_CORETYPE");
    if (core.empty()) {
      return true;
    }
    if (forced == nullptr) {
      std::fprintf(stderr,
                   "warning: OpenBLAS does not know this CPU and runs its Prescott kernels; "
                   "start with OPENBLAS_CORETYPE=%s for 1.6-3x faster fp32 (docs/engine.md)\n",
                   core.c_str());
    } else if (::strcasecmp(forced, "prescott") != 0) {
      // Set after OpenBLAS was loaded (by an import before the variable was set): no effect.
      std::fprintf(stderr,
                   "warning: OpenBLAS runs its Prescott kernels although OPENBLAS_CORETYPE=%s: "
                   "the variable was set after this process loaded OpenBLAS, which reads it "
                   "once (from Python, call bragg_train.use_known_blas_core() before anything "
                   "loads it; docs/engine.md)\n",
                   forced);
    }
    return true;
  }();
  (void)warned;
  ::mallopt(M_MMAP_THRESHOLD, 32 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 512 << 20);
  // OpenBLAS built with OpenMP needs nothing: a call takes the calling thread's OpenMP thread
  // count (torch sets it on every thread it computes on) and runs single-threaded inside torch's
  // own parallel regions, all on one pool. A pthreads build keeps a pool of its own.
  if (OpenBlasParallel() != 2) {
    if (auto* set = OpenBlasFunction<void (*)(int)>("openblas_set_num_threads")) {
      set(1);
    }
  }
}

std::string DescribeCpuRuntime() {
  std::string blas = "a BLAS other than OpenBLAS";
  if (auto* config = OpenBlasFunction<char* (*)()>("openblas_get_config")) {
    blas = config();
    Dl_info info{};
    if (::dladdr(reinterpret_cast<void*>(config), &info) != 0 && info.dli_fname != nullptr) {
      blas = Cat(blas, " (", info.dli_fname, ")");
    }
    switch (OpenBlasParallel()) {
      case 2:
        blas += ", OpenMP: on torch's threads";
        break;
      case 1:
        blas += ", pthreads: single-threaded under torch's threads";
        break;
      default:
        blas += ", sequential";
    }
  }
  if (const char* forced = std::getenv("OPENBLAS_CORETYPE")) {
    blas = Cat(blas, ", OPENBLAS_CORETYPE=", forced);
  }
  return Cat("torch ", at::get_num_threads(), " thread(s); BLAS: ", blas,
             "; the engine's kernels: ", CpuIsaName(BestCpuIsa()));
}

int Weights::num_moe_layers() const {
  int n = 0;
  for (int i : moe_layer_index) {
    n += i >= 0;
  }
  return n;
}

torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  torch::Tensor h = x.to(torch::kFloat32);
  torch::Tensor var = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * torch::rsqrt(var + eps);
  return w * h.to(x.scalar_type());
}

std::pair<torch::Tensor, torch::Tensor> RopeTables(const torch::Tensor& pos,
                                                   const torch::Tensor& inv_freq,
                                                   torch::Dtype dtype) {
  torch::Tensor freqs = pos.to(torch::kFloat32).unsqueeze(1) * inv_freq.unsqueeze(0);
  torch::Tensor emb = torch::cat({freqs, freqs}, -1);
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

torch::Tensor Rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  int64_t half = x.size(-1) / 2;
  torch::Tensor x1 = x.index({"...", Slice(0, half)});
  torch::Tensor x2 = x.index({"...", Slice(half, torch::indexing::None)});
  torch::Tensor rotated = torch::cat({-x2, x1}, -1);
  return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
}

torch::Tensor SwiGlu(const torch::Tensor& x, const torch::Tensor& gate_up,
                     const torch::Tensor& down, bool deterministic) {
  torch::Tensor gu = Linear(x, gate_up, {}, deterministic);
  int64_t I = gate_up.size(0) / 2;
  return Linear(torch::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I), down, {}, deterministic);
}

void TransposeLinearWeights(Weights* w) {
  auto flip = [](torch::Tensor* t) { *t = t->t().contiguous().t(); };
  auto flip_fused = [&](torch::Tensor* fused, torch::Tensor* gate, torch::Tensor* up) {
    flip(fused);
    int64_t I = fused->size(0) / 2;
    *gate = fused->narrow(0, 0, I);
    *up = fused->narrow(0, I, I);
  };
  for (Layer& L : w->layers) {
    for (torch::Tensor* t : {&L.wq, &L.wk, &L.wv, &L.wo}) {
      flip(t);
    }
    if (L.moe) {
      flip(&L.router);
      for (size_t e = 0; e < L.e_gate_up.size(); ++e) {
        flip_fused(&L.e_gate_up[e], &L.e_gate[e], &L.e_up[e]);
        flip(&L.e_down[e]);
      }
    } else {
      flip_fused(&L.w_gate_up, &L.w_gate, &L.w_up);
      flip(&L.w_down);
    }
  }
  if (!w->lm_head.is_same(w->embed)) {
    flip(&w->lm_head);
  }
}

// Moe's experts with torch's operators, each expert's rows gathered and computed in one SwiGlu:
// for deterministic mode, other dtypes and devices, and rows the CPU kernels do not take. idx and
// w: [T, k]; cnt: rows per expert.
static torch::Tensor ExpertsByTorch(const ModelConfig& c, const Layer& L, const torch::Tensor& x,
                                    const torch::Tensor& idx, const torch::Tensor& w,
                                    const int64_t* cnt, bool deterministic);

torch::Tensor Moe(const ModelConfig& c, const Layer& L, const torch::Tensor& x, bool deterministic,
                  torch::Tensor* experts_out, const torch::Tensor* replay) {
  // Serving (fp32 on the CPU, no replay, not deterministic): the routing in one kernel, and
  // the experts in moe_cpu.h's where they fit.
  if (!deterministic && replay == nullptr && RouterTopKFits(x, L.router, c.num_experts_per_tok)) {
    torch::Tensor idx, w;
    std::vector<int64_t> counts;
    RouterTopK(x, L.router, c.num_experts_per_tok, c.norm_topk_prob, &idx, &w, &counts);
    *experts_out = idx;
    if (SmallBatchExpertsFit(x, L.e_gate_up, L.e_down, counts.data())) {
      return SmallBatchExperts(x, idx, w, L.e_gate_up, L.e_down);
    }
    return ExpertsByTorch(c, L, x, idx, w, counts.data(), deterministic);
  }
  torch::Tensor logits = Linear(x, L.router, {}, deterministic);
  torch::Tensor probs = torch::softmax(logits.to(torch::kFloat32), -1);
  torch::Tensor w, idx;
  if (replay != nullptr) {
    idx = *replay;
    w = probs.gather(1, idx);
  } else {
    std::tie(w, idx) = torch::topk(probs, c.num_experts_per_tok, -1);
  }
  if (c.norm_topk_prob) {
    w = w / w.sum(-1, /*keepdim=*/true);
  }
  w = w.to(x.scalar_type());
  *experts_out = idx;
  torch::Tensor flat = idx.reshape({-1});
  torch::Tensor counts = torch::bincount(flat, {}, c.num_experts).cpu();
  const int64_t* cnt = counts.data_ptr<int64_t>();
  if (!deterministic && SmallBatchExpertsFit(x, L.e_gate_up, L.e_down, cnt)) {
    return SmallBatchExperts(x, idx, w, L.e_gate_up, L.e_down);  // moe_cpu.h
  }
  return ExpertsByTorch(c, L, x, idx, w, cnt, deterministic);
}

static torch::Tensor ExpertsByTorch(const ModelConfig& c, const Layer& L, const torch::Tensor& x,
                                    const torch::Tensor& idx, const torch::Tensor& w,
                                    const int64_t* cnt, bool deterministic) {
  torch::Tensor flat = idx.reshape({-1});
  torch::Tensor out = torch::zeros_like(x);
  torch::Tensor order = torch::argsort(flat);
  int64_t k = c.num_experts_per_tok;
  int64_t offset = 0;
  torch::Tensor flat_w = w.reshape({-1});
  for (int e = 0; e < c.num_experts; ++e) {
    int64_t n = cnt[e];
    if (n == 0) {
      continue;
    }
    torch::Tensor sel = order.index({Slice(offset, offset + n)});
    offset += n;
    torch::Tensor rows = torch::div(sel, k, "floor");
    torch::Tensor xe = x.index_select(0, rows);
    torch::Tensor ye = SwiGlu(xe, L.e_gate_up[e], L.e_down[e], deterministic);
    ye = ye * flat_w.index_select(0, sel).unsqueeze(1);
    out.index_add_(0, rows, ye);
  }
  return out;
}

namespace {

template <typename S>
torch::Tensor AttendExactT(const ModelConfig& c, const torch::Tensor& keys,
                           const torch::Tensor& values, const torch::Tensor& q,
                           const std::vector<int64_t>& row_seq, const std::vector<int64_t>& row_pos,
                           const std::vector<torch::Tensor>& seq_slots) {
  const int64_t T = q.size(0), nh = c.num_attention_heads, kvh = c.num_key_value_heads;
  const int64_t g = nh / kvh, hd = c.head_dim;
  torch::Tensor qf = q.to(torch::kFloat32).contiguous();
  torch::Tensor out = torch::empty({T, nh * hd}, torch::TensorOptions().dtype(torch::kFloat32));
  const float* qp = qf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const S* kp = keys.data_ptr<S>();
  const S* vp = values.data_ptr<S>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  at::parallel_for(0, T * nh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      int64_t row = item / nh, h = item % nh, kh = h / g;
      const int64_t* slots = seq_slots[row_seq[row]].data_ptr<int64_t>();
      int64_t len = row_pos[row] + 1;
      const float* qv = qp + (row * nh + h) * hd;
      scores.resize(len);
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t l = 0; l < len; ++l) {
        const S* kv = kp + (slots[l] * kvh + kh) * hd;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t d = 0;
        for (; d + 8 <= hd; d += 8) {
          for (int i = 0; i < 8; ++i) {
            acc[i] += qv[d + i] * static_cast<float>(kv[d + i]);
          }
        }
        for (; d < hd; ++d) {
          acc[d % 8] += qv[d] * static_cast<float>(kv[d]);
        }
        float s =
            (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) *
            scale;
        scores[l] = s;
        m = std::max(m, s);
      }
      float sum = 0;
      for (int64_t l = 0; l < len; ++l) {
        scores[l] = std::exp(scores[l] - m);
        sum += scores[l];
      }
      float* o = op + (row * nh + h) * hd;
      std::fill(o, o + hd, 0.0f);
      for (int64_t l = 0; l < len; ++l) {
        const S* vv = vp + (slots[l] * kvh + kh) * hd;
        float p = scores[l] / sum;
        for (int64_t d2 = 0; d2 < hd; ++d2) {
          o[d2] += p * static_cast<float>(vv[d2]);
        }
      }
    }
  });
  return out.to(q.scalar_type());
}

}  // namespace

torch::Tensor AttendExact(const ModelConfig& c, const torch::Tensor& keys,
                          const torch::Tensor& values, const torch::Tensor& q,
                          const std::vector<int64_t>& row_seq, const std::vector<int64_t>& row_pos,
                          const std::vector<torch::Tensor>& seq_slots) {
  if (keys.scalar_type() == torch::kBFloat16) {
    return AttendExactT<c10::BFloat16>(c, keys, values, q, row_seq, row_pos, seq_slots);
  }
  return AttendExactT<float>(c, keys, values, q, row_seq, row_pos, seq_slots);
}

}  // namespace bragg::engine::qwen3
