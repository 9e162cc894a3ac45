#pragma once

// The fused linear cross-entropy (linear_cross_entropy.h) on CUDA, on raw device pointers: cuBLAS
// SGEMM for each token chunk's logits [chunk, V] and row kernels for max, log-sum-exp, entropy and
// the softmax gradient. float32 only; the whole vocabulary per chunk. No torch types (Debian's
// libtorch has no CUDA): a caller with a CUDA torch passes data_ptr()s.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"

namespace bragg::train {

struct LinearCrossEntropyCudaOptions {
  int64_t token_chunk = 1024;  // rows per chunk: the workspace is token_chunk x V x 4 bytes
  float temperature = 1.0f;    // logits / temperature, as the engine's sampler
  // A cublasHandle_t to use (the caller's: it must outlive the call; the op sets its stream to
  // `stream` and its math mode to CUBLAS_PEDANTIC_MATH); null: one is created and destroyed per
  // call (about a millisecond, and a device synchronization).
  void* cublas_handle = nullptr;
};

// Bytes of device memory one call allocates (stream-ordered, cudaMallocAsync, freed before the
// call returns): the chunk's logits, min(token_chunk, T) x V float32, plus a few bytes.
int64_t LinearCrossEntropyCudaWorkspaceBytes(int64_t T, int64_t V,
                                             const LinearCrossEntropyCudaOptions& options);

// All pointers are device pointers, row-major and contiguous: hidden [T, H], weight [V, H],
// labels [T] (int64 in [0, V)); writes logprobs, entropy and lse (the log-sum-exp of
// logits / temperature, which backward takes) [T] float32. The work is enqueued on `stream`; the
// call returns after it finished (it synchronizes the stream, to read back the label check).
// Errors: InvalidArgument for bad sizes or options or a label outside [0, V) (named:
// "labels[17] = 300 is outside the vocabulary (V = 256)"); ResourceExhausted when the workspace
// cannot be allocated; Internal for any other CUDA or cuBLAS failure. Thread-safety: none of its
// own state; concurrent calls on different streams are independent.
[[nodiscard]] Status LinearCrossEntropyForwardCuda(const float* hidden, const float* weight,
                                                   const int64_t* labels, int64_t T, int64_t H,
                                                   int64_t V,
                                                   const LinearCrossEntropyCudaOptions& options,
                                                   float* logprobs, float* entropy, float* lse,
                                                   cudaStream_t stream);

// The gradients of sum(grad_logprobs * logprobs + grad_entropy * entropy) with respect to hidden
// and weight, from the forward's lse and entropy; grad_logprobs or grad_entropy may be null (zero).
// Writes grad_hidden [T, H] and grad_weight [V, H] (both overwritten, accumulated in float32 over
// the chunks). Same pointer rules, synchronization and errors as the forward.
[[nodiscard]] Status LinearCrossEntropyBackwardCuda(
    const float* hidden, const float* weight, const int64_t* labels, int64_t T, int64_t H,
    int64_t V, const LinearCrossEntropyCudaOptions& options, const float* lse, const float* entropy,
    const float* grad_logprobs, const float* grad_entropy, float* grad_hidden, float* grad_weight,
    cudaStream_t stream);

}  // namespace bragg::train
