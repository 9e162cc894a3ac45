#include "engine/model/fused_cpu.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

// Built with -ffp-contract=off (CMakeLists.txt): a product and a sum round apart, as torch's
// separate operators do, so that these functions differ from qwen3.h's only in the order of
// the norm's sum of squares.

namespace bragg::engine::qwen3 {
namespace {

// Rows per work item: enough that torch's threads are woken only for prefill-sized inputs (a
// decode step's 1-64 rows of a few hundred floats take microseconds).
int64_t Grain(int64_t floats_per_row) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, floats_per_row));
}

// 1 / sqrt(mean(x^2) + eps), the sum in 16 lanes as a vectorized loop would keep them.
float InverseRms(const float* x, int64_t n, float eps) {
  float lane[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) {
      lane[j] += x[i + j] * x[i + j];
    }
  }
  for (; i < n; ++i) {
    lane[i % 16] += x[i] * x[i];
  }
  for (int w = 8; w > 0; w /= 2) {
    for (int j = 0; j < w; ++j) {
      lane[j] += lane[j + w];
    }
  }
  float var = lane[0] / static_cast<float>(n);
  return 1.0f / std::sqrt(var + eps);
}

void NormRow(const float* x, const float* w, int64_t n, float eps, float* out) {
  float r = InverseRms(x, n, eps);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = w[i] * (x[i] * r);
  }
}

// out = Rope(RmsNorm(x, w)) of one head: x*cos + rotate_half(x)*sin after the norm.
void NormRopeHead(const float* x, const float* w, const float* cos, const float* sin, int64_t hd,
                  float eps, float* out) {
  float r = InverseRms(x, hd, eps);
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    float a = w[i] * (x[i] * r);
    float b = w[i + half] * (x[i + half] * r);
    out[i] = a * cos[i] + (-b) * sin[i];
    out[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

}  // namespace

bool FusedCpuFits(const torch::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == torch::kFloat32;
}

namespace {

// RmsNorm of h's rows into a new tensor; with `delta`, h += delta first, row by row in the same
// pass. `name` names the caller in refusals.
torch::Tensor NormRows(const torch::Tensor& h, const torch::Tensor* delta, const torch::Tensor& w,
                       double eps, const char* name) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && FusedCpuFits(h), name, ": h");
  TORCH_CHECK(delta == nullptr ||
                  (delta->sizes() == h.sizes() && delta->is_contiguous() && FusedCpuFits(*delta)),
              name, ": delta");
  TORCH_CHECK(w.numel() == h.size(1) && w.is_contiguous() && FusedCpuFits(w), name, ": w");
  const int64_t n = h.size(1);
  torch::Tensor out = torch::empty_like(h);
  float* hp = h.data_ptr<float>();
  const float* dp = delta != nullptr ? delta->data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, h.size(0), Grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = hp + t * n;
      if (dp != nullptr) {
        const float* d = dp + t * n;
        for (int64_t i = 0; i < n; ++i) {
          row[i] += d[i];
        }
      }
      NormRow(row, wp, n, e, op + t * n);
    }
  });
  return out;
}

}  // namespace

torch::Tensor FusedRmsNorm(const torch::Tensor& h, const torch::Tensor& w, double eps) {
  return NormRows(h, nullptr, w, eps, "FusedRmsNorm");
}

torch::Tensor AddRmsNorm(torch::Tensor& h, const torch::Tensor& delta, const torch::Tensor& w,
                         double eps) {
  return NormRows(h, &delta, w, eps, "AddRmsNorm");
}

torch::Tensor QkNormRopeCache(const torch::Tensor& qkv, const torch::Tensor& q_norm,
                              const torch::Tensor& k_norm, const torch::Tensor& cos,
                              const torch::Tensor& sin, torch::Tensor& keys, torch::Tensor& values,
                              const torch::Tensor& slot, int64_t nh, int64_t kvh, double eps) {
  const int64_t T = qkv.size(0);
  const int64_t hd = q_norm.numel();
  TORCH_CHECK(hd % 2 == 0 && nh > 0 && kvh > 0, "QkNormRopeCache: heads");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (nh + 2 * kvh) * hd && qkv.is_contiguous() &&
                  FusedCpuFits(qkv),
              "QkNormRopeCache: qkv");
  for (const torch::Tensor* t : {&q_norm, &k_norm}) {
    TORCH_CHECK(t->numel() == hd && t->is_contiguous() && FusedCpuFits(*t),
                "QkNormRopeCache: norm weight");
  }
  for (const torch::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == T && t->size(1) == hd && t->is_contiguous() &&
                    FusedCpuFits(*t),
                "QkNormRopeCache: rope table");
  }
  for (const torch::Tensor* t : {&keys, &values}) {
    TORCH_CHECK(t->dim() == 3 && t->size(1) == kvh && t->size(2) == hd && t->is_contiguous() &&
                    FusedCpuFits(*t),
                "QkNormRopeCache: cache");
  }
  TORCH_CHECK(slot.numel() == T && slot.is_contiguous() && slot.device().is_cpu() &&
                  slot.scalar_type() == torch::kInt64,
              "QkNormRopeCache: slot");
  torch::Tensor q = torch::empty({T, nh, hd}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  const float* qw = q_norm.data_ptr<float>();
  const float* kw = k_norm.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* sl = slot.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  const int64_t width = (nh + 2 * kvh) * hd;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, Grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = in + t * width;
      const float* c = cp + t * hd;
      const float* s = sp + t * hd;
      for (int64_t h = 0; h < nh; ++h) {
        NormRopeHead(row + h * hd, qw, c, s, hd, e, qp + (t * nh + h) * hd);
      }
      float* k = kp + sl[t] * kvh * hd;
      for (int64_t h = 0; h < kvh; ++h) {
        NormRopeHead(row + (nh + h) * hd, kw, c, s, hd, e, k + h * hd);
      }
      std::memcpy(vp + sl[t] * kvh * hd, row + (nh + kvh) * hd, kvh * hd * sizeof(float));
    }
  });
  return q;
}

}  // namespace bragg::engine::qwen3
