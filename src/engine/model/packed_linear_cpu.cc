#include "engine/model/packed_linear_cpu.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace bragg::engine::qwen3 {
namespace {

constexpr int64_t kCols = kPackedLinearCols;
// Rows per tile: 8 rows x 3 vectors = 24 accumulators of the 32 AVX-512 registers, and per
// input 3 weight loads and 8 broadcasts for 24 FMAs. (12 rows x 2 vectors measured slower.)
constexpr int64_t kTileRows = 8;

// out[r][0, ncols) = sum_k x[r][k] * block[k][0, ncols) for R rows (x: row stride `in`, out:
// row stride `ld`). The block stays in L1/L2 for every tile of rows after the first; the first
// prefetches `next` (the next block, or null) as it goes.
template <int R>
__attribute__((target("avx512f"))) void Tile(const float* __restrict x, int64_t in,
                                             const float* __restrict block, float* __restrict out,
                                             int64_t ld, int64_t ncols, const float* next) {
  __m512 acc[R][3];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm512_setzero_ps();
    acc[r][1] = _mm512_setzero_ps();
    acc[r][2] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < in; ++k) {
    const float* wk = block + k * kCols;
    const __m512 w0 = _mm512_loadu_ps(wk);
    const __m512 w1 = _mm512_loadu_ps(wk + 16);
    const __m512 w2 = _mm512_loadu_ps(wk + 32);
    if (next != nullptr) {
      const char* nk = reinterpret_cast<const char*>(next + k * kCols);
      _mm_prefetch(nk, _MM_HINT_T0);
      _mm_prefetch(nk + 64, _MM_HINT_T0);
      _mm_prefetch(nk + 128, _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * in + k]);
      acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(a, w2, acc[r][2]);
    }
  }
  if (ncols == kCols) {
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(out + r * ld, acc[r][0]);
      _mm512_storeu_ps(out + r * ld + 16, acc[r][1]);
      _mm512_storeu_ps(out + r * ld + 32, acc[r][2]);
    }
    return;
  }
  auto mask = [](int64_t n) -> __mmask16 {
    return n >= 16 ? __mmask16{0xffff} : n <= 0 ? __mmask16{0} : __mmask16((1u << n) - 1);
  };
  const __mmask16 m0 = mask(ncols), m1 = mask(ncols - 16), m2 = mask(ncols - 32);
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(out + r * ld, m0, acc[r][0]);
    _mm512_mask_storeu_ps(out + r * ld + 16, m1, acc[r][1]);
    _mm512_mask_storeu_ps(out + r * ld + 32, m2, acc[r][2]);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t,
                        const float*);
constexpr TileFn kTiles[kTileRows] = {Tile<1>, Tile<2>, Tile<3>, Tile<4>,
                                      Tile<5>, Tile<6>, Tile<7>, Tile<8>};

}  // namespace

bool PackedLinearAvailable() {
  static const bool available = __builtin_cpu_supports("avx512f");
  return available;
}

torch::Tensor PackLinearWeight(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.device().is_cpu(),
              "PackLinearWeight: W must be a 2-D fp32 CPU tensor");
  const int64_t blocks = (w.size(0) + kCols - 1) / kCols;
  torch::Tensor packed = torch::empty({blocks, w.size(1), kCols}, w.options());
  RepackLinearWeight(w, packed);
  return packed;
}

void RepackLinearWeight(const torch::Tensor& w, torch::Tensor& packed) {
  const int64_t out = w.size(0), in = w.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == (out + kCols - 1) / kCols &&
                  packed.size(1) == in && packed.size(2) == kCols && packed.is_contiguous(),
              "RepackLinearWeight: the packed tensor was made for another shape");
  c10::InferenceMode guard;
  const float* src = w.data_ptr<float>();
  const int64_t s_out = w.stride(0), s_in = w.stride(1);
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, packed.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t ncols = std::min(kCols, out - b * kCols);
      float* blk = dst + b * in * kCols;
      for (int64_t k = 0; k < in; ++k) {
        float* row = blk + k * kCols;
        for (int64_t j = 0; j < ncols; ++j) {
          row[j] = src[(b * kCols + j) * s_out + k * s_in];
        }
        std::fill(row + ncols, row + kCols, 0.0f);
      }
    }
  });
}

bool PackedLinearFits(const torch::Tensor& x, const torch::Tensor& packed) {
  if (!PackedLinearAvailable() || !packed.defined() || x.dim() != 2 ||
      x.scalar_type() != torch::kFloat32 || !x.device().is_cpu() || x.size(0) < 1 ||
      x.size(0) > kPackedLinearMaxRows || x.size(1) != packed.size(1)) {
    return false;
  }
  return !(torch::GradMode::is_enabled() && x.requires_grad());
}

torch::Tensor PackedLinear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out) {
  TORCH_CHECK(PackedLinearFits(x, packed), "PackedLinear: a call it cannot take");
  TORCH_CHECK(out > (packed.size(0) - 1) * kCols && out <= packed.size(0) * kCols,
              "PackedLinear: ", out, " columns were not packed in ", packed.size(0), " blocks");
  const torch::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), in = xc.size(1);
  torch::Tensor y = torch::empty({rows, out}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, packed.size(0), 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t ncols = std::min(kCols, out - b * kCols);
      for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
        const int64_t n = std::min(kTileRows, rows - r0);
        // The first tile of rows fetches the next block while it computes.
        const float* next = r0 == 0 && b + 1 < end ? wp + (b + 1) * in * kCols : nullptr;
        kTiles[n - 1](xp + r0 * in, in, wp + b * in * kCols, yp + r0 * out + b * kCols, out,
                      ncols, next);
      }
    }
  });
  return y;
}

}  // namespace bragg::engine::qwen3
