#include "engine/model/attention_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/model/avx512_kernels.h"

namespace bragg::engine::qwen3 {
namespace {

// One (sequence, KV head): the g query heads at q (g x NV*16 floats) over the len keys and
// values at slots; writes g x NV*16 floats at out. scores: g * len floats of scratch.
template <int NV>
__attribute__((target("avx512f"))) void Item(const float* __restrict q, int64_t g,
                                             const float* __restrict keys,
                                             const float* __restrict values, int64_t stride,
                                             const int64_t* slots, int64_t len, float scale,
                                             float* __restrict scores, float* __restrict out) {
  constexpr int64_t hd = NV * 16;
  // Scores: each key read once for the g heads that share it.
  for (int64_t p = 0; p < len; ++p) {
    const float* k = keys + slots[p] * stride;
    __m512 kv[NV];
    for (int v = 0; v < NV; ++v) {
      kv[v] = _mm512_loadu_ps(k + v * 16);
    }
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = q + j * hd;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qj), kv[0]);
      for (int v = 1; v < NV; ++v) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qj + v * 16), kv[v], acc);
      }
      scores[j * len + p] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    float* s = scores + j * len;
    // Softmax over the row: max, then exp(s - max) in place and its sum.
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t p = 0;
    for (; p + 16 <= len; p += 16) {
      mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + p));
    }
    float m = _mm512_reduce_max_ps(mv);
    for (; p < len; ++p) {
      m = std::max(m, s[p]);
    }
    const __m512 mb = _mm512_set1_ps(m);
    __m512 sv = _mm512_setzero_ps();
    for (p = 0; p < len; p += 16) {
      const __mmask16 mask = len - p >= 16 ? __mmask16{0xffff} : __mmask16((1u << (len - p)) - 1);
      const __m512 e = avx512::Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + p), mb));
      _mm512_mask_storeu_ps(s + p, mask, e);
      sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(mask, e));
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sv));
    // The weighted sum of the values.
    __m512 acc[NV];
    for (int v = 0; v < NV; ++v) {
      acc[v] = _mm512_setzero_ps();
    }
    for (p = 0; p < len; ++p) {
      const float* val = values + slots[p] * stride;
      const __m512 w = _mm512_set1_ps(s[p]);
      for (int v = 0; v < NV; ++v) {
        acc[v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(val + v * 16), acc[v]);
      }
    }
    for (int v = 0; v < NV; ++v) {
      _mm512_storeu_ps(out + j * hd + v * 16, _mm512_mul_ps(acc[v], inv));
    }
  }
}

using ItemFn = void (*)(const float*, int64_t, const float*, const float*, int64_t, const int64_t*,
                        int64_t, float, float*, float*);

ItemFn ItemFor(int64_t hd) {
  switch (hd) {
    case 16:
      return Item<1>;
    case 32:
      return Item<2>;
    case 64:
      return Item<4>;
    case 128:
      return Item<8>;
    case 256:
      return Item<16>;
    default:
      return nullptr;
  }
}

bool CpuFloat(const torch::Tensor& t) {
  return t.defined() && t.scalar_type() == torch::kFloat32 && t.device().is_cpu();
}

}  // namespace

bool DecodeAttentionFits(const torch::Tensor& keys, const torch::Tensor& values,
                         const torch::Tensor& q, const std::vector<torch::Tensor>& seq_slots) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (!avx512 || !CpuFloat(keys) || !CpuFloat(values) || !CpuFloat(q) || keys.dim() != 3 ||
      q.dim() != 3 || !keys.is_contiguous() || !values.is_contiguous() ||
      keys.sizes() != values.sizes()) {
    return false;
  }
  const int64_t kvh = keys.size(1), hd = keys.size(2);
  if (ItemFor(hd) == nullptr || q.size(2) != hd || kvh < 1 || q.size(1) % kvh != 0 ||
      q.size(0) != static_cast<int64_t>(seq_slots.size())) {
    return false;
  }
  for (const torch::Tensor& s : seq_slots) {
    if (!s.defined() || s.scalar_type() != torch::kInt64 || !s.device().is_cpu() || s.dim() != 1 ||
        s.size(0) < 1 || !s.is_contiguous()) {
      return false;
    }
  }
  if (torch::GradMode::is_enabled() &&
      (q.requires_grad() || keys.requires_grad() || values.requires_grad())) {
    return false;
  }
  return true;
}

torch::Tensor DecodeAttention(const torch::Tensor& keys, const torch::Tensor& values,
                              const torch::Tensor& q, const std::vector<torch::Tensor>& seq_slots) {
  TORCH_CHECK(DecodeAttentionFits(keys, values, q, seq_slots),
              "DecodeAttention: a call it cannot take");
  const torch::Tensor qc = q.contiguous();
  const int64_t B = qc.size(0), nh = qc.size(1), hd = qc.size(2);
  const int64_t kvh = keys.size(1), g = nh / kvh, stride = kvh * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const ItemFn item = ItemFor(hd);
  torch::Tensor out = torch::empty({B, nh * hd}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kvh, kh = i % kvh;
      const int64_t len = seq_slots[b].size(0);
      scores.resize(static_cast<size_t>(g * len));
      item(qp + (b * nh + kh * g) * hd, g, kp + kh * hd, vp + kh * hd, stride,
           seq_slots[b].data_ptr<int64_t>(), len, scale, scores.data(),
           op + (b * nh + kh * g) * hd);
    }
  });
  return out;
}

}  // namespace bragg::engine::qwen3
