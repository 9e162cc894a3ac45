#include "engine/model/attention_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/model/avx512_kernels.h"

namespace bragg::engine::qwen3 {
namespace {

__attribute__((target("avx512f"))) inline __m512 Lo64(__m512 a, __m512 b) {
  return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}

__attribute__((target("avx512f"))) inline __m512 Hi64(__m512 a, __m512 b) {
  return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}

// r[i][j] becomes r[j][i]: a 16 x 16 transpose in registers (32-bit, then 64-bit interleaves,
// then two rounds of 128-bit lane shuffles).
__attribute__((target("avx512f"))) inline void Transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int b = 0; b < 16; b += 4) {
    u[b] = Lo64(t[b], t[b + 2]);
    u[b + 1] = Hi64(t[b], t[b + 2]);
    u[b + 2] = Lo64(t[b + 1], t[b + 3]);
    u[b + 3] = Hi64(t[b + 1], t[b + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(u[i], u[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(u[i], u[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(u[i + 8], u[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(u[i + 8], u[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// One (sequence, KV head): the g query heads at q (g x NV*16 floats) over the len keys and
// values at slots (float offsets slots[p] * stride, under 2^31); writes g x NV*16 floats at out.
// scratch: g * len + 16 * NV * 16 floats. The sums go in the order of torch's matmul and
// softmax (as the trainer's attention runs them), so the engine's log-probs stay as close to the
// trainer's as they were with torch's path: each score one chain of FMAs over the head
// dimension in order, the weights exp(s - max) times 1 / their sum, the values summed in
// position order.
template <int NV>
__attribute__((target("avx512f"))) void Item(const float* __restrict q, int64_t g,
                                             const float* __restrict keys,
                                             const float* __restrict values, int64_t stride,
                                             const int64_t* slots, int64_t len, float scale,
                                             float* __restrict scratch, float* __restrict out) {
  constexpr int64_t hd = NV * 16;
  float* scores = scratch;
  float* kt = scratch + g * len;  // 16 positions' keys, transposed: [hd][16]
  // Scores, 16 positions at a time: their keys loaded once and transposed, for the g heads.
  for (int64_t p0 = 0; p0 < len; p0 += 16) {
    const int64_t n = len - p0 < 16 ? len - p0 : 16;
    const __mmask16 mask = n == 16 ? __mmask16{0xffff} : __mmask16((1u << n) - 1);
    alignas(64) int32_t off[16] = {};
    for (int64_t i = 0; i < n; ++i) {
      off[i] = static_cast<int32_t>(slots[p0 + i] * stride);
    }
    // The cache's blocks lie anywhere: fetch the next 16 positions' keys, and these positions'
    // values for the weighted sum below, while these scores compute.
    for (int64_t i = 0; i < n; ++i) {
      const char* val = reinterpret_cast<const char*>(values + slots[p0 + i] * stride);
      for (int v = 0; v < NV; ++v) {
        _mm_prefetch(val + v * 64, _MM_HINT_T0);
      }
    }
    for (int64_t i = p0 + 16; i < p0 + 32 && i < len; ++i) {
      const char* key = reinterpret_cast<const char*>(keys + slots[i] * stride);
      for (int v = 0; v < NV; ++v) {
        _mm_prefetch(key + v * 64, _MM_HINT_T0);
      }
    }
    // Each key row loaded whole (positions past len as zeros) and turned 16 x 16 at a time:
    // a gather per dimension cost twice as much.
    for (int v = 0; v < NV; ++v) {
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i) {
        r[i] = i < n ? _mm512_loadu_ps(keys + off[i] + v * 16) : _mm512_setzero_ps();
      }
      Transpose16(r);
      for (int j = 0; j < 16; ++j) {
        _mm512_storeu_ps(kt + (v * 16 + j) * 16, r[j]);
      }
    }
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = q + j * hd;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < hd; ++d) {
        acc = _mm512_fmadd_ps(_mm512_set1_ps(qj[d]), _mm512_loadu_ps(kt + d * 16), acc);
      }
      _mm512_mask_storeu_ps(scores + j * len + p0, mask, _mm512_mul_ps(acc, _mm512_set1_ps(scale)));
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
    const float inv = 1.0f / _mm512_reduce_add_ps(sv);
    // The weighted sum of the values.
    __m512 acc[NV];
    for (int v = 0; v < NV; ++v) {
      acc[v] = _mm512_setzero_ps();
    }
    for (p = 0; p < len; ++p) {
      const float* val = values + slots[p] * stride;
      const __m512 w = _mm512_set1_ps(s[p] * inv);
      for (int v = 0; v < NV; ++v) {
        acc[v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(val + v * 16), acc[v]);
      }
    }
    for (int v = 0; v < NV; ++v) {
      _mm512_storeu_ps(out + j * hd + v * 16, acc[v]);
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
  if (!avx512::Available() || !CpuFloat(keys) || !CpuFloat(values) || !CpuFloat(q) ||
      keys.dim() != 3 || q.dim() != 3 || !keys.is_contiguous() || !values.is_contiguous() ||
      keys.sizes() != values.sizes() || keys.numel() > std::numeric_limits<int32_t>::max()) {
    return false;  // (keys are read at 32-bit offsets)
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

}  // namespace bragg::engine::qwen3
