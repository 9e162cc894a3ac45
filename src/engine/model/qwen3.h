#pragma once

// The Qwen3 model's weights and arithmetic (dense and MoE), shared by the engine's inference
// (model.cc) and the trainer (src/train/), so that the two cannot drift: the log-probs the
// trainer computes for a rollout are the ones the engine sampled it with, bit for bit in
// deterministic mode. Torch's side: include only from translation units built with libtorch.
//
// Every function here is differentiable (plain torch ops) except AttendExact, which the trainer
// wraps in an autograd function of its own.

#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "engine/model/checkpoint.h"

namespace bragg::engine::qwen3 {

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
};

struct Weights {
  ModelConfig config;
  torch::Device device = torch::kCPU;
  torch::Dtype dtype = torch::kFloat32;
  torch::Tensor embed, final_norm, lm_head;  // lm_head is embed when tied
  std::vector<Layer> layers;
  torch::Tensor inv_freq;  // [hd / 2] float32
  // Every checkpoint tensor by its Hugging Face name (gate and up are views of the fused
  // tensors), and the file dtype it was first loaded from.
  std::map<std::string, torch::Tensor*> params;
  std::map<std::string, TensorDType> file_dtypes;
  // The tensors that own the storage, each once (fused gate_up under the name
  // "<layer>.mlp[.experts.E].gate_up_proj.weight"), in a fixed order: what a trainer optimises.
  std::vector<std::pair<std::string, torch::Tensor*>> leaves;
  std::vector<int> moe_layer_index;  // layer -> position among the MoE layers, or -1

  // Loads every tensor the config names from `ck` (copied, cast to `dtype`, on `device`).
  // InvalidArgument naming the tensor on a shape mismatch, NotFound for a missing one.
  Status Load(const Checkpoint& ck, torch::Device device, torch::Dtype dtype);
  int num_moe_layers() const;
};

// The torch dtype of a checkpoint dtype.
torch::Dtype TorchDType(TensorDType t);
// A view of a checkpoint tensor's mapped bytes as a tensor: no copy; valid while the checkpoint
// is open.
torch::Tensor Borrow(const TensorView& v);

// Process-wide settings for torch on the CPU, as the engine and the trainer both want them:
// `threads` intra-op threads (0: torch's default) and freed tensor memory kept in the heap (glibc
// otherwise maps each large temporary fresh and returns it on free, and every step pays page
// faults and zeroing again). BLAS: OpenBLAS built with OpenMP runs on torch's threads (one pool;
// the build links it first where installed, see bragg_torch_blas in src/engine/CMakeLists.txt);
// a pthreads OpenBLAS is made single-threaded, since its own idle threads spin beside torch's
// (measured: 40% of a decode step on 2 cores; 3.4x slower decode with one of the two cores
// busy with other work).
void ConfigureCpuRuntime(int threads);

// What ConfigureCpuRuntime left in effect, for logs and benchmarks: torch's thread count and the
// BLAS library (its build string and file, and how it is threaded).
std::string DescribeCpuRuntime();

// Qwen3RMSNorm: in float32, then the weight times the value cast back.
torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& w, double eps);

// cos and sin tables [T, hd] in `dtype` for positions `pos` (int64 [T]), as transformers makes
// them (float32 frequencies).
std::pair<torch::Tensor, torch::Tensor> RopeTables(const torch::Tensor& pos,
                                                   const torch::Tensor& inv_freq,
                                                   torch::Dtype dtype);

// x: [T, heads, hd]; cos/sin: [T, hd] in x's dtype.
torch::Tensor Rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// down(silu(gate(x)) * up(x)) with gate and up in one GEMM.
torch::Tensor SwiGlu(const torch::Tensor& x, const torch::Tensor& gate_up,
                     const torch::Tensor& down, bool deterministic);

// Qwen3MoeSparseMoeBlock: softmax router in float32, top-k, optional renormalisation, experts
// weighted and summed. `experts_out` gets the chosen ids [T, top_k] (int64). With `replay`
// (int64 [T, top_k], ids in [0, E)) the router's choice is replaced by it (router replay): the
// same experts, weighted by the router's own probabilities for them.
// Stores every matrix that goes through Linear as its transpose ([in, out] in memory), keeping
// the tensor's shape ([out, in], a transposed view): x W^T then reads W as BLAS's plain
// right-hand operand, which OpenBLAS multiplies with a few rows faster (measured: a 4-row
// expert SwiGLU 1.5-2x, the 32-row lm_head 1.1x). Loading and weight updates write through the
// views. The engine does this on the CPU (measured with OpenBLAS; cuBLAS takes either layout
// as a flag). Not for deterministic mode, whose kernels the trainer shares bit for bit, nor a
// tied lm_head (it is the embedding, read by rows).
void TransposeLinearWeights(Weights* w);

torch::Tensor Moe(const ModelConfig& c, const Layer& L, const torch::Tensor& x, bool deterministic,
                  torch::Tensor* experts_out, const torch::Tensor* replay = nullptr);

// Attention with a fixed order of every sum, one (query, head) per work item: the same result
// for a query whether it comes in a prefill chunk or a decode step, alone or batched, on any
// thread count. Scores and the softmax in float32, keys in position order; dot products with
// eight partial sums combined in a fixed tree.
//   q: [T, nh, hd]; keys/values: [slots, kvh, hd], same dtype as each other (float32 or
//   bfloat16), contiguous; row_seq[t], row_pos[t]: query t's sequence and position;
//   seq_slots[s]: int64 [len] CPU, the key/value slot of each of sequence s's positions.
// Query t attends to positions [0, row_pos[t]] of its sequence. Returns [T, nh*hd] in q's dtype.
// Not differentiable (reads raw memory).
torch::Tensor AttendExact(const ModelConfig& c, const torch::Tensor& keys,
                          const torch::Tensor& values, const torch::Tensor& q,
                          const std::vector<int64_t>& row_seq, const std::vector<int64_t>& row_pos,
                          const std::vector<torch::Tensor>& seq_slots);

}  // namespace bragg::engine::qwen3
