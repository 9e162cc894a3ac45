#include "engine/model/packed_linear_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>

#include "engine/model/cpu_simd.h"

namespace bragg::engine::qwen3 {
namespace {

constexpr int64_t kCols = kPackedLinearCols;
static_assert(kCols == kTileCols);

const TileFn* TilesFor(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return simd512::kTiles;
    case CpuIsa::kAvx2:
      return simd256::kTiles;
    case CpuIsa::kNone:
      break;
  }
  return nullptr;
}

}  // namespace

bool PackedLinearAvailable(CpuIsa isa) { return isa != CpuIsa::kNone && CpuRuns(isa); }

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

bool PackedLinearFits(const torch::Tensor& x, const torch::Tensor& packed, CpuIsa isa) {
  if (!PackedLinearAvailable(isa) || !packed.defined() || x.dim() != 2 ||
      x.scalar_type() != torch::kFloat32 || !x.device().is_cpu() || x.size(0) < 1 ||
      x.size(0) > kPackedLinearMaxRows || x.size(1) != packed.size(1)) {
    return false;
  }
  return !(torch::GradMode::is_enabled() && x.requires_grad());
}

torch::Tensor PackedLinear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out,
                           CpuIsa isa) {
  TORCH_CHECK(PackedLinearFits(x, packed, isa), "PackedLinear: a call it cannot take");
  torch::Tensor y = torch::empty({x.size(0), out}, x.options().dtype(torch::kFloat32));
  PackedLinearInto(x, packed, y, isa);
  return y;
}

void PackedLinearInto(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& y,
                      CpuIsa isa) {
  TORCH_CHECK(PackedLinearFits(x, packed, isa), "PackedLinear: a call it cannot take");
  TORCH_CHECK(y.dim() == 2 && y.size(0) == x.size(0) && y.scalar_type() == torch::kFloat32 &&
                  y.device().is_cpu() && y.is_contiguous(),
              "PackedLinear: the output must be fp32 [", x.size(0), ", out], contiguous, CPU");
  const int64_t out = y.size(1);
  TORCH_CHECK(out > (packed.size(0) - 1) * kCols && out <= packed.size(0) * kCols,
              "PackedLinear: ", out, " columns were not packed in ", packed.size(0), " blocks");
  const torch::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), in = xc.size(1);
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const TileFn* tiles = TilesFor(isa);
  at::parallel_for(0, packed.size(0), 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t ncols = std::min(kCols, out - b * kCols);
      for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
        const int64_t n = std::min(kTileRows, rows - r0);
        // Each tile of rows fetches its share of the block after next while it computes (a
        // cold lm_head streams from memory: measured 3.4 -> 2.7-3.1 ms at 32 rows against one
        // block ahead, fetched by the first tile alone).
        const LineShare pf = ShareLines(b + 2 < end ? in * kCols / 16 : 0,
                                        (rows + kTileRows - 1) / kTileRows, r0 / kTileRows);
        const float* next = pf.count > 0 ? wp + (b + 2) * in * kCols + pf.first * 16 : wp;
        tiles[n - 1](xp + r0 * in, in, in, wp + b * in * kCols, kCols, yp + r0 * out + b * kCols,
                     out, ncols, next, pf.count);
      }
    }
  });
}

}  // namespace bragg::engine::qwen3
