#pragma once

// The row kernels of linear_cross_entropy_cuda.cc, behind plain launch functions (compiled by
// nvcc; the host side, with its Status and cuBLAS, by the C++ compiler). Each launches on
// `stream` and returns the launch's error. Private to train/kernels.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace bragg::train::cuda {

// *first_bad = min over i of { i : labels[i] outside [0, V) }; *first_bad must hold T (none)
// before the launch.
cudaError_t LaunchCheckLabels(const int64_t* labels, int64_t T, int64_t V,
                              unsigned long long* first_bad, cudaStream_t stream);

// For each of n rows of logits [n, V]: z = logit / t; lse = max z + log sum exp(z - max z);
// logprobs = z[label] - lse; entropy = lse - sum softmax(z) z. Sums in double.
cudaError_t LaunchForwardRows(const float* logits, int64_t n, int64_t V, const int64_t* labels,
                              float t, float* logprobs, float* entropy, float* lse,
                              cudaStream_t stream);

// In place, for each of n rows: logits -> d(g_lp * logprob + g_h * entropy) / d logits
//   = (g_lp (onehot(label) - p) - g_h p (log p + entropy)) / t,   log p = logit / t - lse.
// grad_logprobs / grad_entropy may be null (zero).
cudaError_t LaunchBackwardRows(float* logits, int64_t n, int64_t V, const int64_t* labels, float t,
                               const float* lse, const float* entropy, const float* grad_logprobs,
                               const float* grad_entropy, cudaStream_t stream);

}  // namespace bragg::train::cuda
