#include "engine/model/moe_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "engine/model/cpu_simd.h"

namespace bragg::engine::qwen3 {
namespace {

// One expert's rows: g = x W_gu (each weight row read once for all n rows, while it is in L1),
// a = silu(g[:I]) * g[I:], y = a W_down. Row r is assignment a = slots[r] (token a / k, its slot
// a % k): it reads x row a / k and writes y row a. gu: [H][2I] and down: [I][H], row-major
// ([in, out]). scratch: n * 2I floats.
// Built for each vector width the machine may have; the loops are written for the vectorizer
// (this file is compiled with -O3).
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) void ExpertRows(
    const float* __restrict x, int64_t H, int64_t I, const float* __restrict gu,
    const float* __restrict down, const int64_t* slots, int64_t k, int64_t n,
    float* __restrict scratch, float* __restrict y) {
  const int64_t I2 = 2 * I;
  std::fill(scratch, scratch + n * I2, 0.0f);
  for (int64_t kk = 0; kk < H; ++kk) {
    const float* __restrict wk = gu + kk * I2;
    for (int64_t r = 0; r < n; ++r) {
      const float a = x[slots[r] / k * H + kk];
      float* __restrict g = scratch + r * I2;
      for (int64_t j = 0; j < I2; ++j) {
        g[j] += a * wk[j];
      }
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    float* __restrict g = scratch + r * I2;
    for (int64_t i = 0; i < I; ++i) {
      const float v = g[i];
      g[i] = v / (1.0f + std::exp(-v)) * g[I + i];
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    std::fill(y + slots[r] * H, y + slots[r] * H + H, 0.0f);
  }
  for (int64_t i = 0; i < I; ++i) {
    const float* __restrict wi = down + i * H;
    for (int64_t r = 0; r < n; ++r) {
      const float a = scratch[r * I2 + i];
      float* __restrict yr = y + slots[r] * H;
      for (int64_t h = 0; h < H; ++h) {
        yr[h] += a * wi[h];
      }
    }
  }
}

// ExpertRows with the AVX-512 tiles of cpu_simd.h: the rows of x are gathered, g is a
// tiled product over 48-column blocks of gu (each weight row read once per 8 rows, from
// registers' worth of accumulators rather than a pass over g per input), and the down
// projection writes each row's y once. scratch: n * (2I + 2H) floats. Call only where
// BestCpuIsa() is kAvx512: AVX2 CPUs keep the vectorized ExpertRows (the AVX2 tiles were not
// measured against it there).
void ExpertRowsTiled(const float* __restrict x, int64_t H, int64_t I, const float* __restrict gu,
                     const float* __restrict down, const int64_t* slots, int64_t k, int64_t n,
                     float* __restrict scratch, float* __restrict y, const float* next_gu,
                     const float* next_down) {
  const int64_t I2 = 2 * I;
  float* xs = scratch;     // [n][H]: the rows of x
  float* g = xs + n * H;   // [n][2I]: gate and up, then the activation in g[:, :I]
  float* ys = g + n * I2;  // [n][H]
  for (int64_t r = 0; r < n; ++r) {
    std::copy_n(x + slots[r] / k * H, H, xs + r * H);
  }
  // out[:, c0, c0 + 48) for each block of columns and tile of rows: a = [n][in] at stride lda,
  // w = [in][cols] at stride cols. The tiles share out the prefetch of `next` (the next
  // expert's matrix of the same shape, or null) into L2.
  auto product = [&](const float* a, int64_t lda, int64_t in, const float* w, int64_t cols,
                     float* out, const float* next) {
    const int64_t calls = (cols + kTileCols - 1) / kTileCols * ((n + kTileRows - 1) / kTileRows);
    const int64_t lines = next != nullptr ? in * cols / 16 : 0;
    int64_t call = 0;
    for (int64_t c0 = 0; c0 < cols; c0 += kTileCols) {
      const int64_t nc = std::min(kTileCols, cols - c0);
      for (int64_t r0 = 0; r0 < n; r0 += kTileRows, ++call) {
        const int64_t m = std::min(kTileRows, n - r0);
        const LineShare pf = ShareLines(lines, calls, call);
        simd512::kTilesL2[m - 1](a + r0 * lda, lda, in, w + c0, cols, out + r0 * cols + c0, cols,
                                 nc, pf.count > 0 ? next + pf.first * 16 : w, pf.count);
      }
    }
  };
  product(xs, H, H, gu, I2, g, next_gu);
  for (int64_t r = 0; r < n; ++r) {
    float* __restrict gr = g + r * I2;
    for (int64_t i = 0; i < I; ++i) {
      const float v = gr[i];
      gr[i] = v / (1.0f + std::exp(-v)) * gr[I + i];
    }
  }
  product(g, I2, I, down, H, ys, next_down);
  for (int64_t r = 0; r < n; ++r) {
    std::copy_n(ys + r * H, H, y + slots[r] * H);
  }
}

// One row's routing: logits over the E experts from x (H floats) and w ([H][E] row-major),
// softmax, the k largest into idx and p (descending; the lower expert first among equal ones),
// p divided by their sum where `normalize`. scratch: E floats.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) void RouteRow(
    const float* __restrict x, const float* __restrict w, int64_t H, int64_t E, int64_t k,
    bool normalize, float* __restrict scratch, int64_t* idx, float* p) {
  float* __restrict l = scratch;
  std::fill(l, l + E, 0.0f);
  for (int64_t h = 0; h < H; ++h) {
    const float a = x[h];
    const float* __restrict wh = w + h * E;
    for (int64_t e = 0; e < E; ++e) {
      l[e] += a * wh[e];
    }
  }
  float m = l[0];
  for (int64_t e = 1; e < E; ++e) {
    m = std::max(m, l[e]);
  }
  float sum = 0;
  for (int64_t e = 0; e < E; ++e) {
    l[e] = std::exp(l[e] - m);
    sum += l[e];
  }
  const float inv = 1.0f / sum;
  for (int64_t e = 0; e < E; ++e) {
    l[e] *= inv;
  }
  float chosen = 0;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) {
        taken = taken || idx[i] == e;
      }
      // NaN logits (a broken checkpoint) still pick k distinct experts.
      if (!taken && (best < 0 || l[e] > l[best])) {
        best = e;
      }
    }
    idx[j] = best;
    p[j] = l[best];
    chosen += l[best];
  }
  if (normalize) {
    for (int64_t j = 0; j < k; ++j) {
      p[j] /= chosen;
    }
  }
}

// Whether a Linear weight of shape [out, in] is fp32 on the CPU over [in, out] memory.
bool InOutLayout(const torch::Tensor& t) {
  return t.dim() == 2 && t.scalar_type() == torch::kFloat32 && t.device().is_cpu() &&
         t.stride(0) == 1 && t.stride(1) == t.size(0);
}

}  // namespace

bool SmallBatchExpertsFit(const torch::Tensor& x, const std::vector<torch::Tensor>& gate_up,
                          const std::vector<torch::Tensor>& down, const int64_t* counts) {
  if (x.dim() != 2 || x.scalar_type() != torch::kFloat32 || !x.device().is_cpu() ||
      gate_up.empty() || gate_up.size() != down.size()) {
    return false;
  }
  if (torch::GradMode::is_enabled() && x.requires_grad()) {
    return false;
  }
  const int64_t H = x.size(1);
  const int64_t most_rows =
      BestCpuIsa() == CpuIsa::kAvx512 ? kTiledExpertRows : kSmallBatchExpertRows;
  for (size_t e = 0; e < gate_up.size(); ++e) {
    if (counts[e] > most_rows) {
      return false;
    }
    if (gate_up[e].requires_grad() || down[e].requires_grad() || gate_up[e].size(1) != H ||
        down[e].size(0) != H || gate_up[e].size(0) != 2 * down[e].size(1) ||
        !InOutLayout(gate_up[e]) || !InOutLayout(down[e])) {
      return false;
    }
  }
  return true;
}

torch::Tensor SmallBatchExperts(const torch::Tensor& x, const torch::Tensor& idx,
                                const torch::Tensor& w, const std::vector<torch::Tensor>& gate_up,
                                const std::vector<torch::Tensor>& down) {
  const torch::Tensor xc = x.contiguous();
  const torch::Tensor ic = idx.to(torch::kInt64).contiguous();
  const torch::Tensor wc = w.to(torch::kFloat32).contiguous();
  const int64_t T = xc.size(0), H = xc.size(1), k = ic.size(1);
  const int64_t E = static_cast<int64_t>(gate_up.size());
  const int64_t I = down[0].size(1);
  // Assignments (token t, slot j) by expert; assignment a = t * k + j writes y row a.
  std::vector<std::vector<int64_t>> slots(E);
  const int64_t* ip = ic.data_ptr<int64_t>();
  for (int64_t a = 0; a < T * k; ++a) {
    const int64_t e = ip[a];
    TORCH_CHECK(e >= 0 && e < E, "expert index ", e, " outside [0, ", E, ")");
    slots[e].push_back(a);
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e) {
    if (!slots[e].empty()) {
      active.push_back(e);
    }
  }
  torch::Tensor y = torch::empty({T * k, H}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool tiled = BestCpuIsa() == CpuIsa::kAvx512;
  at::parallel_for(0, static_cast<int64_t>(active.size()), 1, [&](int64_t b, int64_t end) {
    std::vector<float> scratch;
    for (int64_t i = b; i < end; ++i) {
      const int64_t e = active[i];
      const int64_t n = static_cast<int64_t>(slots[e].size());
      const float* gu = gate_up[e].data_ptr<float>();
      const float* dn = down[e].data_ptr<float>();
      if (tiled) {
        scratch.resize(static_cast<size_t>(n * (2 * I + 2 * H)));
        // This thread's next expert, fetched while this one computes.
        const bool more = i + 1 < end;
        ExpertRowsTiled(xp, H, I, gu, dn, slots[e].data(), k, n, scratch.data(), yp,
                        more ? gate_up[active[i + 1]].data_ptr<float>() : nullptr,
                        more ? down[active[i + 1]].data_ptr<float>() : nullptr);
      } else {
        scratch.resize(static_cast<size_t>(n * 2 * I));
        ExpertRows(xp, H, I, gu, dn, slots[e].data(), k, n, scratch.data(), yp);
      }
    }
  });
  // out[t] = sum_j w[t, j] y[t * k + j], in slot order.
  torch::Tensor out = torch::zeros({T, H}, xc.options());
  float* op = out.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    float* __restrict o = op + t * H;
    for (int64_t j = 0; j < k; ++j) {
      const float s = wp[t * k + j];
      const float* __restrict yr = yp + (t * k + j) * H;
      for (int64_t h = 0; h < H; ++h) {
        o[h] += s * yr[h];
      }
    }
  }
  return out;
}

bool RouterTopKFits(const torch::Tensor& x, const torch::Tensor& router, int64_t k) {
  if (x.dim() != 2 || x.scalar_type() != torch::kFloat32 || !x.device().is_cpu() ||
      !InOutLayout(router) || router.size(1) != x.size(1) || k < 1 || k > router.size(0)) {
    return false;
  }
  return !(torch::GradMode::is_enabled() && (x.requires_grad() || router.requires_grad()));
}

void RouterTopK(const torch::Tensor& x, const torch::Tensor& router, int64_t k, bool normalize,
                torch::Tensor* idx, torch::Tensor* w, std::vector<int64_t>* counts) {
  TORCH_CHECK(RouterTopKFits(x, router, k), "RouterTopK: a call it cannot take");
  const torch::Tensor xc = x.contiguous();
  const int64_t T = xc.size(0), H = xc.size(1), E = router.size(0);
  *idx = torch::empty({T, k}, torch::TensorOptions().dtype(torch::kInt64));
  *w = torch::empty({T, k}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* rp = router.data_ptr<float>();  // [H][E]
  int64_t* ip = idx->data_ptr<int64_t>();
  float* wp = w->data_ptr<float>();
  // A row is about 300 ns at the benchmark model's size: a decode step's rows stay on this thread.
  at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(E));
    for (int64_t t = begin; t < end; ++t) {
      RouteRow(xp + t * H, rp, H, E, k, normalize, scratch.data(), ip + t * k, wp + t * k);
    }
  });
  counts->assign(static_cast<size_t>(E), 0);
  for (int64_t a = 0; a < T * k; ++a) {
    ++(*counts)[ip[a]];
  }
}

}  // namespace bragg::engine::qwen3
