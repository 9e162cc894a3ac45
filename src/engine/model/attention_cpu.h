#pragma once

// The attention of a decode step on the CPU: one new query per sequence over its cached keys and
// values, read in place from the block KV cache (torch side: include only from torch
// translation units). Torch's batched path gathers every sequence's keys and values into fresh
// tensors, pads them to the longest, and goes through a dozen operators per layer; at 32
// requests of ~200 tokens that was a third of a decode step of the benchmark's model.

#include <torch/torch.h>

#include <vector>

#include "engine/model/cpu_isa.h"

namespace bragg::engine::qwen3 {

// Whether DecodeAttention can take this step with `isa` (cpu_isa.h: the best this CPU runs
// unless a test or benchmark names another): a CPU that runs it, fp32 keys, values and
// queries on the CPU, keys and values [slots, kvh, hd] contiguous and under 2^31 floats each, q [B,
// nh, hd] with nh a multiple of kvh, hd one of 16, 32, 64, 128, 256, one slot list per query
// (int64, CPU, contiguous, at least one slot), nothing needing a gradient.
bool DecodeAttentionFits(const torch::Tensor& keys, const torch::Tensor& values,
                         const torch::Tensor& q, const std::vector<torch::Tensor>& seq_slots,
                         CpuIsa isa = BestCpuIsa());

// Query b (q[b]: [nh, hd]) attends to the keys and values at seq_slots[b] (int64 [len], CPU:
// the slots of its positions 0 .. len - 1, its own last); query head j reads KV head j / (nh /
// kvh). softmax(q k^T / sqrt(hd)) v in float32, each (sequence, KV head) one work item over
// torch's threads, which reads each key and value once for the query heads that share it. Its
// sums go in the order of torch's matmul and softmax, as the trainer's own attention runs them
// (the engine's log-probs and the trainer's differed 3x more with a faster order: p99 3.3e-6
// against 0.95e-6, bench/train/parity.py). Returns [B, nh * hd]. A query's result does not
// depend on the queries beside it, but it is not AttendExact's to the bit (the engine's
// deterministic mode keeps to that). Slots are not checked against the cache: the caller's block
// tables are.
torch::Tensor DecodeAttention(const torch::Tensor& keys, const torch::Tensor& values,
                              const torch::Tensor& q, const std::vector<torch::Tensor>& seq_slots,
                              CpuIsa isa = BestCpuIsa());

// Whether PrefillAttention can take this call with `isa`: a CPU that runs it, fp32 keys, values and
// queries on the CPU, keys and values [slots, kvh, hd] contiguous and under 2^31 floats each, q
// [n, nh, hd] (n >= 1) with nh a multiple of kvh and hd one of 16, 32, 64, 128, 256, slots int64
// [start + n] on the CPU, contiguous, nothing needing a gradient.
bool PrefillAttentionFits(const torch::Tensor& keys, const torch::Tensor& values,
                          const torch::Tensor& q, const torch::Tensor& slots, int64_t start,
                          CpuIsa isa = BestCpuIsa());

// Causal attention of one chunk of a prompt: query i (q[i]: [nh, hd], position start + i)
// attends to the keys and values at slots[0 .. start + i] (the sequence's positions in order);
// query head j reads KV head j / (nh / kvh). softmax(q k^T / sqrt(hd)) v in float32, the score
// matrix never made whole: each (position, KV head) is one work item that computes its row of
// scores into a scratch the size of the sequence, and the sequence's keys are packed (transposed,
// 16 positions at a time) and its values gathered once per call and KV head. A query's result
// does not depend on the chunk it is in, nor on the threads. Returns [n, nh * hd].
torch::Tensor PrefillAttention(const torch::Tensor& keys, const torch::Tensor& values,
                               const torch::Tensor& q, const torch::Tensor& slots, int64_t start,
                               CpuIsa isa = BestCpuIsa());

}  // namespace bragg::engine::qwen3
