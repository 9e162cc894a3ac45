#pragma once

// Building blocks of the engine's CPU kernels (packed_linear_cpu, attention_cpu, moe_cpu), once
// per instruction set of cpu_isa.h. Internal: include only from those sources.
//
// A kernel is written once, against a 16-float vector V, its lane mask M and the operations
// below, in a .inc file that a source includes inside each of the namespaces simd512 (AVX-512F,
// V one register) and simd256 (AVX2 with FMA, V two registers), each under its own `#pragma
// GCC target`: the same sums in the same order on either, so one set of tests covers the logic
// of both, and a CPU runs the instance of its best instruction set. Only the instances'
// constants differ: how many rows or vectors a kernel keeps in registers (32 registers of 16
// floats against 16 of 8).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "engine/model/cpu_isa.h"

namespace bragg::engine::qwen3 {

// Part `part` of `parts` even shares of `lines` cache lines to prefetch: its first line and how
// many (0 past the end), for the tiles that share out a prefetch.
struct LineShare {
  int64_t first, count;
};
inline LineShare ShareLines(int64_t lines, int64_t parts, int64_t part) {
  const int64_t share = (lines + parts - 1) / parts, first = part * share;
  return {first, std::max<int64_t>(0, std::min(share, lines - first))};
}

// The tile kernel of cpu_simd_kernels.inc, for 1 to 8 rows: out[r][0, ncols) = sum_k x[r][k] *
// w[k][0, ncols) for k < in, ncols <= 48 (x: row stride ldx; w: row stride ldw, columns past
// ncols never read; out: row stride ldo), prefetching next_lines cache lines at `next`.
using TileFn = void (*)(const float* x, int64_t ldx, int64_t in, const float* w, int64_t ldw,
                        float* out, int64_t ldo, int64_t ncols, const float* next,
                        int64_t next_lines);
inline constexpr int64_t kTileCols = 48;  // three vectors
inline constexpr int64_t kTileRows = 8;   // rows per call

}  // namespace bragg::engine::qwen3

// GCC 12's AVX-512 headers give the unmasked forms of some intrinsics (_mm512_max_ps,
// _mm512_scalef_ps, the reductions' extracts) an "undefined" source vector for their unused
// lanes, which its own -Wmaybe-uninitialized reports once they are inlined into a kernel:
// warnings about the headers, none about the kernels (GCC 13 fixed the headers).
#pragma GCC diagnostic push
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace bragg::engine::qwen3::simd512 {

inline constexpr CpuIsa kIsa = CpuIsa::kAvx512;
// Rows a tile keeps in registers at once: 8 rows x 3 vectors = 24 accumulators of the 32
// registers, and per input 3 weight loads and 8 broadcasts for 24 FMAs (12 rows x 2 vectors
// measured slower).
inline constexpr int kTileGroupRows = 8;
// Vectors of accumulators PrefillRows keeps in registers (rows x vectors a row).
inline constexpr int kAccumulatorVectors = 16;

using V = __m512;
using M = __mmask16;

inline V Zero() { return _mm512_setzero_ps(); }
inline V Set1(float a) { return _mm512_set1_ps(a); }
inline V Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, V a) { _mm512_storeu_ps(p, a); }
// Lanes [0, n) (n clamped to [0, 16]).
inline M MaskN(int64_t n) { return n >= 16 ? M{0xffff} : n <= 0 ? M{0} : M((1u << n) - 1); }
// The lanes of m from p, zeros elsewhere (lanes outside m are not read).
inline V LoadM(const float* p, M m) { return _mm512_maskz_loadu_ps(m, p); }
// Writes the lanes of m only.
inline void StoreM(float* p, V a, M m) { _mm512_mask_storeu_ps(p, m, a); }
// a in the lanes of m, `other` elsewhere.
inline V Select(M m, V a, V other) { return _mm512_mask_blend_ps(m, other, a); }
inline V KeepM(V a, M m) { return _mm512_maskz_mov_ps(m, a); }
// a * b + c, one rounding.
inline V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
// c - a * b, one rounding.
inline V Fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
inline V Add(V a, V b) { return _mm512_add_ps(a, b); }
inline V Sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
// Lane-wise max and min (b where either is NaN, as MAXPS and MINPS).
inline V Max(V a, V b) { return _mm512_max_ps(a, b); }
inline V Min(V a, V b) { return _mm512_min_ps(a, b); }
// Over the 16 lanes: the eight sums (max) of lanes i and i + 8, then of i and i + 4, i + 2, i + 1.
inline float ReduceMax(V a) {
  __m256 m = _mm256_max_ps(_mm512_castps512_ps256(a),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
inline float ReduceAdd(V a) {
  __m256 m = _mm256_add_ps(_mm512_castps512_ps256(a),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
// round-to-nearest-even of a (whole floats), and p * 2^n for whole n (exact where the result is
// a normal float).
inline V Round(V a) {
  return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline V Scale2(V p, V n) { return _mm512_scalef_ps(p, n); }

inline V Lo64(V a, V b) {
  return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}
inline V Hi64(V a, V b) {
  return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}
// r[i][j] becomes r[j][i]: a 16 x 16 transpose in registers (32-bit, then 64-bit interleaves,
// then two rounds of 128-bit lane shuffles).
inline void Transpose16(V r[16]) {
  V t[16], u[16];
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

#include "engine/model/cpu_simd_kernels.inc"

}  // namespace bragg::engine::qwen3::simd512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace bragg::engine::qwen3::simd256 {

inline constexpr CpuIsa kIsa = CpuIsa::kAvx2;
// 2 rows x 3 vectors (12 of the 16 registers), the weights loaded one register at a time.
inline constexpr int kTileGroupRows = 2;
inline constexpr int kAccumulatorVectors = 6;

struct V {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
struct M {
  __m256i lo, hi;  // all ones in the lanes of the mask
};

inline V Zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V Set1(float a) {
  const __m256 b = _mm256_set1_ps(a);
  return {b, b};
}
inline V Load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void Store(float* p, V a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline M MaskN(int64_t n) {
  const __m256i c = _mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(n, 0, 16)));
  return {_mm256_cmpgt_epi32(c, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
          _mm256_cmpgt_epi32(c, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15))};
}
inline V LoadM(const float* p, M m) {
  return {_mm256_maskload_ps(p, m.lo), _mm256_maskload_ps(p + 8, m.hi)};
}
inline void StoreM(float* p, V a, M m) {
  _mm256_maskstore_ps(p, m.lo, a.lo);
  _mm256_maskstore_ps(p + 8, m.hi, a.hi);
}
inline V Select(M m, V a, V other) {
  return {_mm256_blendv_ps(other.lo, a.lo, _mm256_castsi256_ps(m.lo)),
          _mm256_blendv_ps(other.hi, a.hi, _mm256_castsi256_ps(m.hi))};
}
inline V KeepM(V a, M m) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(m.lo)),
          _mm256_and_ps(a.hi, _mm256_castsi256_ps(m.hi))};
}
inline V Fma(V a, V b, V c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V Fnma(V a, V b, V c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline V Add(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V Sub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V Mul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V Max(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V Min(V a, V b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline float ReduceMax(V a) {
  const __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
inline float ReduceAdd(V a) {
  const __m256 m = _mm256_add_ps(a.lo, a.hi);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
inline V Round(V a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
// p * 2^n as p * 2^(n >> 1) * 2^(n - (n >> 1)): each factor a normal float for |n| <= 252, so
// both products are exact where the result is normal, as VSCALEFPS's one.
// (A function rather than a lambda: a lambda's body does not take the pragma's target.)
inline __m256 Pow2(__m256i k) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}
inline __m256 Scale2Half(__m256 p, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  return _mm256_mul_ps(_mm256_mul_ps(p, Pow2(n1)), Pow2(n2));
}
inline V Scale2(V p, V n) { return {Scale2Half(p.lo, n.lo), Scale2Half(p.hi, n.hi)}; }

// An 8 x 8 transpose: 32-bit and 64-bit interleaves, then the 128-bit halves exchanged.
inline void Transpose8(__m256 r[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int b = 0; b < 8; b += 4) {
    s[b] = _mm256_shuffle_ps(t[b], t[b + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[b + 1] = _mm256_shuffle_ps(t[b], t[b + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[b + 2] = _mm256_shuffle_ps(t[b + 1], t[b + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[b + 3] = _mm256_shuffle_ps(t[b + 1], t[b + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}
// The 16 x 16 transpose as four 8 x 8 ones: row j < 8 of the result is column j of the left
// halves of rows 0-7 then of rows 8-15; row 8 + j the same of the right halves.
inline void Transpose16(V r[16]) {
  __m256 a[8], b[8], c[8], d[8];
  for (int i = 0; i < 8; ++i) {
    a[i] = r[i].lo;
    b[i] = r[i + 8].lo;
    c[i] = r[i].hi;
    d[i] = r[i + 8].hi;
  }
  Transpose8(a);
  Transpose8(b);
  Transpose8(c);
  Transpose8(d);
  for (int j = 0; j < 8; ++j) {
    r[j] = {a[j], b[j]};
    r[j + 8] = {c[j], d[j]};
  }
}

#include "engine/model/cpu_simd_kernels.inc"

}  // namespace bragg::engine::qwen3::simd256
#pragma GCC pop_options

#pragma GCC diagnostic pop
