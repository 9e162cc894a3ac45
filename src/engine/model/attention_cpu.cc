#include "engine/model/attention_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "engine/model/cpu_simd.h"

namespace bragg::engine::qwen3 {
namespace {

using ItemFn = void (*)(const float*, int64_t, const float*, const float*, int64_t, const int64_t*,
                        int64_t, float, float*, float*);
using PrefillItemFn = void (*)(const float*, int64_t, const float*, const float*, int64_t, float,
                               float*, int64_t, float*);
using PackKeyBlockFn = void (*)(const float*, int64_t, const int64_t*, int64_t, int64_t, int64_t,
                                float*);

// A kernel's instance for head size hd (NV = hd / 16 vectors a row), or null.
template <typename Fn, Fn F1, Fn F2, Fn F4, Fn F8, Fn F16>
Fn ForHeadSize(int64_t hd) {
  switch (hd) {
    case 16:
      return F1;
    case 32:
      return F2;
    case 64:
      return F4;
    case 128:
      return F8;
    case 256:
      return F16;
    default:
      return nullptr;
  }
}

}  // namespace
}  // namespace bragg::engine::qwen3

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace bragg::engine::qwen3::simd512 {
namespace {
#include "engine/model/attention_cpu_kernels.inc"
}  // namespace
}  // namespace bragg::engine::qwen3::simd512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace bragg::engine::qwen3::simd256 {
namespace {
#include "engine/model/attention_cpu_kernels.inc"
}  // namespace
}  // namespace bragg::engine::qwen3::simd256
#pragma GCC pop_options

namespace bragg::engine::qwen3 {
namespace {

// One instruction set's instances of the kernels for head size hd (any null: none).
struct Kernels {
  ItemFn item;
  PrefillItemFn prefill_item;
  PackKeyBlockFn pack_key_block;
};
Kernels KernelsFor(CpuIsa isa, int64_t hd) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return {simd512::ItemFor(hd), simd512::PrefillItemFor(hd), simd512::PackKeyBlock};
    case CpuIsa::kAvx2:
      return {simd256::ItemFor(hd), simd256::PrefillItemFor(hd), simd256::PackKeyBlock};
    case CpuIsa::kNone:
      break;
  }
  return {nullptr, nullptr, nullptr};
}

bool CpuFloat(const torch::Tensor& t) {
  return t.defined() && t.scalar_type() == torch::kFloat32 && t.device().is_cpu();
}

// What both kernels ask of the cache and the queries: a CPU that runs `isa`, fp32 on the CPU,
// keys and values [slots, kvh, hd] contiguous and under 2^31 floats each (read at 32-bit
// offsets), q [n, nh, hd] with nh a multiple of kvh and a head size the kernels are built for,
// no gradient wanted.
bool CacheAndQueriesFit(const torch::Tensor& keys, const torch::Tensor& values,
                        const torch::Tensor& q, CpuIsa isa) {
  if (isa == CpuIsa::kNone || !CpuRuns(isa) || !CpuFloat(keys) || !CpuFloat(values) ||
      !CpuFloat(q) || keys.dim() != 3 || q.dim() != 3 || !keys.is_contiguous() ||
      !values.is_contiguous() || keys.sizes() != values.sizes() ||
      keys.numel() > std::numeric_limits<int32_t>::max()) {
    return false;
  }
  const int64_t kvh = keys.size(1), hd = keys.size(2);
  const Kernels k = KernelsFor(isa, hd);
  if (k.item == nullptr || k.prefill_item == nullptr || q.size(2) != hd || kvh < 1 ||
      q.size(1) % kvh != 0) {
    return false;
  }
  return !(torch::GradMode::is_enabled() &&
           (q.requires_grad() || keys.requires_grad() || values.requires_grad()));
}

}  // namespace

bool DecodeAttentionFits(const torch::Tensor& keys, const torch::Tensor& values,
                         const torch::Tensor& q, const std::vector<torch::Tensor>& seq_slots,
                         CpuIsa isa) {
  if (!CacheAndQueriesFit(keys, values, q, isa) ||
      q.size(0) != static_cast<int64_t>(seq_slots.size())) {
    return false;
  }
  for (const torch::Tensor& s : seq_slots) {
    if (!s.defined() || s.scalar_type() != torch::kInt64 || !s.device().is_cpu() || s.dim() != 1 ||
        s.size(0) < 1 || !s.is_contiguous()) {
      return false;
    }
  }
  return true;
}

torch::Tensor DecodeAttention(const torch::Tensor& keys, const torch::Tensor& values,
                              const torch::Tensor& q, const std::vector<torch::Tensor>& seq_slots,
                              CpuIsa isa) {
  TORCH_CHECK(DecodeAttentionFits(keys, values, q, seq_slots, isa),
              "DecodeAttention: a call it cannot take");
  const torch::Tensor qc = q.contiguous();
  const int64_t B = qc.size(0), nh = qc.size(1), hd = qc.size(2);
  const int64_t kvh = keys.size(1), g = nh / kvh, stride = kvh * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const ItemFn item = KernelsFor(isa, hd).item;
  torch::Tensor out = torch::empty({B, nh * hd}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kvh, kh = i % kvh;
      const int64_t len = seq_slots[b].size(0);
      scratch.resize(static_cast<size_t>(g * len + 16 * hd));
      item(qp + (b * nh + kh * g) * hd, g, kp + kh * hd, vp + kh * hd, stride,
           seq_slots[b].data_ptr<int64_t>(), len, scale, scratch.data(),
           op + (b * nh + kh * g) * hd);
    }
  });
  return out;
}

bool PrefillAttentionFits(const torch::Tensor& keys, const torch::Tensor& values,
                          const torch::Tensor& q, const torch::Tensor& slots, int64_t start,
                          CpuIsa isa) {
  return CacheAndQueriesFit(keys, values, q, isa) && q.size(0) >= 1 && start >= 0 &&
         slots.defined() && slots.scalar_type() == torch::kInt64 && slots.device().is_cpu() &&
         slots.dim() == 1 && slots.is_contiguous() && slots.size(0) == start + q.size(0);
}

torch::Tensor PrefillAttention(const torch::Tensor& keys, const torch::Tensor& values,
                               const torch::Tensor& q, const torch::Tensor& slots, int64_t start,
                               CpuIsa isa) {
  TORCH_CHECK(PrefillAttentionFits(keys, values, q, slots, start, isa),
              "PrefillAttention: a call it cannot take");
  const torch::Tensor qc = q.contiguous();
  const int64_t n = qc.size(0), nh = qc.size(1), hd = qc.size(2);
  const int64_t kvh = keys.size(1), g = nh / kvh, stride = kvh * hd;
  const int64_t len = start + n, blocks = (len + 15) / 16, ld = blocks * 16;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const Kernels kernels = KernelsFor(isa, hd);
  const PrefillItemFn item = kernels.prefill_item;
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  // Per KV head: its keys packed [block][hd][16] and its values [position][hd], every float
  // written below (so not zeroed here).
  std::unique_ptr<float[]> kt(new float[static_cast<size_t>(kvh * blocks * hd * 16)]);
  std::unique_ptr<float[]> vt(new float[static_cast<size_t>(kvh * len * hd)]);
  at::parallel_for(0, kvh * blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t kh = i / blocks, b = i % blocks;
      kernels.pack_key_block(kp + kh * hd, stride, sp, len, hd, b,
                             kt.get() + kh * blocks * hd * 16);
      float* vout = vt.get() + (kh * len + b * 16) * hd;
      for (int64_t p = b * 16; p < std::min(len, b * 16 + 16); ++p, vout += hd) {
        std::memcpy(vout, vp + sp[p] * stride + kh * hd, hd * sizeof(float));
      }
    }
  });
  torch::Tensor out = torch::empty({n, nh * hd}, qc.options());
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Items are (position, KV head), dealt round-robin over the threads: a later position has more
  // keys, so contiguous ranges of them would leave one thread with most of the work.
  const int64_t items = n * kvh;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    constexpr int64_t kRows = 4;  // PrefillItem's most rows at a time
    std::vector<float> scores(static_cast<size_t>(kRows * ld));
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t x = t; x < items; x += threads) {
        const int64_t i = x / kvh, kh = x % kvh;
        item(qp + (i * nh + kh * g) * hd, g, kt.get() + kh * blocks * hd * 16,
             vt.get() + kh * len * hd, start + i + 1, scale, scores.data(), ld,
             op + (i * nh + kh * g) * hd);
      }
    }
  });
  return out;
}

}  // namespace bragg::engine::qwen3
