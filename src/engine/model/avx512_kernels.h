#pragma once

// AVX-512 building blocks of the engine's CPU kernels (packed_linear_cpu, attention_cpu,
// moe_cpu). Internal: include only from those sources, and call the kernels only where
// Available().

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace bragg::engine::qwen3::avx512 {

// Whether this CPU runs the kernels below (AVX-512F), asked once.
inline bool Available() {
  static const bool available = __builtin_cpu_supports("avx512f");
  return available;
}

// Output columns per tile: three 16-float vectors.
inline constexpr int64_t kTileCols = 48;
// Rows per tile: 8 rows x 3 vectors = 24 accumulators of the 32 registers, and per input 3
// weight loads and 8 broadcasts for 24 FMAs (12 rows x 2 vectors measured slower).
inline constexpr int64_t kTileRows = 8;

// out[r][0, ncols) = sum_k x[r][k] * w[k][0, ncols) for R rows and k < in, ncols <= 48. x: row
// stride ldx; w: row stride ldw, columns past ncols never read; out: row stride ldo. The 48
// columns of w stay in L1/L2 for the tiles of rows after the first. The tile prefetches the
// next_lines cache lines at `next` (contiguous; any address when next_lines is 0) evenly over its
// inputs: its share of a packed weight's block to come. Every output is one sum in k order.
// The loops over rows are unrolled in full so that GCC keeps the accumulators in registers
// (with a loop it kept them in an array on the stack and stored all 24 every input: 1.7x
// slower at 32 rows).
template <int R, int Hint = _MM_HINT_T0>
__attribute__((target("avx512f"))) inline void Tile(const float* __restrict x, int64_t ldx,
                                                    int64_t in, const float* __restrict w,
                                                    int64_t ldw, float* __restrict out, int64_t ldo,
                                                    int64_t ncols, const float* next,
                                                    int64_t next_lines) {
  auto mask = [](int64_t n) -> __mmask16 {
    return n >= 16 ? __mmask16{0xffff} : n <= 0 ? __mmask16{0} : __mmask16((1u << n) - 1);
  };
  const __mmask16 m0 = mask(ncols), m1 = mask(ncols - 16), m2 = mask(ncols - 32);
  const int64_t per_k = in > 0 ? (next_lines + in - 1) / in : 0;  // lines to prefetch per input
  __m512 acc[R][3];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm512_setzero_ps();
    acc[r][1] = _mm512_setzero_ps();
    acc[r][2] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < in; ++k) {
    const float* wk = w + k * ldw;
    const __m512 w0 = _mm512_maskz_loadu_ps(m0, wk);
    const __m512 w1 = _mm512_maskz_loadu_ps(m1, wk + 16);
    const __m512 w2 = _mm512_maskz_loadu_ps(m2, wk + 32);
    for (int64_t l = k * per_k, e = std::min(l + per_k, next_lines); l < e; ++l) {
      _mm_prefetch(reinterpret_cast<const char*>(next + l * 16), static_cast<_mm_hint>(Hint));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(a, w2, acc[r][2]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(out + r * ldo, m0, acc[r][0]);
    _mm512_mask_storeu_ps(out + r * ldo + 16, m1, acc[r][1]);
    _mm512_mask_storeu_ps(out + r * ldo + 32, m2, acc[r][2]);
  }
}

// Part `part` of `parts` even shares of `lines` cache lines to prefetch: its first line and how
// many (0 past the end), for the tiles that share out a prefetch.
struct LineShare {
  int64_t first, count;
};
inline LineShare ShareLines(int64_t lines, int64_t parts, int64_t part) {
  const int64_t share = (lines + parts - 1) / parts, first = part * share;
  return {first, std::max<int64_t>(0, std::min(share, lines - first))};
}

// Tile for 1 to kTileRows rows.
using TileFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t,
                        int64_t, const float*, int64_t);
inline constexpr TileFn kTiles[kTileRows] = {Tile<1>, Tile<2>, Tile<3>, Tile<4>,
                                             Tile<5>, Tile<6>, Tile<7>, Tile<8>};
// The same, prefetching into L2 only (for more than L1 holds).
inline constexpr TileFn kTilesL2[kTileRows] = {
    Tile<1, _MM_HINT_T1>, Tile<2, _MM_HINT_T1>, Tile<3, _MM_HINT_T1>, Tile<4, _MM_HINT_T1>,
    Tile<5, _MM_HINT_T1>, Tile<6, _MM_HINT_T1>, Tile<7, _MM_HINT_T1>, Tile<8, _MM_HINT_T1>};

// exp(x), Cephes' expf: x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-7 polynomial, times
// 2^n: relative error about 2e-7 over [-87, 88]; below -87 it gives exp(-87) ~ 1.6e-38, above
// 88.7 infinity. NaN stays NaN.
__attribute__((target("avx512f"))) inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // a NaN x is returned as it is
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace bragg::engine::qwen3::avx512
