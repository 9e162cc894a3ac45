#pragma once

// Cost model for one trace: cost(s) = a*s + b*s^2, where s is the padded length of the trace in
// tokens. The linear term stands for the dense layers (GEMMs), the quadratic one for causal
// attention. Only ratios between costs matter to the balancer, so the unit is free (FLOPs,
// seconds, ...).

#include <cstdint>
#include <span>

#include "common/status.h"

namespace bragg::pack {

// Plain value type; thread-compatible.
struct CostModel {
  double a = 1.0;  // per token
  double b = 0.0;  // per token^2

  double Cost(int64_t s) const {
    const double x = static_cast<double>(s);
    return a * x + b * x * x;
  }

  // Training FLOPs (forward + backward = 3x forward) of a decoder-only transformer with
  // `layers` layers of width `hidden`: 24*h^2 FLOPs per token and layer in the dense
  // projections and MLP (12*h^2 weights, 2 FLOPs each), 2*h*s FLOPs per token and layer in
  // causal attention (QK^T and AV, half the pairs masked). Returns InvalidArgument unless both
  // are positive.
  static Result<CostModel> FromModelSize(int64_t hidden, int64_t layers);
};

// One measured step: a micro-batch whose traces had padded lengths s_i took `seconds`.
// `linear` = sum of s_i, `quadratic` = sum of s_i^2.
struct StepSample {
  double linear = 0;
  double quadratic = 0;
  double seconds = 0;
};

struct CostFit {
  CostModel model;
  // Coefficient of determination of the fit over the samples (1 = perfect). Can be negative
  // when the model explains less than the mean does.
  double r_squared = 0;
};

// Least-squares fit of seconds = a*linear + b*quadratic (no intercept) with a, b >= 0: when
// the unconstrained optimum has a negative coefficient, that coefficient is fixed at 0 and the
// other one refitted. Errors: InvalidArgument with fewer than 2 samples, non-finite or negative
// values, or when the samples cannot determine any coefficient (all zero).
Result<CostFit> FitCostModel(std::span<const StepSample> samples);

}  // namespace bragg::pack
