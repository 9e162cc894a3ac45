#include "engine/model/attention_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "engine/model/avx512_kernels.h"

// GCC 12's AVX-512 headers give the unmasked forms of some intrinsics (_mm512_max_ps,
// _mm512_scalef_ps, the reductions' extracts) an "undefined" source vector for their unused
// lanes, which its own -Wmaybe-uninitialized reports once they are inlined here: hundreds of
// warnings about the headers, none about this file (GCC 13 fixed the headers).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

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

// PrefillAttention's rows: R query heads (q: R x NV*16 floats, one position's heads that share
// a KV head) over the first len positions of one KV head's packed keys (kt: [block][NV*16][16],
// zeros past the sequence) and values (vp: [position][NV*16]). scores: R rows of ld >= len
// rounded up to 16 floats. Writes R x NV*16 floats at out. R rows at a time, so that every key
// and value loaded serves R heads, with R * NV accumulators held in registers.
template <int NV, int R>
__attribute__((target("avx512f"))) void PrefillRows(const float* __restrict q,
                                                    const float* __restrict kt,
                                                    const float* __restrict vp, int64_t len,
                                                    float scale, float* __restrict scores,
                                                    int64_t ld, float* __restrict out) {
  constexpr int64_t hd = NV * 16;
  const int64_t blocks = (len + 15) / 16;
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* k = kt + b * hd * 16;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_setzero_ps();
    }
    for (int64_t d = 0; d < hd; ++d) {
      const __m512 kv = _mm512_loadu_ps(k + d * 16);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * hd + d]), kv, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(scores + r * ld + b * 16, _mm512_mul_ps(acc[r], sc));
    }
  }
  float inv[R];
  for (int r = 0; r < R; ++r) {
    float* s = scores + r * ld;
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t p = 0; p < len; p += 16) {
      const __mmask16 mask = len - p >= 16 ? __mmask16{0xffff} : __mmask16((1u << (len - p)) - 1);
      mv = _mm512_mask_max_ps(mv, mask, mv, _mm512_loadu_ps(s + p));
    }
    const __m512 mb = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sv = _mm512_setzero_ps();
    for (int64_t p = 0; p < len; p += 16) {
      const __mmask16 mask = len - p >= 16 ? __mmask16{0xffff} : __mmask16((1u << (len - p)) - 1);
      const __m512 e =
          _mm512_maskz_mov_ps(mask, avx512::Exp(_mm512_sub_ps(_mm512_loadu_ps(s + p), mb)));
      _mm512_storeu_ps(s + p, e);
      sv = _mm512_add_ps(sv, e);
    }
    inv[r] = 1.0f / _mm512_reduce_add_ps(sv);
  }
  __m512 o[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) {
      o[r][v] = _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < len; ++p) {
    const float* val = vp + p * hd;
    for (int v = 0; v < NV; ++v) {
      const __m512 x = _mm512_loadu_ps(val + v * 16);
      for (int r = 0; r < R; ++r) {
        o[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(scores[r * ld + p]), x, o[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 w = _mm512_set1_ps(inv[r]);
    for (int v = 0; v < NV; ++v) {
      _mm512_storeu_ps(out + r * hd + v * 16, _mm512_mul_ps(o[r][v], w));
    }
  }
}

// One position's g heads of one KV head: PrefillRows over them, kMaxRows at a time (as many as
// keep R * NV accumulators within 16 registers).
template <int NV>
__attribute__((target("avx512f"))) void PrefillItem(const float* q, int64_t g, const float* kt,
                                                    const float* vp, int64_t len, float scale,
                                                    float* scores, int64_t ld, float* out) {
  constexpr int64_t hd = NV * 16;
  constexpr int kMaxRows = NV >= 16 ? 1 : NV >= 8 ? 2 : 4;
  int64_t j = 0;
  for (; j + kMaxRows <= g; j += kMaxRows) {
    PrefillRows<NV, kMaxRows>(q + j * hd, kt, vp, len, scale, scores, ld, out + j * hd);
  }
  switch (g - j) {
    case 3:
      PrefillRows<NV, 3>(q + j * hd, kt, vp, len, scale, scores, ld, out + j * hd);
      break;
    case 2:
      PrefillRows<NV, 2>(q + j * hd, kt, vp, len, scale, scores, ld, out + j * hd);
      break;
    case 1:
      PrefillRows<NV, 1>(q + j * hd, kt, vp, len, scale, scores, ld, out + j * hd);
      break;
    default:
      break;
  }
}

// The keys of positions [16 b, 16 b + 16) of one KV head, transposed into kt's block b ([hd][16],
// zeros past len): each key row loaded whole, turned 16 x 16 at a time.
__attribute__((target("avx512f"))) void PackKeyBlock(const float* keys, int64_t stride,
                                                     const int64_t* slots, int64_t len, int64_t hd,
                                                     int64_t b, float* kt) {
  const int64_t p0 = b * 16, n = std::min<int64_t>(16, len - p0);
  float* out = kt + b * hd * 16;
  for (int64_t v = 0; v < hd / 16; ++v) {
    __m512 r[16];
    for (int64_t i = 0; i < 16; ++i) {
      r[i] = i < n ? _mm512_loadu_ps(keys + slots[p0 + i] * stride + v * 16) : _mm512_setzero_ps();
    }
    Transpose16(r);
    for (int j = 0; j < 16; ++j) {
      _mm512_storeu_ps(out + (v * 16 + j) * 16, r[j]);
    }
  }
}

using PrefillItemFn = void (*)(const float*, int64_t, const float*, const float*, int64_t, float,
                               float*, int64_t, float*);

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

PrefillItemFn PrefillItemFor(int64_t hd) {
  return ForHeadSize<PrefillItemFn, PrefillItem<1>, PrefillItem<2>, PrefillItem<4>, PrefillItem<8>,
                     PrefillItem<16>>(hd);
}

using ItemFn = void (*)(const float*, int64_t, const float*, const float*, int64_t, const int64_t*,
                        int64_t, float, float*, float*);

ItemFn ItemFor(int64_t hd) {
  return ForHeadSize<ItemFn, Item<1>, Item<2>, Item<4>, Item<8>, Item<16>>(hd);
}

bool CpuFloat(const torch::Tensor& t) {
  return t.defined() && t.scalar_type() == torch::kFloat32 && t.device().is_cpu();
}

// What both kernels ask of the cache and the queries: AVX-512F, fp32 on the CPU, keys and values
// [slots, kvh, hd] contiguous and under 2^31 floats each (read at 32-bit offsets), q [n, nh, hd]
// with nh a multiple of kvh and a head size the kernels are built for, no gradient wanted.
bool CacheAndQueriesFit(const torch::Tensor& keys, const torch::Tensor& values,
                        const torch::Tensor& q) {
  if (!avx512::Available() || !CpuFloat(keys) || !CpuFloat(values) || !CpuFloat(q) ||
      keys.dim() != 3 || q.dim() != 3 || !keys.is_contiguous() || !values.is_contiguous() ||
      keys.sizes() != values.sizes() || keys.numel() > std::numeric_limits<int32_t>::max()) {
    return false;
  }
  const int64_t kvh = keys.size(1), hd = keys.size(2);
  if (ItemFor(hd) == nullptr || PrefillItemFor(hd) == nullptr || q.size(2) != hd || kvh < 1 ||
      q.size(1) % kvh != 0) {
    return false;
  }
  return !(torch::GradMode::is_enabled() &&
           (q.requires_grad() || keys.requires_grad() || values.requires_grad()));
}

}  // namespace

bool DecodeAttentionFits(const torch::Tensor& keys, const torch::Tensor& values,
                         const torch::Tensor& q, const std::vector<torch::Tensor>& seq_slots) {
  if (!CacheAndQueriesFit(keys, values, q) || q.size(0) != static_cast<int64_t>(seq_slots.size())) {
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

bool PrefillAttentionFits(const torch::Tensor& keys, const torch::Tensor& values,
                          const torch::Tensor& q, const torch::Tensor& slots, int64_t start) {
  return CacheAndQueriesFit(keys, values, q) && q.size(0) >= 1 && start >= 0 && slots.defined() &&
         slots.scalar_type() == torch::kInt64 && slots.device().is_cpu() && slots.dim() == 1 &&
         slots.is_contiguous() && slots.size(0) == start + q.size(0);
}

torch::Tensor PrefillAttention(const torch::Tensor& keys, const torch::Tensor& values,
                               const torch::Tensor& q, const torch::Tensor& slots, int64_t start) {
  TORCH_CHECK(PrefillAttentionFits(keys, values, q, slots, start),
              "PrefillAttention: a call it cannot take");
  const torch::Tensor qc = q.contiguous();
  const int64_t n = qc.size(0), nh = qc.size(1), hd = qc.size(2);
  const int64_t kvh = keys.size(1), g = nh / kvh, stride = kvh * hd;
  const int64_t len = start + n, blocks = (len + 15) / 16, ld = blocks * 16;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const PrefillItemFn item = PrefillItemFor(hd);
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
      PackKeyBlock(kp + kh * hd, stride, sp, len, hd, b, kt.get() + kh * blocks * hd * 16);
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
