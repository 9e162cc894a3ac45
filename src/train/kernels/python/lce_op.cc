// The fused linear cross-entropy as a torch operator, for a user's own PyTorch training loop:
// torch.ops.bragg.linear_cross_entropy(hidden, weight, labels, token_chunk, vocab_chunk,
// temperature, deterministic) -> (logprobs, entropy). Built against the user's torch by
// bragg_train_lce.load() (torch.utils.cpp_extension), with linear_cross_entropy.cc: the same
// algorithm and validation as the C++ trainer's. Autograd comes from the op's own
// torch::autograd::Function (a CompositeImplicitAutograd kernel); errors are RuntimeErrors.

#include <torch/library.h>
#include <torch/torch.h>

#include <tuple>

#include "train/kernels/linear_cross_entropy.h"

namespace {

std::tuple<torch::Tensor, torch::Tensor> LinearCrossEntropyOp(
    const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& labels,
    int64_t token_chunk, int64_t vocab_chunk, double temperature, bool deterministic) {
  bragg::train::LinearCrossEntropyOutput out = bragg::train::LinearCrossEntropy(
      hidden, weight, labels, {token_chunk, vocab_chunk, temperature, deterministic});
  return {out.logprobs, out.entropy};
}

}  // namespace

TORCH_LIBRARY(bragg, m) {
  m.def(
      "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor labels, int token_chunk=1024, "
      "int vocab_chunk=0, float temperature=1.0, bool deterministic=False) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(bragg, CompositeImplicitAutograd, m) {
  m.impl("linear_cross_entropy", &LinearCrossEntropyOp);
}
