#include "engine/model/model.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <malloc.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <map>

#include "engine/model/linear.h"
#include "engine/str_cat.h"

namespace bragg::engine {
namespace {

namespace F = torch::nn::functional;
using torch::indexing::Slice;

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

// A view of mapped bytes as a tensor (no copy; valid while the checkpoint is open).
torch::Tensor Borrow(const TensorView& v) {
  return torch::from_blob(const_cast<uint8_t*>(v.data), v.shape,
                          torch::TensorOptions().dtype(TorchDType(v.dtype)));
}

struct Layer {
  torch::Tensor ln1, ln2;        // [H]
  torch::Tensor wq, wk, wv, wo;  // [nh*hd, H], [kvh*hd, H] x2, [H, nh*hd]
  torch::Tensor bq, bk, bv, bo;  // attention_bias only
  torch::Tensor q_norm, k_norm;  // [hd]
  bool moe = false;
  // Gate and up projections are stored fused, [2I, H] (one GEMM instead of two); w_gate and
  // w_up are views of its halves, which is what loading and weight updates write through.
  torch::Tensor w_gate_up, w_gate, w_up, w_down;  // dense MLP
  torch::Tensor router;                           // [E, H]
  std::vector<torch::Tensor> e_gate_up, e_gate, e_up, e_down;
  torch::Tensor k_cache, v_cache;  // [blocks * block_size, kvh, hd]
};

}  // namespace

struct Model::Impl {
  ModelConfig config;
  ModelOptions options;
  torch::Device device = torch::kCPU;
  torch::Dtype dtype = torch::kFloat32;
  torch::Tensor embed, final_norm, lm_head;
  std::vector<Layer> layers;
  torch::Tensor inv_freq;  // [hd / 2] float32
  // Every parameter by its checkpoint name, and the file dtype it was first loaded from.
  std::map<std::string, torch::Tensor*> params;
  std::map<std::string, TensorDType> file_dtypes;
  std::vector<int> moe_layer_index;  // layer -> position among the MoE layers, or -1

  torch::TensorOptions opts() const { return torch::TensorOptions().dtype(dtype).device(device); }

  Status LoadParam(const Checkpoint& ck, const std::string& name, std::vector<int64_t> shape,
                   torch::Tensor* dst) {
    BRAGG_ASSIGN_OR_RETURN(const TensorView* v, ck.Find(name));
    if (v->shape != shape) {
      return absl::InvalidArgumentError(Cat(
          v->file, ": tensor ", name, " has shape [", fmt::format("{}", fmt::join(v->shape, ", ")),
          "], the config says [", fmt::format("{}", fmt::join(shape, ", ")), "]"));
    }
    *dst = Borrow(*v).to(device, dtype, /*non_blocking=*/false, /*copy=*/true).contiguous();
    params[name] = dst;
    file_dtypes[name] = v->dtype;
    return absl::OkStatus();
  }

  // Replaces *gate and *up ([I, H] each) by views of one [2I, H] tensor holding both.
  static void Fuse(torch::Tensor* gate, torch::Tensor* up, torch::Tensor* fused) {
    int64_t I = gate->size(0);
    *fused = torch::cat({*gate, *up}, 0).contiguous();
    *gate = fused->narrow(0, 0, I);
    *up = fused->narrow(0, I, I);
  }

  // down(silu(gate(x)) * up(x)) with gate and up in one GEMM.
  torch::Tensor SwiGlu(const torch::Tensor& x, const torch::Tensor& gate_up,
                       const torch::Tensor& down) const {
    torch::Tensor gu = Linear(x, gate_up);
    int64_t I = gate_up.size(0) / 2;
    return Linear(torch::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I), down);
  }

  Status Load(const Checkpoint& ck) {
    const ModelConfig& c = config;
    int64_t H = c.hidden_size, hd = c.head_dim;
    int64_t q_out = c.num_attention_heads * hd, kv_out = c.num_key_value_heads * hd;
    BRAGG_RETURN_IF_ERROR(LoadParam(ck, "model.embed_tokens.weight", {c.vocab_size, H}, &embed));
    BRAGG_RETURN_IF_ERROR(LoadParam(ck, "model.norm.weight", {H}, &final_norm));
    if (c.tie_word_embeddings) {
      lm_head = embed;
    } else {
      BRAGG_RETURN_IF_ERROR(LoadParam(ck, "lm_head.weight", {c.vocab_size, H}, &lm_head));
    }
    layers.resize(c.num_hidden_layers);
    int moe_seen = 0;
    for (int i = 0; i < c.num_hidden_layers; ++i) {
      Layer& L = layers[i];
      std::string p = Cat("model.layers.", i, ".");
      BRAGG_RETURN_IF_ERROR(LoadParam(ck, p + "input_layernorm.weight", {H}, &L.ln1));
      BRAGG_RETURN_IF_ERROR(LoadParam(ck, p + "post_attention_layernorm.weight", {H}, &L.ln2));
      BRAGG_RETURN_IF_ERROR(LoadParam(ck, p + "self_attn.q_proj.weight", {q_out, H}, &L.wq));
      BRAGG_RETURN_IF_ERROR(LoadParam(ck, p + "self_attn.k_proj.weight", {kv_out, H}, &L.wk));
      BRAGG_RETURN_IF_ERROR(LoadParam(ck, p + "self_attn.v_proj.weight", {kv_out, H}, &L.wv));
      BRAGG_RETURN_IF_ERROR(LoadParam(ck, p + "self_attn.o_proj.weight", {H, q_out}, &L.wo));
      if (c.attention_bias) {
        BRAGG_RETURN_IF_ERROR(LoadParam(ck, p + "self_attn.q_proj.bias", {q_out}, &L.bq));
        BRAGG_RETURN_IF_ERROR(LoadParam(ck, p + "self_attn.k_proj.bias", {kv_out}, &L.bk));
        BRAGG_RETURN_IF_ERROR(LoadParam(ck, p + "self_attn.v_proj.bias", {kv_out}, &L.bv));
        BRAGG_RETURN_IF_ERROR(LoadParam(ck, p + "self_attn.o_proj.bias", {H}, &L.bo));
      }
      BRAGG_RETURN_IF_ERROR(LoadParam(ck, p + "self_attn.q_norm.weight", {hd}, &L.q_norm));
      BRAGG_RETURN_IF_ERROR(LoadParam(ck, p + "self_attn.k_norm.weight", {hd}, &L.k_norm));
      L.moe = c.is_moe_layer(i);
      moe_layer_index.push_back(L.moe ? moe_seen++ : -1);
      if (L.moe) {
        int64_t I = c.moe_intermediate_size;
        BRAGG_RETURN_IF_ERROR(LoadParam(ck, p + "mlp.gate.weight", {c.num_experts, H}, &L.router));
        L.e_gate.resize(c.num_experts);
        L.e_up.resize(c.num_experts);
        L.e_down.resize(c.num_experts);
        for (int e = 0; e < c.num_experts; ++e) {
          std::string q = Cat(p, "mlp.experts.", e, ".");
          BRAGG_RETURN_IF_ERROR(LoadParam(ck, q + "gate_proj.weight", {I, H}, &L.e_gate[e]));
          BRAGG_RETURN_IF_ERROR(LoadParam(ck, q + "up_proj.weight", {I, H}, &L.e_up[e]));
          BRAGG_RETURN_IF_ERROR(LoadParam(ck, q + "down_proj.weight", {H, I}, &L.e_down[e]));
        }
        L.e_gate_up.resize(c.num_experts);
        for (int e = 0; e < c.num_experts; ++e) {
          Fuse(&L.e_gate[e], &L.e_up[e], &L.e_gate_up[e]);
        }
      } else {
        int64_t I = c.intermediate_size;
        BRAGG_RETURN_IF_ERROR(LoadParam(ck, p + "mlp.gate_proj.weight", {I, H}, &L.w_gate));
        BRAGG_RETURN_IF_ERROR(LoadParam(ck, p + "mlp.up_proj.weight", {I, H}, &L.w_up));
        BRAGG_RETURN_IF_ERROR(LoadParam(ck, p + "mlp.down_proj.weight", {H, I}, &L.w_down));
        Fuse(&L.w_gate, &L.w_up, &L.w_gate_up);
      }
      int64_t slots = options.kv_blocks * options.block_size;
      L.k_cache = torch::zeros({slots, c.num_key_value_heads, hd}, opts());
      L.v_cache = torch::zeros({slots, c.num_key_value_heads, hd}, opts());
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

  torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& w,
                       const torch::Tensor& b = {}) const {
    return engine::Linear(x, w, b, options.deterministic);
  }

  // Qwen3RMSNorm: in float32, then the weight times the value cast back.
  torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& w) const {
    torch::Tensor h = x.to(torch::kFloat32);
    torch::Tensor var = h.pow(2).mean(-1, /*keepdim=*/true);
    h = h * torch::rsqrt(var + config.rms_norm_eps);
    return w * h.to(x.scalar_type());
  }

  // x: [T, heads, hd]; cos/sin: [T, hd] in x's dtype.
  static torch::Tensor Rope(const torch::Tensor& x, const torch::Tensor& cos,
                            const torch::Tensor& sin) {
    int64_t half = x.size(-1) / 2;
    torch::Tensor x1 = x.index({"...", Slice(0, half)});
    torch::Tensor x2 = x.index({"...", Slice(half, torch::indexing::None)});
    torch::Tensor rotated = torch::cat({-x2, x1}, -1);
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
  }

  torch::Tensor Mlp(const Layer& L, const torch::Tensor& x) const {
    return SwiGlu(x, L.w_gate_up, L.w_down);
  }

  // Qwen3MoeSparseMoeBlock: softmax router in float32, top-k, optional renormalisation, experts
  // weighted and summed. `experts_out` gets the chosen ids [T, top_k].
  torch::Tensor Moe(const Layer& L, const torch::Tensor& x, torch::Tensor* experts_out) const {
    const ModelConfig& c = config;
    torch::Tensor logits = Linear(x, L.router);
    torch::Tensor probs = torch::softmax(logits.to(torch::kFloat32), -1);
    auto [w, idx] = torch::topk(probs, c.num_experts_per_tok, -1);
    if (c.norm_topk_prob) {
      w = w / w.sum(-1, /*keepdim=*/true);
    }
    w = w.to(x.scalar_type());
    *experts_out = idx;
    torch::Tensor out = torch::zeros_like(x);
    torch::Tensor flat = idx.reshape({-1});
    torch::Tensor order = torch::argsort(flat);
    torch::Tensor counts = torch::bincount(flat, {}, c.num_experts).cpu();
    const int64_t* cnt = counts.data_ptr<int64_t>();
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
      torch::Tensor ye = SwiGlu(xe, L.e_gate_up[e], L.e_down[e]);
      ye = ye * flat_w.index_select(0, sel).unsqueeze(1);
      out.index_add_(0, rows, ye);
    }
    return out;
  }

  // Causal attention of one chunk's queries over its sequence's cached keys and values.
  // q: [n, nh, hd]; returns [n, nh * hd]. Queries go in slices whose score matrix stays under
  // kScoreBytes: a 512-token chunk over a 4K context would otherwise make several 64 MB
  // temporaries per layer, each served by fresh pages (a third of a long prefill went to page
  // faults and zeroing).
  static constexpr int64_t kScoreBytes = int64_t{4} << 20;
  torch::Tensor AttendOne(const Layer& L, const torch::Tensor& q, const torch::Tensor& slots,
                          int64_t start) const {
    const ModelConfig& c = config;
    int64_t n = q.size(0), len = slots.size(0);
    int64_t kvh = c.num_key_value_heads, g = c.num_attention_heads / kvh, hd = c.head_dim;
    torch::Tensor k = L.k_cache.index_select(0, slots).permute({1, 2, 0});  // [kvh, hd, len]
    torch::Tensor v = L.v_cache.index_select(0, slots).permute({1, 0, 2});  // [kvh, len, hd]
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    int64_t step = std::max<int64_t>(1, kScoreBytes / (kvh * g * len * 4));
    std::vector<torch::Tensor> outs;
    for (int64_t b = 0; b < n; b += step) {
      int64_t m = std::min(step, n - b);
      torch::Tensor qh =
          q.narrow(0, b, m).view({m, kvh, g, hd}).permute({1, 2, 0, 3}).reshape({kvh, g * m, hd});
      torch::Tensor scores = torch::bmm(qh, k).mul_(scale).view({kvh, g, m, len});
      if (start + b + m < len || m > 1) {
        torch::Tensor qpos = torch::arange(
            start + b, start + b + m, torch::TensorOptions().dtype(torch::kInt64).device(device));
        torch::Tensor kpos =
            torch::arange(0, len, torch::TensorOptions().dtype(torch::kInt64).device(device));
        scores.masked_fill_(kpos.unsqueeze(0) > qpos.unsqueeze(1),
                            -std::numeric_limits<float>::infinity());
      }
      torch::Tensor probs = torch::softmax(scores.to(torch::kFloat32), -1).to(q.scalar_type());
      torch::Tensor o = torch::bmm(probs.view({kvh, g * m, len}), v);
      outs.push_back(o.view({kvh, g, m, hd}).permute({2, 0, 1, 3}).reshape({m, kvh * g * hd}));
    }
    return outs.size() == 1 ? outs[0] : torch::cat(outs, 0);
  }

  // Attention with a fixed order of every sum, one (query, head) per work item: the same result
  // for a query whether it comes in a prefill chunk or a decode step, alone or batched, on any
  // thread count. Scores and the softmax in float32, keys in position order; dot products with
  // eight partial sums combined in a fixed tree. q: [T, nh, hd] (any dtype); returns [T, nh*hd].
  template <typename S>
  torch::Tensor AttendExactT(const Layer& L, const torch::Tensor& q,
                             const std::vector<int64_t>& row_chunk,
                             const std::vector<int64_t>& row_pos,
                             const std::vector<torch::Tensor>& seq_slots) const {
    const ModelConfig& c = config;
    const int64_t T = q.size(0), nh = c.num_attention_heads, kvh = c.num_key_value_heads;
    const int64_t g = nh / kvh, hd = c.head_dim;
    torch::Tensor qf = q.to(torch::kFloat32).contiguous();
    torch::Tensor out = torch::empty({T, nh * hd}, torch::TensorOptions().dtype(torch::kFloat32));
    const float* qp = qf.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const S* kp = L.k_cache.data_ptr<S>();
    const S* vp = L.v_cache.data_ptr<S>();
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    at::parallel_for(0, T * nh, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      std::vector<float> kf(hd);
      for (int64_t item = begin; item < end; ++item) {
        int64_t row = item / nh, h = item % nh, kh = h / g;
        const int64_t* slots = seq_slots[row_chunk[row]].data_ptr<int64_t>();
        int64_t len = row_pos[row] + 1;
        const float* qv = qp + (row * nh + h) * hd;
        scores.resize(len);
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t l = 0; l < len; ++l) {
          const S* kv = kp + (slots[l] * kvh + kh) * hd;
          float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
          int64_t d = 0;
          for (; d + 8 <= hd; d += 8) {
            for (int i = 0; i < 8; ++i) acc[i] += qv[d + i] * static_cast<float>(kv[d + i]);
          }
          for (; d < hd; ++d) acc[d % 8] += qv[d] * static_cast<float>(kv[d]);
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
          for (int64_t d2 = 0; d2 < hd; ++d2) o[d2] += p * static_cast<float>(vv[d2]);
        }
      }
    });
    return out.to(q.scalar_type());
  }

  torch::Tensor AttendExact(const Layer& L, const torch::Tensor& q,
                            const std::vector<int64_t>& row_chunk,
                            const std::vector<int64_t>& row_pos,
                            const std::vector<torch::Tensor>& seq_slots) const {
    if (dtype == torch::kBFloat16) {
      return AttendExactT<c10::BFloat16>(L, q, row_chunk, row_pos, seq_slots);
    }
    return AttendExactT<float>(L, q, row_chunk, row_pos, seq_slots);
  }

  // Decode steps of several sequences at once (one query each), keys padded to the longest.
  // q: [B, nh, hd]; slots: [B, maxlen] (padding: any valid slot); lens: [B].
  torch::Tensor AttendDecode(const Layer& L, const torch::Tensor& q, const torch::Tensor& slots,
                             const torch::Tensor& lens) const {
    const ModelConfig& c = config;
    int64_t B = q.size(0), maxlen = slots.size(1);
    int64_t kvh = c.num_key_value_heads, g = c.num_attention_heads / kvh, hd = c.head_dim;
    torch::Tensor k = L.k_cache.index_select(0, slots.reshape({-1})).view({B, maxlen, kvh, hd});
    torch::Tensor v = L.v_cache.index_select(0, slots.reshape({-1})).view({B, maxlen, kvh, hd});
    torch::Tensor qh = q.view({B, kvh, g, hd});
    torch::Tensor scores = torch::matmul(qh, k.permute({0, 2, 3, 1})) *
                           (1.0 / std::sqrt(static_cast<double>(hd)));  // [B, kvh, g, maxlen]
    torch::Tensor kpos =
        torch::arange(0, maxlen, torch::TensorOptions().dtype(torch::kInt64).device(device));
    torch::Tensor mask = (kpos.unsqueeze(0) >= lens.unsqueeze(1)).view({B, 1, 1, maxlen});
    scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
    torch::Tensor probs = torch::softmax(scores.to(torch::kFloat32), -1).to(q.scalar_type());
    torch::Tensor o = torch::matmul(probs, v.permute({0, 2, 1, 3}));  // [B, kvh, g, hd]
    return o.reshape({B, kvh * g * hd});
  }

  Status Forward(std::span<const SeqChunk> chunks, ForwardOutput* out) {
    c10::InferenceMode guard;
    const ModelConfig& c = config;
    const int64_t bs = options.block_size;
    const int64_t capacity = options.kv_blocks * bs;
    int64_t T = 0;
    for (const SeqChunk& ch : chunks) {
      if (ch.tokens.empty()) {
        return absl::InvalidArgumentError("a chunk with no tokens");
      }
      int64_t end = ch.start + static_cast<int64_t>(ch.tokens.size());
      if (static_cast<int64_t>(ch.block_table.size()) * bs < end) {
        return absl::InternalError("a block table shorter than its sequence");
      }
      T += static_cast<int64_t>(ch.tokens.size());
    }
    auto i64 = torch::TensorOptions().dtype(torch::kInt64);
    torch::Tensor ids = torch::empty({T}, i64), pos = torch::empty({T}, i64),
                  slot = torch::empty({T}, i64);
    int64_t* pid = ids.data_ptr<int64_t>();
    int64_t* ppos = pos.data_ptr<int64_t>();
    int64_t* pslot = slot.data_ptr<int64_t>();
    std::vector<torch::Tensor> seq_slots;  // per chunk: slots of positions [0, end)
    std::vector<int64_t> row_begin;
    std::vector<int64_t> logit_rows;
    std::vector<int64_t> row_chunk, row_pos;  // per new token: its chunk and position
    int64_t r = 0;
    bool all_decode = chunks.size() > 1;
    int64_t maxlen = 0;
    for (const SeqChunk& ch : chunks) {
      int64_t n = static_cast<int64_t>(ch.tokens.size());
      int64_t end = ch.start + n;
      all_decode = all_decode && n == 1 && !options.deterministic;
      maxlen = std::max(maxlen, end);
      row_begin.push_back(r);
      torch::Tensor s = torch::empty({end}, i64);
      int64_t* ps = s.data_ptr<int64_t>();
      for (int64_t p = 0; p < end; ++p) {
        int64_t b = ch.block_table[p / bs];
        if (b < 0 || b >= options.kv_blocks) {
          return absl::InternalError(Cat("block ", b, " outside the KV cache"));
        }
        ps[p] = b * bs + p % bs;
      }
      for (int64_t j = 0; j < n; ++j) {
        int32_t t = ch.tokens[j];
        if (t < 0 || t >= c.vocab_size) {
          return absl::InvalidArgumentError(Cat("token id ", t, " is outside the vocabulary"));
        }
        pid[r + j] = t;
        row_chunk.push_back(static_cast<int64_t>(seq_slots.size()));
        row_pos.push_back(ch.start + j);
        ppos[r + j] = ch.start + j;
        pslot[r + j] = ps[ch.start + j];
        if (ch.all_logits || j == n - 1) {
          logit_rows.push_back(r + j);
        }
      }
      r += n;
      seq_slots.push_back(s.to(device));
    }
    (void)capacity;
    ids = ids.to(device);
    pos = pos.to(device);
    slot = slot.to(device);

    torch::Tensor freqs = pos.to(torch::kFloat32).unsqueeze(1) * inv_freq.unsqueeze(0);
    torch::Tensor emb = torch::cat({freqs, freqs}, -1);
    torch::Tensor cos = emb.cos().to(dtype), sin = emb.sin().to(dtype);

    torch::Tensor decode_slots, decode_lens;
    if (all_decode) {
      int64_t B = static_cast<int64_t>(chunks.size());
      decode_slots = torch::zeros({B, maxlen}, i64);
      decode_lens = torch::empty({B}, i64);
      for (int64_t b = 0; b < B; ++b) {
        int64_t len = seq_slots[b].size(0);
        decode_slots.index_put_({b, Slice(0, len)}, seq_slots[b].cpu());
        decode_lens[b] = len;
      }
      decode_slots = decode_slots.to(device);
      decode_lens = decode_lens.to(device);
    }

    const int64_t nh = c.num_attention_heads, kvh = c.num_key_value_heads, hd = c.head_dim;
    torch::Tensor h = embed.index_select(0, ids);
    std::vector<torch::Tensor> experts;
    for (size_t li = 0; li < layers.size(); ++li) {
      Layer& L = layers[li];
      torch::Tensor x = RmsNorm(h, L.ln1);
      torch::Tensor q = Linear(x, L.wq, L.bq).view({T, nh, hd});
      torch::Tensor k = Linear(x, L.wk, L.bk).view({T, kvh, hd});
      torch::Tensor v = Linear(x, L.wv, L.bv).view({T, kvh, hd});
      q = Rope(RmsNorm(q, L.q_norm), cos, sin);
      k = Rope(RmsNorm(k, L.k_norm), cos, sin);
      L.k_cache.index_copy_(0, slot, k);
      L.v_cache.index_copy_(0, slot, v);
      torch::Tensor attn;
      if (options.deterministic) {
        attn = AttendExact(L, q, row_chunk, row_pos, seq_slots);
      } else if (all_decode) {
        attn = AttendDecode(L, q, decode_slots, decode_lens);
      } else {
        std::vector<torch::Tensor> parts;
        for (size_t i = 0; i < chunks.size(); ++i) {
          int64_t n = static_cast<int64_t>(chunks[i].tokens.size());
          parts.push_back(
              AttendOne(L, q.narrow(0, row_begin[i], n), seq_slots[i], chunks[i].start));
        }
        attn = parts.size() == 1 ? parts[0] : torch::cat(parts, 0);
      }
      h = h + Linear(attn, L.wo, L.bo);
      x = RmsNorm(h, L.ln2);
      if (L.moe) {
        torch::Tensor idx;
        h = h + Moe(L, x, &idx);
        experts.push_back(idx.to(torch::kInt32));
      } else {
        h = h + Mlp(L, x);
      }
    }
    torch::Tensor rows = torch::tensor(logit_rows, i64).to(device);
    torch::Tensor hs = RmsNorm(h.index_select(0, rows), final_norm);
    torch::Tensor logits = Linear(hs, lm_head).to(torch::kFloat32).contiguous().cpu();
    out->logits.assign(logits.data_ptr<float>(), logits.data_ptr<float>() + logits.numel());
    out->experts.clear();
    if (!experts.empty()) {
      torch::Tensor e = torch::stack(experts, 1).contiguous().cpu();  // [T, moe layers, k]
      out->experts.assign(e.data_ptr<int32_t>(), e.data_ptr<int32_t>() + e.numel());
    }
    return absl::OkStatus();
  }
};

Model::Model(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Model::~Model() = default;

Result<std::unique_ptr<Model>> Model::Load(const Checkpoint& ck, const ModelOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->config = ck.config();
  impl->options = options;
  if (options.cuda) {
    if (!torch::cuda::is_available()) {
      return absl::FailedPreconditionError(
          "--device cuda: this libtorch has no CUDA or no GPU is visible (docs/engine.md, "
          "\"Building with CUDA\")");
    }
    impl->device = torch::Device(torch::kCUDA, 0);
  }
  impl->dtype = options.bf16 ? torch::kBFloat16 : torch::kFloat32;
  if (options.kv_blocks <= 0 || options.block_size <= 0) {
    return absl::InvalidArgumentError("the KV cache needs at least one block");
  }
  if (options.threads > 0) {
    torch::set_num_threads(options.threads);
  }
  // Keep freed tensor memory in the heap: glibc otherwise maps every allocation over its
  // (adaptive) threshold fresh and returns it on free, and each forward step pays page faults
  // and zeroing for its temporaries again.
  ::mallopt(M_MMAP_THRESHOLD, 32 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 512 << 20);
  // Torch parallelises around BLAS calls with its own threads; a multi-threaded OpenBLAS under
  // them oversubscribes the cores (its idle threads spin in sched_yield: measured as 40% of a
  // decode step's time on 2 cores). OpenBLAS runs single-threaded inside the engine.
  using SetThreads = void (*)(int);
  if (auto* set = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set(1);
  }
  BRAGG_RETURN_IF_ERROR(impl->Load(ck));
  return std::unique_ptr<Model>(new Model(std::move(impl)));
}

const ModelConfig& Model::config() const { return impl_->config; }

std::string Model::dtype_name() const {
  return impl_->dtype == torch::kBFloat16 ? "bfloat16" : "float32";
}

Status Model::Forward(std::span<const SeqChunk> chunks, ForwardOutput* out) {
  try {
    return impl_->Forward(chunks, out);
  } catch (const c10::Error& e) {
    return absl::InternalError(Cat("forward: ", e.what_without_backtrace()));
  }
}

Status Model::CheckUpdate(const Checkpoint& ck) const {
  const ModelConfig& a = impl_->config;
  const ModelConfig& b = ck.config();
  auto same = [&](std::string_view field, auto x, auto y) -> Status {
    if (x == y) return absl::OkStatus();
    return absl::InvalidArgumentError(
        Cat(ck.dir(), "/config.json: ", field, " is ", y, ", the running model's is ", x));
  };
  BRAGG_RETURN_IF_ERROR(same("architecture", a.architecture, b.architecture));
  BRAGG_RETURN_IF_ERROR(same("num_hidden_layers", a.num_hidden_layers, b.num_hidden_layers));
  BRAGG_RETURN_IF_ERROR(same("hidden_size", a.hidden_size, b.hidden_size));
  BRAGG_RETURN_IF_ERROR(same("vocab_size", a.vocab_size, b.vocab_size));
  BRAGG_RETURN_IF_ERROR(same("num_attention_heads", a.num_attention_heads, b.num_attention_heads));
  BRAGG_RETURN_IF_ERROR(same("num_key_value_heads", a.num_key_value_heads, b.num_key_value_heads));
  BRAGG_RETURN_IF_ERROR(same("head_dim", a.head_dim, b.head_dim));
  BRAGG_RETURN_IF_ERROR(same("num_experts", a.num_experts, b.num_experts));
  BRAGG_RETURN_IF_ERROR(same("num_experts_per_tok", a.num_experts_per_tok, b.num_experts_per_tok));
  BRAGG_RETURN_IF_ERROR(same("tie_word_embeddings", a.tie_word_embeddings, b.tie_word_embeddings));
  if (a.moe_layers() != b.moe_layers()) {
    return absl::InvalidArgumentError(Cat(ck.dir(), "/config.json: other MoE layers"));
  }
  // Norm constants and rope are part of the weights' meaning; a change would silently alter the
  // model in ways the tensors cannot show.
  BRAGG_RETURN_IF_ERROR(same("rms_norm_eps", a.rms_norm_eps, b.rms_norm_eps));
  BRAGG_RETURN_IF_ERROR(same("rope_theta", a.rope_theta, b.rope_theta));
  BRAGG_RETURN_IF_ERROR(same("norm_topk_prob", a.norm_topk_prob, b.norm_topk_prob));
  for (const auto& [name, view] : ck.tensors()) {
    if (!impl_->params.contains(name) && !(a.tie_word_embeddings && name == "lm_head.weight")) {
      return absl::InvalidArgumentError(
          Cat(view.file, ": tensor ", name, " is not a parameter of the running model"));
    }
  }
  for (const auto& [name, param] : impl_->params) {
    BRAGG_ASSIGN_OR_RETURN(const TensorView* v, ck.Find(name));
    std::vector<int64_t> want = param->sizes().vec();
    if (v->shape != want) {
      return absl::InvalidArgumentError(Cat(
          v->file, ": tensor ", name, " has shape [", fmt::format("{}", fmt::join(v->shape, ", ")),
          "], the running model's is [", fmt::format("{}", fmt::join(want, ", ")), "]"));
    }
    TensorDType was = impl_->file_dtypes.at(name);
    if (v->dtype != was) {
      return absl::InvalidArgumentError(
          Cat(v->file, ": tensor ", name, " is ", TensorDTypeName(v->dtype),
              ", the running model was loaded from ", TensorDTypeName(was)));
    }
  }
  return absl::OkStatus();
}

void Model::ApplyUpdate(const Checkpoint& ck) {
  c10::InferenceMode guard;
  for (auto& [name, param] : impl_->params) {
    const TensorView* v = *ck.Find(name);
    param->copy_(Borrow(*v));
  }
}

}  // namespace bragg::engine
