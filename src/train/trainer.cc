#include "train/trainer.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <set>

#include "common/fs.h"
#include "common/hash.h"
#include "common/str_cat.h"
#include "engine/model/checkpoint.h"
#include "engine/model/linear.h"
#include "engine/model/qwen3.h"
#include "pack/plan.h"
#include "train/data_parallel.h"
#include "train/kernels/linear_cross_entropy.h"
#include "train/optim/offload_adamw.h"
#include "train/safetensors_writer.h"

namespace bragg::train {
namespace {

// A 64-bit fingerprint of a sequence of values (SplitMix64 over their bytes, 8 at a time).
class Fingerprint {
 public:
  Fingerprint& Add(std::string_view bytes) {
    Mix(bytes.size());
    for (size_t i = 0; i < bytes.size(); i += 8) {
      uint64_t w = 0;
      std::memcpy(&w, bytes.data() + i, std::min<size_t>(8, bytes.size() - i));
      Mix(w);
    }
    return *this;
  }
  template <typename T>
  Fingerprint& Add(const T& v) {
    static_assert(std::is_arithmetic_v<T> || std::is_enum_v<T>);
    uint64_t w = 0;
    std::memcpy(&w, &v, std::min(sizeof(v), sizeof(w)));
    Mix(w);
    return *this;
  }
  uint64_t value() const { return h_; }

 private:
  void Mix(uint64_t w) { h_ = SplitMix64(h_ ^ w); }
  uint64_t h_ = 0x6272616767ULL;
};

using engine::ModelConfig;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
namespace qwen3 = engine::qwen3;

// Causal attention of one trace's queries over its own keys, in plain torch ops (autograd
// differentiates it). q: [n, nh, hd]; k, v: [n, kvh, hd]; returns [n, nh * hd]. Scores and the
// softmax in float32, as the engine's kernels.
torch::Tensor AttendTrace(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t n = q.size(0), nh = q.size(1), hd = q.size(2), kvh = k.size(1), g = nh / kvh;
  torch::Tensor qh = q.reshape({n, kvh, g, hd}).permute({1, 2, 0, 3});  // [kvh, g, n, hd]
  torch::Tensor kh = k.permute({1, 2, 0}).unsqueeze(1);                 // [kvh, 1, hd, n]
  torch::Tensor scores =
      torch::matmul(qh.to(torch::kFloat32), kh.to(torch::kFloat32)) / std::sqrt(double(hd));
  torch::Tensor mask =
      torch::ones({n, n}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
  scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  torch::Tensor probs = torch::softmax(scores, -1);
  torch::Tensor o =
      torch::matmul(probs, v.permute({1, 0, 2}).unsqueeze(1).to(torch::kFloat32));  // [kvh,g,n,hd]
  return o.permute({2, 0, 1, 3}).reshape({n, nh * hd}).to(q.scalar_type());
}

// The engine's exact attention kernel (qwen3::AttendExact) as an autograd function over a
// packed row: forward is the kernel itself, so a trace's attention output is the engine's bit
// for bit; backward recomputes each trace with AttendTrace and differentiates that (the same
// function up to rounding).
class ExactAttention : public torch::autograd::Function<ExactAttention> {
 public:
  // spans: [begin0, len0, begin1, len1, ...] of the traces in the row.
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor q, torch::Tensor k,
                               torch::Tensor v, const ModelConfig* config,
                               std::vector<int64_t> spans) {
    std::vector<int64_t> row_seq(q.size(0)), row_pos(q.size(0));
    std::vector<torch::Tensor> seq_slots;
    for (size_t s = 0; s < spans.size(); s += 2) {
      int64_t begin = spans[s], len = spans[s + 1];
      for (int64_t i = 0; i < len; ++i) {
        row_seq[begin + i] = static_cast<int64_t>(seq_slots.size());
        row_pos[begin + i] = i;
      }
      seq_slots.push_back(torch::arange(begin, begin + len, torch::kInt64));
    }
    ctx->save_for_backward({q, k, v});
    ctx->saved_data["spans"] = spans;
    return qwen3::AttendExact(*config, k.contiguous(), v.contiguous(), q, row_seq, row_pos,
                              seq_slots);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    const torch::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
    std::vector<int64_t> spans = ctx->saved_data["spans"].toIntVector();
    torch::Tensor go = grads[0];
    torch::Tensor dq = torch::zeros_like(q), dk = torch::zeros_like(k), dv = torch::zeros_like(v);
    torch::AutoGradMode enable(true);
    for (size_t s = 0; s < spans.size(); s += 2) {
      int64_t begin = spans[s], len = spans[s + 1];
      torch::Tensor qs = q.narrow(0, begin, len).detach().requires_grad_(true);
      torch::Tensor ks = k.narrow(0, begin, len).detach().requires_grad_(true);
      torch::Tensor vs = v.narrow(0, begin, len).detach().requires_grad_(true);
      torch::Tensor o = AttendTrace(qs, ks, vs);
      variable_list d = torch::autograd::grad({o}, {qs, ks, vs}, {go.narrow(0, begin, len)});
      dq.narrow(0, begin, len).copy_(d[0]);
      dk.narrow(0, begin, len).copy_(d[1]);
      dv.narrow(0, begin, len).copy_(d[2]);
    }
    return {dq, dk, dv, torch::Tensor(), torch::Tensor()};
  }
};

// Activation recomputation (the reentrant form of torch.utils.checkpoint): forward runs the block
// without building a graph and keeps only its input; backward runs it again with a graph and
// backpropagates through it, so the parameters' gradients accumulate as usual and the input's is
// returned. The block (a closure) must outlive the backward pass: Impl::blocks holds it.
using Block = std::function<torch::Tensor(const torch::Tensor&)>;
class Recomputed : public torch::autograd::Function<Recomputed> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, const Block* block) {
    ctx->save_for_backward({x});
    ctx->saved_data["block"] = reinterpret_cast<int64_t>(block);
    return (*block)(x);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    torch::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    const Block* block = reinterpret_cast<const Block*>(ctx->saved_data["block"].toInt());
    torch::Tensor y;
    {
      torch::AutoGradMode enable(true);
      y = (*block)(x);
    }
    torch::autograd::backward({y}, {grads[0]});
    return {x.grad(), torch::Tensor()};
  }
};

// One micro-batch: trajectories packed into one THD row. Each trace contributes its tokens but
// the last (the last token predicts nothing), at positions 0..n-2.
// With TrainOptions::padded every member's span is the micro-batch's longest trace (a padded
// batch, for comparison): the padding positions hold token 0, carry no loss and, coming after
// the trace's real tokens, are never attended to by them.
struct PackedRow {
  std::vector<size_t> members;  // indices into the batch
  std::vector<int64_t> begin;   // per member: its first row in the packed tensors
  std::vector<int64_t> span;    // per member: rows it occupies (its tokens - 1, or padded)
  int64_t tokens = 0;
};

struct Forwarded {
  torch::Tensor hidden;                // [T, H] after the final norm
  std::vector<torch::Tensor> experts;  // per MoE layer, int64 [T, top_k]
};

// Each option enum's names, one table for both directions (Parse* and Name).
template <typename E>
using NameTable = std::span<const std::pair<E, std::string_view>>;
constexpr std::pair<Recompute, std::string_view> kRecomputeNames[] = {
    {Recompute::kNone, "none"}, {Recompute::kSelective, "selective"}, {Recompute::kFull, "full"}};
constexpr std::pair<DpBalance, std::string_view> kDpBalanceNames[] = {
    {DpBalance::kCost, "cost"}, {DpBalance::kRoundRobin, "round-robin"}};
constexpr std::pair<Objective, std::string_view> kObjectiveNames[] = {{Objective::kGrpo, "grpo"},
                                                                      {Objective::kSft, "sft"}};

template <typename E>
std::optional<E> FromName(NameTable<E> table, std::string_view name) {
  for (const auto& [e, n] : table) {
    if (n == name) return e;
  }
  return std::nullopt;
}

template <typename E>
std::string_view ToName(NameTable<E> table, E e) {
  for (const auto& [v, n] : table) {
    if (v == e) return n;
  }
  return "?";
}

}  // namespace

Result<Recompute> ParseRecompute(std::string_view name) {
  if (auto e = FromName<Recompute>(kRecomputeNames, name)) return *e;
  return absl::InvalidArgumentError(
      Cat("unknown recomputation \"", name, "\" (none, selective or full)"));
}
std::string_view Name(Recompute r) { return ToName<Recompute>(kRecomputeNames, r); }

Result<DpBalance> ParseDpBalance(std::string_view name) {
  if (auto e = FromName<DpBalance>(kDpBalanceNames, name)) return *e;
  return absl::InvalidArgumentError(
      Cat("unknown data-parallel balance \"", name, "\" (cost or round-robin)"));
}
std::string_view Name(DpBalance b) { return ToName<DpBalance>(kDpBalanceNames, b); }

Result<Objective> ParseObjective(std::string_view name) {
  if (auto e = FromName<Objective>(kObjectiveNames, name)) return *e;
  return absl::InvalidArgumentError(Cat("unknown objective \"", name, "\" (grpo or sft)"));
}
std::string_view Name(Objective o) { return ToName<Objective>(kObjectiveNames, o); }

struct Trainer::Impl {
  TrainOptions options;
  engine::Checkpoint checkpoint;  // the loaded model's files (config, tensor dtypes)
  qwen3::Weights w;
  std::unique_ptr<qwen3::Weights> reference;
  std::unique_ptr<OffloadAdamW> optimizer;
  std::unique_ptr<DataParallel> dp;  // null with one rank
  bool gradients_only = false;       // Step accumulates gradients and stops (SaveGradients)
  // The recomputed blocks of the micro-batch in flight (their closures live until its backward).
  mutable std::vector<std::unique_ptr<Block>> blocks;
  int64_t step = 0;
  int64_t version = 0;

  const ModelConfig& config() const { return w.config; }
  int top_k() const { return config().num_experts_per_tok; }

  Status CheckBatch(std::span<const Trajectory> batch) const {
    if (batch.empty()) {
      return absl::InvalidArgumentError("an empty batch: nothing to train on");
    }
    std::set<std::string> ids;
    bool any_experts = false, all_experts = true;
    for (const Trajectory& t : batch) {
      BRAGG_RETURN_IF_ERROR(
          Validate(t, config().vocab_size, w.num_moe_layers(), top_k(), config().num_experts));
      if (!ids.insert(t.id).second) {
        return absl::InvalidArgumentError(Cat("trajectory ", t.id, " appears twice in the batch"));
      }
      any_experts = any_experts || !t.routed_experts.empty();
      all_experts = all_experts && !t.routed_experts.empty();
    }
    if (any_experts && !all_experts) {
      return absl::InvalidArgumentError(
          "some trajectories carry routed_experts and some do not: router replay needs them all");
    }
    return absl::OkStatus();
  }

  // bragg_pack's plan of `members` into micro-batches of at most options.max_tokens tokens.
  // With `mine_only`, the micro-batches of this data-parallel rank, dealt as
  // options.dp_balance says; else all of them, planned by cost.
  Result<std::vector<PackedRow>> Plan(std::span<const Trajectory> batch,
                                      const std::vector<size_t>& members,
                                      bool mine_only = false) const {
    std::vector<pack::Trace> traces;
    traces.reserve(members.size());
    for (size_t i : members) {
      const Trajectory& t = batch[i];
      pack::Trace tr;
      tr.id = static_cast<int64_t>(i);
      tr.length = static_cast<int64_t>(t.tokens.size()) - 1;
      tr.loss_tokens = std::accumulate(t.loss_mask.begin() + 1, t.loss_mask.end(), int64_t{0});
      if (tr.length > options.max_tokens) {
        return absl::InvalidArgumentError(Cat("trajectory ", t.id, " has ", t.tokens.size(),
                                              " tokens; a micro-batch holds ", options.max_tokens,
                                              " (raise --max-tokens)"));
      }
      traces.push_back(tr);
    }
    pack::PackConfig pc;
    pc.dp = mine_only ? options.world_size : 1;
    pc.max_tokens = options.max_tokens;
    pc.method = pack::Method::kLpt;
    if (options.padded) {
      pc.method = pack::Method::kPaddedBshd;
    } else if (mine_only && options.dp_balance == DpBalance::kRoundRobin) {
      pc.method = pack::Method::kRoundRobin;
    }
    BRAGG_ASSIGN_OR_RETURN(pack::Plan plan, pack::PlanPacking(traces, pc));
    std::vector<PackedRow> rows;
    std::vector<bool> covered(batch.size(), false);
    for (size_t rk = 0; rk < plan.ranks.size(); ++rk) {
      for (const pack::MicroBatch& mb : plan.ranks[rk].micro_batches) {
        // THD: one row per micro-batch. Padded: the micro-batch's rows (one trace each) stacked,
        // each padded to the longest.
        PackedRow row;
        int64_t longest = 0;
        for (const pack::Row& r : mb.rows) {
          for (int64_t id : r.trace_ids) {
            size_t i = static_cast<size_t>(id);
            if (i >= batch.size() || covered[i]) {
              return absl::InternalError(Cat("the packing plan names trace ", id, " wrongly"));
            }
            covered[i] = true;
            row.members.push_back(i);
            longest = std::max<int64_t>(longest, static_cast<int64_t>(batch[i].tokens.size()) - 1);
          }
        }
        for (size_t i : row.members) {
          int64_t n = static_cast<int64_t>(batch[i].tokens.size()) - 1;
          row.begin.push_back(row.tokens);
          row.span.push_back(options.padded ? longest : n);
          row.tokens += row.span.back();
        }
        if (!row.members.empty() && (!mine_only || static_cast<int>(rk) == options.rank)) {
          rows.push_back(std::move(row));
        }
      }
    }
    for (size_t i : members) {
      if (!covered[i]) {
        return absl::InternalError(Cat("the packing plan leaves out trajectory ", batch[i].id));
      }
    }
    return rows;
  }

  // The model over a packed row (autograd on when grad mode is).
  Forwarded Forward(const qwen3::Weights& m, std::span<const Trajectory> batch,
                    const PackedRow& row, bool replay) const {
    const ModelConfig& c = m.config;
    const int64_t T = row.tokens;
    auto i64 = torch::TensorOptions().dtype(torch::kInt64);
    torch::Tensor ids = torch::zeros({T}, i64), pos = torch::empty({T}, i64);
    int64_t* pid = ids.data_ptr<int64_t>();
    int64_t* ppos = pos.data_ptr<int64_t>();
    std::vector<int64_t> spans;
    const int moe_layers = m.num_moe_layers();
    const int k = c.num_experts_per_tok;
    std::vector<torch::Tensor> replays;
    if (replay) {
      for (int l = 0; l < moe_layers; ++l) {
        replays.push_back(torch::zeros({T, k}, i64));
      }
    }
    for (size_t j = 0; j < row.members.size(); ++j) {
      const Trajectory& t = batch[row.members[j]];
      int64_t n = static_cast<int64_t>(t.tokens.size()) - 1, b = row.begin[j];
      for (int64_t i = n; i < row.span[j]; ++i) {
        ppos[b + i] = i;
      }
      for (int64_t i = 0; i < n; ++i) {
        pid[b + i] = t.tokens[i];
        ppos[b + i] = i;
        for (int l = 0; l < static_cast<int>(replays.size()); ++l) {
          int64_t* r = replays[l].data_ptr<int64_t>() + (b + i) * k;
          const int32_t* src = t.routed_experts.data() + (i * moe_layers + l) * k;
          for (int e = 0; e < k; ++e) {
            r[e] = src[e];
          }
        }
      }
      spans.push_back(b);
      spans.push_back(row.span[j]);
    }
    ids = ids.to(m.device);
    pos = pos.to(m.device);
    torch::Tensor cos, sin;
    std::tie(cos, sin) = qwen3::RopeTables(pos, m.inv_freq, m.dtype);
    const bool det = options.deterministic;
    const int64_t nh = c.num_attention_heads, kvh = c.num_key_value_heads, hd = c.head_dim;
    Forwarded out;
    torch::Tensor h = m.embed.index_select(0, ids);
    const bool grad = torch::GradMode::is_enabled();
    if (grad) {
      // Only a forward with a graph recomputes; one without (the KL reference's, inside a
      // step) must leave the policy's closures alone until its backward.
      blocks.clear();
    }
    const Recompute recompute = grad ? options.recompute : Recompute::kNone;
    for (size_t li = 0; li < m.layers.size(); ++li) {
      const qwen3::Layer& L = m.layers[li];
      const int ml = m.moe_layer_index[li];
      // The halves capture by value: a recomputed one runs again in backward, after Forward
      // has returned.
      torch::Tensor layer_replay = replay && ml >= 0 ? replays[ml] : torch::Tensor();
      auto experts = std::make_shared<torch::Tensor>();
      auto attention = [&c, det, T, nh, kvh, hd, cos, sin, spans,
                        L = &L](const torch::Tensor& hin) {
        torch::Tensor x = qwen3::RmsNorm(hin, L->ln1, c.rms_norm_eps);
        torch::Tensor q = engine::Linear(x, L->wq, L->bq, det).view({T, nh, hd});
        torch::Tensor kk = engine::Linear(x, L->wk, L->bk, det).view({T, kvh, hd});
        torch::Tensor v = engine::Linear(x, L->wv, L->bv, det).view({T, kvh, hd});
        q = qwen3::Rope(qwen3::RmsNorm(q, L->q_norm, c.rms_norm_eps), cos, sin);
        kk = qwen3::Rope(qwen3::RmsNorm(kk, L->k_norm, c.rms_norm_eps), cos, sin);
        torch::Tensor attn;
        if (det) {
          attn = ExactAttention::apply(q, kk, v, &c, spans);
        } else {
          std::vector<torch::Tensor> parts;
          for (size_t s = 0; s < spans.size(); s += 2) {
            parts.push_back(AttendTrace(q.narrow(0, spans[s], spans[s + 1]),
                                        kk.narrow(0, spans[s], spans[s + 1]),
                                        v.narrow(0, spans[s], spans[s + 1])));
          }
          attn = parts.size() == 1 ? parts[0] : torch::cat(parts, 0);
        }
        return hin + engine::Linear(attn, L->wo, L->bo, det);
      };
      // The MLP half (norm, MLP or experts) adds its output to its input.
      auto mlp = [&c, det, L = &L, layer_replay, experts](const torch::Tensor& hin) {
        torch::Tensor x = qwen3::RmsNorm(hin, L->ln2, c.rms_norm_eps);
        if (L->moe) {
          return hin + qwen3::Moe(c, *L, x, det, experts.get(),
                                  layer_replay.defined() ? &layer_replay : nullptr);
        }
        return hin + qwen3::SwiGlu(x, L->w_gate_up, L->w_down, det);
      };
      switch (recompute) {
        case Recompute::kNone:
          h = mlp(attention(h));
          break;
        case Recompute::kSelective:
          // Keep the attention half's activations; recompute the MLP half (norm, SwiGLU or the
          // experts' intermediates: the memory-heavy, cheap part).
          h = attention(h);
          blocks.push_back(std::make_unique<Block>(mlp));
          h = Recomputed::apply(h, blocks.back().get());
          break;
        case Recompute::kFull:
          blocks.push_back(std::make_unique<Block>(
              [attention, mlp](const torch::Tensor& hin) { return mlp(attention(hin)); }));
          h = Recomputed::apply(h, blocks.back().get());
          break;
      }
      if (L.moe) {
        out.experts.push_back(*experts);
      }
    }
    out.hidden = qwen3::RmsNorm(h, m.final_norm, c.rms_norm_eps);
    return out;
  }

  torch::Tensor Labels(std::span<const Trajectory> batch, const PackedRow& row) const {
    torch::Tensor labels = torch::zeros({row.tokens}, torch::kInt64);
    int64_t* p = labels.data_ptr<int64_t>();
    for (size_t j = 0; j < row.members.size(); ++j) {
      const Trajectory& t = batch[row.members[j]];
      for (size_t i = 1; i < t.tokens.size(); ++i) {
        p[row.begin[j] + static_cast<int64_t>(i) - 1] = t.tokens[i];
      }
    }
    return labels;
  }

  LinearCrossEntropyOptions LceOptions() const {
    LinearCrossEntropyOptions o;
    o.token_chunk = options.lce_token_chunk;
    o.temperature = options.temperature;
    o.deterministic = options.deterministic;
    return o;
  }

  // Log-probs [T] (and entropy) of the row's labels under `m`.
  LinearCrossEntropyOutput TokenLogProbs(const qwen3::Weights& m, std::span<const Trajectory> batch,
                                         const PackedRow& row, bool replay,
                                         std::vector<torch::Tensor>* experts = nullptr) const {
    Forwarded f = Forward(m, batch, row, replay);
    if (experts != nullptr) {
      *experts = f.experts;
    }
    torch::Tensor labels = Labels(batch, row).to(m.device);
    if (!options.fused_cross_entropy) {
      // The unfused path, for comparison: the [T, V] logits whole.
      torch::Tensor logits = engine::Linear(f.hidden, m.lm_head, {}, options.deterministic)
                                 .to(torch::kFloat32)
                                 .div(static_cast<double>(static_cast<float>(options.temperature)));
      torch::Tensor logp = torch::log_softmax(logits, -1);
      return {logp.gather(1, labels.unsqueeze(1)).squeeze(1), -(logp.exp() * logp).sum(-1)};
    }
    return LinearCrossEntropy(f.hidden, m.lm_head, labels, LceOptions());
  }

  std::vector<size_t> All(size_t n) const {
    std::vector<size_t> v(n);
    std::iota(v.begin(), v.end(), 0);
    return v;
  }

  Result<std::vector<std::vector<float>>> LogProbs(std::span<const Trajectory> batch) {
    BRAGG_RETURN_IF_ERROR(CheckBatch(batch));
    torch::NoGradGuard no_grad;
    BRAGG_ASSIGN_OR_RETURN(std::vector<PackedRow> rows, Plan(batch, All(batch.size())));
    std::vector<std::vector<float>> out(batch.size());
    bool replay = !batch[0].routed_experts.empty();
    for (const PackedRow& row : rows) {
      torch::Tensor lp = TokenLogProbs(w, batch, row, replay).logprobs.cpu().contiguous();
      const float* p = lp.data_ptr<float>();
      for (size_t j = 0; j < row.members.size(); ++j) {
        const Trajectory& t = batch[row.members[j]];
        std::vector<float>& v = out[row.members[j]];
        v.assign(t.tokens.size(), 0.0f);
        std::copy(p + row.begin[j], p + row.begin[j] + t.tokens.size() - 1, v.begin() + 1);
      }
    }
    return out;
  }

  Result<std::vector<std::vector<int32_t>>> RoutedExperts(std::span<const Trajectory> batch) {
    BRAGG_RETURN_IF_ERROR(CheckBatch(batch));
    torch::NoGradGuard no_grad;
    std::vector<std::vector<int32_t>> out(batch.size());
    if (config().num_experts == 0) {
      return out;
    }
    BRAGG_ASSIGN_OR_RETURN(std::vector<PackedRow> rows, Plan(batch, All(batch.size())));
    for (const PackedRow& row : rows) {
      Forwarded f = Forward(w, batch, row, /*replay=*/false);
      torch::Tensor e = torch::stack(f.experts, 1).to(torch::kInt32).cpu().contiguous();
      const int64_t per = e.size(1) * e.size(2);
      const int32_t* p = e.data_ptr<int32_t>();
      for (size_t j = 0; j < row.members.size(); ++j) {
        int64_t n = static_cast<int64_t>(batch[row.members[j]].tokens.size()) - 1;
        out[row.members[j]].assign(p + row.begin[j] * per, p + (row.begin[j] + n) * per);
      }
    }
    return out;
  }

  // Per-token tensors of a row: mask (float, 1 where the label carries loss), behaviour
  // log-probs, advantages and proximal log-probs (when given per trajectory).
  struct RowTargets {
    torch::Tensor mask, behaviour, advantage, proximal;
  };
  RowTargets Targets(std::span<const Trajectory> batch, const PackedRow& row,
                     const std::vector<double>& adv,
                     const std::vector<std::vector<float>>* proximal) const {
    RowTargets r;
    r.mask = torch::zeros({row.tokens}, torch::kFloat32);
    r.behaviour = torch::zeros({row.tokens}, torch::kFloat32);
    r.advantage = torch::zeros({row.tokens}, torch::kFloat32);
    if (proximal != nullptr) {
      r.proximal = torch::zeros({row.tokens}, torch::kFloat32);
    }
    float* m = r.mask.data_ptr<float>();
    float* b = r.behaviour.data_ptr<float>();
    float* a = r.advantage.data_ptr<float>();
    for (size_t j = 0; j < row.members.size(); ++j) {
      size_t idx = row.members[j];
      const Trajectory& t = batch[idx];
      for (size_t i = 1; i < t.tokens.size(); ++i) {
        int64_t at = row.begin[j] + static_cast<int64_t>(i) - 1;
        m[at] = t.loss_mask[i];
        b[at] = t.loss_mask[i] ? t.logprobs[i] : 0.0f;
        a[at] = static_cast<float>(adv[idx]);
        if (proximal != nullptr) {
          r.proximal.data_ptr<float>()[at] = (*proximal)[idx][i];
        }
      }
    }
    return r;
  }

  // Sums every parameter's gradient over the ranks (one flat buffer, one collective); a rank
  // without micro-batches contributes zeros.
  Status AllReduceGrads() {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> flat;
    for (auto& [name, p] : w.leaves) {
      flat.push_back(p->grad().defined() ? p->grad().reshape({-1}).to(torch::kFloat32)
                                         : torch::zeros({p->numel()}, torch::kFloat32));
    }
    std::vector<torch::Tensor> buf = {torch::cat(flat)};
    BRAGG_RETURN_IF_ERROR(dp->AllReduceSum(buf));
    int64_t off = 0;
    for (auto& [name, p] : w.leaves) {
      torch::Tensor g = buf[0].narrow(0, off, p->numel()).view(p->sizes()).to(p->scalar_type());
      off += p->numel();
      p->mutable_grad() = g.clone();
    }
    return absl::OkStatus();
  }

  // With data parallelism: every rank must bring the same `fp` (a fingerprint of `what`); when
  // they differ, FailedPrecondition on every rank, so that none goes on alone into the next
  // collective and none trains on a batch the others did not plan.
  Status AgreeAcrossRanks(uint64_t fp, std::string_view what) const {
    if (!dp) return absl::OkStatus();
    const auto hi = static_cast<int64_t>(fp >> 32), lo = static_cast<int64_t>(fp & 0xffffffffu);
    // max(x) and max(-x) = -min(x): equal everywhere only when min == max.
    std::vector<torch::Tensor> t{torch::tensor({hi, lo, -hi, -lo}, torch::kInt64)};
    BRAGG_RETURN_IF_ERROR(dp->AllReduceMax(t));
    auto a = t[0].accessor<int64_t, 1>();
    if (a[0] != -a[2] || a[1] != -a[3]) {
      return absl::FailedPreconditionError(Cat("the data-parallel ranks were given different ",
                                               what, ": every rank must be given the same (rank ",
                                               dp->rank(), " of ", dp->world_size(), ")"));
    }
    return absl::OkStatus();
  }

  // What every rank of a step must agree on: the batch, in order (ids, tokens, masks, rewards
  // and advantages); the plan and the gradients follow from it.
  static uint64_t BatchFingerprint(std::span<const Trajectory> batch) {
    Fingerprint f;
    f.Add(batch.size());
    for (const Trajectory& t : batch) {
      f.Add(std::string_view(t.id)).Add(std::string_view(t.group));
      f.Add(std::string_view(reinterpret_cast<const char*>(t.tokens.data()),
                             t.tokens.size() * sizeof(int32_t)));
      f.Add(
          std::string_view(reinterpret_cast<const char*>(t.loss_mask.data()), t.loss_mask.size()));
      f.Add(t.reward).Add(t.advantage.has_value()).Add(t.advantage.value_or(0.0));
    }
    return f.value();
  }

  Result<StepMetrics> Step(std::span<const Trajectory> batch) {
    auto t0 = std::chrono::steady_clock::now();
    BRAGG_RETURN_IF_ERROR(AgreeAcrossRanks(BatchFingerprint(batch), "batches"));
    BRAGG_RETURN_IF_ERROR(CheckBatch(batch));
    const bool grpo = options.objective == Objective::kGrpo;
    const bool replay = !batch[0].routed_experts.empty();
    std::vector<double> adv = GroupAdvantages(batch, options.normalize_std);
    StepMetrics mt;
    mt.trajectories = static_cast<int64_t>(batch.size());
    for (size_t i = 0; i < batch.size(); ++i) {
      const Trajectory& t = batch[i];
      mt.tokens += static_cast<int64_t>(t.tokens.size());
      mt.reward_mean += t.reward / static_cast<double>(batch.size());
      mt.advantage_abs_mean += std::abs(adv[i]) / static_cast<double>(batch.size());
      for (size_t j = 0; j < t.tokens.size(); ++j) {
        if (t.loss_mask[j] && !t.versions.empty() && t.versions[j] >= 0) {
          mt.min_version =
              mt.min_version < 0 ? t.versions[j] : std::min(mt.min_version, t.versions[j]);
          mt.max_version = std::max(mt.max_version, t.versions[j]);
        }
      }
    }
    // The proximal policy: with several optimizer steps per batch, the policy before the first
    // (computed now); with one, the current policy itself (detached in the loss).
    std::vector<std::vector<float>> proximal;
    const int K =
        gradients_only
            ? 1
            : std::max(1, std::min<int>(options.minibatches, static_cast<int>(batch.size())));
    if (grpo && K > 1) {
      BRAGG_ASSIGN_OR_RETURN(proximal, LogProbs(batch));
    }
    // Mini-batches: contiguous slices of the batch in its order (the rl controller shuffles).
    double sum_loss = 0, sum_pg = 0, sum_ent = 0, sum_kl = 0, sum_clip = 0, sum_w = 0,
           sum_trunc = 0, max_diff = 0, grad_norm = 0, compute_s = 0;
    int64_t loss_tokens = 0, rank_tokens = 0;
    for (int mb = 0; mb < K; ++mb) {
      size_t lo = batch.size() * mb / K, hi = batch.size() * (mb + 1) / K;
      std::vector<size_t> members(hi - lo);
      std::iota(members.begin(), members.end(), lo);
      BRAGG_ASSIGN_OR_RETURN(std::vector<PackedRow> rows, Plan(batch, members, true));
      int64_t mb_tokens = 0;
      for (size_t i : members) {
        mb_tokens +=
            std::accumulate(batch[i].loss_mask.begin() + 1, batch[i].loss_mask.end(), int64_t{0});
      }
      for (const PackedRow& row : rows) {
        rank_tokens += row.tokens;
      }
      auto c0 = std::chrono::steady_clock::now();
      for (const PackedRow& row : rows) {
        RowTargets tg = Targets(batch, row, adv, proximal.empty() ? nullptr : &proximal);
        torch::Tensor mask = tg.mask.to(w.device);
        LinearCrossEntropyOutput lce = TokenLogProbs(w, batch, row, replay);
        torch::Tensor logp = lce.logprobs;
        torch::Tensor per_token;
        if (grpo) {
          torch::Tensor behaviour = tg.behaviour.to(w.device);
          torch::Tensor prox = proximal.empty() ? logp.detach() : tg.proximal.to(w.device);
          torch::Tensor A = tg.advantage.to(w.device);
          torch::Tensor ratio = torch::exp(logp - prox);
          torch::Tensor clipped =
              torch::clamp(ratio, 1.0 - options.clip_low, 1.0 + options.clip_high);
          torch::Tensor surrogate = torch::min(ratio * A, clipped * A);
          torch::Tensor weight = torch::ones_like(logp);
          if (options.tis_cap > 0) {
            torch::Tensor raw = torch::exp(prox - behaviour).detach();
            weight = torch::clamp_max(raw, options.tis_cap);
            sum_trunc += ((raw > options.tis_cap).to(torch::kFloat32) * mask).sum().item<double>();
          }
          per_token = -weight * surrogate;
          sum_pg += (per_token.detach() * mask).sum().item<double>();
          sum_w += (weight * mask).sum().item<double>();
          sum_clip +=
              (((ratio * A) > (clipped * A)).to(torch::kFloat32) * mask).sum().item<double>();
          max_diff =
              std::max(max_diff, ((logp.detach() - behaviour).abs() * mask).max().item<double>());
          if (options.kl_coef > 0) {
            torch::Tensor ref;
            {
              torch::NoGradGuard ng;
              ref = TokenLogProbs(*reference, batch, row, replay).logprobs;
            }
            // Only loss tokens: on a prompt token the two models may disagree by more than
            // exp() holds in float, and inf times a zero mask is NaN (in the gradient too).
            torch::Tensor d = torch::where(mask > 0, ref - logp, torch::zeros_like(logp));
            torch::Tensor k3 = torch::exp(d) - d - 1;
            per_token = per_token + options.kl_coef * k3;
            sum_kl += (k3.detach() * mask).sum().item<double>();
          }
        } else {
          per_token = -logp;
          sum_pg += (per_token.detach() * mask).sum().item<double>();
        }
        if (options.entropy_coef > 0) {
          per_token = per_token - options.entropy_coef * lce.entropy;
        }
        sum_ent += (lce.entropy.detach() * mask).sum().item<double>();
        torch::Tensor loss = (per_token * mask).sum() / static_cast<double>(mb_tokens);
        sum_loss += loss.item<double>() * static_cast<double>(mb_tokens);
        loss.backward();
        ++mt.micro_batches;
      }
      compute_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
      loss_tokens += mb_tokens;
      if (dp) {
        BRAGG_RETURN_IF_ERROR(AllReduceGrads());
      }
      if (gradients_only) {
        continue;
      }
      BRAGG_ASSIGN_OR_RETURN(StepStats st, optimizer->Step());
      grad_norm = st.grad_norm;
      for (auto& [name, p] : w.leaves) {
        p->mutable_grad() = torch::Tensor();
      }
      ++step;
    }
    if (!gradients_only) {
      ++version;
    }
    double seconds_max = compute_s, seconds_mean = compute_s;
    double tokens_max = static_cast<double>(rank_tokens), tokens_mean = tokens_max;
    if (dp) {
      // Every rank's sums, and the largest difference, time and tokens (counts well below
      // 2^53: exact in double).
      std::vector<torch::Tensor> sums = {
          torch::tensor({sum_loss, sum_pg, sum_ent, sum_kl, sum_clip, sum_w, sum_trunc,
                         static_cast<double>(mt.micro_batches), compute_s, tokens_mean},
                        torch::kFloat64)};
      std::vector<torch::Tensor> maxes = {
          torch::tensor({max_diff, compute_s, tokens_max}, torch::kFloat64)};
      BRAGG_RETURN_IF_ERROR(dp->AllReduceSum(sums));
      BRAGG_RETURN_IF_ERROR(dp->AllReduceMax(maxes));
      const double* a = sums[0].data_ptr<double>();
      sum_loss = a[0], sum_pg = a[1], sum_ent = a[2], sum_kl = a[3], sum_clip = a[4];
      sum_w = a[5], sum_trunc = a[6];
      mt.micro_batches = static_cast<int>(a[7]);
      seconds_mean = a[8] / dp->world_size();
      tokens_mean = a[9] / dp->world_size();
      max_diff = maxes[0].data_ptr<double>()[0];
      seconds_max = maxes[0].data_ptr<double>()[1];
      tokens_max = maxes[0].data_ptr<double>()[2];
    }
    mt.rank_seconds_max = seconds_max;
    mt.rank_seconds_mean = seconds_mean;
    mt.rank_tokens_max = static_cast<int64_t>(tokens_max);
    mt.rank_tokens_mean = tokens_mean;
    const double n = static_cast<double>(std::max<int64_t>(1, loss_tokens));
    mt.loss_tokens = loss_tokens;
    mt.loss = sum_loss / n;
    mt.policy_loss = sum_pg / n;
    mt.entropy = sum_ent / n;
    mt.kl = sum_kl / n;
    mt.clip_fraction = sum_clip / n;
    mt.is_weight_mean = grpo ? sum_w / n : 1.0;
    mt.is_truncated_fraction = sum_trunc / n;
    mt.logprob_diff_max = max_diff;
    mt.grad_norm = grad_norm;
    mt.step = step;
    mt.version = version;
    mt.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    mt.tokens_per_second = static_cast<double>(mt.tokens) / std::max(1e-9, mt.seconds);
    return mt;
  }

  // The objective's gradient on `batch` by Hugging Face parameter name (FP32), no step taken.
  Status SaveGradients(std::span<const Trajectory> batch, const std::string& path) {
    gradients_only = true;
    Result<StepMetrics> m = Step(batch);
    gradients_only = false;
    BRAGG_RETURN_IF_ERROR(m.status());
    torch::NoGradGuard no_grad;
    std::map<const void*, std::string> leaf_of;  // storage of every leaf
    std::vector<torch::Tensor> keep;
    std::vector<TensorBytes> tensors;
    for (const auto& [name, param] : w.params) {
      // The gradient of a view (gate, up) is the same view of its fused leaf's gradient.
      torch::Tensor g;
      for (auto& [lname, leaf] : w.leaves) {
        const char* base = static_cast<const char*>(leaf->data_ptr());
        const char* at = static_cast<const char*>(param->data_ptr());
        if (at >= base && at < base + leaf->nbytes()) {
          int64_t offset = (at - base) / static_cast<int64_t>(leaf->element_size());
          torch::Tensor lg = leaf->grad().defined() ? leaf->grad() : torch::zeros_like(*leaf);
          g = lg.reshape({-1}).narrow(0, offset, param->numel()).view(param->sizes());
          break;
        }
      }
      if (!g.defined()) {
        return absl::InternalError(Cat("no gradient found for ", name));
      }
      torch::Tensor t = g.to(torch::kCPU, torch::kFloat32).contiguous();
      keep.push_back(t);
      tensors.push_back(
          {name, engine::TensorDType::kF32, t.sizes().vec(),
           std::span<const uint8_t>(static_cast<const uint8_t*>(t.data_ptr()), t.nbytes())});
    }
    Status s = WriteSafetensors(path, tensors);
    for (auto& [name, p] : w.leaves) {
      p->mutable_grad() = torch::Tensor();
    }
    return s;
  }

  // The current weights as tensors in the dtypes of the files they were loaded from.
  Status WriteModelFiles(const std::string& dir) const {
    namespace fs = std::filesystem;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(checkpoint.dir(), ec)) {
      std::string name = entry.path().filename().string();
      if (!entry.is_regular_file() || name.ends_with(".safetensors") ||
          name == "model.safetensors.index.json") {
        continue;
      }
      fs::copy_file(entry.path(), fs::path(dir) / name, fs::copy_options::overwrite_existing, ec);
      if (ec) {
        return absl::InternalError(Cat("copying ", entry.path().string(), ": ", ec.message()));
      }
    }
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> keep;
    std::vector<TensorBytes> tensors;
    for (const auto& [name, param] : w.params) {
      engine::TensorDType dt = w.file_dtypes.at(name);
      torch::Tensor t = param->detach().to(torch::kCPU, qwen3::TorchDType(dt)).contiguous();
      keep.push_back(t);
      TensorBytes b;
      b.name = name;
      b.dtype = dt;
      b.shape = t.sizes().vec();
      b.data = std::span<const uint8_t>(static_cast<const uint8_t*>(t.data_ptr()), t.nbytes());
      tensors.push_back(std::move(b));
    }
    return WriteSafetensors((fs::path(dir) / "model.safetensors").string(), tensors,
                            {{"format", "pt"}});
  }

  Status SaveModel(const std::string& dir) const {
    if (options.rank != 0) {
      return absl::OkStatus();
    }
    std::string staging = Cat(dir, ".tmp-", ::getpid());
    (void)RemoveTree(staging);
    BRAGG_RETURN_IF_ERROR(MakeDirs(staging));
    BRAGG_RETURN_IF_ERROR(WriteModelFiles(staging));
    return PublishDirectory(staging, dir);
  }

  Status SaveCheckpoint(const std::string& root) const {
    if (options.rank != 0) {
      return absl::OkStatus();
    }
    std::string name = Cat("step-", step);
    std::string final_dir = Cat(root, "/", name);
    std::string staging = Cat(final_dir, ".tmp-", ::getpid());
    (void)RemoveTree(staging);
    BRAGG_RETURN_IF_ERROR(MakeDirs(staging + "/model"));
    BRAGG_RETURN_IF_ERROR(WriteModelFiles(staging + "/model"));
    std::vector<std::pair<std::string, torch::Tensor>> state = optimizer->StateTensors();
    std::vector<TensorBytes> tensors;
    std::vector<torch::Tensor> keep;
    for (auto& [n, t] : state) {
      torch::Tensor c = t.to(torch::kCPU, torch::kFloat32).contiguous();
      keep.push_back(c);
      tensors.push_back(
          {n, engine::TensorDType::kF32, c.sizes().vec(),
           std::span<const uint8_t>(static_cast<const uint8_t*>(c.data_ptr()), c.nbytes())});
    }
    BRAGG_RETURN_IF_ERROR(WriteSafetensors(staging + "/optimizer.safetensors", tensors));
    nlohmann::json meta = {{"step", step}, {"version", version}, {"format", "bragg-train/1"}};
    BRAGG_RETURN_IF_ERROR(WriteStringToFile(staging + "/trainer.json", meta.dump(2) + "\n"));
    BRAGG_RETURN_IF_ERROR(PublishDirectory(staging, final_dir));
    std::string latest_tmp = Cat(root, "/latest.tmp-", ::getpid());
    BRAGG_RETURN_IF_ERROR(WriteStringToFile(latest_tmp, name + "\n"));
    if (::rename(latest_tmp.c_str(), (root + "/latest").c_str()) != 0) {
      return absl::InternalError(Cat("rename ", latest_tmp, ": ", std::strerror(errno)));
    }
    return absl::OkStatus();
  }
};

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;

namespace {

// What every data-parallel rank must agree on: every option that shapes a step (not the paths,
// threads, rank or rendezvous) and the model's parameter names and shapes.
uint64_t OptionsFingerprint(const TrainOptions& o, const qwen3::Weights& w) {
  Fingerprint f;
  f.Add(o.bf16).Add(o.deterministic).Add(o.objective).Add(o.temperature).Add(o.lr);
  f.Add(o.beta1).Add(o.beta2).Add(o.eps).Add(o.weight_decay).Add(o.max_grad_norm);
  f.Add(o.optimizer_chunk_elements).Add(o.normalize_std).Add(o.clip_low).Add(o.clip_high);
  f.Add(o.tis_cap).Add(o.kl_coef).Add(o.entropy_coef).Add(o.minibatches).Add(o.max_tokens);
  f.Add(o.lce_token_chunk).Add(o.fused_cross_entropy).Add(o.padded).Add(o.recompute);
  f.Add(o.dp_balance).Add(o.world_size).Add(o.reference_dir.empty());
  for (const auto& [name, p] : w.leaves) {
    f.Add(std::string_view(name));
    for (int64_t d : p->sizes()) f.Add(d);
  }
  return f.value();
}

Status CheckOptions(const TrainOptions& o) {
  auto bad = [](auto&&... p) { return absl::InvalidArgumentError(Cat(p...)); };
  if (o.model_dir.empty()) return bad("no model directory (--model)");
  if (!(o.lr >= 0) || !std::isfinite(o.lr)) return bad("lr must be >= 0, not ", o.lr);
  if (!(o.temperature > 0)) return bad("temperature must be > 0, not ", o.temperature);
  if (o.clip_low < 0 || o.clip_low >= 1 || o.clip_high < 0) {
    return bad("clip range [1 - ", o.clip_low, ", 1 + ", o.clip_high, "] is empty or inverted");
  }
  if (o.tis_cap < 0) return bad("tis_cap must be >= 0 (0: off), not ", o.tis_cap);
  if (o.minibatches < 1) return bad("minibatches must be >= 1");
  if (o.max_tokens < 2) return bad("max_tokens must be >= 2");
  if (o.lce_token_chunk < 1 ||
      (o.deterministic && o.lce_token_chunk % engine::kDeterministicTile != 0)) {
    return bad("lce_token_chunk must be >= 1 (a multiple of ", engine::kDeterministicTile,
               " in deterministic mode), not ", o.lce_token_chunk);
  }
  if (o.kl_coef < 0 || o.entropy_coef < 0) return bad("kl_coef and entropy_coef must be >= 0");
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size) {
    return bad("rank ", o.rank, " of world size ", o.world_size, ": need 0 <= rank < world size");
  }
  if (o.world_size > 1 && o.rendezvous.empty()) {
    return bad("world size ", o.world_size, " needs a rendezvous (file:PATH or tcp:HOST:PORT)");
  }
  if (o.kl_coef > 0 && o.reference_dir.empty()) {
    return absl::FailedPreconditionError("kl_coef > 0 needs a reference model (--reference)");
  }
  return absl::OkStatus();
}

}  // namespace

Result<std::unique_ptr<Trainer>> Trainer::Create(const TrainOptions& options) {
  BRAGG_RETURN_IF_ERROR(CheckOptions(options));
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  qwen3::ConfigureCpuRuntime(options.threads);
  // BLAS as in the engine (ConfigureCpuRuntime): OpenBLAS's OpenMP build on torch's threads
  // (train_step_bench's speed set, 2 cores: 0.47 s a step); a pthreads build single-threaded
  // (0.69 s; on the trainer's threads its idle threads spun: 1.2-2.4 s).
  try {
    BRAGG_ASSIGN_OR_RETURN(impl->checkpoint, engine::Checkpoint::Open(options.model_dir));
    torch::Dtype dt = options.bf16 ? torch::kBFloat16 : torch::kFloat32;
    BRAGG_RETURN_IF_ERROR(impl->w.Load(impl->checkpoint, torch::kCPU, dt));
    if (!options.reference_dir.empty()) {
      BRAGG_ASSIGN_OR_RETURN(engine::Checkpoint ref,
                             engine::Checkpoint::Open(options.reference_dir));
      impl->reference = std::make_unique<qwen3::Weights>();
      BRAGG_RETURN_IF_ERROR(impl->reference->Load(ref, torch::kCPU, dt));
      if (impl->reference->leaves.size() != impl->w.leaves.size()) {
        return absl::InvalidArgumentError(Cat(options.reference_dir,
                                              ": the reference model has other tensors than ",
                                              options.model_dir));
      }
      for (size_t i = 0; i < impl->w.leaves.size(); ++i) {
        if (!impl->reference->leaves[i].second->sizes().equals(impl->w.leaves[i].second->sizes())) {
          return absl::InvalidArgumentError(Cat(options.reference_dir, ": tensor ",
                                                impl->w.leaves[i].first, " has another shape"));
        }
      }
    }
    std::vector<std::pair<std::string, torch::Tensor>> named;
    for (auto& [name, p] : impl->w.leaves) {
      p->requires_grad_(true);
      named.emplace_back(name, *p);
    }
    AdamWOptions ao;
    ao.lr = options.lr;
    ao.beta1 = options.beta1;
    ao.beta2 = options.beta2;
    ao.eps = options.eps;
    ao.weight_decay = options.weight_decay;
    ao.chunk_elements = options.optimizer_chunk_elements;
    ao.max_grad_norm = options.max_grad_norm;
    BRAGG_ASSIGN_OR_RETURN(impl->optimizer, OffloadAdamW::Create(std::move(named), ao));
    if (options.world_size > 1) {
      BRAGG_ASSIGN_OR_RETURN(
          impl->dp, DataParallel::Join(options.world_size, options.rank, options.rendezvous));
      BRAGG_RETURN_IF_ERROR(
          impl->AgreeAcrossRanks(OptionsFingerprint(options, impl->w), "options or models"));
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        Cat("loading ", options.model_dir, ": ", e.what_without_backtrace()));
  }
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

Result<std::unique_ptr<Trainer>> Trainer::Resume(const std::string& root, TrainOptions options) {
  BRAGG_ASSIGN_OR_RETURN(std::string latest, ReadFileToString(root + "/latest"));
  while (!latest.empty() && (latest.back() == '\n' || latest.back() == ' ')) {
    latest.pop_back();
  }
  if (latest.empty() || latest.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(Cat(root, "/latest does not name a checkpoint"));
  }
  std::string dir = Cat(root, "/", latest);
  options.model_dir = dir + "/model";
  BRAGG_ASSIGN_OR_RETURN(std::string meta_text, ReadFileToString(dir + "/trainer.json"));
  nlohmann::json meta = nlohmann::json::parse(meta_text, nullptr, false);
  if (meta.is_discarded() || !meta.contains("step") || !meta["step"].is_number_integer() ||
      !meta.contains("version") || !meta["version"].is_number_integer()) {
    return absl::InvalidArgumentError(Cat(dir, "/trainer.json: no integer step and version"));
  }
  BRAGG_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> t, Create(options));
  const std::string opt_path = dir + "/optimizer.safetensors";
  BRAGG_ASSIGN_OR_RETURN(std::string opt_bytes, ReadFileToString(opt_path));
  BRAGG_ASSIGN_OR_RETURN(
      std::vector<engine::TensorView> views,
      engine::ParseSafetensors(reinterpret_cast<const uint8_t*>(opt_bytes.data()), opt_bytes.size(),
                               opt_path));
  std::map<std::string, torch::Tensor> state;
  for (const engine::TensorView& v : views) {
    const std::string& name = v.name;
    if (v.dtype != engine::TensorDType::kF32) {
      return absl::InvalidArgumentError(Cat(v.file, ": tensor ", name, " is not F32"));
    }
    state[name] = torch::from_blob(const_cast<uint8_t*>(v.data), v.shape, torch::kFloat32).clone();
  }
  BRAGG_RETURN_IF_ERROR(t->impl_->optimizer->LoadState(state, meta["step"].get<int64_t>()));
  t->impl_->step = meta["step"].get<int64_t>();
  t->impl_->version = meta["version"].get<int64_t>();
  return t;
}

Result<StepMetrics> Trainer::Step(std::span<const Trajectory> batch) {
  try {
    return impl_->Step(batch);
  } catch (const c10::Error& e) {
    return absl::InternalError(Cat("training step: ", e.what_without_backtrace()));
  }
}

Result<std::vector<std::vector<float>>> Trainer::LogProbs(std::span<const Trajectory> batch) {
  try {
    return impl_->LogProbs(batch);
  } catch (const c10::Error& e) {
    return absl::InternalError(Cat("log-probs: ", e.what_without_backtrace()));
  }
}

Result<std::vector<std::vector<int32_t>>> Trainer::RoutedExperts(
    std::span<const Trajectory> batch) {
  try {
    return impl_->RoutedExperts(batch);
  } catch (const c10::Error& e) {
    return absl::InternalError(Cat("routing: ", e.what_without_backtrace()));
  }
}

Status Trainer::SaveModel(const std::string& dir) const { return impl_->SaveModel(dir); }
Status Trainer::SaveGradients(std::span<const Trajectory> batch, const std::string& path) {
  try {
    return impl_->SaveGradients(batch, path);
  } catch (const c10::Error& e) {
    return absl::InternalError(Cat("gradients: ", e.what_without_backtrace()));
  }
}
Status Trainer::SaveCheckpoint(const std::string& root) const {
  BRAGG_RETURN_IF_ERROR(MakeDirs(root));
  return impl_->SaveCheckpoint(root);
}
int64_t Trainer::step() const { return impl_->step; }
int64_t Trainer::version() const { return impl_->version; }
void Trainer::set_version(int64_t v) { impl_->version = v; }
void Trainer::set_lr(double lr) {
  impl_->options.lr = lr;
  impl_->optimizer->set_lr(lr);
}
const TrainOptions& Trainer::options() const { return impl_->options; }

}  // namespace bragg::train
