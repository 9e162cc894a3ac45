#include "pack/cost_model.h"

#include <cmath>

#include "fmt/format.h"

namespace bragg::pack {

Result<CostModel> CostModel::FromModelSize(int64_t hidden, int64_t layers) {
  if (hidden <= 0 || layers <= 0) {
    return absl::InvalidArgumentError(
        fmt::format("model size hidden={} layers={}: both must be positive", hidden, layers));
  }
  const double h = static_cast<double>(hidden);
  const double l = static_cast<double>(layers);
  return CostModel{.a = 3.0 * 24.0 * h * h * l, .b = 3.0 * 2.0 * h * l};
}

namespace {

struct Sums {
  double xx = 0, xy = 0, yy = 0, xt = 0, yt = 0;
};

double RSquared(std::span<const StepSample> samples, const CostModel& m) {
  double mean = 0;
  for (const StepSample& s : samples) {
    mean += s.seconds;
  }
  mean /= static_cast<double>(samples.size());
  double ss_res = 0, ss_tot = 0;
  for (const StepSample& s : samples) {
    const double pred = m.a * s.linear + m.b * s.quadratic;
    ss_res += (s.seconds - pred) * (s.seconds - pred);
    ss_tot += (s.seconds - mean) * (s.seconds - mean);
  }
  if (ss_tot == 0) {
    return ss_res == 0 ? 1.0 : 0.0;
  }
  return 1.0 - ss_res / ss_tot;
}

}  // namespace

Result<CostFit> FitCostModel(std::span<const StepSample> samples) {
  if (samples.size() < 2) {
    return absl::InvalidArgumentError(
        fmt::format("cost fit needs at least 2 measured steps, got {}", samples.size()));
  }
  Sums s;
  for (size_t i = 0; i < samples.size(); ++i) {
    const StepSample& p = samples[i];
    if (!std::isfinite(p.linear) || !std::isfinite(p.quadratic) || !std::isfinite(p.seconds) ||
        p.linear < 0 || p.quadratic < 0 || p.seconds < 0) {
      return absl::InvalidArgumentError(fmt::format(
          "step sample {} (linear={}, quadratic={}, seconds={}) must be finite and >= 0", i,
          p.linear, p.quadratic, p.seconds));
    }
    s.xx += p.linear * p.linear;
    s.xy += p.linear * p.quadratic;
    s.yy += p.quadratic * p.quadratic;
    s.xt += p.linear * p.seconds;
    s.yt += p.quadratic * p.seconds;
  }
  if (s.xx == 0 && s.yy == 0) {
    return absl::InvalidArgumentError("cost fit: every sample has zero tokens");
  }
  CostModel m{.a = 0, .b = 0};
  const double det = s.xx * s.yy - s.xy * s.xy;
  bool solved = false;
  // Relative threshold: linear and quadratic sums differ by orders of magnitude.
  if (det > 1e-12 * s.xx * s.yy) {
    m.a = (s.xt * s.yy - s.yt * s.xy) / det;
    m.b = (s.yt * s.xx - s.xt * s.xy) / det;
    solved = m.a >= 0 && m.b >= 0;
  }
  if (!solved) {
    // Collinear samples or a negative coefficient: best of the two one-term fits.
    const CostModel only_a{.a = s.xx > 0 ? std::max(0.0, s.xt / s.xx) : 0.0, .b = 0};
    const CostModel only_b{.a = 0, .b = s.yy > 0 ? std::max(0.0, s.yt / s.yy) : 0.0};
    m = RSquared(samples, only_a) >= RSquared(samples, only_b) ? only_a : only_b;
  }
  return CostFit{.model = m, .r_squared = RSquared(samples, m)};
}

}  // namespace bragg::pack
