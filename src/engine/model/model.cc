#include "engine/model/model.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <map>

#include "common/str_cat.h"
#include "engine/model/attention_cpu.h"
#include "engine/model/fused_cpu.h"
#include "engine/model/linear.h"
#include "engine/model/packed_linear_cpu.h"
#include "engine/model/qwen3.h"

namespace bragg::engine {
namespace {

// An operand of the attention's batched products, as float32 where it is bfloat16: torch
// 1.13's bmm and matmul of bfloat16 on a CPU without oneDNN's bf16 GEMM (no AVX-512) sum in
// bfloat16 (measured: max error 1.1 on products of magnitude 45, against 0.12 for the bf16
// rounding of a float32 sum). The callers round the float32 product back, as a bf16 GEMM
// summing in float32 does. float32 operands are returned as they are.
torch::Tensor Accurate(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 ? t.to(torch::kFloat32) : t;
}

namespace F = torch::nn::functional;
using torch::indexing::Slice;

using qwen3::Borrow;
using qwen3::Layer;

// One layer's KV cache: [blocks * block_size, kvh, hd].
struct LayerCache {
  torch::Tensor k, v;
};

}  // namespace

struct Model::Impl {
  ModelConfig config;
  ModelOptions options;
  torch::Device device = torch::kCPU;
  torch::Dtype dtype = torch::kFloat32;
  qwen3::Weights w;
  // w.lm_head packed for qwen3::PackedLinear (fp32 on the CPU outside deterministic mode, where
  // the CPU has the kernel; else undefined): one more copy of the lm_head's memory, which a
  // decode step's logits come from instead of a BLAS call that would pack it every step.
  torch::Tensor lm_head_packed;
  // fp32 on the CPU outside deterministic mode: the norms, rotary embedding and cache writes
  // around the products go through fused_cpu.h, and q, k and v come from one product per layer
  // with wqkv[layer] (its layers' wq, wk and wv are views of it, which weight updates write
  // through).
  bool fused = false;
  std::vector<torch::Tensor> wqkv, bqkv;
  // Fused, where the CPU has the packed kernel and the model no q/k/v/o biases: wqkv and wo of
  // each layer packed for qwen3::PackedLinear, which takes a decode step's projections from
  // kPackedProjectionMinRows rows on (below that BLAS's small-matrix path was as fast or
  // faster); else empty.
  std::vector<torch::Tensor> wqkv_packed, wo_packed;
  static constexpr int64_t kPackedProjectionMinRows = 8;
  std::vector<LayerCache> cache;

  torch::TensorOptions opts() const { return torch::TensorOptions().dtype(dtype).device(device); }

  Status Load(const Checkpoint& ck) {
    BRAGG_RETURN_IF_ERROR(w.Load(ck, device, dtype));
    // fp32 only: torch 1.13 multiplies bfloat16 by a weight in that layout summing in bfloat16
    // where it has no oneDNN bf16 GEMM (a CPU without AVX-512: max error 0.47 against 0.06 for
    // the row-major weight), which failed engine_transformers_parity_test's bf16 cases there.
    if (!options.deterministic && device.is_cpu() && dtype == torch::kFloat32) {
      qwen3::TransposeLinearWeights(&w);  // measured with OpenBLAS only
      if (qwen3::PackedLinearAvailable()) {
        lm_head_packed = qwen3::PackLinearWeight(w.lm_head);
      }
      fused = true;
    }
    if (fused) {
      for (Layer& L : w.layers) {
        FuseQkv(&L);
      }
      bool biases = false;
      for (size_t li = 0; li < w.layers.size(); ++li) {
        biases = biases || bqkv[li].defined() || w.layers[li].bo.defined();
      }
      if (lm_head_packed.defined() && !biases) {
        for (size_t li = 0; li < w.layers.size(); ++li) {
          wqkv_packed.push_back(qwen3::PackLinearWeight(wqkv[li]));
          wo_packed.push_back(qwen3::PackLinearWeight(w.layers[li].wo));
        }
      }
    }
    const ModelConfig& c = config;
    int64_t slots = options.kv_blocks * options.block_size;
    cache.resize(c.num_hidden_layers);
    for (LayerCache& lc : cache) {
      lc.k = torch::zeros({slots, c.num_key_value_heads, c.head_dim}, opts());
      lc.v = torch::zeros({slots, c.num_key_value_heads, c.head_dim}, opts());
    }
    return absl::OkStatus();
  }

  // wq, wk and wv into one tensor, laid out as TransposeLinearWeights lays each out, with the
  // three as views of it (their biases likewise, where the model has them).
  void FuseQkv(Layer* L) {
    auto fuse = [](std::initializer_list<torch::Tensor*> parts, bool flip) {
      std::vector<torch::Tensor> all;
      for (torch::Tensor* t : parts) {
        all.push_back(*t);
      }
      torch::Tensor f = torch::cat(all, 0);
      if (flip) {
        f = f.t().contiguous().t();
      }
      int64_t at = 0;
      for (torch::Tensor* t : parts) {
        int64_t n = t->size(0);
        *t = f.narrow(0, at, n);
        at += n;
      }
      return f;
    };
    wqkv.push_back(fuse({&L->wq, &L->wk, &L->wv}, true));
    bqkv.push_back(L->bq.defined() ? fuse({&L->bq, &L->bk, &L->bv}, false) : torch::Tensor());
  }

  torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& w,
                       const torch::Tensor& b = {}) const {
    return engine::Linear(x, w, b, options.deterministic);
  }

  // x w^T for layer `li`'s fused q/k/v product or its output projection (`packed`: wqkv_packed
  // or wo_packed): from the packed copy where it takes x, else Linear.
  torch::Tensor Projection(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                           const std::vector<torch::Tensor>& packed, size_t li) const {
    if (!packed.empty() && x.size(0) >= kPackedProjectionMinRows &&
        qwen3::PackedLinearFits(x, packed[li])) {
      return qwen3::PackedLinear(x, packed[li], w.size(0));
    }
    return Linear(x, w, b);
  }

  torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& weight) const {
    return qwen3::RmsNorm(x, weight, config.rms_norm_eps);
  }

  // Causal attention of one chunk's queries over its sequence's cached keys and values.
  // q: [n, nh, hd]; returns [n, nh * hd]. Queries go in slices whose score matrix stays under
  // kScoreBytes: a 512-token chunk over a 4K context would otherwise make several 64 MB
  // temporaries per layer, each served by fresh pages (a third of a long prefill went to page
  // faults and zeroing). 4 MB measured best: 2 and 8 MB took twice as long on a 4K prefill of
  // the benchmark's model (2 cores).
  static constexpr int64_t kScoreBytes = int64_t{4} << 20;
  torch::Tensor AttendOne(const LayerCache& L, const torch::Tensor& q, const torch::Tensor& slots,
                          int64_t start) const {
    if (qwen3::PrefillAttentionFits(L.k, L.v, q, slots, start)) {
      return qwen3::PrefillAttention(L.k, L.v, q, slots, start);  // attention_cpu.h
    }
    const ModelConfig& c = config;
    int64_t n = q.size(0), len = slots.size(0);
    int64_t kvh = c.num_key_value_heads, g = c.num_attention_heads / kvh, hd = c.head_dim;
    torch::Tensor k = L.k.index_select(0, slots).permute({1, 2, 0});  // [kvh, hd, len]
    torch::Tensor v = L.v.index_select(0, slots).permute({1, 0, 2});  // [kvh, len, hd]
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    int64_t step = std::max<int64_t>(1, kScoreBytes / (kvh * g * len * 4));
    std::vector<torch::Tensor> outs;
    for (int64_t b = 0; b < n; b += step) {
      int64_t m = std::min(step, n - b);
      // Causal: this slice's queries (positions start+b .. start+b+m-1) see no key past its
      // last one, and only the keys of the slice's own positions need a mask (a triangle).
      int64_t kend = std::min(len, start + b + m);
      torch::Tensor qh =
          q.narrow(0, b, m).view({m, kvh, g, hd}).permute({1, 2, 0, 3}).reshape({kvh, g * m, hd});
      torch::Tensor scores = torch::bmm(Accurate(qh), Accurate(k.narrow(2, 0, kend)))
                                 .to(q.scalar_type())
                                 .mul_(scale)
                                 .view({kvh, g, m, kend});
      if (m > 1) {
        scores.narrow(3, kend - m, m)
            .masked_fill_(
                torch::ones({m, m}, torch::TensorOptions().dtype(torch::kBool).device(device))
                    .triu(1),
                -std::numeric_limits<float>::infinity());
      }
      torch::Tensor probs = torch::softmax(scores.to(torch::kFloat32), -1).to(q.scalar_type());
      torch::Tensor o =
          torch::bmm(Accurate(probs.view({kvh, g * m, kend})), Accurate(v.narrow(1, 0, kend)))
              .to(q.scalar_type());
      outs.push_back(o.view({kvh, g, m, hd}).permute({2, 0, 1, 3}).reshape({m, kvh * g * hd}));
    }
    return outs.size() == 1 ? outs[0] : torch::cat(outs, 0);
  }

  // Decode steps of several sequences at once (one query each), keys padded to the longest.
  // q: [B, nh, hd]; slots: [B, maxlen] (padding: any valid slot); lens: [B].
  torch::Tensor AttendDecode(const LayerCache& L, const torch::Tensor& q,
                             const torch::Tensor& slots, const torch::Tensor& lens) const {
    const ModelConfig& c = config;
    int64_t B = q.size(0), maxlen = slots.size(1);
    int64_t kvh = c.num_key_value_heads, g = c.num_attention_heads / kvh, hd = c.head_dim;
    torch::Tensor k = L.k.index_select(0, slots.reshape({-1})).view({B, maxlen, kvh, hd});
    torch::Tensor v = L.v.index_select(0, slots.reshape({-1})).view({B, maxlen, kvh, hd});
    torch::Tensor qh = q.view({B, kvh, g, hd});
    torch::Tensor scores =
        torch::matmul(Accurate(qh), Accurate(k.permute({0, 2, 3, 1}))).to(q.scalar_type()) *
        (1.0 / std::sqrt(static_cast<double>(hd)));  // [B, kvh, g, maxlen]
    torch::Tensor kpos =
        torch::arange(0, maxlen, torch::TensorOptions().dtype(torch::kInt64).device(device));
    torch::Tensor mask = (kpos.unsqueeze(0) >= lens.unsqueeze(1)).view({B, 1, 1, maxlen});
    scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
    torch::Tensor probs = torch::softmax(scores.to(torch::kFloat32), -1).to(q.scalar_type());
    torch::Tensor o = torch::matmul(Accurate(probs), Accurate(v.permute({0, 2, 1, 3})))
                          .to(q.scalar_type());  // [B, kvh, g, hd]
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

    auto [cos, sin] = qwen3::RopeTables(pos, w.inv_freq, dtype);

    // A decode step's attention: the CPU kernel (attention_cpu.h) reads the cache in place where
    // it can; else torch's batched path, over the slots padded to the longest sequence.
    torch::Tensor decode_slots, decode_lens;
    auto pad_decode_slots = [&] {
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
    };

    const int64_t nh = c.num_attention_heads, kvh = c.num_key_value_heads, hd = c.head_dim;
    torch::Tensor h = w.embed.index_select(0, ids);
    std::vector<torch::Tensor> experts;
    const double eps = c.rms_norm_eps;
    torch::Tensor pending;  // fused: the last MLP's output, not yet added to h
    for (size_t li = 0; li < w.layers.size(); ++li) {
      const Layer& L = w.layers[li];
      LayerCache& lc = cache[li];
      torch::Tensor x, q;
      if (fused) {
        x = pending.defined() ? qwen3::AddRmsNorm(h, pending, L.ln1, eps)
                              : qwen3::FusedRmsNorm(h, L.ln1, eps);
        q = qwen3::QkNormRopeCache(Projection(x, wqkv[li], bqkv[li], wqkv_packed, li), L.q_norm,
                                   L.k_norm, cos, sin, lc.k, lc.v, slot, nh, kvh, eps);
      } else {
        x = RmsNorm(h, L.ln1);
        q = Linear(x, L.wq, L.bq).view({T, nh, hd});
        torch::Tensor k = Linear(x, L.wk, L.bk).view({T, kvh, hd});
        torch::Tensor v = Linear(x, L.wv, L.bv).view({T, kvh, hd});
        q = qwen3::Rope(RmsNorm(q, L.q_norm), cos, sin);
        k = qwen3::Rope(RmsNorm(k, L.k_norm), cos, sin);
        lc.k.index_copy_(0, slot, k);
        lc.v.index_copy_(0, slot, v);
      }
      torch::Tensor attn;
      if (options.deterministic) {
        attn = qwen3::AttendExact(c, lc.k, lc.v, q, row_chunk, row_pos, seq_slots);
      } else if (all_decode && qwen3::DecodeAttentionFits(lc.k, lc.v, q, seq_slots)) {
        attn = qwen3::DecodeAttention(lc.k, lc.v, q, seq_slots);
      } else if (all_decode) {
        if (!decode_slots.defined()) {
          pad_decode_slots();
        }
        attn = AttendDecode(lc, q, decode_slots, decode_lens);
      } else {
        std::vector<torch::Tensor> parts;
        for (size_t i = 0; i < chunks.size(); ++i) {
          int64_t n = static_cast<int64_t>(chunks[i].tokens.size());
          parts.push_back(
              AttendOne(lc, q.narrow(0, row_begin[i], n), seq_slots[i], chunks[i].start));
        }
        attn = parts.size() == 1 ? parts[0] : torch::cat(parts, 0);
      }
      if (fused) {
        x = qwen3::AddRmsNorm(h, Projection(attn, L.wo, L.bo, wo_packed, li), L.ln2, eps);
      } else {
        h = h + Linear(attn, L.wo, L.bo);
        x = RmsNorm(h, L.ln2);
      }
      torch::Tensor mlp;
      if (L.moe) {
        torch::Tensor idx;
        mlp = qwen3::Moe(c, L, x, options.deterministic, &idx);
        experts.push_back(idx.to(torch::kInt32));
      } else {
        mlp = qwen3::SwiGlu(x, L.w_gate_up, L.w_down, options.deterministic);
      }
      if (fused) {
        pending = mlp.contiguous();
      } else {
        h = h + mlp;
      }
    }
    if (pending.defined()) {
      h.add_(pending);
    }
    torch::Tensor rows = torch::tensor(logit_rows, i64).to(device);
    torch::Tensor hs = RmsNorm(h.index_select(0, rows), w.final_norm);
    // The logits land in out->logits, whose memory a caller that keeps its ForwardOutput
    // reuses from step to step (a fresh 4 MB for a decode step of 32 rows cost its page
    // faults and a copy every step); a buffer far larger than this step needs is let go.
    const int64_t vocab = w.lm_head.size(0);
    const size_t need = logit_rows.size() * static_cast<size_t>(vocab);
    if (out->logits.capacity() > std::max<size_t>(4 * need, size_t{16} << 20)) {
      std::vector<float>().swap(out->logits);
    }
    out->logits.resize(need);
    torch::Tensor into =
        torch::from_blob(out->logits.data(), {static_cast<int64_t>(logit_rows.size()), vocab},
                         torch::TensorOptions().dtype(torch::kFloat32));
    if (qwen3::PackedLinearFits(hs, lm_head_packed)) {
      qwen3::PackedLinearInto(hs, lm_head_packed, into);
    } else {
      into.copy_(Linear(hs, w.lm_head));
    }
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

std::string DescribeCpuRuntime() { return qwen3::DescribeCpuRuntime(); }

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
  qwen3::ConfigureCpuRuntime(options.threads);
  BRAGG_RETURN_IF_ERROR(impl->Load(ck));
  return std::unique_ptr<Model>(new Model(std::move(impl)));
}

const ModelConfig& Model::config() const { return impl_->config; }

int Model::threads() const { return at::get_num_threads(); }

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
    if (!impl_->w.params.contains(name) && !(a.tie_word_embeddings && name == "lm_head.weight")) {
      return absl::InvalidArgumentError(
          Cat(view.file, ": tensor ", name, " is not a parameter of the running model"));
    }
  }
  for (const auto& [name, param] : impl_->w.params) {
    BRAGG_ASSIGN_OR_RETURN(const TensorView* v, ck.Find(name));
    std::vector<int64_t> want = param->sizes().vec();
    if (v->shape != want) {
      return absl::InvalidArgumentError(Cat(
          v->file, ": tensor ", name, " has shape [", fmt::format("{}", fmt::join(v->shape, ", ")),
          "], the running model's is [", fmt::format("{}", fmt::join(want, ", ")), "]"));
    }
    TensorDType was = impl_->w.file_dtypes.at(name);
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
  for (auto& [name, param] : impl_->w.params) {
    const TensorView* v = *ck.Find(name);
    param->copy_(Borrow(*v));
  }
  if (impl_->lm_head_packed.defined()) {
    qwen3::RepackLinearWeight(impl_->w.lm_head, impl_->lm_head_packed);
  }
  for (size_t li = 0; li < impl_->wqkv_packed.size(); ++li) {
    qwen3::RepackLinearWeight(impl_->wqkv[li], impl_->wqkv_packed[li]);
    qwen3::RepackLinearWeight(impl_->w.layers[li].wo, impl_->wo_packed[li]);
  }
}

}  // namespace bragg::engine
