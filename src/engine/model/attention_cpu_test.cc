// DecodeAttention and PrefillAttention against softmax(q k^T / sqrt(hd)) v computed with torch's
// operators, on keys and values scattered over a block cache as the engine's are, and the calls
// they must refuse.

#include "engine/model/attention_cpu.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "engine/model/cpu_isa_testing.h"

namespace bragg::engine::qwen3 {
namespace {

struct Case {
  int64_t kvh, g, hd;
  std::vector<int64_t> lens;
};

struct Inputs {
  torch::Tensor keys, values, q;  // [slots, kvh, hd] x2, [B, nh, hd]
  std::vector<torch::Tensor> slots;
};

// A cache of `slots` positions with every sequence's positions at random distinct slots.
Inputs Make(const Case& c, int64_t slots, double q_scale = 1.0) {
  Inputs in;
  in.keys = torch::randn({slots, c.kvh, c.hd});
  in.values = torch::randn({slots, c.kvh, c.hd});
  in.q = torch::randn({static_cast<int64_t>(c.lens.size()), c.kvh * c.g, c.hd}).mul(q_scale);
  for (int64_t len : c.lens) {
    in.slots.push_back(torch::randperm(slots, torch::kInt64).narrow(0, 0, len).contiguous());
  }
  return in;
}

// softmax(q k^T / sqrt(hd)) v per sequence in `dtype`: float64 for the exact value, float32
// for what torch's own operators make of it.
torch::Tensor Reference(const Inputs& in, int64_t g, torch::Dtype dtype = torch::kFloat64) {
  std::vector<torch::Tensor> rows;
  const int64_t hd = in.q.size(2);
  for (size_t b = 0; b < in.slots.size(); ++b) {
    torch::Tensor k =
        in.keys.index_select(0, in.slots[b]).repeat_interleave(g, 1);  // [len, nh, hd]
    torch::Tensor v = in.values.index_select(0, in.slots[b]).repeat_interleave(g, 1);
    torch::Tensor qb = in.q[b].to(dtype);  // [nh, hd]
    torch::Tensor s = torch::einsum("hd,lhd->hl", {qb, k.to(dtype)}) / std::sqrt(hd);
    torch::Tensor o = torch::einsum("hl,lhd->hd", {torch::softmax(s, -1), v.to(dtype)});
    rows.push_back(o.reshape({-1}).to(torch::kFloat32));
  }
  return torch::stack(rows);
}

TEST(DecodeAttention, EqualsTorchOverScatteredSlots) {
  for (CpuIsa isa : TestedIsas()) {
    SCOPED_TRACE(CpuIsaName(isa));
    c10::InferenceMode guard;
    torch::manual_seed(21);
    // GQA ratios 1-8, every head size it takes, lengths around the vector of 16 and long ones.
    for (const Case& c : {Case{2, 4, 32, {1, 15, 16, 17, 200, 129}}, Case{1, 1, 16, {3}},
                          Case{4, 2, 64, {33, 1, 64}}, Case{2, 8, 128, {250, 7}},
                          Case{1, 2, 256, {31, 2}}, Case{8, 1, 32, std::vector<int64_t>(40, 48)}}) {
      SCOPED_TRACE(::testing::Message() << "kvh " << c.kvh << " g " << c.g << " hd " << c.hd);
      Inputs in = Make(c, 512);
      ASSERT_TRUE(DecodeAttentionFits(in.keys, in.values, in.q, in.slots, isa));
      torch::Tensor got = DecodeAttention(in.keys, in.values, in.q, in.slots, isa);
      torch::Tensor want = Reference(in, c.g);
      ASSERT_EQ(got.sizes(), want.sizes());
      EXPECT_LE((got - want).abs().max().item<double>(), 2e-6);
    }
  }
}

TEST(DecodeAttention, PeakedAndFlatScoresStayFinite) {
  for (CpuIsa isa : TestedIsas()) {
    SCOPED_TRACE(CpuIsaName(isa));
    c10::InferenceMode guard;
    torch::manual_seed(22);
    // Scores in the hundreds: most weights underflow, the softmax must not overflow; and all-zero
    // queries: every position weighs the same.
    Case c{2, 4, 32, {100, 300, 5}};
    Inputs peaked = Make(c, 512, 60.0);
    torch::Tensor got = DecodeAttention(peaked.keys, peaked.values, peaked.q, peaked.slots, isa);
    EXPECT_TRUE(torch::isfinite(got).all().item<bool>());
    // Scores of ~300 carry float32 rounding of ~3e-5 into the weights: judged against what torch's
    // own float32 operators make of the same inputs.
    torch::Tensor exact = Reference(peaked, c.g);
    const double torch_err =
        (Reference(peaked, c.g, torch::kFloat32) - exact).abs().max().item<double>();
    EXPECT_LE((got - exact).abs().max().item<double>(), 2 * torch_err + 1e-6)
        << "torch's float32 error " << torch_err;
    Inputs flat = Make(c, 512);
    flat.q.zero_();
    got = DecodeAttention(flat.keys, flat.values, flat.q, flat.slots, isa);
    EXPECT_LE((got - Reference(flat, c.g)).abs().max().item<double>(), 2e-6);
  }
}

TEST(DecodeAttention, AQuerysResultDoesNotDependOnItsBatch) {
  for (CpuIsa isa : TestedIsas()) {
    SCOPED_TRACE(CpuIsaName(isa));
    c10::InferenceMode guard;
    torch::manual_seed(23);
    Case c{2, 4, 32, {10, 200, 77, 1, 64}};
    Inputs in = Make(c, 256);
    torch::Tensor all = DecodeAttention(in.keys, in.values, in.q, in.slots, isa);
    for (int64_t b = 0; b < 5; ++b) {
      torch::Tensor one =
          DecodeAttention(in.keys, in.values, in.q.narrow(0, b, 1), {in.slots[b]}, isa);
      EXPECT_TRUE(torch::equal(one, all.narrow(0, b, 1))) << "query " << b;
    }
  }
}

TEST(DecodeAttention, RefusesWhatItCannotTake) {
  torch::manual_seed(24);
  Case c{2, 4, 32, {10, 20}};
  Inputs in = Make(c, 64);
  // No instruction set, or one this CPU does not run, takes anything.
  EXPECT_FALSE(DecodeAttentionFits(in.keys, in.values, in.q, in.slots, CpuIsa::kNone));
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    SCOPED_TRACE(CpuIsaName(isa));
    if (!CpuRuns(isa)) {
      EXPECT_FALSE(DecodeAttentionFits(in.keys, in.values, in.q, in.slots, isa));
      EXPECT_THROW(DecodeAttention(in.keys, in.values, in.q, in.slots, isa), c10::Error);
      continue;
    }
    EXPECT_TRUE(DecodeAttentionFits(in.keys, in.values, in.q, in.slots, isa));
    auto refuses = [&](const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& q,
                       const std::vector<torch::Tensor>& s) {
      return !DecodeAttentionFits(k, v, q, s, isa);
    };
    EXPECT_TRUE(
        refuses(in.keys.to(torch::kBFloat16), in.values.to(torch::kBFloat16), in.q, in.slots));
    EXPECT_TRUE(refuses(in.keys, in.values, in.q.to(torch::kFloat64), in.slots));
    EXPECT_TRUE(refuses(in.keys.transpose(0, 1), in.values, in.q, in.slots));   // not contiguous
    EXPECT_TRUE(refuses(in.keys, in.values.narrow(0, 0, 32), in.q, in.slots));  // other shapes
    EXPECT_TRUE(refuses(in.keys, in.values, in.q.narrow(1, 0, 7), in.slots));   // 7 heads over 2
    EXPECT_TRUE(refuses(torch::randn({64, 2, 48}), torch::randn({64, 2, 48}),
                        torch::randn({2, 8, 48}),
                        in.slots));                                 // head size 48
    EXPECT_TRUE(refuses(in.keys, in.values, in.q, {in.slots[0]}));  // a query without slots
    EXPECT_TRUE(refuses(in.keys, in.values, in.q, {in.slots[0], torch::empty({0}, torch::kInt64)}));
    EXPECT_TRUE(refuses(in.keys, in.values, in.q, {in.slots[0], in.slots[1].to(torch::kInt32)}));
    EXPECT_TRUE(refuses(in.keys, in.values, in.q.detach().requires_grad_(), in.slots));
    EXPECT_THROW(DecodeAttention(in.keys, in.values, in.q, {in.slots[0]}, isa), c10::Error);
  }
}

// A prompt chunk: q [n, kvh * g, hd] at positions start .. start + n - 1 of a sequence whose
// start + n positions sit at random distinct slots of a cache of `slots` positions.
struct Chunk {
  torch::Tensor keys, values, q, seq;
};

Chunk MakeChunk(int64_t kvh, int64_t g, int64_t hd, int64_t start, int64_t n, int64_t slots,
                double q_scale = 1.0) {
  Chunk c;
  c.keys = torch::randn({slots, kvh, hd});
  c.values = torch::randn({slots, kvh, hd});
  c.q = torch::randn({n, kvh * g, hd}).mul(q_scale);
  c.seq = torch::randperm(slots, torch::kInt64).narrow(0, 0, start + n).contiguous();
  return c;
}

// Causal attention of the chunk in float64 (or `dtype`), the whole score matrix masked.
torch::Tensor CausalReference(const Chunk& c, int64_t start, torch::Dtype dtype = torch::kFloat64) {
  const int64_t n = c.q.size(0), nh = c.q.size(1), hd = c.q.size(2), g = nh / c.keys.size(1);
  const int64_t len = start + n;
  torch::Tensor k = c.keys.index_select(0, c.seq).repeat_interleave(g, 1).to(dtype);
  torch::Tensor v = c.values.index_select(0, c.seq).repeat_interleave(g, 1).to(dtype);
  torch::Tensor s = torch::einsum("ihd,lhd->hil", {c.q.to(dtype), k}) / std::sqrt(hd);
  torch::Tensor future = torch::arange(len).unsqueeze(0) > (torch::arange(n) + start).unsqueeze(1);
  s = s.masked_fill(future.unsqueeze(0), -std::numeric_limits<double>::infinity());
  torch::Tensor o = torch::einsum("hil,lhd->ihd", {torch::softmax(s, -1), v});
  return o.reshape({n, nh * hd}).to(torch::kFloat32);
}

TEST(PrefillAttention, EqualsTorchCausallyOverScatteredSlots) {
  for (CpuIsa isa : TestedIsas()) {
    SCOPED_TRACE(CpuIsaName(isa));
    c10::InferenceMode guard;
    torch::manual_seed(31);
    struct PrefillCase {
      int64_t kvh, g, hd, start, n;
    };
    // GQA ratios 1-8 (and 3, 5, 6, 7: remainders of the 4-row groups), every head size it takes,
    // chunks from the sequence's start and after a cached prefix, lengths around 16.
    for (const PrefillCase& c :
         {PrefillCase{2, 4, 32, 0, 1}, PrefillCase{2, 4, 32, 0, 200}, PrefillCase{2, 4, 32, 37, 64},
          PrefillCase{1, 1, 16, 0, 17}, PrefillCase{4, 2, 64, 16, 16},
          PrefillCase{2, 8, 128, 5, 33}, PrefillCase{1, 2, 256, 0, 31},
          PrefillCase{1, 3, 32, 15, 9}, PrefillCase{1, 5, 32, 0, 20}, PrefillCase{2, 6, 16, 100, 3},
          PrefillCase{1, 7, 64, 1, 47}}) {
      SCOPED_TRACE(::testing::Message() << "kvh " << c.kvh << " g " << c.g << " hd " << c.hd
                                        << " start " << c.start << " n " << c.n);
      Chunk in = MakeChunk(c.kvh, c.g, c.hd, c.start, c.n, 512);
      ASSERT_TRUE(PrefillAttentionFits(in.keys, in.values, in.q, in.seq, c.start, isa));
      torch::Tensor got = PrefillAttention(in.keys, in.values, in.q, in.seq, c.start, isa);
      torch::Tensor want = CausalReference(in, c.start);
      ASSERT_EQ(got.sizes(), want.sizes());
      EXPECT_LE((got - want).abs().max().item<double>(), 2e-6);
    }
  }
}

TEST(PrefillAttention, PeakedScoresStayFiniteAndAccurate) {
  for (CpuIsa isa : TestedIsas()) {
    SCOPED_TRACE(CpuIsaName(isa));
    c10::InferenceMode guard;
    torch::manual_seed(32);
    Chunk peaked = MakeChunk(2, 4, 32, 10, 90, 256, 60.0);
    torch::Tensor got = PrefillAttention(peaked.keys, peaked.values, peaked.q, peaked.seq, 10, isa);
    EXPECT_TRUE(torch::isfinite(got).all().item<bool>());
    torch::Tensor exact = CausalReference(peaked, 10);
    const double torch_err =
        (CausalReference(peaked, 10, torch::kFloat32) - exact).abs().max().item<double>();
    EXPECT_LE((got - exact).abs().max().item<double>(), 2 * torch_err + 1e-6)
        << "torch's float32 error " << torch_err;
    // The first position sees itself alone: its output is its own value row, exactly.
    Chunk first = MakeChunk(2, 4, 32, 0, 5, 64);
    got = PrefillAttention(first.keys, first.values, first.q, first.seq, 0, isa);
    torch::Tensor v0 = first.values[first.seq[0].item<int64_t>()].repeat_interleave(4, 0);
    EXPECT_TRUE(torch::equal(got[0], v0.reshape({-1})));
  }
}

TEST(PrefillAttention, AQuerysResultDoesNotDependOnItsChunkOrThreads) {
  for (CpuIsa isa : TestedIsas()) {
    SCOPED_TRACE(CpuIsaName(isa));
    c10::InferenceMode guard;
    torch::manual_seed(33);
    const int64_t start = 20, n = 100;
    Chunk in = MakeChunk(2, 4, 32, start, n, 256);
    torch::Tensor whole = PrefillAttention(in.keys, in.values, in.q, in.seq, start, isa);
    // The same positions split into three chunks, as a chunked prefill or a cached prefix would.
    int64_t at = 0;
    for (int64_t part : {1, 60, 39}) {
      torch::Tensor got =
          PrefillAttention(in.keys, in.values, in.q.narrow(0, at, part),
                           in.seq.narrow(0, 0, start + at + part).contiguous(), start + at, isa);
      EXPECT_TRUE(torch::equal(got, whole.narrow(0, at, part))) << "chunk at " << at;
      at += part;
    }
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    torch::Tensor one = PrefillAttention(in.keys, in.values, in.q, in.seq, start, isa);
    at::set_num_threads(threads);
    EXPECT_TRUE(torch::equal(one, whole));
  }
}

TEST(PrefillAttention, RefusesWhatItCannotTake) {
  torch::manual_seed(34);
  Chunk in = MakeChunk(2, 4, 32, 8, 12, 64);
  EXPECT_FALSE(PrefillAttentionFits(in.keys, in.values, in.q, in.seq, 8, CpuIsa::kNone));
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    SCOPED_TRACE(CpuIsaName(isa));
    if (!CpuRuns(isa)) {
      EXPECT_FALSE(PrefillAttentionFits(in.keys, in.values, in.q, in.seq, 8, isa));
      EXPECT_THROW(PrefillAttention(in.keys, in.values, in.q, in.seq, 8, isa), c10::Error);
      continue;
    }
    EXPECT_TRUE(PrefillAttentionFits(in.keys, in.values, in.q, in.seq, 8, isa));
    auto refuses = [&](const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& q,
                       const torch::Tensor& s,
                       int64_t start) { return !PrefillAttentionFits(k, v, q, s, start, isa); };
    EXPECT_TRUE(
        refuses(in.keys.to(torch::kBFloat16), in.values.to(torch::kBFloat16), in.q, in.seq, 8));
    EXPECT_TRUE(refuses(in.keys, in.values, in.q.to(torch::kFloat64), in.seq, 8));
    EXPECT_TRUE(refuses(in.keys.transpose(0, 1), in.values, in.q, in.seq, 8));   // not contiguous
    EXPECT_TRUE(refuses(in.keys, in.values.narrow(0, 0, 32), in.q, in.seq, 8));  // other shapes
    EXPECT_TRUE(refuses(in.keys, in.values, in.q.narrow(1, 0, 7), in.seq, 8));   // 7 heads over 2
    EXPECT_TRUE(refuses(in.keys, in.values, in.q.narrow(0, 0, 0), in.seq.narrow(0, 0, 8), 8));
    EXPECT_TRUE(refuses(in.keys, in.values, in.q, in.seq, 7));   // slots not start + n
    EXPECT_TRUE(refuses(in.keys, in.values, in.q, in.seq, -1));  // a negative start
    EXPECT_TRUE(refuses(in.keys, in.values, in.q, in.seq.to(torch::kInt32), 8));
    EXPECT_TRUE(refuses(in.keys, in.values, in.q.detach().requires_grad_(), in.seq, 8));
    EXPECT_THROW(PrefillAttention(in.keys, in.values, in.q, in.seq, 7, isa), c10::Error);
  }
}

}  // namespace
}  // namespace bragg::engine::qwen3
